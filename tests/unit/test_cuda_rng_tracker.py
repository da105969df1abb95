"""On CUDA, megatron-core's layers fork its RNG tracker's "model-parallel-rng" state to initialize their
weights: pretrain seeds the tracker as Megatron-LM does before building the model (the first GPU check
failed without it: "cuda rng state model-parallel-rng is not added"). Here megatron-core's own seeding
runs in a one-rank group with CPU stand-ins, in this test only, for the CUDA generator calls it makes
(each seed a state of its own, so the stand-ins are checked too)."""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_rank_process_group")


def _cuda_generator_on_cpu(monkeypatch) -> None:
    current = {"state": torch.zeros(8, dtype=torch.uint8)}

    def manual_seed(seed):
        current["state"] = torch.tensor(list(int(seed).to_bytes(8, "little")), dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "manual_seed", manual_seed)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: current["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, *a, **k: current.update(state=state.clone()))


def test_pretrain_seeds_the_trackers_states_before_building_the_model(monkeypatch):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_mfsdp.compat.cpu import cuda_on_cpu
    from megatron_mfsdp.testing import init_megatron
    from megatron_mfsdp.training.setup import seed_cuda_rng_tracker

    init_megatron()
    get_cuda_rng_tracker().reset()
    seed_cuda_rng_tracker(1234)  # no GPU here: nothing to seed, the CPU generator serves
    assert "model-parallel-rng" not in get_cuda_rng_tracker().get_states()
    _cuda_generator_on_cpu(monkeypatch)
    with cuda_on_cpu():
        seed_cuda_rng_tracker(1234, on_cuda=True)
    states = get_cuda_rng_tracker().get_states()
    assert {"model-parallel-rng", "expert-parallel-rng"} <= set(states), sorted(states)
    seeds = {name: int.from_bytes(bytes(state.tolist()), "little") for name, state in states.items()}
    assert seeds["model-parallel-rng"] == 1234 + 2718  # megatron-core's tensor-parallel offset, TP rank 0
    get_cuda_rng_tracker().reset()
