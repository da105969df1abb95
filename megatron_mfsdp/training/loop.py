"""The pretraining job: set-up, the training loop, evaluation, checkpoints and exit conditions,
in Megatron-LM's order (megatron/training/training.py: pretrain and train at core_v0.16.1)."""

from __future__ import annotations

import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from ..compat.collectives import all_gather_single
from ..groups import group_rank, group_size
from . import control, launch, logging, memory, moe, schedule, steps, threads


def initialize_distributed(args) -> bool:
    """torchrun's environment, or a single process when launched plainly. Returns whether this call
    created the process group (a caller that made its own keeps it)."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        threads.configure_threads()  # OMP_NUM_THREADS where the user set it, else cores / local ranks
        dist.init_process_group(
            args.distributed_backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes)
        )
        owns = True
    else:
        owns = False
    from .setup import agree_ns_dtype

    agree_ns_dtype(args)  # a default from each rank's hardware, made one before the flags are compared
    control.check_ranks_agree(args)
    from ..groups import initialize_model_parallel

    initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        order=args.parallel_order,
        create_gloo_process_groups=args.enable_gloo_process_groups,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    from .setup import seed_cuda_rng_tracker

    seed_cuda_rng_tracker(args.seed)
    if args.deterministic_mode:
        torch.use_deterministic_algorithms(True)
    return owns


def build_run_tokenizer(args):
    """Megatron-LM's training tokenizer for the --tokenizer-* flags (data/tokenizers.py)."""
    from ..data.datasets import build_tokenizer

    return build_tokenizer(
        args.tokenizer_type,
        args.tokenizer_model,
        args.vocab_size,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_extra_ids=args.vocab_extra_ids,
        tokenizer_special_tokens=args.tokenizer_special_tokens,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        trust_remote_code=args.trust_remote_code,
    )


