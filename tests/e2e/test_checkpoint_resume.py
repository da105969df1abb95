"""Checkpoints through pretrain_gpt.py's code path: resharding across TP, PP, DP and backends,
a save killed with SIGKILL, damaged files, missing trackers, old --save folders, changed
schedules and asynchronous saves (issue 9, items 1 and 2)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megatron_mfsdp.testing import free_port
from tests.launch import ITERATION_LINE, ROOT, TINY, pretrain_in_workers, train_losses

# Four layers so that PP2 x VP2 has one layer per virtual stage; no evaluation (speed).
FLAGS = [*TINY, "--num-layers", "4", "--eval-iters", "0", "--train-iters", "6"]
MFSDP = "--use-matrix-fsdp"
TP2 = ["--tensor-model-parallel-size", "2", "--muon-tp-mode", "distributed"]
PP2 = ["--pipeline-model-parallel-size", "2"]
RESUME_AT = {
    "1x1x1": (1, [MFSDP]),
    "tp2 x dp2, no MatrixFSDP": (4, TP2),
    "pp2 (interleaved, 2 virtual stages) x dp2": (4, [MFSDP, *PP2, "--num-layers-per-virtual-pipeline-stage", "1"]),
}
# Layouts sum gradients in other orders; test_parallel and test_pretrain bound that at 1e-5 too.
TOLERANCE = 1e-5


def test_saved_at_tp2_pp2_dp2_resumes_at_other_layouts(tmp_path):
    """Save after 3 iterations at TP2 x PP2 x DP2 (MatrixFSDP, distributed TP mode; its losses are
    the 1 x 1 x 1 run's); iterations 4-6 resumed at 1x1x1, TP2 x DP2 without MatrixFSDP and PP2 x DP2
    interleaved give the uninterrupted run's losses (DP 1 -> 2 -> 4: tests/distributed/test_checkpoint.py)."""
    save = tmp_path / "ckpt"
    single = train_losses(pretrain_in_workers(1, *FLAGS, MFSDP, tmp_path=tmp_path))
    full = pretrain_in_workers(
        8, *FLAGS, MFSDP, *TP2, *PP2, "--save", str(save), "--save-interval", "3", tmp_path=tmp_path
    )
    reference = train_losses(full)
    assert len(reference) == 6 and reference[-1] < reference[0]
    assert max(abs(a - b) for a, b in zip(reference, single)) <= TOLERANCE, (reference, single)
    (save / "latest_checkpointed_iteration.txt").write_text("3")  # resume from the middle of the run
    for name, (nproc, layout) in RESUME_AT.items():
        resumed = pretrain_in_workers(nproc, *FLAGS, *layout, "--load", str(save), tmp_path=tmp_path)
        got = train_losses(resumed)
        deltas = [abs(a - b) for a, b in zip(got, reference[3:])]
        print(f"\nresumed at {name}: max |lm loss delta| over iterations 4-6 = {max(deltas):.2e}")
        assert len(got) == 3 and max(deltas) <= TOLERANCE, (name, got, reference[3:])


def test_swiglu_saved_at_tp2_resumes_at_1x1x1(tmp_path):
    """SwiGLU's fc1 is [gate; up], each half split over TP (megatron-core's swiglu factory): saved at
    TP2 x DP2, resumed at 1x1x1, iterations 3-4 match the uninterrupted run."""
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "4", "--use-matrix-fsdp", "--swiglu"]
    save = tmp_path / "ckpt"
    reference = train_losses(
        pretrain_in_workers(4, *flags, *TP2, "--save", str(save), "--save-interval", "2", tmp_path=tmp_path)
    )
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    got = train_losses(pretrain_in_workers(1, *flags, "--load", str(save), tmp_path=tmp_path))
    assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, reference[2:])) <= TOLERANCE, (got, reference)


def test_dp_owner_layout_change_resumes_bitwise(tmp_path):
    """Saved at DP2 with owners sharded over 2 ranks, resumed at DP2 with every rank owning everything
    (--mfsdp-replicate-size 2), and by the same layout: the losses are bitwise the uninterrupted run's
    (two gradient contributions add in either order to the same float)."""
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "4", "--use-matrix-fsdp"]
    save = tmp_path / "ckpt"
    reference = train_losses(
        pretrain_in_workers(2, *flags, "--save", str(save), "--save-interval", "2", tmp_path=tmp_path)
    )
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    for extra in ([], ["--mfsdp-replicate-size", "2"]):
        got = train_losses(pretrain_in_workers(2, *flags, *extra, "--load", str(save), tmp_path=tmp_path))
        assert got == reference[2:], (extra, got, reference)


