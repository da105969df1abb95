"""Shared test helpers: spawning gloo workers, a tiny megatron GPT, its data,
and a single-process reference trainer that averages exactly as MatrixFSDP does."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron_mfsdp.devtools import count_collectives, free_port, run_workers  # noqa: F401 (re-exported)

VOCAB, SEQ, MBS = 96, 16, 2


def init_megatron(tp: int = 1, pp: int = 1, vp: Optional[int] = None) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)


def tiny_gpt(seed: int = 1234, by_global_name: bool = False, pre_process: bool = True,
             post_process: bool = True, vp_stage=None, **config_overrides):
    """A 2-layer GPT (GQA, tied embeddings) built identically on every rank;
    ``by_global_name`` seeds each weight from its global name (layout-independent)."""
    from megatron_mfsdp.model import build_gpt_model, initialize_by_global_name, tiny_gpt_config

    torch.manual_seed(seed)
    config = tiny_gpt_config(**config_overrides)
    model = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                            pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    if by_global_name:
        initialize_by_global_name(model, config, seed)
    return config, model


def micro_batch(step: int, micro: int, dp_rank: int) -> torch.Tensor:
    """Tokens of one rank's micro-batch: a pure function of (step, micro-batch, rank)."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * micro + dp_rank)
    return torch.randint(0, VOCAB, (MBS, SEQ), generator=g)


def lm_loss(model, tokens: torch.Tensor, num_micro: int) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    per_token = model(tokens, positions, None, labels=tokens)
    return per_token.float().mean() / num_micro


def optimizer_config(**overrides):
    from megatron_mfsdp.config import MatrixFSDPOptimizerConfig

    kwargs = dict(lr=1e-2, min_lr=1e-2, weight_decay=0.1, clip_grad=0.0, muon_ns_dtype="fp32",
                  adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
    kwargs.update(overrides)
    return MatrixFSDPOptimizerConfig(**kwargs)


def reference_train(model, config, opt_config, world_size: int, steps: int, num_micro: int,
                    muon_blocks: int = 1) -> Dict:
    """Single-process training that processes every rank's micro-batches and
    averages the way MatrixFSDP does: per micro-batch, each rank's gradient is
    scaled by 1/W and the W contributions are summed in rank order, then added
    to the fp32 accumulator. The update uses the same per-parameter math.

    ``muon_blocks`` > 1 orthogonalizes each matrix in that many blocks along its
    tensor-parallel split dimension: what blockwise Muon does at that TP size."""
    from megatron_mfsdp.optimizer import _no_weight_decay, adamw_step_
    from megatron_mfsdp.placement import MUON, classify_parameter, qkv_block_rows

    params = dict(model.named_parameters())
    state = {n: {} for n in params}
    qkv_rows = qkv_block_rows(config) if opt_config.muon_split_qkv else None
    ns_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[opt_config.muon_ns_dtype]
    losses = []
    for step in range(1, steps + 1):
        acc = {n: torch.zeros(p.numel(), dtype=torch.float32) for n, p in params.items()}
        step_loss = 0.0
        for k in range(num_micro):
            contributions = []
            for r in range(world_size):
                model.zero_grad(set_to_none=True)
                loss = lm_loss(model, micro_batch(step, k, r), num_micro)
                loss.backward()
                step_loss += loss.item() / world_size
                contributions.append({n: p.grad.reshape(-1).float() * (1.0 / world_size)
                                      for n, p in params.items()})
            for n in params:
                total = contributions[0][n].clone()
                for r in range(1, world_size):
                    total.add_(contributions[r][n])
                acc[n].add_(total)
        losses.append(step_loss)
        sumsq = sum(a.double().square().sum() for a in acc.values())
        norm = float(sumsq.sqrt())
        if opt_config.clip_grad > 0 and opt_config.clip_grad / (norm + 1e-6) < 1.0:
            for a in acc.values():
                a.mul_(opt_config.clip_grad / (norm + 1e-6))
        b1, b2 = opt_config.adam_beta1, opt_config.adam_beta2
        with torch.no_grad():
            for n, p in params.items():
                kind = classify_parameter(n, p.shape)
                if kind == MUON and opt_config.optimizer == "muon":
                    buf = state[n].setdefault("momentum_buffer", torch.zeros(p.shape))
                    dim = getattr(p, "partition_dim", 0)
                    for block, grad_block, buf_block in zip(p.data.chunk(muon_blocks, dim),
                                                            acc[n].view(p.shape).chunk(muon_blocks, dim),
                                                            buf.chunk(muon_blocks, dim)):
                        _muon_block_step(block, grad_block, buf_block, n, opt_config, ns_dtype, qkv_rows)
                else:
                    wd = 0.0 if _no_weight_decay(n, p.shape) else opt_config.weight_decay
                    m = state[n].setdefault("exp_avg", torch.zeros(p.numel()))
                    v = state[n].setdefault("exp_avg_sq", torch.zeros(p.numel()))
                    adamw_step_(p.data.view(-1), acc[n], m, v, lr=opt_config.lr, weight_decay=wd,
                                beta1=b1, beta2=b2, eps=opt_config.adam_eps,
                                bias_correction1=1 - b1 ** step, bias_correction2=1 - b2 ** step)
    return {"params": {n: p.detach().clone() for n, p in params.items()},
            "state": {n: {k: v.reshape(-1).clone() for k, v in st.items()} for n, st in state.items()},
            "losses": losses}


def _muon_block_step(param, grad, buf, name, opt_config, ns_dtype, qkv_rows) -> None:
    """muon_step_ on one (possibly non-contiguous) block, written back in place."""
    from megatron_mfsdp.muon import muon_step_

    work, work_buf = param.contiguous(), buf.contiguous()
    muon_step_(work, grad.contiguous(), work_buf, lr=opt_config.lr, weight_decay=opt_config.weight_decay,
               momentum=opt_config.muon_momentum, nesterov=opt_config.muon_use_nesterov,
               ns_steps=opt_config.muon_num_ns_steps, coefficients=opt_config.muon_coefficients,
               ns_dtype=ns_dtype, scale_mode=opt_config.muon_scale_mode,
               extra_scale_factor=opt_config.muon_extra_scale_factor,
               qkv_split_shapes=qkv_rows if name.endswith("linear_qkv.weight") else None)
    param.copy_(work)
    buf.copy_(work_buf)


def assemble_optimizer_state(rank_states: List[Dict], shapes: Dict[str, tuple]) -> Dict:
    """Join the per-rank optimizer pieces (name@offset -> tensors) into full flat tensors."""
    full: Dict[str, Dict[str, torch.Tensor]] = {}
    for sd in rank_states:
        for key, st in sd["state"].items():
            name, offset = key.rsplit("@", 1)
            offset = int(offset)
            numel = 1
            for s in shapes[name]:
                numel *= s
            for k, v in list(st.items()) + [("master", sd["master"][key])]:
                flat = full.setdefault(name, {}).setdefault(k, torch.full((numel,), float("nan")))
                flat[offset: offset + v.numel()] = v.reshape(-1)
    return full
