"""--profile as Megatron-LM users know it (megatron/training/training.py at core_v0.16.1): nsys
mode's cudaProfilerStart/Stop at the step bounds on --profile-ranks, --use-pytorch-profiler's
chrome trace with our named ranges (megatron_mfsdp/profiling.py), and the start-up checks."""

import glob
import json
from types import SimpleNamespace

import pytest
import torch

from megatron_mfsdp import profiling
from megatron_mfsdp.profiling import profile_range
from megatron_mfsdp.training.arguments import parse_args
from megatron_mfsdp.training.control import Profiler
from tests.launch import TINY, pretrain_in_workers

# The ranges a --use-pytorch-profiler trace of a --use-matrix-fsdp Muon run must name. The runtime's
# ranges ("mfsdp.gather <unit>", "mfsdp.reduce <unit>", "mfsdp.wait <unit>") join this list when
# megatron_mfsdp/runtime/ opens them.
REQUIRED_RANGES = ["mfsdp.optimizer.step", "mfsdp.rule muon", "mfsdp.rule adamw"]
REQUIRED_RANGES += [f"mfsdp.{op} {unit}" for op in ("gather", "wait") for unit in ("embedding", "layer1", "final")]
REQUIRED_RANGES += ["mfsdp.reduce layer1", "mfsdp.reduce embedding"]


def _trace_names(path) -> list:
    with open(path) as f:
        trace = json.load(f)
    return [event.get("name", "") for event in trace["traceEvents"]]


def test_pytorch_profiler_writes_a_chrome_trace_naming_our_ranges(tmp_path):
    """Megatron-LM's schedule (wait start-1, warmup 1, active end-start) stepped at the top of
    each iteration records iteration 2 alone for --profile-step-start 2 --profile-step-end 3;
    only rank 0 (--profile-ranks' default) writes a trace."""
    tb = tmp_path / "tb"
    flags = [*TINY, "--use-matrix-fsdp", "--use-pytorch-profiler", "--profile", "--tensorboard-dir", str(tb)]
    first, last = pretrain_in_workers(
        2, *flags, "--profile-step-start", "2", "--profile-step-end", "3", tmp_path=tmp_path, rank=None
    )
    assert [i for i, _ in last["history"]["train"]] == [1, 2, 3, 4, 5]
    traces = glob.glob(str(tb / "*.pt.trace.json"))
    assert len(traces) == 1, traces  # rank 1 is not in --profile-ranks
    assert f"> profiler: PyTorch trace (*.pt.trace.json, chrome format) written to {tb}" in first["stdout"]
    names = _trace_names(traces[0])
    missing = [name for name in REQUIRED_RANGES if name not in names]
    assert not missing, (missing, sorted({n for n in names if n.startswith("mfsdp")}))
    assert names.count("mfsdp.optimizer.step") == 1  # one iteration recorded
    steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2"], steps


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA notice")
def test_profile_without_cuda_trains_with_one_notice(tmp_path):
    flags = [*TINY, "--use-matrix-fsdp", "--profile", "--profile-step-start", "1", "--profile-step-end", "3"]
    flags += ["--tensorboard-dir", str(tmp_path / "tb")]
    first, last = pretrain_in_workers(2, *flags, tmp_path=tmp_path, rank=None)
    assert [i for i, _ in last["history"]["train"]] == [1, 2, 3, 4, 5]
    lines = first["stdout"].splitlines()
    notices = [line for line in lines if line.startswith("> notice: --profile without --use-pytorch-profiler")]
    assert notices == [
        "> notice: --profile without --use-pytorch-profiler is nsys mode (cudaProfilerStart/Stop around "
        "iterations 2..3, for nsys --capture-range=cudaProfilerApi): it needs CUDA and this machine has none, "
        "so nothing is captured; add --use-pytorch-profiler for a PyTorch trace"
    ]
    assert not glob.glob(str(tmp_path / "**" / "*.pt.trace.json"), recursive=True)


def test_pytorch_profiler_without_a_folder_is_a_start_up_error(capsys):
    with pytest.raises(SystemExit):
        parse_args([*TINY, "--profile", "--use-pytorch-profiler"], world_size=2)
    assert "--use-pytorch-profiler writes its trace to --tensorboard-dir (else --output-dir)" in capsys.readouterr().err
    args = parse_args([*TINY, "--profile", "--use-pytorch-profiler", "--output-dir", "/tmp"], world_size=2)
    assert args.use_pytorch_profiler  # --output-dir is enough
    args = parse_args([*TINY, "--use-pytorch-profiler"], world_size=2)
    assert "--use-pytorch-profiler without --profile: nothing is profiled (as Megatron-LM)" in args.notices


