"""GPT model construction on megatron-core's own GPTModel and layer specs.

megatron-core's local ``DotProductAttention`` allocates its score buffer on
``torch.cuda.current_device()`` and forks the CUDA RNG tracker, so it cannot
run on a CPU. Everything else in the local spec can; this module swaps only the
core attention for one built on ``torch.nn.functional.scaled_dot_product_attention``
and otherwise returns megatron-core's spec unchanged. With Transformer Engine
on a GPU, the TE spec is used as is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from .qk_clip import record_max_logits

try:  # Apex's fused norms, when installed, are what megatron-core's local spec uses.
    import apex  # noqa: F401

    HAVE_APEX_NORM = True
except ImportError:
    HAVE_APEX_NORM = False

try:  # Transformer Engine is optional and GPU only.
    import transformer_engine  # noqa: F401
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    HAVE_TE = torch.cuda.is_available()
except Exception:  # pragma: no cover - depends on the machine
    HAVE_TE = False


class SDPAttention(MegatronModule):
    """Causal core attention on PyTorch SDPA: same inputs and outputs as
    megatron-core's ``DotProductAttention`` ([s, b, heads, head_dim] in,
    [s, b, heads*head_dim] out), but device agnostic. Multi-latent attention passes
    ``k_channels`` (query/key head dim: qk_head_dim + qk_pos_emb_head_dim) and ``v_channels``
    (v_head_dim) as it passes them to TEDotProductAttention, and its own ``softmax_scale``
    (mscale^2 / sqrt(k_channels), multi_latent_attention.py at core_v0.16.1)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        tp_size = pg_collection.tp.size()
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.groups_per_partition = divide(config.num_query_groups, tp_size)
        self.head_dim = k_channels or config.kv_channels  # query and key
        self.v_head_dim = v_channels or config.kv_channels  # value, and each head's output
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.attn_mask_type = attn_mask_type
        self.track_max_logits = config.qk_clip or config.log_max_attention_logit
        self.current_max_attn_logits = None  # per local head, this step's (TEDotProductAttention's name)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention supports neither packed sequences nor bias")
        repeat = query.shape[2] // key.shape[2]  # GQA's key/value heads (MLA gives every head its key)
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # Attention passes no_mask when one new query reads a KV cache (megatron-core's static
        # inference, transformer/attention.py: _adjust_key_value_for_inference at core_v0.16.1).
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if self.track_max_logits and self.training:  # QK-clip or --log-max-attention-logit (qk_clip.py)
            record_max_logits(self, q, k, self.softmax_scale, mask_type == AttnMaskType.causal)
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=mask_type == AttnMaskType.causal,
            scale=self.softmax_scale,
            dropout_p=self.dropout_p if self.training else 0.0,
        )
        seq, batch = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, self.heads_per_partition * self.v_head_dim)


class TorchNorm(torch.nn.Module):
    """LayerNorm or RMSNorm of the local spec where Apex is missing (megatron-core's torch fallback,
    WrappedTorchNorm, refuses sequence parallelism and zero-centered gamma, which a plain norm
    supports): each TP rank normalizes its part of the sequence, the weight gradients are summed
    over TP (parameters marked ``sequence_parallel``, which the runtime honours), and with
    --apply-layernorm-1p the weight is centered at zero: y = norm(x) * (1 + w) + b."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.shape, self.eps = (hidden_size,), eps
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.rms:
            return F.rms_norm(x, self.shape, weight, self.eps)
        return F.layer_norm(x, self.shape, weight, self.bias, self.eps)


def _local_spec(spec):
    """megatron-core's local layer spec made to run on a CPU: SDPA core attention and, without Apex,
    torch norms (in place; returns it)."""
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = SDPAttention
    if not HAVE_APEX_NORM:
        spec.submodules.input_layernorm = TorchNorm
        spec.submodules.pre_mlp_layernorm = TorchNorm
        for norm in ("q_layernorm", "k_layernorm", "kv_layernorm"):  # MLA has q_ and kv_layernorm
            if getattr(attention, norm, IdentityOp) is not IdentityOp:
                setattr(attention, norm, TorchNorm)
    return spec


def _check_experts(config: TransformerConfig, use_transformer_engine: bool) -> None:
    """The expert implementations a matrix optimizer can treat one expert at a time: SequentialMLP (one
    local linear pair per expert) and, with Transformer Engine, TEGroupedMLP (one ``weight{i}`` per
    expert). megatron-core's legacy GroupedMLP holds all local experts in one 2D ``weight1``."""
    legacy = config.moe_use_legacy_grouped_gemm or (config.moe_grouped_gemm and not use_transformer_engine)
    if legacy:
        raise ValueError(
            "megatron-core's legacy GroupedMLP (--moe-grouped-gemm without Transformer Engine, or "
            "--moe-use-legacy-grouped-gemm) is not supported: its weight1 concatenates the local experts in one "
            "2D tensor, so a matrix optimizer cannot treat each expert as its own matrix"
        )


