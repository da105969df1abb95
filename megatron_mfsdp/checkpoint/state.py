"""What a checkpoint holds besides weights and optimizer tensors, in tensor-only or plain form
(loading never unpickles arbitrary objects): the run's arguments as a dict of plain values,
random-number generator states as tensors, and Megatron-LM's common keys."""

from __future__ import annotations

import random

import numpy as np
import torch

CHECKPOINT_VERSION = 3.0  # Megatron-LM's torch_dist checkpoints (megatron/training/checkpointing.py)
_PLAIN = (bool, int, float, str, type(None))
_PER_RANK = ("rank", "local_rank", "notices")  # the common state is the same on every rank; notices
# are start-up messages, and the values they explain are saved themselves (muon_ns_dtype resolved)


def _plain(value):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
        return list(value)
    if isinstance(value, torch.dtype):
        return str(value)
    return None


def args_dict(args) -> dict:
    """The run's arguments with plain values (lists of plain values kept, dtypes as text); others dropped:
    the checkpoint's ``args`` entry, as Megatron-LM saves ``args`` in its checkpoints. It takes the
    argparse namespace below training/ because storing that namespace is its job (training/configs.py
    calls it when it builds a CheckpointSettings); nothing here reads a setting from it."""
    out = {}
    for key, value in sorted(vars(args).items()):
        if key in _PER_RANK:
            continue
        plain = _plain(value)
        if plain is not None or value is None:
            out[key] = plain
    return out


def rng_tensors() -> dict[str, torch.Tensor]:
    """This process's generator states as tensors: torch (CPU and CUDA), Python's random, numpy's."""
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "torch_cpu": torch.get_rng_state(),
        "python": torch.tensor([version, *state, 0 if gauss is None else 1], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_extra": torch.tensor([pos, has_gauss, cached], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_tensors(states: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`rng_tensors`."""
    torch.set_rng_state(states["torch_cpu"].to(torch.uint8))
    python = states["python"].tolist()
    gauss = states["python_gauss"].item() if python[-1] else None
    random.setstate((python[0], tuple(python[1:-1]), gauss))
    pos, has_gauss, cached = states["numpy_extra"].tolist()
    np.random.set_state(("MT19937", states["numpy"].numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    if "torch_cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["torch_cuda"].to(torch.uint8))
