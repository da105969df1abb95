"""torch.distributed's current names for the single-tensor all-gather and reduce-scatter.

torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to ``all_gather_single``
and ``reduce_scatter_single`` and warns (FutureWarning) at every call of the old names, which
flooded a user's log once per unit and micro-batch. The NGC containers' older torch has only the
old names, so these pick whichever exists."""

from __future__ import annotations

import torch.distributed as dist


def all_gather_single(output, input, group=None, async_op: bool = False):
    """Every rank's equal-sized ``input`` concatenated into ``output`` on every rank."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, group=None, async_op: bool = False):
    """``input`` (W equal slices) summed over the group; rank r keeps slice r in ``output``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)