def prepare_data(args):
    """Tokenizer, padded vocabulary and (train, valid, test) datasets; builds the embedded default once."""
    from ..data.datasets import build_train_valid_test_datasets, padded_vocab_size

    if args.use_default_data:
        from ..data.corpus import prepare_default_data

        default = prepare_default_data(args.data_cache_path, progress=dist.get_rank() == 0)
        args.data_path = [str(default["data_prefix"])]
        args.tokenizer_model = str(default["tokenizer_model"])
        args.split = args.split or "969, 30, 1"
    tokenizer = build_run_tokenizer(args)
    tp = 1 if args.mfsdp_vocab_padding_independent_of_tp else args.tensor_model_parallel_size
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, tp)
    logging.print_rank0(
        f" > padded vocab (size: {tokenizer.vocab_size}) with "
        f"{args.padded_vocab_size - tokenizer.vocab_size} dummy tokens (new size: {args.padded_vocab_size})"
    )
    train = args.train_samples or args.train_iters * args.global_batch_size
    # Megatron-LM's count (training.py build_train_valid_test_data_loaders); without --eval-interval
    # (its default is None at core_v0.16.1, where this line raises) only the final evaluation runs.
    evals = ((args.train_iters // args.eval_interval if args.eval_interval else 0) + 1) * args.eval_iters
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    datasets = build_train_valid_test_datasets(
        [train, evals * args.global_batch_size, args.eval_iters * args.global_batch_size],
        args.seq_length,
        tokenizer=tokenizer,
        data_prefix=None if args.mock_data else args.data_path,
        per_split_prefixes=per_split if any(per_split) else None,
        split=args.split,
        seed=args.seed,
        mock=args.mock_data,
        data_cache_path=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
    )
    return tokenizer, datasets


class _Run:
    """What one job holds."""

    def __init__(self, args, groups, chunks, optimizer, scheduler, owns_process_group: bool):
        self.groups, self.chunks, self.optimizer, self.scheduler = groups, chunks, optimizer, scheduler
        self.device = chunks[0].device
        self.owns_process_group = owns_process_group
        self.dp_rank, self.dp_size = group_rank(groups.dp), group_size(groups.dp)
        self.train = self.valid = self.test = None
        self.consumed_train = self.consumed_valid = 0
        self.flops_so_far = 0.0  # floating-point operations of the iterations before this job (checkpoint)
        self.qk_clip = None  # training/qk_clip.py, with --qk-clip or --log-max-attention-logit

    def iterators(self, args, dataset, start: int):
        from .batches import StepIterators

        return StepIterators(args, dataset, start, self.dp_rank, self.dp_size, len(self.chunks)) if dataset else None


def _set_up(args):
    from .setup import backend, build_model_and_optimizer, configure_schedule

    start = time.time()
    connections = launch.configure_cuda_connections(args)  # before set_device creates the CUDA context
    owns = initialize_distributed(args)
    logging.print_rank0(connections)
    logging.print_rank0(threads.startup_line(threads.decide_here() if owns else None))
    for notice in args.notices:
        logging.print_rank0(f"> notice: {notice}")
    logging.set_logging_level(args)
    logging.print_args(args)  # Megatron-LM's dump of every argument, after its warnings
    schedule.init_microbatches(args)
    schedule.update_train_iters(args)
    tokenizer, datasets = prepare_data(args)
    moe.start()
    _, groups, chunks, optimizer, scheduler = build_model_and_optimizer(args, args.padded_vocab_size)
    logging.print_parameter_count(chunks, groups)
    configure_schedule(args, chunks, optimizer)
    mode = backend(args)
    logging.print_rank0(
        f"> {mode}: TP={args.tensor_model_parallel_size} x PP={args.pipeline_model_parallel_size} x "
        f"DP={args.data_parallel_size}, optimizer={args.optimizer}: {_optimizer_text(args)}, "
        f"micro-batches={args.num_microbatches}, padded vocab={args.padded_vocab_size}"
        + (_mfsdp_settings(args, chunks[0]) if mode == "matrix_fsdp" else "")
    )
    from .arguments.moe import expert_layout_line

    experts = expert_layout_line(args)
    if experts is not None:
        logging.print_rank0(experts)
    logging.print_stage_plans(chunks, groups)
    if mode == "matrix_fsdp":
        for chunk in chunks:
            logging.print_rank0(f"> {chunk.traffic_line(args.num_microbatches)}")
    from .timeouts import print_timeout_line

    print_timeout_line(args)  # what --distributed-timeout-minutes covers (issue 21)
    run = _Run(args, groups, chunks, optimizer, scheduler, owns)
    if args.qk_clip or args.log_max_attention_logit:
        from .qk_clip import QKClip

        run.qk_clip = QKClip(args, chunks, groups)
        if hasattr(optimizer, "after_rules"):  # MatrixFSDP: inside the step, on the owners' masters
            optimizer.after_rules = run.qk_clip
    return run, datasets, start


def _optimizer_text(args) -> str:
    """The rules --optimizer runs and their settings (optim/registry.py describe)."""
    from ..optim import registry
    from .setup import optimizer_config

    return registry.describe(optimizer_config(args))


def _mfsdp_settings(args, chunk) -> str:
    from .setup import overlap_grad_reduce

    wire = str(chunk.grad_dtype).removeprefix("torch.")
    order = chunk.comm.reduce_order
    how = "chained in rank order, fp32 partial sums" if order == "rank" else f"NCCL ring order, summed in {wire}"
    return (
        f", prefetch depth {args.mfsdp_prefetch_depth}, grad reduce "
        f"{'overlapped' if overlap_grad_reduce(args) else 'blocking'} in {wire} (owner accumulates in fp32), "
        f"reduce order {order} ({how})"
    )


def _maybe_load(args, run) -> int:
    from ..checkpoint import load_checkpoint
    from .configs import checkpoint_settings_from_args

    settings = checkpoint_settings_from_args(args)
    loaded = load_checkpoint(settings, run.chunks, run.optimizer, run.scheduler, run.groups) if args.load else None
    if loaded is None and args.pretrained_checkpoint:
        # Megatron-LM's rule (load_checkpoint, megatron/training/checkpointing.py at HEAD): no checkpoint in
        # --load, so fine-tune from --pretrained-checkpoint (weights only, iteration 0).
        logging.print_rank0(f"> no checkpoint in --load {args.load}: fine-tuning from {args.pretrained_checkpoint}")
        loaded = _load_pretrained(args, run)
    if loaded is None:
        if not args.load:
            return 0
        if args.exit_on_missing_checkpoint:
            raise SystemExit(f"--load {args.load}: no checkpoint found and --exit-on-missing-checkpoint is set")
        logging.print_rank0(f"> no checkpoint found in {args.load}, starting from scratch")
        return 0
    run.consumed_train, run.consumed_valid = loaded["consumed_train"], loaded["consumed_valid"]
    run.flops_so_far = loaded["flops"]
    return loaded["iteration"]


def _load_pretrained(args, run) -> dict:
    """--pretrained-checkpoint: its weights, as --finetune loads them (no optimizer, no generator states)."""
    from ..checkpoint import load_checkpoint
    from .configs import checkpoint_settings_from_args

    pretrained = checkpoint_settings_from_args(args, load=args.pretrained_checkpoint, finetune=True, ckpt_step=None)
    loaded = load_checkpoint(pretrained, run.chunks, run.optimizer, run.scheduler, run.groups)
    if loaded is None:
        raise SystemExit(
            f"--pretrained-checkpoint {args.pretrained_checkpoint}: no checkpoint found there"
            + (f" (nor in --load {args.load})" if args.load else "")
        )
    return loaded


class _Interval:
    """Sums over one logging interval (Megatron-LM resets its counts per interval)."""

    def __init__(self):
        self.loss = self.step_s = 0.0
        self.advanced = self.skipped = self.nans = 0
        self.start = time.perf_counter()
        self.paused = 0.0
        self.moe = {}  # MoE auxiliary losses summed over the interval (training/moe.py)

    def add(self, loss: float, success: bool, step_s: float) -> None:
        self.step_s += step_s
        if success:
            self.advanced += 1
            self.loss += loss
        else:
            self.skipped += 1
            self.nans += 0 if loss == loss and abs(loss) != float("inf") else 1

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start - self.paused


def _log(args, run, writers, timers, iteration: int, interval: _Interval, gbs: int, stats, report_memory) -> None:
    grad_norm, zeros = stats
    dist.barrier()  # the slowest rank decides the elapsed time, as Megatron-LM's barrier'd timer
    count = interval.advanced + interval.skipped
    mine = torch.tensor([interval.elapsed_s() / count, interval.step_s / count], dtype=torch.float64, device=run.device)
    per_rank = torch.empty(dist.get_world_size() * 2, dtype=torch.float64, device=run.device)
    all_gather_single(per_rank, mine)
    per_rank = per_rank.view(-1, 2).tolist()  # (iteration s, optimizer step s) of every rank
    elapsed, step_s = (max(column) for column in zip(*per_rank))  # the slowest rank's, as Megatron's timers
    lr = run.optimizer.param_groups[0]["lr"]
    loss = interval.loss / max(1, interval.advanced)
    params_norm = steps.params_norm(run) if args.log_params_norm else None
    tflops = (
        logging.flops_per_iteration(args, gbs, args.padded_vocab_size) / elapsed / 1e12 / args.world_size
        if args.log_throughput
        else None
    )
    extra = dict(
        tflops=tflops,
        step_ms=step_s * 1000,
        tokens_per_s=gbs * args.seq_length / elapsed,
        spread=logging.timing_spread(args.timing_log_option, per_rank),
        moe=moe.averages(interval.moe, interval.advanced),
        max_logit=run.qk_clip.last if run.qk_clip is not None else None,
    )
    logging.print_rank_last(
        logging.iteration_line(
            args,
            iteration,
            args.train_iters,
            run.consumed_train,
            elapsed * 1000,
            lr,
            gbs,
            loss,
            run.optimizer.get_loss_scale().item(),
            grad_norm,
            zeros,
            params_norm,
            interval.skipped,
            interval.nans,
            extra,
        )
    )
    if args.log_params_norm and getattr(args, "fp8_param_gather", False):
        logging.print_rank_last(logging.fp8_error_line(run.optimizer, run.groups))
    if report_memory:  # Megatron-LM's report_memory_flag: after the iteration line, before the timers
        num_micro = gbs // (args.micro_batch_size * args.data_parallel_size)
        memory.report(args, run.chunks, run.optimizer, run.groups, iteration, num_micro)
    if args.timing_log_level >= 1:
        from ..compat.cpu import cuda_on_cpu

        with cuda_on_cpu():
            timers.log(["forward-backward", "optimizer"], normalizer=count)
    if args.log_timers_to_tensorboard:
        writers.scalars({"iteration-time": elapsed}, iteration)


def _record(args, run, writers, iteration: int, loss: float, gbs: int, grad_norm, zeros) -> None:
    if iteration % args.tensorboard_log_interval:
        return
    values = {"learning-rate": run.optimizer.param_groups[0]["lr"], "batch-size": gbs, "lm loss": loss}
    if args.log_loss_scale_to_tensorboard:
        values["loss-scale"] = run.optimizer.get_loss_scale().item()
    if args.log_world_size_to_tensorboard:
        values["world-size"] = args.world_size
    if grad_norm is not None:
        values["grad-norm"] = grad_norm
    if args.log_max_attention_logit and run.qk_clip is not None and run.qk_clip.last is not None:
        values["max_attention_logit"] = run.qk_clip.last  # Megatron-LM's tag (training.py training_log)
    if zeros is not None:
        values["num-zeros"] = zeros
    if args.log_memory_to_tensorboard:  # Megatron-LM writes them every --tensorboard-log-interval
        values.update(logging.memory_stats())
    writers.scalars(values, iteration, run.consumed_train)


def _evaluate(args, run, writers, iteration: int, prefix: str, source, history=None) -> None:
    if source is None or not args.eval_iters:
        return
    gbs, num_micro = schedule.current_batch(run.consumed_train)
    control.manual_gc_eval(args)  # --no-manual-gc-eval turns these collections off (Megatron-LM's train)
    loss = steps.evaluate(args, run, source, num_micro)
    if args.num_experts is not None:
        moe.clear()  # evaluation's forward passes are not training's auxiliary losses (as Megatron-LM)
    control.manual_gc_eval(args, generation=0)
    if source is run.valid:
        run.consumed_valid += args.eval_iters * gbs
    logging.print_rank_last(logging.validation_lines(prefix, loss))
    if history is not None:
        history["valid"].append((iteration, loss))
    values = {"lm loss validation": loss}
    if args.log_validation_ppl_to_tensorboard:
        values["lm loss validation ppl"] = min(float("inf"), 2.718281828459045 ** min(20.0, loss))
    writers.scalars(values, iteration, run.consumed_train)


def _save(args, run, iteration: int, interval: _Interval) -> int:
    from ..checkpoint import save_checkpoint
    from .configs import checkpoint_settings_from_args

    paused = time.perf_counter()
    _finish_async_save(args, run, blocking=True)  # what save_checkpoint would do first, seen by --log-progress
    consumed = (run.consumed_train, run.consumed_valid)
    settings = checkpoint_settings_from_args(args)
    save_checkpoint(
        settings, iteration, run.chunks, run.optimizer, run.scheduler, consumed, run.groups, run.progress.flops
    )
    run.progress.saved(iteration, run.consumed_train)
    interval.paused += time.perf_counter() - paused
    return iteration


def _finish_async_save(args, run, blocking: bool) -> None:
    if args.save and args.async_save:
        from ..checkpoint import finalize_async_save

        run.progress.async_saved(finalize_async_save(blocking=blocking))


def _train(args, run, start_iteration: int, writers, start_time: float) -> dict:
    from megatron.core.timers import Timers

    timers = Timers(args.timing_log_level, args.timing_log_option)
    history = {"train": [], "valid": []}
    exits, profiler = control.ExitControl(args, start_time), control.Profiler(args)
    control.manual_gc_start(args)
    interval = _Interval()
    iteration = saved_at = start_iteration
    report_memory = True  # Megatron-LM's report_memory_flag: at log iterations until one past the first
    try:
        while iteration < args.train_iters:
            profiler.step(iteration)
            gbs, num_micro = schedule.current_batch(run.consumed_train)
            iteration += 1
            if hasattr(run.optimizer, "fp8_track_error"):  # FP8 rounding against the update, at log iterations
                run.optimizer.fp8_track_error = bool(args.log_params_norm) and iteration % args.log_interval == 0
            loss, success, grad_norm, zeros, step_s = steps.train_step(args, run, iteration, num_micro)
            run.scheduler.step(increment=gbs)
            run.consumed_train += gbs
            run.progress.add(logging.flops_per_iteration(args, gbs, args.padded_vocab_size))
            history["train"].append((iteration, loss))
            interval.add(loss, success, step_s)
            if args.num_experts is not None:
                moe.track(args, iteration, num_micro, interval.moe, writers)
            _record(args, run, writers, iteration, loss, gbs, grad_norm, zeros)
            if iteration % args.log_interval == 0:
                _log(args, run, writers, timers, iteration, interval, gbs, (grad_norm, zeros), report_memory)
                report_memory = report_memory and iteration <= start_iteration + 1
                interval = _Interval()
            if args.eval_interval and iteration % args.eval_interval == 0 and _evaluating_from(args, iteration):
                paused = time.perf_counter()
                _evaluate(args, run, writers, iteration, f"iteration {iteration}", run.valid, history)
                interval.paused += time.perf_counter() - paused
            profiler.after_step(iteration)  # nsys mode stops after iteration end's evaluation, before its save
            control.manual_gc_step(args, iteration)
            _finish_async_save(args, run, blocking=False)
            if args.save and iteration % args.save_interval == 0:
                saved_at = _save(args, run, iteration, interval)
            reason = exits.reason(iteration, run.device)
            if reason is not None:
                if args.save and saved_at != iteration:
                    saved_at = _save(args, run, iteration, interval)
                logging.print_datetime(reason)
                history["exited"] = reason
                break
    finally:  # a run that raises inside the window still closes the profiler (a pooled worker lives on)
        profiler.stop()
    if args.save and iteration > saved_at:  # once: an exit above may have saved this iteration already
        _save(args, run, iteration, interval)
    _finish_async_save(args, run, blocking=True)
    history["iteration"] = iteration
    return history


def _evaluating_from(args, iteration: int) -> bool:
    """--start-eval-at-iter: periodic evaluation from that iteration on (Megatron-LM's train loop)."""
    return args.start_eval_at_iter is None or iteration >= args.start_eval_at_iter


def _write_history(args, history) -> None:
    if dist.get_rank() != 0 or not args.output_dir:
        return
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "loss_history.json"), "w") as f:
        json.dump(history, f)
    if history["train"]:
        path = os.path.join(args.output_dir, "loss_curve.png")
        logging.plot_loss_curve(history, path)
        logging.print_rank0(f"> loss curve written to {path}")


