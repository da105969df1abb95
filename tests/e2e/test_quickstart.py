"""scripts/quickstart.sh as a newcomer runs it, cut to a few iterations (a later flag wins), and the
commands it prints at the end, each parsed from its output and run as printed; a second run of a
command continues from its checkpoint, --no-load starts from scratch. The tools' warnings.
scripts/setup_env.sh is skipped (QUICKSTART_SETUP=0): the .venv is set up already."""

import os
import shlex
import subprocess
import sys

import pytest

from megatron_mfsdp.data.corpus import default_cache_dir
from tests.launch import ROOT

SHORT = ["--train-iters", "4", "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "2"]
PROMPT = "def __init__(self"
NEXT = "> what next (each command runs as printed):"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # the tools' own summary shows
    env.update(QUICKSTART_SETUP="0", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
    return env


def _run(command: str, cwd, **env) -> subprocess.CompletedProcess:
    out = subprocess.run(
        command,
        shell=True,
        executable="/bin/bash",
        cwd=cwd,
        env={**_env(), **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _quickstart(cwd, *args: str, **env) -> str:
    return _run(shlex.join(["bash", os.path.join(ROOT, "scripts", "quickstart.sh"), *args]), cwd, **env).stdout


def _printed_commands(stdout: str) -> list[str]:
    """The command lines of the last "what next" block (its comment lines left out)."""
    block = stdout[stdout.rindex(NEXT) + len(NEXT) :].splitlines()
    return [line.strip() for line in block if line.strip() and not line.strip().startswith("#")]


def _more(stdout: str) -> str:
    return next(line for line in _printed_commands(stdout) if line.startswith("bash scripts/quickstart.sh"))


def _iteration(folder) -> int:
    return int((folder / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())


def test_quickstart_leaves_a_checkpoint_a_sample_and_commands_that_run_as_printed(tmp_path):
    """First run (from another folder: a `cd` is printed), then each printed command; training
    more continues from the checkpoint, and so does running that command again (nothing left to
    train); --no-load moves the checkpoint aside and starts from scratch."""
    run = tmp_path / "run"
    first = _quickstart(tmp_path, "--output-dir", str(run), *SHORT)
    assert first.splitlines()[0].startswith(f"> quickstart: training from scratch (no checkpoint in {run}/checkpoints")
    assert _iteration(run) == 4 and (run / "loss_curve.png").exists()
    assert f"(iteration 4, torch_dist); greedy from '{PROMPT}' (tools/generate.py):\n{PROMPT}" in first
    assert PROMPT in (default_cache_dir() / "corpus" / "stdlib.jsonl").read_text()  # a prompt from the corpus

    cd, generate, more, export = _printed_commands(first)
    assert cd == f"cd {shlex.quote(ROOT)}"
    assert generate.startswith(".venv/bin/python tools/generate.py") and more.startswith("bash scripts/quickstart.sh")
    out = _run(generate, ROOT)
    assert "generated text: " in out.stdout
    stderr = out.stderr.splitlines()
    assert len(stderr) == 1 and stderr[0].startswith("> notice: generate.py: Transformer Engine and Apex"), stderr

    resumed = _run(more, ROOT).stdout
    assert resumed.startswith(f"> quickstart: continuing from the checkpoint in {run}/checkpoints at iteration 4;")
    assert f"successfully loaded checkpoint from {run}/checkpoints at iteration 4" in resumed
    assert _iteration(run) == 8 and NEXT in resumed and "    cd " not in resumed  # run from the root: no `cd`

    out = _run(export, ROOT)
    assert out.stdout.startswith("converted mfsdp") and "GPT2LMHeadModel" in out.stdout
    assert sorted(os.listdir(run / "hf-iter4")) == ["config.json", "model.safetensors"]

    again = _run(more, ROOT, QUICKSTART_SAMPLE="0").stdout  # the same command a second time (no sample: quicker)
    assert again.splitlines()[0] == (
        f"> quickstart: continuing from the checkpoint in {run}/checkpoints at iteration 8 of --train-iters 8: "
        "nothing left to train (add --train-iters 16 --override-opt_param-scheduler for more); "
        "--no-load starts from scratch"
    )
    assert "iteration        " not in again and _iteration(run) == 8

    fresh = _quickstart(
        ROOT, "--output-dir", str(run), *SHORT, "--train-iters", "2", "--no-load", QUICKSTART_SAMPLE="0"
    )
    first_line = f"> quickstart: --no-load: training from scratch; the checkpoint in {run}/checkpoints (iteration 8) "
    assert fresh.splitlines()[0].startswith(first_line + f"is moved to {run}/checkpoints.before-")
    assert "successfully loaded" not in fresh and _iteration(run) == 2  # not 8: the old one is aside
    (aside,) = run.glob("checkpoints.before-*")
    assert (aside / "latest_checkpointed_iteration.txt").read_text().strip() == "8"  # nothing lost
    assert "--no-load" not in _more(fresh)  # training more continues from the new checkpoint


@pytest.mark.parametrize(
    "tool",
    [
        ["tools/plan.py", "--help"],
        ["tools/generate.py", "--load", "no-such-folder", "--prompt", "x"],
        ["tools/checkpoint/convert.py", "--loader", "mfsdp", "--saver", "hf", "--load-dir", "no-such-folder"]
        + ["--save-dir", "no-such-output"],
    ],
    ids=["plan", "generate", "convert"],
)
def test_tools_tell_megatron_cores_fallbacks_in_one_line(tool, tmp_path):
    """Each tool imports megatron-core (6 fallback warnings without Transformer Engine and Apex, 12
    lines): one `> notice:` line instead, and nothing else on stderr but the tool's own error."""
    out = subprocess.run([sys.executable, *tool], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    stderr = [line for line in out.stderr.splitlines() if "error: " not in line]
    name = os.path.basename(tool[0]) if tool[0] != "tools/plan.py" else "tools/plan.py"
    assert len(stderr) == 1 and stderr[0].startswith(f"> notice: {name}: Transformer Engine and Apex are not"), stderr
    assert "Warning" not in out.stderr and "Torch optimizers" in stderr[0]


@pytest.mark.parametrize("how", ["-W", "PYTHONWARNINGS"])
def test_w_default_or_pythonwarnings_still_show_every_warning(how):
    env = _env()
    flags = ["-W", "default"] if how == "-W" else []
    if how == "PYTHONWARNINGS":
        env["PYTHONWARNINGS"] = "default"
    out = subprocess.run(
        [sys.executable, *flags, "tools/plan.py", "--help"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0
    assert out.stderr.count("UserWarning: Transformer Engine and Apex are not installed. Falling back to") == 4
    assert "> notice:" not in out.stderr
