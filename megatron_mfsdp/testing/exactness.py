"""Workers that hold an update rule to the single-process reference at DP, PP and TP layouts: what
every rule's exactness test runs (tests/distributed/test_*_rule.py).

DP and PP train the tiny GPT through megatron-core's schedule. TP changes the order of the
row-parallel sums in forward and backward, so the gradients themselves differ in their last bits;
the TP check is at the optimizer: every rank's pieces get their part of the same full gradients
(:func:`synthetic_grad`), and the TP run's weights after the steps must equal the single-process
rule's bitwise. Each run counts the collectives of every step.
"""

from __future__ import annotations

import zlib

import torch

from .reference import reference_step, reference_train
from .tiny import forward_step, init_megatron, lm_loss, micro_batch, optimizer_config, tiny_gpt
from .workers import count_collectives


def synthetic_grad(name: str, shape, step: int) -> torch.Tensor:
    """A full (TP = 1) fp32 gradient, a pure function of (global name, step): noise plus a rank-2
    part, so preconditioners see a spectrum with structure."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * step)
    noise = torch.randn(tuple(shape), generator=g)
    if len(shape) != 2:
        return noise * 1e-2
    low = torch.randn(shape[0], 2, generator=g) @ torch.randn(2, shape[1], generator=g)
    return (noise + low) * 1e-2


def _build(opt_overrides: dict, tp: int = 1, pp: int = 1):
    from .. import MatrixFSDP, MatrixFSDPConfig, ProcessGroups, configure_schedule, get_megatron_optimizer
    from ..groups import group_rank
    from ..optim import registry

    init_megatron(tp=tp, pp=pp)
    groups = ProcessGroups.from_parallel_state()
    stage = group_rank(groups.pp)
    opt_config = optimizer_config(**opt_overrides)
    config, model = tiny_gpt(
        by_global_name=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        pre_process=stage == 0,
        post_process=stage == pp - 1,
    )
    ddp = MatrixFSDP(config, MatrixFSDPConfig(rules=registry.rule_set((), opt_config)), model, groups)
    opt = get_megatron_optimizer(opt_config, [ddp])
    configure_schedule([ddp], opt)
    return model, ddp, opt, groups


def _full_params(model, ddp, groups) -> dict[str, torch.Tensor]:
    """Every parameter of this stage as TP = 1 holds it, by global name."""
    import torch.distributed as dist

    params, full = dict(model.named_parameters()), {}
    for name, tensor in ddp.full_state_dict().items():
        param = params.get(name)
        if param is None:
            continue
        if getattr(param, "tensor_model_parallel", False) and groups.tp_size > 1:
            parts = [torch.empty_like(tensor) for _ in range(groups.tp_size)]
            dist.all_gather(parts, tensor, group=groups.tp)
            tensor = torch.cat(parts, dim=param.partition_dim)
        full[ddp.global_names[name]] = tensor
    return full


def _owned_state(opt) -> dict[str, dict[str, torch.Tensor]]:
    """The rule state of every piece this rank owns whole, by global name (TP rank 0's for TP state)."""
    return {
        o.global_name: {k: v.clone() for k, v in o.state.items()}
        for o in opt.owned_pieces()
        if o.master.dim() == 2 and o.tp_rank == 0
    }


def train_worker(rank, world_size, opt_overrides: dict, runs, pp: int = 1):
    """For each (steps, micro-batches) of ``runs``: the tiny GPT built afresh at DP = world / pp and
    trained; its full weights, its owners' rule state and each step's collectives."""
    from .. import forward_backward

    out = []
    for steps, num_micro in runs:
        model, ddp, opt, groups = _build(opt_overrides, pp=pp)
        dp_rank = groups.dp_shard_rank
        step_calls = []
        for step in range(1, steps + 1):
            opt.zero_grad()
            batches = iter([micro_batch(step, k, dp_rank) for k in range(num_micro)])
            forward_backward(forward_step, batches, [ddp], num_micro, 16, 2)
            with count_collectives() as calls:
                assert opt.step()[0]
            step_calls.append(list(calls))
        out.append({"params": _full_params(model, ddp, groups), "state": _owned_state(opt), "step_calls": step_calls})
    return out


def tiny_dp_run(rank: int, opt_config, steps: int, layout: str = "owner"):
    """The tiny GPT (global names) on MatrixFSDP at DP = world in ``layout``, trained ``steps`` steps of one
    micro-batch with ``opt_config``: (ddp, optimizer, each step's collectives)."""
    from .. import MatrixFSDP, MatrixFSDPConfig, get_megatron_optimizer
    from ..optim import registry

    init_megatron()
    config, model = tiny_gpt(by_global_name=True)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(layout=layout, rules=registry.rule_set((), opt_config, layout)), model)
    opt = get_megatron_optimizer(opt_config, [ddp])
    step_calls = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        lm_loss(ddp, micro_batch(step, 0, rank), 1).backward()
        ddp.finish_grad_sync()
        with count_collectives() as calls:
            assert opt.step()[0]
        step_calls.append(list(calls))
    return ddp, opt, step_calls


def reference_worker(rank, world_size, opt_overrides: dict, runs, dp_size: int):
    """:func:`reference_train` of each (steps, micro-batches) of ``runs`` at ``dp_size``."""
    out = []
    for steps, num_micro in runs:
        init_megatron()
        config, model = tiny_gpt(by_global_name=True)
        out.append(reference_train(model, config, optimizer_config(**opt_overrides), dp_size, steps, num_micro))
    return out


def tp_step_worker(rank, world_size, opt_overrides: dict, steps: int):
    """TP = world: one real forward and backward per step (so the runtime is in its after-backward
    state), then every owned piece's gradient replaced by its part of :func:`synthetic_grad` and the
    optimizer stepped. Returns the full weights, the owners' state and each step's collectives."""
    from .. import forward_backward

    model, ddp, opt, groups = _build(opt_overrides, tp=world_size)
    step_calls = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        forward_backward(forward_step, iter([micro_batch(step, 0, 0)]), [ddp], 1, 16, 2)
        for piece in opt.owned_pieces():
            piece.grad.copy_(_piece_grad(piece, step))
        with count_collectives() as calls:
            assert opt.step()[0]
        step_calls.append(list(calls))
    return {"params": _full_params(model, ddp, groups), "state": _owned_state(opt), "step_calls": step_calls}


def _piece_grad(piece, step: int) -> torch.Tensor:
    """This piece's part of the full synthetic gradient: its TP shard, then its range of it."""
    shape = list(piece.param_shape)
    if piece.partition_dim is not None:
        shape[piece.partition_dim] *= piece.tp_size
    full = synthetic_grad(piece.global_name, shape, step)
    if piece.partition_dim is not None:
        full = full.chunk(piece.tp_size, dim=piece.partition_dim)[piece.tp_rank]
    flat = full.reshape(-1)[piece.param_offset : piece.param_offset + piece.master.numel()]
    return flat.view_as(piece.grad)


def tp_reference_worker(rank, world_size, opt_overrides: dict, steps: int):
    """The single-process steps of :func:`tp_step_worker`'s gradients (TP = 1)."""
    init_megatron()
    config, model = tiny_gpt(by_global_name=True)
    opt_config, state = optimizer_config(**opt_overrides), {}
    for step in range(1, steps + 1):
        grads = {n: synthetic_grad(n, p.shape, step).reshape(-1) for n, p in model.named_parameters()}
        reference_step(model, config, opt_config, grads, state, step)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "state": state}
