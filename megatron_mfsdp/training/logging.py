"""What training prints and records, in Megatron-LM's formats (training_log and
evaluate_and_print_results in megatron/training/training.py at core_v0.16.1): the start-up
arguments dump and parameter counts, the iteration line and validation lines from the last
rank, the memory line, TensorBoard and W&B scalars under Megatron's tags, and our loss
history with its PNG."""

from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist

from ..groups import group_rank


def print_rank0(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def print_rank_last(*args) -> None:
    """Megatron-LM prints training logs from the last rank (it holds the last pipeline stage)."""
    if dist.get_rank() == dist.get_world_size() - 1:
        print(*args, flush=True)


def print_datetime(string: str) -> None:
    """Megatron-LM's print_datetime: a barrier, then rank 0 prints ``[string] datetime: ...``."""
    dist.barrier()
    print_rank0(f"[{string}] datetime: {datetime.datetime.now():%Y-%m-%d %H:%M:%S.%f} ")


def set_logging_level(args) -> None:
    """--logging-level, else $MEGATRON_LOGGING_LEVEL: the root logger's level (Megatron-LM's
    setup_logging, megatron/training/initialize.py at HEAD)."""
    import logging as py_logging

    level = os.environ.get("MEGATRON_LOGGING_LEVEL")
    level = args.logging_level if args.logging_level is not None else (int(level) if level else None)
    if level is not None:
        py_logging.getLogger().setLevel(level)


def print_args(args, title: str = "arguments") -> None:
    """Megatron-LM's argument dump (_print_args in megatron/training/arguments.py at core_v0.16.1):
    rank 0 prints every argument, dotted to column 48, the lines sorted case-blind."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank != 0:
        return
    print(f"------------------------ {title} ------------------------", flush=True)
    lines = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()]
    for line in sorted(lines, key=lambda x: x.lower()):
        print(line, flush=True)
    print(f"-------------------- end of {title} ---------------------", flush=True)


def tp_local_parameter_count(chunks) -> int:
    """Megatron-LM's count (get_model in megatron/training/training.py at core_v0.16.1): every
    parameter of every model chunk of this rank, each once, at its full TP-local shape. MatrixFSDP
    released the full tensors after keeping this rank's segment of them, so a wrapped parameter's
    shape comes from its unit: counting our segments would give this DP rank's share, not the model."""
    total = 0
    for chunk in chunks:
        shapes = {id(p): state.shapes[name] for state in getattr(chunk, "units", ()) for name, p in state.tensors}
        module = getattr(chunk, "module", chunk)
        total += sum(math.prod(shapes.get(id(p), p.shape)) for p in module.parameters())
    return total


def parameter_count_line(tp_rank: int, pp_rank: int, count: int) -> str:
    """As get_model prints it (megatron/training/training.py at core_v0.16.1)."""
    return f" > number of parameters on (tensor, pipeline) model parallel rank ({tp_rank}, {pp_rank}): {count}"


def print_parameter_count(chunks, groups) -> None:
    """Printed by data-parallel rank 0 of every (TP, PP) pair, as Megatron-LM (which also asks for
    context-parallel rank 0: there is no context parallelism here)."""
    if group_rank(groups.dp) == 0:
        line = parameter_count_line(group_rank(groups.tp), group_rank(groups.pp), tp_local_parameter_count(chunks))
        print(line, flush=True)


def flops_per_iteration(args, batch_size: int, vocab_size: int) -> float:
    """Model FLOPs of one iteration (forward and backward = 3 x forward, 2 per multiply-add), as
    Megatron-LM counts a GPT: QKV and output projections, causal attention scores, MLP and logits; an MoE
    layer's MLP is its top-k experts' and its shared experts' (num_floating_point_operations in
    megatron/training/training.py at core_v0.16.1, which leaves the router out)."""
    q = args.kv_channels * args.num_attention_heads
    kv = args.kv_channels * (args.num_query_groups if args.group_query_attention else args.num_attention_heads)
    attention = args.hidden_size * (q + 2 * kv) + q * args.seq_length + q * args.hidden_size
    ffn = 3 if args.swiglu else 2
    moe_layers = moe_layer_count(args)
    moe = (
        0
        if not moe_layers
        else args.moe_router_topk * args.moe_ffn_hidden_size + (args.moe_shared_expert_intermediate_size or 0)
    )
    mlp = args.hidden_size * ffn * (args.ffn_hidden_size * (args.num_layers - moe_layers) + moe * moe_layers)
    per_token = 3 * 2 * (args.num_layers * attention + mlp + args.hidden_size * vocab_size)
    return batch_size * args.seq_length * per_token


def moe_layer_pattern(args) -> list[bool]:
    """Which layers of a parsed namespace are MoE layers (models/gpt/config.py reads --moe-layer-freq)."""
    from ..models.gpt.config import moe_layer_pattern as pattern

    return pattern(vars(args))


def moe_layer_count(args) -> int:
    """How many layers are MoE layers; 0 for a dense model."""
    return sum(moe_layer_pattern(args))


def iteration_line(
    args,
    it,
    train_iters,
    consumed,
    elapsed_ms,
    lr,
    gbs,
    loss,
    loss_scale,
    grad_norm,
    zeros,
    params_norm,
    skipped,
    nans,
    extra,
) -> str:
    line = (
        f" [{datetime.datetime.now():%Y-%m-%d %H:%M:%S.%f}] iteration {it:8d}/{train_iters:8d} |"
        f" consumed samples: {consumed:12d} | elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    )
    if extra.get("tflops") is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {extra['tflops']:.1f} |"
    line += f" learning rate: {lr:.6E} | global batch size: {gbs:5d} |"
    if loss is not None and loss > 0.0:
        line += f" lm loss: {loss:.6E} |"
    for name, value in extra.get("moe", {}).items():  # Megatron-LM prints its other losses after the lm loss
        if value > 0.0:
            line += f" {name}: {value:.6E} |"
    if extra.get("max_logit") is not None:  # the last step's; Megatron-LM has it in TensorBoard only
        line += f" max_attention_logit: {extra['max_logit']:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if zeros is not None:
        line += f" num zeros: {zeros} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} | number of nan iterations: {nans:3d} |"
    # Ours, after Megatron-LM's fields: the slowest rank's optimizer step, and tokens per second.
    line += f" optimizer step time (ms): {extra['step_ms']:.1f} | tokens per second: {extra['tokens_per_s']:.1f} |"
    return line + extra.get("spread", "")


def timing_spread(option: str, per_rank: list) -> str:
    """The iteration line's tail for --timing-log-option (Megatron's timers' choices): the line itself
    shows the slowest rank's times; minmax adds the fastest and slowest, all every rank's (in ms)."""
    if option == "max" or len(per_rank) < 2:
        return ""
    fields = []
    for label, column in zip(("iteration time", "optimizer step time"), zip(*per_rank)):
        ms = [1000 * t for t in column]
        if option == "minmax":
            fields.append(f" {label} min/max over ranks (ms): {min(ms):.1f}/{max(ms):.1f} |")
        else:
            fields.append(f" {label} per rank (ms): {', '.join(f'{t:.1f}' for t in ms)} |")
    return "".join(fields)


def validation_lines(prefix: str, loss: float) -> str:
    text = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(20, loss)):.6E} | "
    return "\n".join(["-" * (len(text) + 1), text, "-" * (len(text) + 1)])