def apply_checkpoint_args(args, saved: dict) -> list[str]:
    """--use-checkpoint-args: take the model's arguments (checkpoint/resume.py MODEL_ARGS) from the
    checkpoint's stored ones into ``args``; returns what changed.
    --no-use-tokenizer-model-from-checkpoint-args keeps this run's --tokenizer-model (Megatron-LM's
    load_args_from_checkpoint at HEAD)."""
    from ..checkpoint.resume import MODEL_ARGS

    changed = []
    keep_tokenizer = not getattr(args, "use_tokenizer_model_from_checkpoint_args", True)
    for key in MODEL_ARGS:
        if keep_tokenizer and key == "tokenizer_model":
            continue
        if key in saved and getattr(args, key, None) != saved[key]:
            changed.append(f"--{key.replace('_', '-')} {saved[key]}")
            setattr(args, key, saved[key])
    return changed


def _checkpoint_args(args) -> None:
    """--use-checkpoint-args: the model's arguments come from the checkpoint in --load."""
    if not (args.use_checkpoint_args and args.load):
        return
    from ..checkpoint import read_checkpoint_args

    saved = read_checkpoint_args(args.load, args.ckpt_step)
    if saved is None:
        if args.exit_on_missing_checkpoint:
            raise SystemExit(f"--load {args.load}: no checkpoint found and --exit-on-missing-checkpoint is set")
        return
    changed = apply_checkpoint_args(args, saved)
    args.notices.append("--use-checkpoint-args: " + (", ".join(changed) if changed else "no model argument changed"))


def pretrain(args) -> dict:
    """Run the whole job; returns the loss history (rank 0 also writes it to --output-dir)."""
    _checkpoint_args(args)
    run, (train_ds, valid_ds, test_ds), start_time = _set_up(args)
    start_iteration = _maybe_load(args, run)
    from .progress import Progress

    run.progress = Progress(args, run.flops_so_far)
    run.train = run.iterators(args, train_ds, run.consumed_train)
    run.valid, run.test = run.iterators(args, valid_ds, run.consumed_valid), run.iterators(args, test_ds, 0)
    writers = logging.Writers(args)
    history = {"train": [], "valid": [], "iteration": start_iteration}
    if not args.skip_train:
        history = _train(args, run, start_iteration, writers, start_time)
    iteration = history["iteration"]
    if "exited" not in history:  # Megatron-LM's train() exits at once on a signal or --exit-*: no final evaluation
        _evaluate(args, run, writers, iteration, f"iteration {iteration} on validation set", run.valid, history)
        _evaluate(args, run, writers, iteration, f"iteration {iteration} on test set", run.test)
    _write_history(args, history)
    writers.close()
    dist.barrier()
    if run.owns_process_group:
        dist.destroy_process_group()
    return history
