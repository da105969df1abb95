"""pretrain_gpt.py end to end on gloo ranks: Megatron log lines, DP invariance,
MatrixFSDP vs plain data parallelism, checkpoint resume, and bad-input errors."""

import os
import re
import subprocess
import sys

import pytest

from tests.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \| elapsed time per iteration \(ms\): ([\d.]+) \|"
    r" learning rate: ([\d.E+-]+) \| global batch size:\s+(\d+) \| lm loss: ([\d.E+-]+) \| loss scale: ([\d.]+) \|"
    r" grad norm: ([\d.]+) \| number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+) \|"
    r" optimizer step time \(ms\): ([\d.]+) \| tokens per second: ([\d.]+) \|")
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([\d.E+-]+) \|")

TINY = ["--mock-data", "--vocab-size", "200", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "5", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "5",
        "--eval-iters", "2", "--clip-grad", "0", "--seed", "7"]


def run_pretrain(nproc: int, *flags: str, tmp_path, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"), *flags,
           "--output-dir", str(tmp_path / "out")]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain_gpt.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def losses(stdout: str):
    return [float(m.group(7)) for m in ITERATION_LINE.finditer(stdout)]


def test_pretrain_dp2_matrix_fsdp_log_lines_parse_and_resume(tmp_path):
    save = tmp_path / "ckpt"
    proc = run_pretrain(2, *TINY, "--use-matrix-fsdp", "--save", str(save), "--save-interval", "3",
                        tmp_path=tmp_path)
    lines = [m for m in ITERATION_LINE.finditer(proc.stdout)]
    assert [int(m.group(1)) for m in lines] == [1, 2, 3, 4, 5]
    assert all(int(m.group(6)) == 8 and float(m.group(8)) == 1.0 for m in lines)
    assert int(lines[-1].group(3)) == 40  # consumed samples
    assert VALIDATION_LINE.search(proc.stdout)
    assert "MatrixFSDP plan: 5 units over 2 DP ranks" in proc.stdout  # tied embedding is its own unit
    assert (tmp_path / "out" / "loss_curve.png").stat().st_size > 1000
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "5"

    # Resume from iteration 3 and reproduce iterations 4 and 5 exactly.
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = run_pretrain(2, *TINY, "--use-matrix-fsdp", "--load", str(save), tmp_path=tmp_path)
    assert losses(resumed.stdout) == losses(proc.stdout)[3:]


def test_dp_invariance_and_plain_data_parallel_agree(tmp_path):
    """Same global batch at DP=1, 2, 4: the same lm loss at every iteration."""
    runs = {f"mfsdp dp{n}": losses(run_pretrain(n, *TINY, "--use-matrix-fsdp", tmp_path=tmp_path).stdout)
            for n in (1, 2, 4)}
    runs.update({f"plain dp{n}": losses(run_pretrain(n, *TINY, tmp_path=tmp_path).stdout) for n in (2, 4)})
    reference = runs["mfsdp dp1"]
    assert len(reference) == 5 and reference[-1] < reference[0]
    worst = max(abs(a - b) for run in runs.values() for a, b in zip(run, reference))
    print(f"\nlargest lm loss difference across DP sizes and modes: {worst:.3e}")
    for name, run in runs.items():
        assert len(run) == 5
        for a, b in zip(run, reference):
            assert abs(a - b) <= 1e-5, (name, run, reference)


@pytest.mark.parametrize("flags,message", [
    (["--global-batch-size", "6"], "--global-batch-size 6 is not divisible"),
    (["--fp16", "--bf16"], "--fp16 and --bf16"),
    (["--num-attention-heads", "3"], "--hidden-size 64 is not divisible by --num-attention-heads 3"),
    (["--optimizer", "sgd"], "--optimizer"),
    (["--lr-warmup-iters", "9"], "--lr-warmup-iters 9 must be smaller"),
    (["--tensor-model-parallel-size", "2", "--num-query-groups", "1"],
     "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--tensor-model-parallel-size", "4"], "world size 2 is not divisible by --tensor-model-parallel-size"),
    (["--mfsdp-replicate-size", "3"], "--mfsdp-replicate-size 3 does not divide the data-parallel size 2"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     "--num-layers-per-virtual-pipeline-stage 2 needs"),
    (["--muon-tp-mode", "sharded"], "--muon-tp-mode"),
    (["--muon-scale-mode", "frobenius"], "--muon-scale-mode"),
    (["--data-path", "/nonexistent/corpus"], "--data-path /nonexistent/corpus"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/nonexistent.model"], "--tokenizer-model"),
])
def test_bad_flags_fail_before_any_work_naming_the_flag(flags, message, capsys):
    from megatron_mfsdp.training.arguments import parse_args

    uses_files = "--data-path" in flags
    base = [a for a in TINY if a != "--mock-data"] if uses_files else TINY
    with pytest.raises(SystemExit):
        parse_args(base + flags, world_size=2)
    assert message in capsys.readouterr().err