def print_stage_plans(chunks, groups) -> None:
    """Rank 0 prints the owner plan of every pipeline stage and virtual stage (from its first TP/DP rank)."""
    first_of_stage = group_rank(groups.tp) == 0 and group_rank(groups.dp) == 0
    stage = group_rank(groups.pp)
    mine = [(stage, v, c.plan.report()) for v, c in enumerate(chunks) if hasattr(c, "plan")] if first_of_stage else []
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for stage, virtual, report in sorted(r for rank_reports in everyone for r in rank_reports):
        label = f"pipeline stage {stage}" + (f", virtual stage {virtual}" if len(chunks) > 1 else "")
        print_rank0(f"> {label}: " + report)


def _rss_bytes() -> tuple[int, int]:
    """(resident set now, its peak) of this process: a CPU's stand-in for the CUDA allocator's."""
    import resource

    import psutil

    rss = psutil.Process().memory_info().rss
    # The kernel's high-water mark (KiB on Linux) trails the current figure between its updates.
    return rss, max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def memory_stats() -> dict:
    """Megatron's mem-* scalars (training_log in megatron/training/training.py at core_v0.16.1): the
    CUDA allocator's, or on a CPU the process's resident set (no allocation count there)."""
    if torch.cuda.is_available():
        s = torch.cuda.memory_stats()
        return {
            "mem-reserved-bytes": s["reserved_bytes.all.current"],
            "mem-allocated-bytes": s["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": s["allocated_bytes.all.peak"],
            "mem-allocated-count": s["allocation.all.current"],
        }
    rss, peak = _rss_bytes()
    return {"mem-reserved-bytes": rss, "mem-allocated-bytes": rss, "mem-max-allocated-bytes": peak}


CPU_MEMORY_NOTE = " | RSS: no CUDA allocator, allocated and reserved are the process's resident set, max its peak"


def memory_line(name: str) -> str:
    """report_memory's text (megatron/training/utils.py at core_v0.16.1) after ``[Rank r] ``: the
    CUDA allocator's figures, or on a CPU the resident set in their place, said at the end."""
    mega_bytes = 1024.0 * 1024.0
    if torch.cuda.is_available():
        figures = (
            torch.cuda.memory_allocated(),
            torch.cuda.max_memory_allocated(),
            torch.cuda.memory_reserved(),
            torch.cuda.max_memory_reserved(),
        )
        note = ""
    else:
        rss, peak = _rss_bytes()
        figures, note = (rss, peak, rss, peak), CPU_MEMORY_NOTE
    string = name + " memory (MB)"
    for label, value in zip(("allocated", "max allocated", "reserved", "max reserved"), figures):
        string += f" | {label}: {value / mega_bytes:.2f}"
    return string + note


def report_memory(name: str, groups) -> None:
    """Megatron-LM's report_memory: every data-parallel rank 0 prints ``[Rank r] ...``."""
    if group_rank(groups.dp) == 0:
        print(f"[Rank {dist.get_rank()}] {memory_line(name)}", flush=True)


class Writers:
    """TensorBoard (--tensorboard-dir) and W&B (--wandb-project) on the last rank, as Megatron-LM."""

    def __init__(self, args):
        self.tb = self.wandb = None
        if dist.get_rank() != dist.get_world_size() - 1:
            return
        if args.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
            except ImportError:
                print(
                    "> WARNING: TensorBoard writing requested but is not available (pip install tensorboard), "
                    "no TensorBoard logs will be written.",
                    flush=True,
                )
        if args.wandb_project:
            import wandb

            wandb.init(
                project=args.wandb_project,
                name=args.wandb_exp_name,
                entity=args.wandb_entity,
                dir=args.wandb_save_dir or args.tensorboard_dir,
                config=vars(args) | {"explicit": None},
            )
            self.wandb = wandb

    def scalars(self, values: dict, iteration: int, samples: int | None = None) -> None:
        """Each tag at ``iteration`` (and ``tag vs samples`` at ``samples``, as Megatron writes them)."""
        if self.tb is not None:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, iteration)
                if samples is not None and not tag.startswith("mem-"):
                    self.tb.add_scalar(f"{tag} vs samples", value, samples)
        if self.wandb is not None:
            self.wandb.log(dict(values), step=iteration)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def plot_loss_curve(history: dict, path: str) -> None:
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


def fp8_error_line(optimizer, groups) -> str:
    """FP8 rounding against the last logged update, per matrix: ||Q(W) - W||_F / ||dW||_F from each
    matrix's owner (above 1 the rounding outweighs the update). Collective: every rank sends its own."""
    mine = {}
    for key, value in getattr(optimizer, "fp8_errors", {}).items():
        name = key.rsplit("@", 1)[0]
        mine[name if groups.tp_size == 1 else f"{name}[tp{group_rank(groups.tp)}]"] = value
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = dict(sorted((k, v) for rank_errors in everyone for k, v in rank_errors.items()))
    if not merged:
        return " fp8 quantization error / update: no FP8 matrix measured yet"
    values = sorted(merged.values())
    worst = max(merged, key=merged.get)
    per_matrix = " ".join(f"{k}={v:.3f}" for k, v in merged.items())
    return (
        f" fp8 quantization error / update: max {values[-1]:.3f} ({worst}) | median {values[len(values) // 2]:.3f}"
        f" over {len(values)} matrices | {per_matrix}"
    )
