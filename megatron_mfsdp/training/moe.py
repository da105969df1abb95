"""The MoE auxiliary losses in the training log, as Megatron-LM logs them (training_log in
megatron/training/training.py at core_v0.16.1): megatron-core's routers add each micro-batch's
losses to its layer-wise tracker (transformer/moe/moe_utils.py), and every iteration, on every rank,
``track_moe_metrics`` reduces them over the pipeline and data-parallel ranks, scales them by one over
the micro-batches, adds the mean over MoE layers to the interval's totals (printed as
``load_balancing_loss: ... |`` after the lm loss, averaged over the interval's iterations) and writes
them to TensorBoard/W&B (per layer with --moe-per-layer-logging). The aux-loss-free expert bias is
updated where Megatron-LM updates it, in the schedule's finalize_model_grads (megatron-core's for its
DDP, runtime/pipeline.py's for MatrixFSDP)."""

from __future__ import annotations


def track_names(args) -> list[str]:
    """The tracker entries Megatron-LM logs for the run's load balancing (its training_log)."""
    types = args.moe_router_load_balancing_type
    names = []
    for kind, name in (
        ("aux_loss", "load_balancing_loss"),
        ("seq_aux_loss", "seq_load_balancing_loss"),
        ("global_aux_loss", "global_load_balancing_loss"),
    ):
        if kind in types:  # a name, or a list of them (``in`` works on both, as in Megatron-LM)
            names.append(name)
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


class _ToWriters:
    """megatron-core writes to a SummaryWriter (``add_scalar``); ours writes TensorBoard and W&B."""

    def __init__(self, writers):
        self.writers = writers

    def add_scalar(self, tag: str, value, step: int) -> None:
        self.writers.scalars({tag: float(value)}, step)


def start() -> None:
    """Forget what an earlier job in this process tracked (its groups may be gone)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def track(args, iteration: int, num_microbatches: int, totals: dict, writers) -> None:
    """One iteration's MoE losses into ``totals`` (name -> running sum) and the writers. Collective."""
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    from ..compat.cpu import cuda_on_cpu

    writer = _ToWriters(writers) if writers.tb is not None or writers.wandb is not None else None
    with cuda_on_cpu():  # the tracker's first tensors are made on "cuda"
        track_moe_metrics(
            loss_scale=1 / num_microbatches,
            iteration=iteration,
            writer=writer,
            total_loss_dict=totals,
            per_layer_logging=args.moe_per_layer_logging,
            force_initialize=True,
            track_names=track_names(args),
            num_layers=args.num_layers,
            moe_layer_freq=args.moe_layer_freq,
        )


def averages(totals: dict, iterations: int) -> dict[str, float]:
    """Each total over the interval's advanced iterations, as Megatron-LM prints them."""
    return {name: total.item() / max(1, iterations) for name, total in totals.items()}


def clear() -> None:
    """Drop what evaluation's forward passes tracked (Megatron-LM clears after each evaluation)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()
