"""The Dockerfile, checked without docker (no engine here): every repository path benchmarks/gpu_check.sh
references is copied to the same place under the image's WORKDIR, NGC's pip constraint is unset before
pip runs (as Megatron-LM's install guide does), and the build stops with a clear message unless
megatron-core is 0.16.1 and Transformer Engine in the range it is tested with. Also: the shell scripts
the image runs parse, and their pretrain_gpt.py flags parse. Each check has a negative control."""

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.sh"
EXAMPLES = [
    ROOT / "examples" / "pretrain_gpt_1.3b_single_node.sh",
    ROOT / "examples" / "pretrain_gpt_1.3b_multi_node.slurm",
]


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, as Docker's parser sees them: comment lines dropped
    (inside continuations too), lines ending in a backslash joined to the next."""
    out, current = [], ""
    for line in text.splitlines():
        if line.strip().startswith("#") or (current and not line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1]
            continue
        current += line
        if current.strip():
            keyword, _, rest = current.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
        current = ""
    return out


def copies(text: str) -> list[tuple[str, str]]:
    """(source, where it lands relative to WORKDIR) of every COPY from the build context."""
    out, workdir = [], "/"
    for keyword, rest in instructions(text):
        if keyword == "WORKDIR":
            workdir = os.path.normpath(os.path.join(workdir, rest))
        if keyword != "COPY":
            continue
        args = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        if any(a.startswith("--from") for a in args):
            continue
        args = [a for a in args if not a.startswith("--")]
        *sources, dest = args
        for source in sources:
            source = os.path.normpath(source)
            is_dir = (ROOT / source).is_dir()
            into_dir = dest.endswith("/") or dest in (".", "./") or len(sources) > 1
            target = os.path.join(dest, os.path.basename(source)) if into_dir and not is_dir else dest
            target = os.path.normpath(os.path.join(workdir, target))
            out.append((source, os.path.relpath(target, workdir)))
    return out


def repository_paths() -> set[str]:
    """Tracked and untracked-but-not-ignored files, and their folders."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    paths = set()
    for f in listed:
        parts = pathlib.PurePosixPath(f).parts
        paths.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return paths


def referenced_paths(script: str, repo: set[str]) -> set[str]:
    """Repository paths a script names: a path with a '/' or a file name with a suffix (pretrain_gpt.py),
    and the package of a dotted module name (megatron_mfsdp.precision -> megatron_mfsdp)."""
    found = set()
    for token in re.findall(r"[\w.][\w./-]*", script):
        token = token.rstrip(".")
        if token in repo and ("/" in token or "." in token.strip(".")) and not token.startswith("."):
            found.add(token)
        package = token.split(".")[0]
        if re.fullmatch(r"\w+(\.\w+)+", token) and (ROOT / package / "__init__.py").is_file():
            found.add(package)
    return found


def uncovered(dockerfile: str, paths: set[str]) -> list[str]:
    """The paths no COPY puts at the same relative place under WORKDIR (gpu_check.sh runs from there)."""

    def covered(path):
        return any((path == src or path.startswith(src + "/")) and src == dst for src, dst in copies(dockerfile))

    return sorted(p for p in paths if not covered(p))


def constraint_unset_before_pip(dockerfile: str) -> bool:
    """PIP_CONSTRAINT emptied (ENV PIP_CONSTRAINT= / "") before the first pip install, or unset in that RUN."""
    unset = False
    for keyword, rest in instructions(dockerfile):
        if keyword in ("ENV", "ARG") and re.match(r"PIP_CONSTRAINT(=(\"\"|'')?\s*$|\s+\"\"\s*$)", rest):
            unset = True
        if keyword == "RUN" and "pip install" in rest:
            before = rest[: rest.index("pip install")]
            return unset or "unset PIP_CONSTRAINT" in before or "PIP_CONSTRAINT= " in before
    return False


