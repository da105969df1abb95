"""Megatron-LM flags of the training loop and its checkpoints (issue 23), through pretrain_gpt.py's code
path on gloo ranks: --ckpt-format torch without --use-matrix-fsdp (megatron-core DDP, with and without
--use-distributed-optimizer), --save-retain-interval, --log-progress and the floating-point operations kept
in checkpoints, --pretrained-checkpoint, --start-eval-at-iter, --exit-signal with --exit-signal-handler,
and the unit-level --logging-level, --manual-gc-eval and --empty-unused-memory-level."""

import argparse
import gc
import logging
import os
import re

import pytest
import torch

from megatron_mfsdp.checkpoint import files
from megatron_mfsdp.checkpoint.dist import load_common
from megatron_mfsdp.testing import run_workers
from tests.launch import TINY, VALIDATION_LINE, pretrain_in_workers, train_losses

# Megatron-core's DDP and optimizer (no --use-matrix-fsdp; --optimizer adam: setup.py MEGATRON_OPTIMIZERS),
# per-rank files; one evaluation batch.
FLAGS = [*TINY, "--optimizer", "adam", "--eval-iters", "1", "--ckpt-format", "torch"]
DIST_OPT = [*FLAGS, "--use-distributed-optimizer"]
LAYOUT_REFUSED = "--ckpt-format torch loads only at the layout that saved it"
# megatron/training/utils/log_utils.py append_to_progress_log and training.py
# compute_throughputs_and_append_to_progress_log at Megatron-LM HEAD.
PROGRESS_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\tJob ID: \t# GPUs: 2\t(.*)$")
SAVED = re.compile(
    r"^Saved checkpoint\tIteration: (\d+)\tJob throughput: \d+\.\d TFLOP/s/GPU\tCumulative throughput: "
    r"\d+\.\d TFLOP/s/GPU\tFloating-point operations: (\d\.\d\de\+\d\d)\tTokens \(in billions\): (\d+\.\d\d)$"
)
FLOPS_KEY = "num_floating_point_operations_so_far"


def _kept(save) -> list[int]:
    return sorted(int(p.name[len("iter_") :]) for p in save.iterdir() if p.name.startswith("iter_"))


def _progress(save) -> list[str]:
    """progress.txt's events (what follows the time, job and GPU fields), every line checked."""
    lines = (save / "progress.txt").read_text().splitlines()
    matches = [PROGRESS_LINE.match(line) for line in lines]
    assert all(matches), lines
    return [m.group(1) for m in matches]


def _saved(events) -> dict[int, str]:
    """{iteration: floating-point operations as written} of the 'Saved checkpoint' events."""
    found = [SAVED.match(e) for e in events if e.startswith("Saved checkpoint")]
    assert all(found), events
    return {int(m.group(1)): m.group(2) for m in found}


def _rank_file_flops(save, iteration: int) -> float:
    state = torch.load(files.iteration_dir(str(save), iteration) + "/rank_00000.pt", weights_only=True)
    return state[FLOPS_KEY]


def _signal_worker(rank, world_size, argv, at_iteration):
    """pretrain on this rank; rank 0 sends itself SIGUSR1 right after training step ``at_iteration``.
    Returns the loss history, stdout, and whether SIGTERM's handler stayed as it was (SIGTERM is not the
    signal asked for). The step and the SIGUSR1 handler are put back (the pooled worker lives on)."""
    import contextlib
    import io
    import signal

    from megatron_mfsdp.training import steps
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import pretrain

    step, usr1, term = steps.train_step, signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    seen = {"sigterm_untouched": True}

    def step_then_signal(args, run, iteration, num_microbatches):
        result = step(args, run, iteration, num_microbatches)
        seen["sigterm_untouched"] &= signal.getsignal(signal.SIGTERM) == term
        if iteration == at_iteration and rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        return result

    steps.train_step = step_then_signal
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            history = pretrain(parse_args(list(argv), world_size=world_size))
    finally:
        steps.train_step = step
        signal.signal(signal.SIGUSR1, usr1)
    return {"history": history, "stdout": out.getvalue(), **seen}


def _refused(tmp_path, *flags) -> str:
    with pytest.raises(RuntimeError) as err:
        pretrain_in_workers(1, *flags, tmp_path=tmp_path)
    return str(err.value)


