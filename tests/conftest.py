"""Markers by folder: ``unit`` (one process, seconds), ``distributed`` (gloo worker
processes), ``e2e`` (pretrain_gpt.py, tools and benchmarks as a user runs them).
``pytest -m unit`` runs the fast part alone."""

import pathlib

import pytest

_MARKERS = {
    "unit": "one process, no process group",
    "distributed": "spawns gloo worker processes",
    "e2e": "runs pretrain_gpt.py, tools/ or benchmarks/ as subprocesses",
}


def pytest_configure(config):
    for name, text in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = pathlib.Path(str(item.fspath)).parent.name
        if folder in _MARKERS:
            item.add_marker(getattr(pytest.mark, folder))


@pytest.fixture(autouse=True, scope="module")
def _release_worker_groups():
    """Pooled gloo workers live for the session (starting them costs seconds per rank); after
    each test module their groups but the world are destroyed, since idle gloo groups poll."""
    yield
    from megatron_mfsdp.testing.workers import release_pool_groups

    release_pool_groups()


@pytest.fixture(autouse=True, scope="session")
def _close_worker_pools():
    yield
    from megatron_mfsdp.testing.workers import close_pools

    close_pools()


@pytest.fixture(scope="module")
def one_rank_process_group(tmp_path_factory):
    """A one-rank gloo group in this process, for megatron-core's GPTModel and dist_checkpointing
    (a module asks for it with ``pytestmark = pytest.mark.usefixtures("one_rank_process_group")``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    own = not dist.is_initialized()
    if own:
        init_file = tmp_path_factory.mktemp("dist") / "init"
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    yield
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()
