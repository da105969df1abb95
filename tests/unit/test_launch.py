"""CUDA_DEVICE_MAX_CONNECTIONS at start-up (training/launch.py): the rule of megatron-core 0.16.1 and
Megatron-LM's validate_args for each overlap, what is set, what is refused (naming the variable and
the flags), the CPU line, and that pretrain decides it before CUDA is initialised."""

from types import SimpleNamespace

import pytest
import torch

from megatron_mfsdp.training import launch, loop
from megatron_mfsdp.training.launch import VARIABLE, LaunchError, decide, requirement

HOPPER, BLACKWELL = 9, 10


@pytest.mark.parametrize(
    "matrix_fsdp,tp,arch,value,warns",
    [
        (True, 1, HOPPER, ">1", False),  # FSDP overlap: never 1 (Megatron-LM asserts it for its FSDPs)
        (True, 2, HOPPER, ">1", True),  # FSDP wins over TP, with Megatron-LM's warning
        (True, 2, BLACKWELL, ">1", False),  # TP needs nothing from Blackwell on: no conflict
        (False, 2, HOPPER, "1", False),  # TP before Blackwell: 1
        (False, 2, None, "1", False),  # unknown GPU (CPU here): answered as before Blackwell
        (False, 2, BLACKWELL, None, False),
        (False, 1, HOPPER, None, False),  # data parallel only: no requirement
    ],
)
def test_rule_follows_megatron(matrix_fsdp, tp, arch, value, warns):
    need = requirement(matrix_fsdp, tp, 1, arch)
    assert need.value == value
    assert bool(need.warning) == warns


def test_context_parallel_counts_as_model_parallel():
    assert requirement(False, 1, 2, HOPPER).value == "1"
    assert "--context-parallel-size 2" in requirement(False, 1, 2, HOPPER).flags


def test_matrix_fsdp_refuses_one_and_names_variable_and_flag():
    need = requirement(True, 1, 1, HOPPER)
    with pytest.raises(LaunchError) as err:
        decide(need, "1", on_cuda=True)
    assert f"{VARIABLE}=1" in str(err.value) and "--use-matrix-fsdp" in str(err.value)
    # negative controls: unset, or above 1, pass and nothing is set
    value, line = decide(need, None, on_cuda=True)
    assert value is None and line.startswith(f"> {VARIABLE} unset (CUDA's default, 8)")
    value, line = decide(need, "4", on_cuda=True)
    assert value is None and line.startswith(f"> {VARIABLE}=4 (from the environment)")


def test_tensor_parallel_without_fsdp_sets_one_or_refuses_another_value():
    need = requirement(False, 2, 1, HOPPER)
    value, line = decide(need, None, on_cuda=True)
    assert value == "1" and line.startswith(f"> {VARIABLE}=1 (set: --tensor-model-parallel-size 2")
    assert decide(need, "1", on_cuda=True)[0] is None  # already right: kept
    with pytest.raises(LaunchError, match=r"CUDA_DEVICE_MAX_CONNECTIONS=8 with --tensor-model-parallel-size 2"):
        decide(need, "8", on_cuda=True)


def test_setting_after_cuda_started_is_refused():
    with pytest.raises(LaunchError, match="export CUDA_DEVICE_MAX_CONNECTIONS=1"):
        decide(requirement(False, 2, 1, HOPPER), None, on_cuda=True, cuda_started=True)
    # negative control: nothing to set, so a started CUDA is fine
    assert decide(requirement(True, 1, 1, HOPPER), None, on_cuda=True, cuda_started=True)[0] is None


@pytest.mark.parametrize("bad", ["0", "33", "abc", ""])
def test_values_cuda_cannot_take_are_refused(bad):
    with pytest.raises(LaunchError, match="integer from 1 to 32"):
        decide(requirement(False, 1, 1, HOPPER), bad, on_cuda=True)
    value, line = decide(requirement(False, 1, 1, None), bad, on_cuda=False)  # on CPU: said, not raised
    assert value is None and "no effect on CPU" in line and "integer from 1 to 32" in line


def test_no_requirement_leaves_any_value():
    need = requirement(False, 1, 1, HOPPER)
    for value in ("1", "32"):
        assert decide(need, value, on_cuda=True)[0] is None


def test_cpu_says_what_cuda_would_need_and_never_sets_or_raises():
    value, line = decide(requirement(True, 1, 1, None), "1", on_cuda=False)
    assert value is None
    assert line.startswith(f"> {VARIABLE}: no effect on CPU; on CUDA this run would need it above 1")
    assert "would be refused there" in line
    value, line = decide(requirement(False, 2, 1, None), None, on_cuda=False)
    assert value is None and "would need 1" in line and "refused" not in line


def _args(**kw):
    return SimpleNamespace(**{"use_matrix_fsdp": True, "tensor_model_parallel_size": 1, **kw})


def test_configure_on_this_machine_prints_and_leaves_the_environment():
    env = {}
    line = launch.configure_cuda_connections(_args(), env)
    if torch.cuda.is_available():
        pytest.skip("a GPU machine: the CPU line is not printed")
    assert env == {} and "no effect on CPU" in line


def test_configure_on_a_hopper_sets_and_refuses(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (HOPPER, 0))
    env = {}
    line = launch.configure_cuda_connections(_args(use_matrix_fsdp=False, tensor_model_parallel_size=2), env)
    assert env == {VARIABLE: "1"} and "(set:" in line
    env = {VARIABLE: "1"}
    with pytest.raises(LaunchError, match="--use-matrix-fsdp"):
        launch.configure_cuda_connections(_args(), env)
    env = {}
    launch.configure_cuda_connections(_args(), env)
    assert env == {}  # MatrixFSDP: unset stays unset


class _Stop(Exception):
    pass


class _StopAtNotices:
    def __iter__(self):
        raise _Stop


def test_pretrain_decides_before_cuda_is_initialised_and_prints_the_line(monkeypatch):
    """_set_up: configure, then initialize_distributed (torch.cuda.set_device), then the line."""
    calls = []
    monkeypatch.setattr(launch, "configure_cuda_connections", lambda args: calls.append("configure") or "> line")
    monkeypatch.setattr(loop, "initialize_distributed", lambda args: calls.append("initialize") or True)
    monkeypatch.setattr(loop.logging, "print_rank0", lambda *a: calls.append(a))
    with pytest.raises(_Stop):
        loop._set_up(SimpleNamespace(notices=_StopAtNotices()))
    assert calls[:3] == ["configure", "initialize", ("> line",)]
    assert calls[3][0].startswith("> intra-op threads per process: ") and len(calls) == 4  # training/threads.py