def test_distributed_optimizer_torch_format_retain_progress_start_eval_and_exit_signal(tmp_path):
    """DP2 with megatron-core's DistributedOptimizer, --ckpt-format torch, saves at 2, 4, 6, 8 with
    --save-retain-interval 4: Megatron-LM HEAD's rule (checkpointing.py save_checkpoint's
    iter_finalize_fn: each save removes the previous one unless its iteration is a multiple of the
    interval) keeps 4 and 8, and --log-progress logs each removal. --start-eval-at-iter 5 with
    --eval-interval 2: validation at 6 and 8 only (and the final one). Resumed from iteration 4 with
    --exit-signal SIGUSR1 --exit-signal-handler, the signal after iteration 6 (to rank 0 alone) saves
    iteration 6 and stops every rank; iterations 5-6 and the validation at 6 are bitwise the
    uninterrupted run's, and the floating-point operations continue from the checkpoint's."""
    save, resumed_save = tmp_path / "ckpt", tmp_path / "resumed"
    evals = ["--eval-interval", "2", "--start-eval-at-iter", "5"]
    saving = ["--save", str(save), "--save-interval", "2", "--save-retain-interval", "4", "--log-progress"]
    first, last = pretrain_in_workers(2, *DIST_OPT, *evals, "--train-iters", "8", *saving, tmp_path=tmp_path, rank=None)
    reference = train_losses(last)
    assert len(reference) == 8 and reference[-1] < reference[0]
    assert _kept(save) == [4, 8] and files.read_tracker(str(save)) == 8
    assert re.findall(r"successfully deleted checkpoint from iteration +(\d+)", first["stdout"]) == ["2", "6"]
    events = _progress(save)
    saved, deleted = "Saved checkpoint", "Deleted checkpoint"
    assert [e.split("\t")[0] for e in events] == ["Starting job", saved, deleted, saved, saved, deleted, saved]
    assert [e for e in events if e.startswith(deleted)] == [f"{deleted}\tIteration: 2", f"{deleted}\tIteration: 6"]
    per_iteration = _rank_file_flops(save, 8) / 8
    assert per_iteration > 0 and _rank_file_flops(save, 4) == 4 * per_iteration
    assert _saved(events) == {k: f"{k * per_iteration:.2e}" for k in (2, 4, 6, 8)}
    assert [it for it, _ in last["history"]["valid"]] == [6, 8, 8]  # the last: "on validation set"
    assert [int(m.group(1)) for m in VALIDATION_LINE.finditer(last["stdout"])] == [6, 8]

    argv = [*DIST_OPT, *evals, "--train-iters", "8", "--load", str(save), "--ckpt-step", "4"]
    argv += ["--save", str(resumed_save), "--save-interval", "4", "--log-progress"]
    argv += ["--exit-signal", "SIGUSR1", "--exit-signal-handler", "--output-dir", str(tmp_path / "out")]
    ranks = run_workers(2, _signal_worker, argv, 6)
    assert all(r["sigterm_untouched"] for r in ranks)
    assert "exiting program after receiving SIGTERM." in ranks[0]["stdout"]  # Megatron-LM's text for any signal
    for r in ranks:
        assert [it for it, _ in r["history"]["train"]] == [5, 6]
    assert train_losses(ranks[1]) == reference[4:6]
    assert ranks[1]["history"]["valid"][0] == last["history"]["valid"][0]
    # Megatron-LM's train() exits at once on the signal: no final "on validation set" evaluation.
    assert [it for it, _ in ranks[1]["history"]["valid"]] == [6]
    assert all("on validation set" not in r["stdout"] for r in ranks)
    assert _kept(resumed_save) == [6] and files.read_tracker(str(resumed_save)) == 6  # saved on the signal
    assert _rank_file_flops(resumed_save, 6) == 6 * per_iteration  # not 2 x: restored from iteration 4's
    events = _progress(resumed_save)
    assert [e.split("\t")[0] for e in events] == ["Starting job", "Saved checkpoint"]
    assert _saved(events) == {6: _saved(_progress(save))[6]}

    message = _refused(tmp_path, *DIST_OPT, "--train-iters", "8", "--load", str(save))  # DP 1
    assert LAYOUT_REFUSED in message, message[-2000:]


