"""Launching pretrain_gpt.py as a user does (torchrun, gloo ranks) and reading its log."""

import os
import re
import subprocess
import sys

from megatron_mfsdp.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \| elapsed time per iteration \(ms\): ([\d.]+) \|"
    r" learning rate: ([\d.E+-]+) \| global batch size:\s+(\d+) \| lm loss: ([\d.E+-]+) \|(?: \w+: [\d.E+-]+ \|)*"
    r" loss scale: ([\d.]+) \|"
    r" grad norm: ([\d.]+) \| number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+) \|"
    r" optimizer step time \(ms\): ([\d.]+) \| tokens per second: ([\d.]+) \|"
)
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([\d.E+-]+) \|")

# A tiny GPT on mock data, every choice explicit (Megatron-LM's defaults are not the tests' choices).
TINY = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "200",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "5",
    "--lr",
    "3e-3",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "1",
    "--adam-beta2",
    "0.95",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--optimizer",
    "muon",
    "--muon-momentum",
    "0.95",
    "--muon-use-nesterov",
    "--muon-extra-scale-factor",
    "0.2",
    "--muon-coefficient-type",
    "simple",
    "--muon-ns-dtype",
    "fp32",
    "--log-interval",
    "1",
    "--eval-interval",
    "5",
    "--eval-iters",
    "2",
    "--clip-grad",
    "0",
    "--seed",
    "7",
    "--num-workers",
    "0",
    "--disable-jit-fuser",
    "--mfsdp-vocab-padding-independent-of-tp",
    "--distributed-backend",
    "gloo",
]


def parse(argv, world_size: int = 2):
    """pretrain_gpt.py's flags parsed and validated as ``world_size`` ranks would."""
    from megatron_mfsdp.training.arguments import parse_args

    return parse_args(list(argv), world_size=world_size)


def parse_error(argv, capsys, world_size: int = 2) -> str:
    """parse_args exits 2 (argparse's usage error) and the message it printed (pytest's ``capsys``)."""
    import pytest

    with pytest.raises(SystemExit) as exit_:
        parse(argv, world_size)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def run_pretrain(nproc: int, *flags: str, tmp_path, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        os.path.join(ROOT, "pretrain_gpt.py"),
        *flags,
        "--output-dir",
        str(tmp_path / "out"),
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain_gpt.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def losses(stdout: str):
    return [float(m.group(7)) for m in ITERATION_LINE.finditer(stdout)]


def _pretrain_worker(rank, world_size, argv, setup=None):
    import contextlib
    import io

    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import pretrain

    if setup is not None:
        setup()  # e.g. register a plug-in update rule before the flags are parsed

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = pretrain(parse_args(list(argv), world_size=world_size))
    return {"history": history, "stdout": out.getvalue()}


def pretrain_in_workers(nproc: int, *flags: str, tmp_path, rank: int | None = -1, setup=None) -> dict | list:
    """pretrain_gpt.py's code path (parse_args, pretrain) on the session's pooled gloo
    workers, without torchrun's start-up cost: one rank's loss history and stdout (by default
    the last rank's, which prints the training log; rank 0 prints start-up and exit lines;
    ``rank=None``: every rank's). ``setup``, a module-level function, runs in each worker first."""
    from megatron_mfsdp.testing import run_workers

    argv = [*flags, "--output-dir", str(tmp_path / "out")]
    results = run_workers(nproc, _pretrain_worker, argv, setup)
    return results if rank is None else results[rank]


def train_losses(result: dict) -> list:
    """Per-iteration training losses at full precision, from a pretrain_in_workers result."""
    return [loss for _, loss in result["history"]["train"]]


def without_query_groups(flags: list) -> list:
    """TINY's grouped-query attention taken out: MLA has no query groups (Megatron-LM refuses both)."""
    out, skip = [], False
    for f in flags:
        if skip or f == "--group-query-attention":
            skip = False
            continue
        if f == "--num-query-groups":
            skip = True
            continue
        out.append(f)
    return out
