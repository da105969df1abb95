"""Torch's thread count under a real torchrun (training/threads.py): with 2 processes per node and
OMP_NUM_THREADS unset, torchrun sets it to 1 itself, and that 1 is told from a user's (cores / 2
threads); a user's 1 or 2 is kept."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.launch import ROOT

PROBE = textwrap.dedent(
    """
    import os
    from megatron_mfsdp.training import threads
    decision = threads.configure_threads()
    print("PROBE", os.environ["LOCAL_RANK"], threads.startup_line(decision), flush=True)
    """
)


@pytest.mark.parametrize("omp", [None, "1"])
def test_under_torchrun(tmp_path, omp):
    """torchrun, 2 processes per node (torch 2.13's torch/distributed/run.py and elastic agent): unset
    (torchrun then sets 1) gives cores / 2; a user's 1, the value torchrun would set, is kept (any other
    value of the user's: tests/unit/test_threads.py)."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env["PYTHONWARNINGS"] = "ignore"
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    out = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    lines = sorted(line for line in out.splitlines() if line.startswith("PROBE"))
    cores = os.cpu_count() or 1
    if omp is None:
        count, source = max(1, cores // 2), "OMP_NUM_THREADS=1 ignored: torchrun's default"
    else:
        count, source = int(omp), f"(OMP_NUM_THREADS={omp})"
    assert len(lines) == 2, out
    for line in lines:
        assert f"> intra-op threads per process: {count} " in line and source in line, line
