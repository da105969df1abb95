"""The pretraining loop: set-up, training iterations, evaluation, logging in
Megatron-LM's format, checkpoints and the loss curve."""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from typing import Dict, List

import torch
import torch.distributed as dist


def _print_rank0(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def initialize_distributed(args) -> None:
    """torchrun's environment, or a single process when launched plainly."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(args.distributed_backend, timeout=datetime.timedelta(minutes=10))
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size)
    if args.deterministic_mode:
        torch.use_deterministic_algorithms(True)


def prepare_data(args):
    """Tokenizer and (train, valid, test) datasets; builds the embedded default once."""
    from ..data.datasets import build_tokenizer, build_train_valid_test_datasets, padded_vocab_size

    if args.use_default_data:
        from ..data.corpus import prepare_default_data

        default = prepare_default_data(args.data_cache_path, progress=dist.get_rank() == 0)
        args.data_path = [str(default["data_prefix"])]
        args.tokenizer_model = str(default["tokenizer_model"])
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    # Padded by --make-vocab-size-divisible-by alone (a multiple of the TP size, checked),
    # not times the TP size as Megatron-LM does: the same vocabulary at every layout.
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, 1)
    gbs = args.global_batch_size
    evals = args.train_iters // args.eval_interval + 1 if args.eval_interval else 1
    num_samples = [args.train_iters * gbs, evals * args.eval_iters * gbs, args.eval_iters * gbs]
    datasets = build_train_valid_test_datasets(
        num_samples, args.seq_length, tokenizer=tokenizer, data_prefix=None if args.mock_data else args.data_path,
        split=args.split, seed=args.seed, mock=args.mock_data, data_cache_path=args.data_cache_path)
    return tokenizer, vocab, datasets


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean lm loss over the micro-batch's unmasked tokens (megatron's 2-tuple form:
    the schedule divides by the number of micro-batches)."""
    mask = loss_mask.float()
    loss = (output_tensor.float() * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place


def _forward_step(data_iterator, model):
    from functools import partial

    batch = next(data_iterator)
    device = model.device
    output = model(batch["tokens"].to(device), batch["position_ids"].to(device), None,
                   labels=batch["labels"].to(device))
    return output, partial(_loss_func, batch["loss_mask"].to(device))


def _mean_loss(loss_dicts, device) -> float:
    """Mean lm loss of the step, from the last pipeline stage, averaged over DP."""
    from megatron.core import parallel_state

    value = sum(d["lm loss"].item() for d in loss_dicts) / max(1, len(loss_dicts))
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        if not parallel_state.is_pipeline_last_stage():
            t.zero_()
        dist.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return t.item() / parallel_state.get_data_parallel_world_size()


def _batches(args, dataset, iteration: int):
    from megatron.core import parallel_state

    from ..data.datasets import get_microbatch

    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    for k in range(args.num_microbatches):
        yield get_microbatch(dataset, iteration, k, rank, size, args.micro_batch_size,
                             args.global_batch_size, wrap=True)


def _data_iterators(args, chunks, dataset, iteration: int):
    """One iterator over the step's micro-batches per model chunk (virtual stage)."""
    iterators = [_batches(args, dataset, iteration) for _ in chunks]
    return iterators if len(iterators) > 1 else iterators[0]


def train_step(args, chunks, optimizer, dataset, iteration: int):
    """One global batch through megatron-core's schedule, then the optimizer step."""
    from ..pipeline import forward_backward

    optimizer.zero_grad()
    loss_dicts = forward_backward(_forward_step, _data_iterators(args, chunks, dataset, iteration), chunks,
                                  args.num_microbatches, args.seq_length, args.micro_batch_size)
    start = time.perf_counter()
    success, grad_norm, _ = optimizer.step()
    step_ms = (time.perf_counter() - start) * 1000
    return _mean_loss(loss_dicts, chunks[0].device), success, grad_norm, step_ms


@torch.no_grad()
def evaluate(args, chunks, dataset, iteration: int) -> float:
    from ..pipeline import forward_backward

    for chunk in chunks:
        chunk.eval()
    losses = []
    for i in range(args.eval_iters):
        iterators = _data_iterators(args, chunks, dataset, iteration * args.eval_iters + i)
        loss_dicts = forward_backward(_forward_step, iterators, chunks, args.num_microbatches, args.seq_length,
                                      args.micro_batch_size, forward_only=True)
        losses.append(_mean_loss(loss_dicts, chunks[0].device))
    for chunk in chunks:
        chunk.train()
    return sum(losses) / len(losses)


def _log_iteration(args, iteration, elapsed_ms, lr, loss, loss_scale, grad_norm, skipped, nans, step_ms) -> None:
    tokens_per_s = args.global_batch_size * args.seq_length / (elapsed_ms / 1000)
    line = (f" [{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} |"
            f" consumed samples: {iteration * args.global_batch_size:12d} |"
            f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
            f" learning rate: {lr:.6E} | global batch size: {args.global_batch_size:5d} |"
            f" lm loss: {loss:.6E} | loss scale: {loss_scale:.1f} |")
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += (f" number of skipped iterations: {skipped:3d} | number of nan iterations: {nans:3d} |"
             f" optimizer step time (ms): {step_ms:.1f} | tokens per second: {tokens_per_s:.1f} |")
    _print_rank0(line)


def _log_validation(iteration: int, loss: float, label: str = "validation") -> None:
    text = (f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} |"
            f" lm loss PPL: {math.exp(min(20.0, loss)):.6E} | ")
    _print_rank0("-" * len(text) + "\n" + text + "\n" + "-" * len(text))


def _print_stage_plans(chunks) -> None:
    """Rank 0 prints the owner plan of every pipeline stage and virtual stage (from its
    first TP/DP rank)."""
    from megatron.core import parallel_state

    first_of_stage = parallel_state.get_tensor_model_parallel_rank() == 0 and \
        parallel_state.get_data_parallel_rank() == 0
    stage = parallel_state.get_pipeline_model_parallel_rank()
    mine = [(stage, v, c.plan.report()) for v, c in enumerate(chunks)] if first_of_stage else []
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for stage, virtual, report in sorted(r for rank_reports in everyone for r in rank_reports):
        label = f"pipeline stage {stage}" + (f", virtual stage {virtual}" if len(chunks) > 1 else "")
        _print_rank0(f"> {label}: " + report)


def plot_loss_curve(history: Dict[str, List], path: str) -> None:
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


def pretrain(args) -> Dict[str, List]:
    """Run the whole job; returns the loss history (rank 0 also writes it to --output-dir)."""
    from .checkpointing import load_checkpoint, save_checkpoint
    from .setup import build_model_and_optimizer

    initialize_distributed(args)
    tokenizer, vocab, (train_ds, valid_ds, test_ds) = prepare_data(args)
    config, chunks, optimizer, scheduler = build_model_and_optimizer(args, vocab)
    from ..pipeline import configure_schedule

    configure_schedule(chunks, optimizer)
    _print_rank0(f"> MatrixFSDP: {'owner-sharded ZeRO-3' if args.use_matrix_fsdp else 'plain data parallelism'}, "
                 f"TP={args.tensor_model_parallel_size} x PP={args.pipeline_model_parallel_size} x "
                 f"DP={args.data_parallel_size} (replicas={args.mfsdp_replicate_size if args.use_matrix_fsdp else args.data_parallel_size}), "
                 f"optimizer={args.optimizer}, muon TP mode={args.muon_tp_mode}, "
                 f"micro-batches={args.num_microbatches}, padded vocab={vocab}")
    _print_stage_plans(chunks)
    start_iteration = 0
    if args.load:
        start_iteration = load_checkpoint(args.load, chunks, optimizer, scheduler) or 0
        _print_rank0(f"> loaded checkpoint at iteration {start_iteration} from {args.load}")
    writer = None
    if args.tensorboard_dir and dist.get_rank() == 0:
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(args.tensorboard_dir)
        except ImportError:
            _print_rank0("> --tensorboard-dir given but tensorboard is not installed; skipping TensorBoard")
    history = {"train": [], "valid": []}
    skipped = nans = 0
    interval_loss, interval_count, interval_step_ms = 0.0, 0, 0.0
    interval_start = time.perf_counter()
    if args.eval_interval and start_iteration == 0:
        valid = evaluate(args, chunks, valid_ds, 0)
        history["valid"].append((0, valid))
        _log_validation(0, valid)
    for iteration in range(start_iteration + 1, args.train_iters + 1):
        loss, success, grad_norm, step_ms = train_step(args, chunks, optimizer, train_ds, iteration - 1)
        scheduler.step(increment=args.global_batch_size)
        if not success:
            skipped += 1
        if not math.isfinite(loss):
            nans += 1
        history["train"].append((iteration, loss))
        interval_loss += loss
        interval_count += 1
        interval_step_ms += step_ms
        if writer is not None:
            writer.add_scalar("lm loss", loss, iteration)
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            elapsed = (time.perf_counter() - interval_start) * 1000 / interval_count
            _log_iteration(args, iteration, elapsed, optimizer.param_groups[0]["lr"],
                           interval_loss / interval_count, optimizer.get_loss_scale().item(),
                           grad_norm, skipped, nans, interval_step_ms / interval_count)
            # Like Megatron-LM, the counts are per logging interval.
            interval_loss, interval_count, interval_step_ms, skipped, nans = 0.0, 0, 0.0, 0, 0
            interval_start = time.perf_counter()
        if args.eval_interval and (iteration % args.eval_interval == 0 or iteration == args.train_iters):
            valid = evaluate(args, chunks, valid_ds, iteration // args.eval_interval)
            history["valid"].append((iteration, valid))
            _log_validation(iteration, valid)
            if writer is not None:
                writer.add_scalar("validation lm loss", valid, iteration)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args.save, iteration, chunks, optimizer, scheduler, args)
    if args.save and (not args.save_interval or args.train_iters % args.save_interval):
        save_checkpoint(args.save, args.train_iters, chunks, optimizer, scheduler, args)
    if dist.get_rank() == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "loss_history.json"), "w") as f:
            json.dump(history, f)
        if history["train"]:
            plot_loss_curve(history, os.path.join(args.output_dir, "loss_curve.png"))
            _print_rank0(f"> loss curve written to {os.path.join(args.output_dir, 'loss_curve.png')}")
    if writer is not None:
        writer.close()
    dist.barrier()
    dist.destroy_process_group()
    return history
