"""The pretraining loop: set-up, training iterations, evaluation, checkpoints and the
loss curve (log lines in logging.py)."""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist

from ..groups import group_rank, group_size
from .logging import log_iteration, log_validation, plot_loss_curve, print_rank0, print_stage_plans


def initialize_distributed(args) -> bool:
    """torchrun's environment, or a single process when launched plainly. Returns whether
    this call created the process group (a caller that made its own keeps it)."""
    if dist.is_initialized():
        _initialize_megatron(args)
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(args.distributed_backend, timeout=datetime.timedelta(minutes=10))
    _initialize_megatron(args)
    return True


def _initialize_megatron(args) -> None:
    from ..groups import initialize_model_parallel

    initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    )
    if args.deterministic_mode:
        torch.use_deterministic_algorithms(True)


def prepare_data(args):
    """Tokenizer and (train, valid, test) datasets; builds the embedded default once."""
    from ..data.datasets import (
        build_tokenizer,
        build_train_valid_test_datasets,
        padded_vocab_size,
        train_valid_test_num_samples,
    )

    if args.use_default_data:
        from ..data.corpus import prepare_default_data

        default = prepare_default_data(args.data_cache_path, progress=dist.get_rank() == 0)
        args.data_path = [str(default["data_prefix"])]
        args.tokenizer_model = str(default["tokenizer_model"])
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    # Padded by --make-vocab-size-divisible-by alone (a multiple of the TP size, checked),
    # not times the TP size as Megatron-LM does: the same vocabulary at every layout.
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, 1)
    num_samples = train_valid_test_num_samples(
        args.train_iters, args.global_batch_size, args.eval_interval, args.eval_iters
    )
    datasets = build_train_valid_test_datasets(
        num_samples,
        args.seq_length,
        tokenizer=tokenizer,
        data_prefix=None if args.mock_data else args.data_path,
        split=args.split,
        seed=args.seed,
        mock=args.mock_data,
        data_cache_path=args.data_cache_path,
    )
    return tokenizer, vocab, datasets


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean lm loss over the micro-batch's unmasked tokens (megatron's 2-tuple form:
    the schedule divides by the number of micro-batches)."""
    mask = loss_mask.float()
    loss = (output_tensor.float() * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    device = model.device
    output = model(
        batch["tokens"].to(device), batch["position_ids"].to(device), None, labels=batch["labels"].to(device)
    )
    return output, partial(_loss_func, batch["loss_mask"].to(device))


def _mean_loss(loss_dicts, groups, device) -> float:
    """Mean lm loss of the step, from the last pipeline stage, averaged over DP."""
    value = sum(d["lm loss"].item() for d in loss_dicts) / max(1, len(loss_dicts))
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if group_size(groups.pp) > 1:
        if group_rank(groups.pp) != group_size(groups.pp) - 1:
            t.zero_()
        dist.all_reduce(t, group=groups.pp)
    dist.all_reduce(t, group=groups.dp)
    return t.item() / group_size(groups.dp)


def _data_iterators(args, run, dataset, iteration: int):
    """One iterator over the step's micro-batches per model chunk (virtual stage)."""
    from ..data.datasets import get_microbatch

    rank, size = group_rank(run.groups.dp), group_size(run.groups.dp)

    def batches():
        for k in range(args.num_microbatches):
            yield get_microbatch(
                dataset, iteration, k, rank, size, args.micro_batch_size, args.global_batch_size, wrap=True
            )

    iterators = [batches() for _ in run.chunks]
    return iterators if len(iterators) > 1 else iterators[0]


class _Run:
    """What one job holds: groups, model chunks, optimizer, scheduler."""

    def __init__(self, groups, chunks, optimizer, scheduler, owns_process_group: bool = True):
        self.groups, self.chunks, self.optimizer, self.scheduler = groups, chunks, optimizer, scheduler
        self.device = chunks[0].device
        self.owns_process_group = owns_process_group


def _forward_backward(args, run, dataset, iteration: int, forward_only: bool = False):
    from ..runtime.pipeline import forward_backward

    return forward_backward(
        _forward_step,
        _data_iterators(args, run, dataset, iteration),
        run.chunks,
        args.num_microbatches,
        args.seq_length,
        args.micro_batch_size,
        forward_only,
    )


def train_step(args, run, dataset, iteration: int):
    """One global batch through megatron-core's schedule, then the optimizer step."""
    run.optimizer.zero_grad()
    loss_dicts = _forward_backward(args, run, dataset, iteration)
    start = time.perf_counter()
    success, grad_norm, _ = run.optimizer.step()
    step_ms = (time.perf_counter() - start) * 1000
    return _mean_loss(loss_dicts, run.groups, run.device), success, grad_norm, step_ms


@torch.no_grad()
def evaluate(args, run, dataset, iteration: int) -> float:
    for chunk in run.chunks:
        chunk.eval()
    losses = [
        _mean_loss(_forward_backward(args, run, dataset, iteration * args.eval_iters + i, True), run.groups, run.device)
        for i in range(args.eval_iters)
    ]
    for chunk in run.chunks:
        chunk.train()
    return sum(losses) / len(losses)