def version_check_code(dockerfile: str) -> str:
    """The python -c program of the RUN that checks the megatron-core / Transformer Engine pair."""
    runs = [rest for keyword, rest in instructions(dockerfile) if keyword == "RUN" and "transformer_engine" in rest]
    assert len(runs) == 1, runs
    args = shlex.split(runs[0])
    return args[args.index("-c") + 1]


NEEDED = {
    "pretrain_gpt.py",
    "megatron_mfsdp",
    "benchmarks/bench_end_to_end.py",
    "benchmarks/gpu_fp8_te_check.py",
    "tests/distributed/test_dp_exactness.py",
}


def test_gpu_check_paths_are_derived_from_the_script():
    found = referenced_paths(GPU_CHECK.read_text(), repository_paths())
    assert NEEDED <= found, NEEDED - found  # the derivation sees what the script runs
    assert "runs/gpu_check" not in found and ".venv/bin/python" not in found  # outputs, not sources


def test_dockerfile_copies_every_path_gpu_check_needs():
    paths = referenced_paths(GPU_CHECK.read_text(), repository_paths())
    assert uncovered(DOCKERFILE, paths) == []


@pytest.mark.parametrize(
    "line,replacement",
    [
        ("COPY tests ./tests", ""),  # not copied
        ("COPY tests ./tests", "COPY tests /tmp/tests"),  # copied elsewhere
        ("COPY tests ./tests", "COPY tests ./"),  # its contents spilled into WORKDIR
        ("COPY pretrain_gpt.py ./", "COPY pretrain_gpt.py ./scripts/"),
        ("COPY benchmarks ./benchmarks", "# COPY benchmarks ./benchmarks"),
    ],
)
def test_negative_control_a_missing_or_misplaced_copy_fails(line, replacement):
    assert line in DOCKERFILE
    paths = referenced_paths(GPU_CHECK.read_text(), repository_paths())
    assert uncovered(DOCKERFILE.replace(line, replacement), paths) != []


def test_pip_constraint_is_unset_before_pip_installs():
    assert constraint_unset_before_pip(DOCKERFILE)
    assert constraint_unset_before_pip("FROM x\nRUN unset PIP_CONSTRAINT && pip install -e .\n")


def test_negative_control_constraint_kept_or_unset_too_late():
    env_line = next(line for line in DOCKERFILE.splitlines() if line.startswith("ENV PIP_CONSTRAINT"))
    assert not constraint_unset_before_pip(DOCKERFILE.replace(env_line, ""))
    late = DOCKERFILE.replace(env_line, "") + f"\n{env_line}\n"
    assert not constraint_unset_before_pip(late)
    assert not constraint_unset_before_pip(DOCKERFILE.replace(env_line, "ENV PIP_CONSTRAINT=/etc/pip/constraint.txt"))


def _run_version_check(monkeypatch, megatron_core: str, te: str | None):
    versions = {"megatron-core": megatron_core, "transformer_engine": te}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if te else None) if name == "transformer_engine" else real_find_spec(name, *a),
    )
    exec(version_check_code(DOCKERFILE), {"__name__": "__main__"})


@pytest.mark.parametrize("te", ["2.7.0+e3c2a1b", "2.9.0", "2.11.0.dev0+5671fd3"])
def test_version_check_passes_a_tested_pair(monkeypatch, capsys, te):
    _run_version_check(monkeypatch, "0.16.1", te)
    assert f"Transformer Engine {te}: in range" in capsys.readouterr().out


@pytest.mark.parametrize(
    "megatron_core,te,message",
    [
        ("0.15.0", "2.9.0", "megatron-core 0.15.0 is installed; megatron-mfsdp needs megatron-core 0.16.1"),
        ("0.17.0", "2.9.0", "needs megatron-core 0.16.1"),
        ("0.16.1", "2.6.0+abc", "Transformer Engine 2.6.0+abc does not work with megatron-core 0.16.1"),
        ("0.16.1", "2.12.0", "need 2.7 <= TE < 2.12"),
        ("0.16.1", None, "Transformer Engine is not installed"),
    ],
)
def test_negative_control_version_check_stops_the_build(monkeypatch, megatron_core, te, message):
    with pytest.raises(SystemExit) as stop:
        _run_version_check(monkeypatch, megatron_core, te)
    assert message in str(stop.value)


