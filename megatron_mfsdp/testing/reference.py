"""The single-process reference trainer the exactness tests compare against, and the
helpers that join per-rank optimizer state for that comparison."""

from __future__ import annotations

import torch

from .tiny import lm_loss, micro_batch


def _reduced_gradients(model, params, step: int, world_size: int, num_micro: int):
    """Every rank's micro-batches through one process, summed as MatrixFSDP sums them: per
    micro-batch each rank's gradient is scaled by 1/W and the W contributions are added in
    rank order, then into the fp32 accumulator. Returns (accumulators, mean loss)."""
    acc = {n: torch.zeros(p.numel(), dtype=torch.float32) for n, p in params.items()}
    step_loss = 0.0
    for k in range(num_micro):
        contributions = []
        for r in range(world_size):
            model.zero_grad(set_to_none=True)
            loss = lm_loss(model, micro_batch(step, k, r), num_micro)
            loss.backward()
            step_loss += loss.item() / world_size
            contributions.append({n: p.grad.reshape(-1).float() * (1.0 / world_size) for n, p in params.items()})
        for n in params:
            total = contributions[0][n].clone()
            for r in range(1, world_size):
                total.add_(contributions[r][n])
            acc[n].add_(total)
    return acc, step_loss


def _clip_(acc, clip_grad: float) -> None:
    norm = float(sum(a.double().square().sum() for a in acc.values()).sqrt())
    if clip_grad > 0 and clip_grad / (norm + 1e-6) < 1.0:
        for a in acc.values():
            a.mul_(clip_grad / (norm + 1e-6))


def reference_train(
    model, config, opt_config, world_size: int, steps: int, num_micro: int, muon_blocks: int = 1
) -> dict:
    """Single-process training that processes every rank's micro-batches and averages the
    way MatrixFSDP does, then updates each parameter with the library's own rule: the rule
    --optimizer gives its role (optim/registry.py), stepped on the whole parameter.

    ``muon_blocks`` > 1 orthogonalizes each Muon matrix in that many blocks along its
    tensor-parallel split dimension: what blockwise Muon does at that TP size."""
    params = dict(model.named_parameters())
    state = {n: {} for n in params}
    losses = []
    for step in range(1, steps + 1):
        acc, step_loss = _reduced_gradients(model, params, step, world_size, num_micro)
        losses.append(step_loss)
        _clip_(acc, opt_config.clip_grad)
        reference_step(model, config, opt_config, acc, state, step, muon_blocks)
    return {
        "params": {n: p.detach().clone() for n, p in params.items()},
        "state": {n: {k: v.reshape(-1).clone() for k, v in st.items()} for n, st in state.items()},
        "losses": losses,
    }


@torch.no_grad()
def reference_step(model, config, opt_config, grads: dict, state: dict, step: int, muon_blocks: int = 1) -> None:
    """One optimizer step on every parameter of the single-process ``model`` from its fp32 gradient
    ``grads[name]`` (flat), with the rule --optimizer gives its role (optim/registry.py) stepped on the
    whole parameter; ``state[name]`` carries each parameter's state from step to step."""
    from ..models.gpt import gpt_param_roles, qkv_split_rows
    from ..optim import registry

    rules = registry.rule_set((), opt_config).extended(gpt_param_roles())
    for n, p in model.named_parameters():
        rule = registry.get(rules.update_rule(rules.classify(n, p.shape)))
        split = qkv_split_rows(config) if n.endswith("linear_qkv.weight") and rule.splits_qkv(opt_config) else None
        if rule.name == "muon":
            _muon_blocks_step(p, grads[n], state.setdefault(n, {}), opt_config, split, muon_blocks)
        else:
            _rule_step(rule, p, n, grads[n], state.setdefault(n, {}), opt_config, step, split)


def _rule_step(rule, p, name, grad, state, opt_config, step: int, split_rows=None) -> None:
    """One step of ``rule`` on the whole parameter (flat for an elementwise rule, as a slice of it is),
    its state kept in ``state`` from step to step; ``split_rows``: Q, K and V updated apart."""
    from ..optim.optimizer import no_weight_decay
    from ..optim.rule import OwnedPiece, StepContext
    from ..placement.classes import WHOLE

    shape = tuple(p.shape) if rule.storage == WHOLE else (p.numel(),)
    piece = OwnedPiece(name, name, rule.name, p.numel(), 0, p.data.view(shape), grad.view(shape), split_rows=split_rows)
    settings = rule.settings_in(opt_config)
    if not state:
        state.update(rule.init_state(piece, settings))
    piece.state = state
    wd = 0.0 if no_weight_decay(name, p.shape) else opt_config.weight_decay
    rule.step([piece], StepContext(opt_config, step, opt_config.lr, wd, settings=settings))


def _muon_blocks_step(p, grad, state, opt_config, split, blocks: int) -> None:
    """muon_step_ on each block along the TP split dimension, written back in place."""
    from ..optim.muon import hyper_in, muon_step_

    hyper, buf = hyper_in(opt_config), state.setdefault("momentum_buffer", torch.zeros(p.shape))
    dim = getattr(p, "partition_dim", 0)
    for block, grad_block, buf_block in zip(
        p.data.chunk(blocks, dim), grad.view(p.shape).chunk(blocks, dim), buf.chunk(blocks, dim)
    ):
        work, work_buf = block.contiguous(), buf_block.contiguous()
        muon_step_(
            work,
            grad_block.contiguous(),
            work_buf,
            hyper,
            lr=opt_config.lr,
            weight_decay=opt_config.weight_decay,
            split_rows=split,
        )
        block.copy_(work)
        buf_block.copy_(work_buf)


def assemble_optimizer_state(rank_states: list[dict], shapes: dict[str, tuple], runs: dict | None = None) -> dict:
    """Join the per-rank optimizer pieces (name@offset -> tensors) into full flat tensors. ``runs``
    maps the key of a Q, K or V block placed apart to its ``ParamSlot.runs()`` (first, run, stride,
    count): its rows of every query group; any other piece is one range from its offset."""
    full: dict[str, dict[str, torch.Tensor]] = {}
    for sd in rank_states:
        for key, st in sd["state"].items():
            name, offset = key.rsplit("@", 1)
            numel = 1
            for s in shapes[name]:
                numel *= s
            for k, v in list(st.items()) + [("master", sd["master"][key])]:
                flat = full.setdefault(name, {}).setdefault(k, torch.full((numel,), float("nan")))
                first, run, stride, count = (runs or {}).get(key, (int(offset), v.numel(), v.numel(), 1))
                flat.as_strided((count, run), (stride, 1), first).copy_(v.reshape(count, run))
    return full
