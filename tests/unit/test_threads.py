"""Torch's thread count at start-up (training/threads.py): OMP_NUM_THREADS where the user set it, else
cores / local ranks (the count before it was respected), torchrun's own OMP_NUM_THREADS=1 told from a
user's; and the start-up line. Under a real torchrun: tests/e2e/test_thread_count.py; the line in
pretrain_gpt.py's log: tests/e2e/test_pretrain.py."""

import os

import pytest
import torch

from megatron_mfsdp.training import threads


@pytest.mark.parametrize(
    "value,cores,ranks,count,source",
    [
        (None, 16, 2, 8, "16 cores / 2 local ranks; OMP_NUM_THREADS unset"),  # as before
        (None, 2, 4, 1, "2 cores / 4 local ranks; OMP_NUM_THREADS unset"),  # never below 1
        ("3", 16, 2, 3, "OMP_NUM_THREADS=3"),  # the user's
        ("1", 16, 2, 1, "OMP_NUM_THREADS=1"),  # the user's 1 (torchrun_set False)
        ("0", 16, 2, 8, "16 cores / 2 local ranks; OMP_NUM_THREADS='0' ignored: not a positive integer"),
        ("four", 16, 2, 8, "16 cores / 2 local ranks; OMP_NUM_THREADS='four' ignored: not a positive integer"),
    ],
)
def test_decide_follows_omp_num_threads_else_cores_per_local_rank(value, cores, ranks, count, source):
    assert threads.decide(value, cores, ranks) == threads.Threads(count, source)


def test_torchruns_own_one_is_not_the_users(tmp_path):
    """Under torchrun with 2 local ranks, OMP_NUM_THREADS=1 is torchrun's where torchrun's start-up
    environment lacks it (then cores / local ranks), the user's where it has it; unreadable: the user's,
    said so. Outside torchrun, with one local rank, or another value, no look."""
    env = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    without, with_it = tmp_path / "without", tmp_path / "with"
    without.write_bytes(b"PATH=/bin\0HOME=/root\0")
    with_it.write_bytes(b"PATH=/bin\0OMP_NUM_THREADS=1\0")
    assert threads.torchrun_default(env, str(without)) is True
    assert threads.torchrun_default(env, str(with_it)) is False
    assert threads.torchrun_default(env, str(tmp_path / "absent")) is None
    for other in ({"TORCHELASTIC_RUN_ID": None}, {"LOCAL_WORLD_SIZE": "1"}, {"OMP_NUM_THREADS": "2"}):
        changed = {k: v for k, v in {**env, **other}.items() if v is not None}
        assert threads.torchrun_default(changed, str(without)) is False, other
    torchrun_s = threads.decide("1", 16, 2, torchrun_set=True)
    assert torchrun_s.count == 8 and "torchrun's default" in torchrun_s.source
    unsure = threads.decide("1", 16, 2, torchrun_set=None)
    assert unsure.count == 1 and "could not be read" in unsure.source


def test_configure_sets_torch_and_the_line_says_it():
    before = torch.get_num_threads()
    try:
        decision = threads.configure_threads({"OMP_NUM_THREADS": "3", "WORLD_SIZE": "2"})
        assert torch.get_num_threads() == 3
        assert threads.startup_line(decision) == "> intra-op threads per process: 3 (OMP_NUM_THREADS=3)"
        cores = os.cpu_count() or 1
        decision = threads.configure_threads({"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "4"})
        assert torch.get_num_threads() == cores
        line = f"> intra-op threads per process: {cores} ({cores} cores / 1 local ranks; OMP_NUM_THREADS unset)"
        assert threads.startup_line(decision) == line
        caller = threads.startup_line(None)
        assert caller == f"> intra-op threads per process: {cores} (set by the caller that created the process group)"
    finally:
        torch.set_num_threads(before)