@pytest.mark.parametrize("script", [GPU_CHECK, *EXAMPLES], ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_negative_control_bash_n_catches_a_broken_script(tmp_path):
    broken = tmp_path / "broken.sh"
    broken.write_text(GPU_CHECK.read_text().replace("\nfi\n", "\n", 1))
    assert subprocess.run(["bash", "-n", str(broken)], capture_output=True).returncode != 0


def _bash_array(path: pathlib.Path, name: str, env: dict) -> list[str]:
    """The bash array NAME=( ... ) of a script, expanded with ``env``."""
    block = re.search(rf"^{name}=\((.*?)\)[ \t]*$", path.read_text(), re.S | re.M)
    assert block, f"no {name}=( ... ) in {path.name}"
    code = f"{name}=({block.group(1)})\nprintf '%s\\0' \"${{{name}[@]}}\""
    out = subprocess.run(["bash", "-c", code], capture_output=True, text=True, env={**os.environ, **env}, check=True)
    return out.stdout.split("\0")[:-1]


def _gpu_check_runs() -> dict[str, list[str]]:
    """Each pretrain_step call of gpu_check.sh: its name and the flags it adds."""
    runs = {}
    for line in GPU_CHECK.read_text().splitlines():
        m = re.match(r"\s*(?:if |elif )?pretrain_step (.*?)(?:;|&&|$)", line)
        if m:
            name, _gpus, *extra = shlex.split(m.group(1))
            runs[name] = extra
    return runs


def _parse(argv, world_size):
    from megatron_mfsdp.training.arguments import parse_args

    return parse_args(argv, world_size=world_size)


def test_gpu_check_pretrain_flags_parse():
    base = _bash_array(GPU_CHECK, "PRETRAIN", {})
    assert base[0] == "pretrain_gpt.py"
    runs = _gpu_check_runs()
    assert set(runs) == {"fused", "unfused", "fp8_train", "nccl_$NGPU"}, runs
    assert runs["unfused"] == ["--no-gradient-accumulation-fusion"]
    for name, extra in runs.items():
        args = _parse(base[1:] + extra + ["--output-dir", "/tmp/x"], world_size=2 if name.startswith("nccl") else 1)
        assert args.use_matrix_fsdp and args.optimizer == "muon" and args.bf16
    fp8 = _parse(base[1:] + runs["fp8_train"], world_size=1)
    assert fp8.fp8 == "e4m3" and fp8.fp8_param_gather and fp8.fp8_recipe == "tensorwise"


@pytest.mark.parametrize(
    "script,world_size", [(EXAMPLES[0], 8), (EXAMPLES[1], 32)], ids=lambda p: getattr(p, "name", p)
)
def test_example_flags_parse(script, world_size, tmp_path):
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "corpus_text_document.bin"), dtype=np.int32)
    builder.add_item(torch.tensor([1, 2, 3]))  # parse_args opens the dataset's index
    builder.end_document()
    builder.finalize(str(tmp_path / "corpus_text_document.idx"))
    (tmp_path / "spm.model").touch()
    env = {"DATA_PATH": str(tmp_path / "corpus_text_document"), "TOKENIZER_MODEL": str(tmp_path / "spm.model")}
    env.update(CKPT=str(tmp_path / "ckpt"), EXIT_DURATION_MINS="225")
    args = _parse(_bash_array(script, "ARGS", env), world_size=world_size)
    assert args.use_matrix_fsdp and args.optimizer == "muon" and args.exit_signal_handler and args.log_throughput
    assert args.num_layers == 24 and args.hidden_size == 2048


def test_negative_control_a_wrong_flag_does_not_parse():
    base = _bash_array(GPU_CHECK, "PRETRAIN", {})
    with pytest.raises(SystemExit):
        _parse(base[1:] + ["--no-gradient-accumulation-fusionn"], world_size=1)
