"""What the training loop prints, in Megatron-LM's formats, and the loss curve."""

from __future__ import annotations

import datetime
import math

import torch.distributed as dist

from ..groups import group_rank


def print_rank0(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def log_iteration(args, iteration, elapsed_ms, lr, loss, loss_scale, grad_norm, skipped, nans, step_ms) -> None:
    tokens_per_s = args.global_batch_size * args.seq_length / (elapsed_ms / 1000)
    line = (
        f" [{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} |"
        f" consumed samples: {iteration * args.global_batch_size:12d} |"
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
        f" learning rate: {lr:.6E} | global batch size: {args.global_batch_size:5d} |"
        f" lm loss: {loss:.6E} | loss scale: {loss_scale:.1f} |"
    )
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += (
        f" number of skipped iterations: {skipped:3d} | number of nan iterations: {nans:3d} |"
        f" optimizer step time (ms): {step_ms:.1f} | tokens per second: {tokens_per_s:.1f} |"
    )
    print_rank0(line)


def log_validation(iteration: int, loss: float, label: str = "validation") -> None:
    text = (
        f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} |"
        f" lm loss PPL: {math.exp(min(20.0, loss)):.6E} | "
    )
    print_rank0("-" * len(text) + "\n" + text + "\n" + "-" * len(text))


def print_stage_plans(chunks, groups) -> None:
    """Rank 0 prints the owner plan of every pipeline stage and virtual stage (from its
    first TP/DP rank)."""
    first_of_stage = group_rank(groups.tp) == 0 and group_rank(groups.dp) == 0
    stage = group_rank(groups.pp)
    mine = [(stage, v, c.plan.report()) for v, c in enumerate(chunks)] if first_of_stage else []
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for stage, virtual, report in sorted(r for rank_reports in everyone for r in rank_reports):
        label = f"pipeline stage {stage}" + (f", virtual stage {virtual}" if len(chunks) > 1 else "")
        print_rank0(f"> {label}: " + report)


def plot_loss_curve(history: dict[str, list], path: str) -> None:
    """Training and validation loss against iteration, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*history["train"]), label="train lm loss")
    if history["valid"]:
        ax.plot(*zip(*history["valid"]), "o-", label="validation lm loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