class _FakeCudart:
    def __init__(self, log):
        self.log = log

    def cudaProfilerStart(self):  # noqa: N802 - the CUDA runtime's name
        self.log.append("cudaProfilerStart")
        return 0

    def cudaProfilerStop(self):  # noqa: N802
        self.log.append("cudaProfilerStop")
        return 0


class _FakeEmitNvtx:
    def __init__(self, log, **kwargs):
        self.log, self.kwargs = log, kwargs

    def __enter__(self):
        self.log.append(f"emit_nvtx enter {self.kwargs}")

    def __exit__(self, *exc):
        self.log.append("emit_nvtx exit")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA runtime that records what the Profiler asks of it (this process is rank 0)."""
    log = []

    def check_error(res):
        assert res == 0
        log.append("check_error")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(log))
    monkeypatch.setattr(torch.cuda, "check_error", check_error)
    monkeypatch.setattr(torch.autograd.profiler, "emit_nvtx", lambda **kw: _FakeEmitNvtx(log, **kw))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    return log


def _drive(profiler, log, train_iters: int, after_step: bool) -> None:
    """training/loop.py's calls: step at the top, iteration += 1, the step, after_step, stop at the end."""
    iteration = 0
    while iteration < train_iters:
        profiler.step(iteration)
        iteration += 1
        log.append(f"iteration {iteration}")
        if after_step:
            profiler.after_step(iteration)
    profiler.stop()


def _args(**kw):
    base = dict(profile=True, use_pytorch_profiler=False, profile_step_start=2, profile_step_end=4, profile_ranks=[0])
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("after_step", [True, False], ids=["after-step", "top-of-loop-only"])
def test_nsys_mode_calls_cuda_profiler_around_megatrons_iterations(fake_cuda, after_step):
    """Start at the top of the loop once 2 iterations are done, stop after iteration 4: the
    capture holds iterations 3 and 4, as Megatron-LM's train loop (training.py at core_v0.16.1)."""
    _drive(Profiler(_args()), fake_cuda, 6, after_step)
    assert fake_cuda == [
        "iteration 1",
        "iteration 2",
        "cudaProfilerStart",
        "check_error",
        "emit_nvtx enter {'record_shapes': True}",
        "iteration 3",
        "iteration 4",
        "cudaProfilerStop",
        "check_error",
        "emit_nvtx exit",
        "iteration 5",
        "iteration 6",
    ]


@pytest.mark.parametrize(
    "kw",
    [dict(profile_ranks=[1]), dict(profile=False), dict(use_pytorch_profiler=True, profile=False)],
    ids=["other-rank", "no-profile", "pytorch-flag-alone"],
)
def test_nsys_mode_off_this_rank_calls_nothing(fake_cuda, kw):
    _drive(Profiler(_args(**kw)), fake_cuda, 6, after_step=True)
    assert fake_cuda == [f"iteration {i}" for i in range(1, 7)]


def test_nsys_mode_stops_when_training_ends_inside_the_window(fake_cuda):
    _drive(Profiler(_args(profile_step_end=9)), fake_cuda, 3, after_step=True)
    assert fake_cuda[-3:] == ["cudaProfilerStop", "check_error", "emit_nvtx exit"]
    assert fake_cuda.count("cudaProfilerStart") == 1


def test_profile_range_names_appear_in_a_pytorch_trace_and_cost_nothing_without_one(monkeypatch, tmp_path):
    with torch.profiler.profile() as prof:
        with profile_range(profiling.OPTIMIZER_STEP):
            with profile_range(profiling.GATHER.format("layer1")):
                torch.ones(4).sum()
    names = {event.name for event in prof.events()}
    assert {"mfsdp.optimizer.step", "mfsdp.gather layer1"} <= names

    def no_record_function(name):
        raise AssertionError(f"record_function({name!r}) entered with no profiler running")

    monkeypatch.setattr(torch.profiler, "record_function", no_record_function)
    with profile_range("mfsdp.rule muon"):
        pass
    with pytest.raises(AssertionError, match="entered with no profiler"):  # the control: it is reached under one
        with torch.profiler.profile():
            with profile_range("mfsdp.rule muon"):
                pass


def test_profile_range_pairs_nvtx_push_and_pop_even_on_error(monkeypatch):
    calls = []
    monkeypatch.setattr(profiling, "_nvtx", [True])
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(f"push {name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    with pytest.raises(ValueError):
        with profile_range("mfsdp.wait layer2"):
            raise ValueError("inside")
    assert calls == ["push mfsdp.wait layer2", "pop"]