def gpt_layer_spec(config: TransformerConfig, use_transformer_engine: bool | None = None, vp_stage: int | None = None):
    """megatron-core's GPT spec: the TE layer spec on a GPU when available; else the local spec
    with SDPA core attention and, without Apex, torch norms that support sequence parallelism and
    zero-centered gamma (as a block spec, since the final norm comes from the block). With
    ``num_moe_experts``, megatron-core's decoder block spec (Megatron-LM's pretrain_gpt.py uses it
    for MoE): MoE layers where ``moe_layer_freq`` says, dense ones elsewhere, this stage's slice;
    SequentialMLP experts on the local spec, TEGroupedMLP with --moe-grouped-gemm on TE."""
    if use_transformer_engine is None:
        use_transformer_engine = HAVE_TE
    if config.num_moe_experts:
        _check_experts(config, use_transformer_engine)
        block = get_gpt_decoder_block_spec(
            config, use_transformer_engine, normalization=config.normalization, vp_stage=vp_stage
        )
        if use_transformer_engine:
            return block
        for spec in {id(s): s for s in block.layer_specs}.values():
            _local_spec(spec)
        if not HAVE_APEX_NORM:
            block.layer_norm = TorchNorm
        return block
    mla = config.multi_latent_attention
    if use_transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, multi_latent_attention=mla)
    spec = _local_spec(
        get_gpt_layer_local_spec(
            normalization=config.normalization, qk_layernorm=config.qk_layernorm, multi_latent_attention=mla
        )
    )
    if HAVE_APEX_NORM:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=TorchNorm)


def build_gpt_model(
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    *,
    position_embedding_type: str = "learned_absolute",
    share_embeddings_and_output_weights: bool = True,
    pre_process: bool = True,
    post_process: bool = True,
    use_transformer_engine: bool | None = None,
    vp_stage: int | None = None,
    **gpt_kwargs,
) -> GPTModel:
    """A megatron-core GPTModel for the given config (parallel_state must be initialized).
    ``gpt_kwargs`` go to GPTModel as they are (rotary_base, rotary_percent, rope_scaling, ...).
    Built under compat/cpu.py: with PP > 1 megatron-core moves the tied output weight to CUDA, and
    its MoE router and all-to-all dispatcher ask for CUDA devices and streams."""
    from ...compat import moe
    from ...compat.cpu import cuda_on_cpu

    if config.num_moe_experts:
        moe.define_te_general_gemm()
    if config.multi_latent_attention:
        from ...compat import mla

        mla.repair_have_te()

    with cuda_on_cpu():
        model = GPTModel(
            config=config,
            transformer_layer_spec=gpt_layer_spec(config, use_transformer_engine, vp_stage),
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            vp_stage=vp_stage,
            **gpt_kwargs,
        )
    if config.multi_latent_attention:
        mla.repair_rotary_key_gradient(model)
    if config.num_moe_experts:
        moe.skip_single_rank_expert_reduce(model)
        moe.unmark_expert_sequence_parallel(model)
    # Megatron-LM's Float16Module casts the whole model (norms included) to the
    # training dtype; MatrixFSDP keeps one dtype per chunk, so do the same here.
    if config.fp16:
        model.half()
    elif config.bf16:
        model.bfloat16()
    return model


@torch.no_grad()
def initialize_by_global_name(
    model: GPTModel,
    config: TransformerConfig,
    seed: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    expert_tp_rank: int | None = None,
    expert_tp_size: int | None = None,
) -> None:
    """Re-initialize every parameter from a generator seeded by (seed, its global name),
    as megatron-core's CPU initialization would shape it: the full tensor is drawn, then
    this tensor-parallel rank's chunk is kept (an expert's over the expert tensor-parallel
    group, default the TP one). So any TP x PP x DP x EP layout starts from exactly the
    weights of the 1 x 1 x 1 model."""
    import re
    import zlib

    from .naming import global_parameter_names

    std = config.init_method_std
    out_std = std / math.sqrt(2.0 * config.num_layers)
    names = global_parameter_names(model)
    for name, param in model.named_parameters():
        global_name = names[name]
        expert = ".mlp.experts." in global_name
        rank, size = (expert_tp_rank, expert_tp_size) if expert and expert_tp_size is not None else (tp_rank, tp_size)
        split = getattr(param, "tensor_model_parallel", False) and size > 1
        dim = getattr(param, "partition_dim", 0)
        stride = getattr(param, "partition_stride", 1)
        full_shape = list(param.shape)
        if split:
            full_shape[dim] *= size
        generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(global_name.encode())) % 2**62)
        kind = re.sub(r"\.(weight|bias)\d+$", r".\1", global_name)  # TEGroupedMLP's weight{i}, bias{i}
        leaf = kind.rsplit(".", 1)[-1]
        if leaf in ("bias", "layer_norm_bias"):
            full = torch.zeros(full_shape)
        elif "norm" in kind:
            full = torch.zeros(full_shape) if config.layernorm_zero_centered_gamma else torch.ones(full_shape)
        else:
            scaled = kind.endswith(("linear_proj.weight", "linear_fc2.weight"))
            full = torch.empty(full_shape).normal_(0.0, out_std if scaled else std, generator=generator)
        if split:
            chunks = torch.split(full, full_shape[dim] // (size * stride), dim=dim)
            full = torch.cat(chunks[rank::size], dim=dim)
        param.copy_(full.to(param.dtype))