def test_resume_with_dropout_is_bitwise(tmp_path):
    """Megatron-LM's default dropout (0.1 in attention and hidden) on 2 ranks: the resumed iterations drop the
    same units as the uninterrupted run, so its losses are bitwise equal. On a CPU dropout draws from the
    CPU generator, which the checkpoint restores; the data loader's iterators, built after the load, used
    to draw their base seed from it too (2.8e-3 off at the first resumed iteration)."""
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "4", "--use-matrix-fsdp"]
    flags += ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # the later flags win
    save = tmp_path / "ckpt"
    reference = train_losses(
        pretrain_in_workers(2, *flags, "--save", str(save), "--save-interval", "2", tmp_path=tmp_path)
    )
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    got = train_losses(pretrain_in_workers(2, *flags, "--load", str(save), tmp_path=tmp_path))
    assert got == reference[2:], (got, reference)


def _short_run(tmp_path, save, *extra, nproc=2, iters=2):
    flags = [*TINY, "--eval-iters", "0", "--train-iters", str(iters), "--use-matrix-fsdp"]
    return pretrain_in_workers(nproc, *flags, "--save", str(save), "--save-interval", "2", *extra, tmp_path=tmp_path)


def _load_error(tmp_path, load, *extra) -> str:
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "4", "--use-matrix-fsdp", "--load", str(load), *extra]
    with pytest.raises(RuntimeError) as err:
        pretrain_in_workers(1, *flags, tmp_path=tmp_path)
    return str(err.value)


def test_damaged_checkpoints_fail_before_training_naming_the_file(tmp_path):
    save = tmp_path / "ckpt"
    _short_run(tmp_path, save)
    folder = save / "iter_0000002"
    shard = sorted(folder.glob("*.distcp"))[0]
    original = shard.read_bytes()

    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))
    message = _load_error(tmp_path, save)
    assert f"checkpoint file {shard} fails its xxh3_128 checksum" in message

    shard.write_bytes(original[: len(original) // 2])
    message = _load_error(tmp_path, save)
    assert f"checkpoint file {shard} has {len(original) // 2} bytes, the save wrote {len(original)}" in message

    shard.unlink()
    message = _load_error(tmp_path, save)
    assert f"checkpoint file {shard} is missing" in message
    shard.write_bytes(original)

    message = _load_error(tmp_path, save, "--hidden-size", "128")
    assert f"checkpoint {folder / 'common.pt'} was saved for another model: --hidden-size: checkpoint 64" in message
    assert "iteration " not in message.split("Traceback")[0]  # nothing trained


def test_missing_tracker_starts_from_scratch_or_exits(tmp_path):
    save = tmp_path / "ckpt"
    _short_run(tmp_path, save)
    (save / "latest_checkpointed_iteration.txt").unlink()
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "2", "--use-matrix-fsdp", "--load", str(save)]
    run = pretrain_in_workers(1, *flags, tmp_path=tmp_path)
    assert f"no checkpoint found in {save}, starting from scratch" in run["stdout"]
    assert [it for it, _ in run["history"]["train"]] == [1, 2]
    message = _load_error(tmp_path, save, "--exit-on-missing-checkpoint")
    assert "no checkpoint found and --exit-on-missing-checkpoint is set" in message


def test_old_save_folder_keeps_its_newer_checkpoint(tmp_path):
    """A fresh run pointed at a --save folder that holds iteration 4 saves iteration 2 beside it;
    the tracker stays at 4, which still loads."""
    save = tmp_path / "ckpt"
    _short_run(tmp_path, save, iters=4)
    newer = (save / "iter_0000004" / "manifest.json").read_bytes()
    fresh = _short_run(tmp_path, save, nproc=1)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert (save / "iter_0000004" / "manifest.json").read_bytes() == newer
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "4", "--use-matrix-fsdp", "--load", str(save)]
    resumed = pretrain_in_workers(1, *flags, tmp_path=tmp_path, rank=0)
    assert "successfully loaded checkpoint" in resumed["stdout"] and "at iteration 4" in resumed["stdout"]
    assert fresh["history"]["train"]


