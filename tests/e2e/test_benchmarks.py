"""Smoke runs of the benchmark scripts (their figures are for the closing notes, not
asserted here): they run, the three optimizers agree, and ours moves no tensor data."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script, *args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_optimizer_step_benchmark_quick():
    out = _run("bench_optimizer_step.py", "--quick")
    results = re.findall(r"RESULT W=(\d+) .*ours_collectives=(\d+) recon_collectives=(\d+)", out)
    assert [w for w, _, _ in results] == ["2", "4"]
    assert all(ours == "1" and int(recon) > 1 for _, ours, recon in results)
    diffs = re.findall(r"max \|param - replicated\| after all steps: ours ([\d.e+-]+), recon ([\d.e+-]+)", out)
    assert diffs and all(float(a) < 1e-5 and float(b) < 1e-5 for a, b in diffs)


def test_memory_per_rank_table():
    out = _run(
        "memory_per_rank.py",
        "--num-layers",
        "4",
        "--hidden-size",
        "256",
        "--ffn-hidden-size",
        "1024",
        "--num-attention-heads",
        "4",
        "--vocab-size",
        "1024",
        "--world-sizes",
        "1",
        "2",
        "4",
    )
    rows = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^\s+(\d+)\s+([\d.]+)", out, re.M)}
    assert set(rows) == {1, 2, 4} and rows[4] < rows[2] < rows[1]
