"""One training step and one evaluation through megatron-core's schedules, with Megatron-LM's
loss conventions (mean lm loss per micro-batch, or a per-token sum with
--calculate-per-token-loss) and its NaN checks."""

from __future__ import annotations

import math
import time
from functools import partial

import torch
import torch.distributed as dist

from ..groups import group_rank, group_size


def _loss_func(per_token: bool, loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """megatron's loss_func contract: (loss, {"lm loss": ...}), or with per-token loss
    (loss sum, token count, {"lm loss": [sum, count]}) so that the schedule can divide by the
    tokens of the whole global batch."""
    mask = loss_mask.float().reshape(-1)
    losses = output_tensor.float().reshape(-1)
    if per_token:
        total, tokens = (losses * mask).sum(), mask.sum().to(torch.int)
        return total, tokens, {"lm loss": torch.stack([total.detach().clone(), tokens.detach().float()])}
    loss = (losses * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place


def forward_step(per_token: bool, data_iterator, model):
    batch = next(data_iterator)
    device = model.device
    output = model(
        batch["tokens"].to(device), batch["position_ids"].to(device), None, labels=batch["labels"].to(device)
    )
    return output, partial(_loss_func, per_token, batch["loss_mask"].to(device))


def mean_loss(loss_dicts, groups, device) -> float:
    """The step's lm loss from the last pipeline stage, averaged over DP (per token with
    --calculate-per-token-loss), as every rank sees it."""
    if loss_dicts and loss_dicts[0]["lm loss"].numel() == 2:
        pair = torch.stack([d["lm loss"] for d in loss_dicts]).sum(0).double()
    else:
        pair = torch.tensor([sum(d["lm loss"].item() for d in loss_dicts), len(loss_dicts)], dtype=torch.float64)
    t = pair.to(device)  # (loss sum, count): micro-batch means and their number, or token sums and tokens
    if group_size(groups.pp) > 1:
        if group_rank(groups.pp) != group_size(groups.pp) - 1:
            t.zero_()
        dist.all_reduce(t, group=groups.pp)
    dist.all_reduce(t, group=groups.dp)
    return (t[0] / t[1].clamp(min=1)).item()


def _ranks_with(flag: bool) -> list:
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return [r for r, f in enumerate(flags) if f]


def check_loss(args, iteration: int, loss: float, local_losses) -> None:
    """--check-for-nan-in-loss-and-grad: stop on a NaN or inf loss, naming the iteration and ranks."""
    if args.check_for_nan_in_loss_and_grad and not math.isfinite(loss):
        local = [d["lm loss"] for d in local_losses]
        bad = _ranks_with(any(not torch.isfinite(x).all() for x in local))
        raise RuntimeError(
            f"iteration {iteration}: the lm loss is {loss} (non-finite on rank(s) {bad or 'none'}); "
            "stopping (--check-for-nan-in-loss-and-grad is on)"
        )


def train_step(args, run, iteration: int, num_microbatches: int):
    """Forward and backward of one global batch, then the optimizer step. Returns
    (loss, success, grad norm, zero count, step seconds)."""
    from ..runtime.pipeline import forward_backward

    for chunk in run.chunks:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    loss_dicts = forward_backward(
        partial(forward_step, args.calculate_per_token_loss),
        run.train.step(num_microbatches),
        run.chunks,
        num_microbatches,
        args.seq_length,
        args.micro_batch_size,
    )
    loss = mean_loss(loss_dicts, run.groups, run.device)
    check_loss(args, iteration, loss, loss_dicts)
    empty_unused_memory(args, 1)
    from ..compat.cpu import cuda_on_cpu

    start = time.perf_counter()
    with cuda_on_cpu():  # megatron-core's optimizers allocate on "cuda"
        success, grad_norm, zeros = run.optimizer.step()
    if run.qk_clip is not None and (not hasattr(run.optimizer, "after_rules") or not success):
        run.qk_clip()  # the max logits for the log (megatron-core's optimizer, or a skipped step): no clip
    seconds = time.perf_counter() - start
    empty_unused_memory(args, 2)
    if not success and args.check_for_nan_in_loss_and_grad and not args.fp16:
        raise RuntimeError(
            f"iteration {iteration}: the gradient norm is not finite; stopping (--check-for-nan-in-loss-and-grad is on)"
        )
    return loss, success, grad_norm, zeros, seconds


def empty_unused_memory(args, level: int) -> None:
    """--empty-unused-memory-level: release the CUDA caching allocator's unused blocks where Megatron-LM's
    train_step and evaluate do (level 1 after each forward-backward, 2 also after the optimizer step;
    megatron/training/training.py at HEAD). A no-op without CUDA (validation said so)."""
    if args.empty_unused_memory_level >= level and torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def evaluate(args, run, source, num_microbatches: int) -> float:
    """Mean lm loss over --eval-iters global batches of ``source`` (a StepIterators)."""
    from ..runtime.pipeline import forward_backward

    for chunk in run.chunks:
        chunk.eval()
    losses = []
    for _ in range(args.eval_iters):
        dicts = forward_backward(
            partial(forward_step, args.calculate_per_token_loss),
            source.step(num_microbatches),
            run.chunks,
            num_microbatches,
            args.seq_length,
            args.micro_batch_size,
            forward_only=True,
        )
        losses.append(mean_loss(dicts, run.groups, run.device))
        empty_unused_memory(args, 1)
    for chunk in run.chunks:
        chunk.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def params_norm(run) -> float:
    """--log-params-norm: the L2 norm of all weights, each element counted once across TP, PP
    and DP (for MatrixFSDP from the owners' fp32 masters)."""
    if hasattr(run.optimizer, "params_norm"):
        return run.optimizer.params_norm()
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    total = torch.zeros(1, dtype=torch.float64, device=run.device)
    for chunk in run.chunks:
        for p in chunk.parameters():
            if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
                total += p.detach().double().square().sum()
    for group in (run.groups.tp, run.groups.pp):
        if group_size(group) > 1:
            dist.all_reduce(total, group=group)
    return math.sqrt(total.item())