def test_ddp_torch_format_resume_pretrained_checkpoint_and_finetune(tmp_path):
    """Plain megatron-core DDP at DP2 (no DistributedOptimizer; --bf16: its Float16Optimizer with fp32
    master weights), --ckpt-format torch: resumed from iteration 2, iterations 3-4 and the validation at 4
    are bitwise the uninterrupted run's. --pretrained-checkpoint with an empty --load loads its weights
    at iteration 0 (with --skip-train the validation loss is bitwise the run's at iteration 4, the same
    batches); --finetune restarts at iteration 1 and, as Megatron-LM's load_checkpoint does, keeps the
    checkpoint's floating-point operations (torch_dist's common.pt here)."""
    save, empty, tuned = tmp_path / "ckpt", tmp_path / "empty", tmp_path / "tuned"
    empty.mkdir()
    run = ["--train-iters", "4", "--eval-interval", "4", "--bf16"]
    full = pretrain_in_workers(
        2, *FLAGS, *run, "--save", str(save), "--save-interval", "2", "--log-progress", tmp_path=tmp_path
    )
    reference = train_losses(full)
    assert len(reference) == 4 and _kept(save) == [2, 4]
    at_4 = full["history"]["valid"][0]
    assert at_4[0] == 4

    resumed = pretrain_in_workers(2, *FLAGS, *run, "--load", str(save), "--ckpt-step", "2", tmp_path=tmp_path)
    assert train_losses(resumed) == reference[2:]
    assert resumed["history"]["valid"][0] == at_4

    pretrained = ["--load", str(empty), "--pretrained-checkpoint", str(save), "--skip-train"]
    first, last = pretrain_in_workers(2, *FLAGS, *run, *pretrained, tmp_path=tmp_path, rank=None)
    assert f"no checkpoint in --load {empty}: fine-tuning from {save}" in first["stdout"]
    assert last["history"]["iteration"] == 0 and last["history"]["valid"] == [(0, at_4[1])]

    flops_at_4 = _rank_file_flops(save, 4)
    finetune = ["--ckpt-format", "torch_dist", "--train-iters", "2", "--eval-iters", "0", "--load", str(save)]
    finetune += ["--finetune", "--save", str(tuned), "--save-interval", "2", "--log-progress"]
    tuned_run = pretrain_in_workers(2, *FLAGS, *finetune, tmp_path=tmp_path)
    assert [it for it, _ in tuned_run["history"]["train"]] == [1, 2]
    tuned_flops = load_common(files.iteration_dir(str(tuned), 2))[FLOPS_KEY]
    assert tuned_flops == flops_at_4 + _rank_file_flops(save, 2)  # 4 + 2 iterations of the same batch size
    assert _saved(_progress(tuned)) == {2: f"{tuned_flops:.2e}"}

    message = _refused(tmp_path, *FLAGS, *run, "--load", str(save))  # DP 1
    assert LAYOUT_REFUSED in message, message[-2000:]


def test_save_retain_leaves_a_newer_checkpoint_the_tracker_names(tmp_path):
    """A fresh run saving iteration 2 into a folder whose tracker says 6 (kept: the tracker never moves
    backwards) must not remove iteration 6; a symbolic link is never removed (Megatron-LM's rule)."""
    root = tmp_path / "ckpt"
    for it in (2, 6, 10):
        os.makedirs(files.iteration_dir(str(root), it))
    assert files.retire(str(root), 6, 2, 4) is None and _kept(root) == [2, 6, 10]
    assert files.retire(str(root), 6, 10, 4) == files.iteration_dir(str(root), 6) and _kept(root) == [2, 10]
    assert files.retire(str(root), 8, 10, 4) is None  # a multiple of the interval
    os.symlink(files.iteration_dir(str(root), 2), files.iteration_dir(str(root), 3))
    assert files.retire(str(root), 3, 10, 4) is None and _kept(root) == [2, 3, 10]


def test_logging_level_flag_and_environment(monkeypatch):
    """Megatron-LM's setup_logging (initialize.py at HEAD): --logging-level, else
    $MEGATRON_LOGGING_LEVEL, sets the root logger's level; neither leaves it alone."""
    from megatron_mfsdp.training.logging import set_logging_level

    root = logging.getLogger()
    before = root.level
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
    try:
        root.setLevel(logging.WARNING)
        set_logging_level(argparse.Namespace(logging_level=None))
        assert root.level == logging.WARNING
        set_logging_level(argparse.Namespace(logging_level=10))
        assert root.level == logging.DEBUG
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "40")
        set_logging_level(argparse.Namespace(logging_level=None))
        assert root.level == logging.ERROR
        set_logging_level(argparse.Namespace(logging_level=20))  # the flag wins
        assert root.level == logging.INFO
    finally:
        root.setLevel(before)


def test_manual_gc_eval_and_empty_unused_memory_level(monkeypatch):
    """--manual-gc collects everything before an evaluation and generation 0 after it unless
    --no-manual-gc-eval; --empty-unused-memory-level 1 empties the CUDA cache after forward-backward,
    2 also after the optimizer step (megatron/training/training.py at HEAD), and nothing without CUDA."""
    from megatron_mfsdp.training import control, steps

    collected, emptied = [], []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation))
    for manual_gc, manual_gc_eval, want in ((True, True, [2, 0]), (True, False, []), (False, True, [])):
        collected.clear()
        args = argparse.Namespace(manual_gc=manual_gc, manual_gc_eval=manual_gc_eval)
        control.manual_gc_eval(args)
        control.manual_gc_eval(args, generation=0)
        assert collected == want, (manual_gc, manual_gc_eval)

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    for cuda, level, want in ((True, 0, 0), (True, 1, 1), (True, 2, 2), (False, 2, 0)):
        emptied.clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        for where in (1, 2):  # after forward-backward, after the optimizer step
            steps.empty_unused_memory(argparse.Namespace(empty_unused_memory_level=level), where)
        assert len(emptied) == want, (cuda, level)