class _Interval:
    """Sums over one logging interval (Megatron-LM resets its counts per interval)."""

    def __init__(self):
        self.loss = self.step_ms = 0.0
        self.count = self.skipped = self.nans = 0
        self.start = time.perf_counter()

    def add(self, loss: float, success: bool, step_ms: float) -> None:
        self.loss += loss
        self.step_ms += step_ms
        self.count += 1
        self.skipped += 0 if success else 1
        self.nans += 0 if math.isfinite(loss) else 1


def _set_up(args):
    from ..runtime.pipeline import configure_schedule
    from .setup import build_model_and_optimizer

    owns_process_group = initialize_distributed(args)
    tokenizer, vocab, datasets = prepare_data(args)
    _, groups, chunks, optimizer, scheduler = build_model_and_optimizer(args, vocab)
    configure_schedule(chunks, optimizer)
    replicas = args.mfsdp_replicate_size if args.use_matrix_fsdp else args.data_parallel_size
    print_rank0(
        f"> MatrixFSDP: {'owner-sharded ZeRO-3' if args.use_matrix_fsdp else 'plain data parallelism'}, "
        f"TP={args.tensor_model_parallel_size} x PP={args.pipeline_model_parallel_size} x "
        f"DP={args.data_parallel_size} (replicas={replicas}), "
        f"optimizer={args.optimizer}, muon TP mode={args.muon_tp_mode}, "
        f"micro-batches={args.num_microbatches}, padded vocab={vocab}"
    )
    print_stage_plans(chunks, groups)
    return _Run(groups, chunks, optimizer, scheduler, owns_process_group), datasets


def _open_tensorboard(args):
    if not args.tensorboard_dir or dist.get_rank() != 0:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(args.tensorboard_dir)
    except ImportError:
        print_rank0("> --tensorboard-dir given but tensorboard is not installed; skipping TensorBoard")
        return None


def _train(args, run, datasets, start_iteration: int, writer) -> dict[str, list]:
    from ..checkpoint.local import save_checkpoint

    train_ds, valid_ds, _ = datasets
    history = {"train": [], "valid": []}
    if args.eval_interval and start_iteration == 0:
        history["valid"].append((0, evaluate(args, run, valid_ds, 0)))
        log_validation(0, history["valid"][-1][1])
    interval = _Interval()
    for iteration in range(start_iteration + 1, args.train_iters + 1):
        loss, success, grad_norm, step_ms = train_step(args, run, train_ds, iteration - 1)
        run.scheduler.step(increment=args.global_batch_size)
        history["train"].append((iteration, loss))
        interval.add(loss, success, step_ms)
        if writer is not None:
            writer.add_scalar("lm loss", loss, iteration)
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            elapsed = (time.perf_counter() - interval.start) * 1000 / interval.count
            log_iteration(
                args,
                iteration,
                elapsed,
                run.optimizer.param_groups[0]["lr"],
                interval.loss / interval.count,
                run.optimizer.get_loss_scale().item(),
                grad_norm,
                interval.skipped,
                interval.nans,
                interval.step_ms / interval.count,
            )
            interval = _Interval()
        if args.eval_interval and (iteration % args.eval_interval == 0 or iteration == args.train_iters):
            valid = evaluate(args, run, valid_ds, iteration // args.eval_interval)
            history["valid"].append((iteration, valid))
            log_validation(iteration, valid)
            if writer is not None:
                writer.add_scalar("validation lm loss", valid, iteration)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args.save, iteration, run.chunks, run.optimizer, run.scheduler, args)
    if args.save and (not args.save_interval or args.train_iters % args.save_interval):
        save_checkpoint(args.save, args.train_iters, run.chunks, run.optimizer, run.scheduler, args)
    return history


def _write_history(args, history) -> None:
    if dist.get_rank() != 0:
        return
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "loss_history.json"), "w") as f:
        json.dump(history, f)
    if history["train"]:
        plot_loss_curve(history, os.path.join(args.output_dir, "loss_curve.png"))
        print_rank0(f"> loss curve written to {os.path.join(args.output_dir, 'loss_curve.png')}")


def pretrain(args) -> dict[str, list]:
    """Run the whole job; returns the loss history (rank 0 also writes it to --output-dir)."""
    from ..checkpoint.local import load_checkpoint

    run, datasets = _set_up(args)
    start_iteration = 0
    if args.load:
        start_iteration = load_checkpoint(args.load, run.chunks, run.optimizer, run.scheduler) or 0
        print_rank0(f"> loaded checkpoint at iteration {start_iteration} from {args.load}")
    writer = _open_tensorboard(args)
    history = _train(args, run, datasets, start_iteration, writer)
    _write_history(args, history)
    if writer is not None:
        writer.close()
    dist.barrier()
    if run.owns_process_group:
        dist.destroy_process_group()
    return history
