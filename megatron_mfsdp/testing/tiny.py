"""A tiny megatron-core GPT and its data, the same on every rank: what the tests and
the benchmarks train."""

from __future__ import annotations

import torch

VOCAB, SEQ, MBS = 96, 16, 2


def init_megatron(tp: int = 1, pp: int = 1, vp: int | None = None, ep: int = 1, etp: int | None = None) -> None:
    """megatron's groups for TP x PP (x VP) x DP, with ``ep`` > 1 also the expert groups of expert TP
    (``etp``, by default TP) x EP x expert DP."""
    from ..groups import initialize_model_parallel

    expert = {"expert_model_parallel_size": ep} if ep > 1 else {}
    if etp is not None and etp != tp:
        expert["expert_tensor_parallel_size"] = etp
    initialize_model_parallel(tp, pp, vp, create_gloo_process_groups=False, **expert)  # fewer idle polling threads


def tiny_gpt_config(**overrides):
    """A few-layer fp32 GPT config that runs in seconds on a CPU."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    if overrides.get("multi_latent_attention"):  # megatron-core's MLA: no query groups, its own head dims
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kwargs.update(MLA_TINY, num_query_groups=None)
        kwargs.update(overrides)
        return MLATransformerConfig(**kwargs)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


MLA_TINY = dict(
    q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12, rotary_scaling_factor=1.0
)
"""The tiny GPT's multi-latent attention (``multi_latent_attention=True``): query/key heads 12 wide, values 12,
YaRN at factor 1 (Megatron-LM's --rotary-scaling-factor default)."""


def tiny_gpt(
    seed: int = 1234,
    by_global_name: bool = False,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage=None,
    vocab_size: int = VOCAB,
    seq_length: int = SEQ,
    tied: bool = True,
    **config_overrides,
):
    """A 2-layer GPT (GQA, tied embeddings) built identically on every rank;
    ``by_global_name`` seeds each weight from its global name (layout-independent)."""
    from megatron.core import parallel_state

    from ..models.gpt import build_gpt_model, initialize_by_global_name

    torch.manual_seed(seed)
    config = tiny_gpt_config(**config_overrides)
    model = build_gpt_model(
        config,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        share_embeddings_and_output_weights=tied,
    )
    if by_global_name:
        initialize_by_global_name(
            model,
            config,
            seed,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
    return config, model


def micro_batch(step: int, micro: int, dp_rank: int) -> torch.Tensor:
    """Tokens of one rank's micro-batch: a pure function of (step, micro-batch, rank)."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * micro + dp_rank)
    return torch.randint(0, VOCAB, (MBS, SEQ), generator=g)


def lm_loss(model, tokens: torch.Tensor, num_micro: int) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    per_token = model(tokens, positions, None, labels=tokens)
    return per_token.float().mean() / num_micro


def forward_step(data_iterator, model):
    """megatron-core's schedule contract for the tiny GPT: the mean per-token loss of the next batch."""
    tokens = next(data_iterator)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    output = model(tokens, positions, None, labels=tokens)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


TEST_MUON = {"muon_coefficient_type": "simple", "muon_ns_dtype": "fp32"}
"""The Newton-Schulz run of the exactness tests (optim/muon.py MuonSettings): Jordan's constants in fp32."""


def optimizer_config(**overrides):
    """The optimizer settings the exactness tests use: Muon on the hidden matrices (momentum
    0.95, Nesterov, spectral x 0.2, Jordan's constants), fp32 Newton-Schulz, no clipping.
    An override named as a field of Muon's settings (``muon_ns_dtype=...``) goes there; a
    ``rule_settings`` entry for "muon" replaces them."""
    import dataclasses

    from ..config import MatrixFSDPOptimizerConfig
    from ..optim.muon import MuonSettings

    fields = {f.name for f in dataclasses.fields(MuonSettings)}
    muon = MuonSettings(**{**TEST_MUON, **{k: overrides.pop(k) for k in list(overrides) if k in fields}})
    kwargs = dict(
        optimizer="muon",
        muon_momentum=0.95,
        muon_use_nesterov=True,
        muon_extra_scale_factor=0.2,
        lr=1e-2,
        min_lr=1e-2,
        weight_decay=0.1,
        clip_grad=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
    )
    kwargs.update(overrides)
    kwargs["rule_settings"] = {"muon": muon, **kwargs.get("rule_settings", {})}
    return MatrixFSDPOptimizerConfig(**kwargs)
