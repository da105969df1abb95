"""Batch sizes and learning-rate schedule as Megatron-LM derives them (training.py's
update_train_iters and get_optimizer_param_scheduler at core_v0.16.1), on megatron-core's
num-microbatches calculator (batch-size ramp-up) and OptimizerParamScheduler."""

from __future__ import annotations

from megatron.core import num_microbatches_calculator as nmc

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_step_schedule(text: str, seq_length: int, micro_times_dp: int) -> list[tuple[int, int]]:
    """--step-batch-size-schedule "TOKENS:BATCH ..." as [(threshold in samples, batch)], with the
    meaning of Megatron-LM HEAD's StepBatchsizeNumMicroBatchesCalculator (thresholds are token
    counts, divided by --seq-length; K/M/B/T suffixes; commas or spaces between entries).
    Raises ValueError naming the flag; unlike HEAD, every batch size is checked up front."""
    flag = f"--step-batch-size-schedule {text!r}"
    steps = []
    for entry in text.replace(",", " ").split():
        tokens, sep, batch = entry.partition(":")
        try:
            values = [_with_suffix(tokens), _with_suffix(batch)] if sep else None
        except ValueError:
            values = None
        if values is None:
            raise ValueError(f"{flag}: entry {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. 2.4B:320)")
        steps.append((values[0] // seq_length, values[1]))
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ValueError(f"{flag}: the first threshold must be 0")
    for (a, _), (b, _) in zip(steps, steps[1:]):
        if a == b:
            raise ValueError(f"{flag}: two thresholds fall on the same sample ({a}) at --seq-length {seq_length}")
    for _, batch in steps:
        if batch <= 0 or batch % micro_times_dp:
            raise ValueError(
                f"{flag}: batch size {batch} is not a positive multiple of micro batch x DP = {micro_times_dp}"
            )
    return steps


def _with_suffix(text: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


class StepBatchCalculator(nmc.NumMicroBatchesCalculator):
    """megatron-core 0.16.1's calculator interface for a step-wise batch schedule (its own
    calculators cover constant batches and linear ramp-up only)."""

    def __init__(self, steps: list[tuple[int, int]], micro_batch_size: int, data_parallel_size: int):
        super().__init__()
        self.steps, self.micro_batch_size = steps, micro_batch_size
        self.micro_times_dp = micro_batch_size * data_parallel_size
        self.update(0, consistency_check=False)

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        batch = [b for threshold, b in self.steps if consumed_samples >= threshold][-1]
        self.current_global_batch_size = self.current_running_global_batch_size = batch
        self.num_micro_batches = batch // self.micro_times_dp


def init_microbatches(args) -> None:
    """megatron-core's global micro-batch calculator: constant, ramping up per --rampup-batch-size,
    or stepping per --step-batch-size-schedule."""
    nmc.unset_num_microbatches_calculator()
    if args.step_batch_size_schedule is not None:
        steps = parse_step_schedule(
            args.step_batch_size_schedule, args.seq_length, args.micro_batch_size * args.data_parallel_size
        )
        # megatron-core 0.16.1 has no setter for its global calculator; its getters read this one.
        nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = StepBatchCalculator(
            steps, args.micro_batch_size, args.data_parallel_size
        )
        return
    nmc.init_num_microbatches_calculator(
        args.rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size, args.data_parallel_size, False
    )


def current_batch(consumed_samples: int) -> tuple[int, int]:
    """(global batch size, micro-batches per rank) for the iteration starting at ``consumed_samples``."""
    nmc.update_num_microbatches(consumed_samples, consistency_check=True)
    return nmc.get_current_global_batch_size(), nmc.get_num_microbatches()


def update_train_iters(args) -> None:
    """--train-samples -> iterations, counting the ramp-up phase batch by batch (Megatron-LM's rule:
    a partial last batch is dropped)."""
    if args.train_iters:
        return
    if args.step_batch_size_schedule is not None:  # HEAD's rule: a partial last batch is one more iteration
        iterations = consumed = 0
        while consumed < args.train_samples:
            consumed += current_batch(consumed)[0]
            iterations += 1
        current_batch(0)
        args.train_iters = iterations
        return
    if args.rampup_batch_size is None:
        args.train_iters = args.train_samples // args.global_batch_size
        return
    iterations = consumed = 0
    while consumed <= args.rampup_batch_size[2] and consumed <= args.train_samples:
        consumed += current_batch(consumed)[0]
        iterations += 1
    current_batch(0)
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    args.train_iters = iterations


def scheduler_steps(args) -> dict:
    """OptimizerParamScheduler's step counts (in samples) for iteration- or sample-based training."""
    if args.train_samples is None:
        decay = (args.lr_decay_iters or args.train_iters) * args.global_batch_size
        wsd = args.lr_wsd_decay_iters * args.global_batch_size if args.lr_wsd_decay_iters is not None else None
        warmup = args.lr_warmup_iters * args.global_batch_size
        wd_incr = args.train_iters * args.global_batch_size
    else:
        decay = args.lr_decay_samples or args.train_samples
        wsd = args.lr_wsd_decay_samples
        warmup = args.lr_warmup_samples
        wd_incr = args.train_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return dict(lr_warmup_steps=warmup, lr_decay_steps=decay, wd_incr_steps=wd_incr, wsd_decay_steps=wsd)


def build_scheduler(args, optimizer):
    """megatron-core's OptimizerParamScheduler with Megatron-LM's arguments."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        **scheduler_steps(args),
    )