def test_resume_with_longer_train_iters_stops_or_follows_the_flags(tmp_path):
    """Megatron-LM's rule: a changed schedule stops naming the values, unless
    --override-opt_param-scheduler (then the new, longer decay: lr > 0 after iteration 4)."""
    save = tmp_path / "ckpt"
    _short_run(tmp_path, save, iters=4)
    message = _load_error(tmp_path, save, "--train-iters", "8")
    assert (
        "lr_decay_steps: checkpoint 32, this run 64" in message and "--train-iters: checkpoint 4, this run 8" in message
    )
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "8", "--use-matrix-fsdp", "--load", str(save)]
    run = pretrain_in_workers(1, *flags, "--override-opt_param-scheduler", tmp_path=tmp_path)
    lrs = [float(m.group(5)) for m in ITERATION_LINE.finditer(run["stdout"])]
    assert len(lrs) == 4 and all(lr > 0 for lr in lrs[:-1]), lrs


def test_async_save_lets_training_continue_and_loads_bitwise(tmp_path):
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "4", "--use-matrix-fsdp"]
    save = tmp_path / "ckpt"
    run = pretrain_in_workers(
        2, *flags, "--save", str(save), "--save-interval", "2", "--async-save", tmp_path=tmp_path, rank=0
    )
    timeline = re.findall(r"training resumed after ([\d.]+) s, the write finished after ([\d.]+) s", run["stdout"])
    assert len(timeline) == 2, run["stdout"]
    for resumed, written in timeline:
        assert float(resumed) < float(written)  # the step went on while the writer thread wrote
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = pretrain_in_workers(2, *flags, "--load", str(save), tmp_path=tmp_path)
    assert train_losses(resumed) == train_losses(run)[2:]


def _kill_9_all(pid: int) -> list[int]:
    """SIGKILL torchrun and every rank it started (they run in sessions of their own)."""
    import psutil

    procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in procs]


def test_kill_9_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """torchrun with 2 ranks, killed with SIGKILL (the whole process group) while iteration 4's save
    is being written: iteration 2 still loads, the partial folder is never picked, and the next save
    removes it."""
    save = tmp_path / "ckpt"
    big = ["--hidden-size", "512", "--num-attention-heads", "8", "--ffn-hidden-size", "2048", "--num-layers", "4"]
    flags = [*TINY, *big, "--eval-iters", "0", "--train-iters", "6", "--use-matrix-fsdp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += [os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--save", str(save), "--save-interval", "2"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    partial = save / "iter_0000004.tmp"
    seen, killed = [], []
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            if partial.is_dir() and any(partial.iterdir()):
                killed = _kill_9_all(proc.pid)
                seen = sorted(p.name for p in partial.iterdir())
                break
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            _kill_9_all(proc.pid)
        proc.wait()
    time.sleep(1)  # nothing may write after the kill: the checks below would see it
    print(f"\nSIGKILL to {len(killed)} processes (torchrun and its ranks) mid-save; the partial folder held: {seen}")
    assert seen and len(killed) >= 3, "the save finished before the kill; nothing was tested"
    assert proc.returncode == -signal.SIGKILL
    assert "manifest.json" not in seen
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (save / "iter_0000004").exists()
    resume = [*TINY, *big, "--eval-iters", "0", "--train-iters", "4", "--use-matrix-fsdp", "--load", str(save)]
    resume.append("--override-opt_param-scheduler")  # a shorter run than the killed one, to save time
    run = pretrain_in_workers(1, *resume, "--save", str(save), "--save-interval", "2", tmp_path=tmp_path, rank=0)
    assert "successfully loaded checkpoint" in run["stdout"] and "at iteration 2" in run["stdout"]
    assert f"removed {partial}" in run["stdout"]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert not partial.exists()


def test_megatron_distributed_optimizer_checkpoint_has_our_keys_and_resumes_matrix_fsdp(tmp_path):
    """Without --use-matrix-fsdp, megatron-core's DDP + DistributedOptimizer save themselves
    (fully_reshardable): the tensor keys equal ours, and MatrixFSDP resumes from theirs with the
    whole Adam state (iterations 3-4 within 1e-6 of megatron's uninterrupted run)."""
    from torch.distributed.checkpoint import FileSystemReader

    flags = [*TINY, "--optimizer", "adam", "--eval-iters", "0", "--train-iters", "4"]
    megatron, ours = tmp_path / "megatron", tmp_path / "ours"
    saving = ["--save-interval", "2"]
    reference = train_losses(
        pretrain_in_workers(
            2, *flags, "--use-distributed-optimizer", "--save", str(megatron), *saving, tmp_path=tmp_path
        )
    )
    pretrain_in_workers(
        2, *flags, "--use-matrix-fsdp", "--train-iters", "2", "--save", str(ours), *saving, tmp_path=tmp_path
    )

    def keys(root):
        return set(FileSystemReader(str(root / "iter_0000002")).read_metadata().state_dict_metadata)

    assert keys(megatron) == keys(ours)
    assert {"optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight", "embedding.word_embeddings.weight"} <= keys(
        ours
    )
    (megatron / "latest_checkpointed_iteration.txt").write_text("2")
    got = train_losses(pretrain_in_workers(2, *flags, "--use-matrix-fsdp", "--load", str(megatron), tmp_path=tmp_path))
    assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, reference[2:])) <= 1e-6, (got, reference)


