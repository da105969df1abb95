"""scripts/setup_env.sh takes torch's CPU build where no GPU is visible (PyPI's Linux torch is the
CUDA build, gigabytes a CPU never uses), says so, and takes PyPI's with a GPU or TORCH_INDEX=pypi."""

import functools
import http.server
import os
import pathlib
import subprocess
import threading

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def _dry_run(tmp_path, gpu: bool, **env) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    if gpu:
        smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100"\n')
        smi.chmod(0o755)
    elif smi.exists():
        smi.unlink()
    full_env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX"}
    full_env.update(PATH=f"{bin_dir}:/usr/bin:/bin", **env)
    out = subprocess.run(
        ["bash", str(ROOT / "scripts/setup_env.sh"), "--dry-run"], env=full_env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_no_gpu_installs_the_cpu_build_and_says_so(tmp_path):
    out = _dry_run(tmp_path, gpu=False, TORCH_INDEX_CHECK="0")  # this machine may not reach the index
    assert "CPU build, from https://download.pytorch.org/whl/cpu" in out
    torch_line = next(line for line in out.splitlines() if "torch==2.13.0" in line and line.startswith("+"))
    assert torch_line.endswith(CPU_INDEX)


def test_a_gpu_or_torch_index_pypi_takes_pypis_build(tmp_path):
    for out in (_dry_run(tmp_path, gpu=True), _dry_run(tmp_path, gpu=False, TORCH_INDEX="pypi")):
        assert "from PyPI" in out
        torch_line = next(line for line in out.splitlines() if "torch==2.13.0" in line and line.startswith("+"))
        assert "--extra-index-url" not in torch_line


def test_torch_index_overrides_the_cpu_index(tmp_path):
    out = _dry_run(tmp_path, gpu=False, TORCH_INDEX="https://mirror.example/whl/cpu", TORCH_INDEX_CHECK="0")
    assert "--extra-index-url https://mirror.example/whl/cpu" in out


def test_an_index_that_answers_is_used_and_one_that_does_not_is_named_and_skipped(tmp_path):
    """pip retries an unreachable extra index for every package; the script checks it once."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        index = f"http://127.0.0.1:{server.server_address[1]}/"
        out = _dry_run(tmp_path, gpu=False, TORCH_INDEX=index)
        server.shutdown()
    assert f"--extra-index-url {index}" in out
    missing = (tmp_path / "missing").as_uri()
    out = _dry_run(tmp_path, gpu=False, TORCH_INDEX=missing)
    assert f"{missing} does not answer" in out
    torch_line = next(line for line in out.splitlines() if "torch==2.13.0" in line and line.startswith("+"))
    assert "--extra-index-url" not in torch_line