@pytest.mark.parametrize("precision", [[], ["--bf16"]])
def test_megatron_ddp_without_the_distributed_optimizer_resumes_bitwise(tmp_path, precision):
    """--optimizer adam without --use-distributed-optimizer (megatron-core's FP32Optimizer, and with --bf16 its
    Float16OptimizerWithFloat16Params) on 2 ranks: saved at iteration 2 and resumed, the losses are bitwise the
    uninterrupted run's. The load used to ask those optimizers for the DistributedOptimizer's dummy state."""
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "4", "--optimizer", "adam", *precision]
    save = tmp_path / "ckpt"
    reference = train_losses(
        pretrain_in_workers(2, *flags, "--save", str(save), "--save-interval", "2", tmp_path=tmp_path)
    )
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    got = train_losses(pretrain_in_workers(2, *flags, "--load", str(save), tmp_path=tmp_path))
    assert got == reference[2:], (got, reference)


def test_ckpt_step_finetune_and_checkpoint_args(tmp_path):
    """--ckpt-step picks an older iteration than the tracker's; --use-checkpoint-args takes the model
    shape from it (this command line says --hidden-size 128); --finetune restarts at iteration 1."""
    save = tmp_path / "ckpt"
    _short_run(tmp_path, save, iters=4)
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "2", "--use-matrix-fsdp", "--load", str(save)]
    flags += ["--ckpt-step", "2", "--use-checkpoint-args", "--finetune", "--hidden-size", "128"]
    run = pretrain_in_workers(1, *flags, tmp_path=tmp_path, rank=0)
    assert "--use-checkpoint-args: --hidden-size 64" in run["stdout"]
    assert "successfully loaded checkpoint" in run["stdout"] and "at iteration 2" in run["stdout"]
    assert [it for it, _ in run["history"]["train"]] == [1, 2]


def test_dist_ckpt_strictness_modes(tmp_path):
    """--no-load-optim leaves the optimizer's keys in the checkpoint unrequested ("missing" in
    dist_checkpointing's terms): the default assume_ok_unexpected loads the weights, raise_all
    refuses naming the keys, return_all loads and prints them (megatron-core's load returns them)."""
    save = tmp_path / "ckpt"
    _short_run(tmp_path, save, nproc=1)
    flags = [*TINY, "--eval-iters", "0", "--train-iters", "3", "--use-matrix-fsdp", "--load", str(save)]
    resumed = train_losses(pretrain_in_workers(1, *flags, "--no-load-optim", tmp_path=tmp_path))
    assert len(resumed) == 1
    with pytest.raises(RuntimeError, match=r"(?s)Missing keys.*optimizer"):
        pretrain_in_workers(1, *flags, "--no-load-optim", "--dist-ckpt-strictness", "raise_all", tmp_path=tmp_path)
    ranks = pretrain_in_workers(
        1, *flags, "--no-load-optim", "--dist-ckpt-strictness", "return_all", tmp_path=tmp_path, rank=None
    )
    assert train_losses(ranks[0]) == resumed
    assert re.search(
        r"--dist-ckpt-strictness return_all: \S+ has \d+ key\(s\) this run did not ask for \(optimizer",
        ranks[0]["stdout"],
    )
