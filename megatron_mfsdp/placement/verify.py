"""Agreement checks across ranks, so that ranks that diverged fail loudly instead of
hanging in (or corrupting) a collective: the plan digest at start-up, and a
3-integer signature with every owner collective."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..compat.collectives import all_gather_single
from .layout import Plan

GATHER, REDUCE = 1, 2
_OP_NAMES = {GATHER: "gather", REDUCE: "reduce"}
ALGORITHM_STRIDE = 10  # a signature's op is GATHER or REDUCE + this x the algorithm's index (runtime/comm.py)


def _op_name(op: int) -> str:
    name = _OP_NAMES.get(op % ALGORITHM_STRIDE, str(op))
    return f"{name} (algorithm {op // ALGORITHM_STRIDE})" if op >= ALGORITHM_STRIDE else name


def verify_plan_agreement(plan: Plan, group) -> None:
    """Compare the plan digest across the group; raise naming the ranks that disagree."""
    if group is None or dist.get_world_size(group) == 1:
        return
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, plan.digest(), group=group)
    if len(set(digests)) != 1:
        by_digest: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            by_digest.setdefault(d, []).append(r)
        groups = "; ".join(f"ranks {ranks}: {d[:12]}" for d, ranks in by_digest.items())
        raise RuntimeError(
            "MatrixFSDP ranks computed different placement plans (different models, parameter "
            f"rules or planner settings per rank?): {groups}"
        )


class SignatureCheck:
    """A signature all-gather in flight; :meth:`verify` waits for it and raises on a mismatch."""

    def __init__(self, everyone: torch.Tensor, work, world: int):
        self._everyone, self._work, self._world = everyone, work, world

    def verify(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        rows = self._everyone.view(self._world, 3).tolist()
        if any(row != rows[0] for row in rows):
            described = ", ".join(
                f"rank {r}: {_op_name(op)} unit {u} ({n} elements)" for r, (u, op, n) in enumerate(rows)
            )
            raise RuntimeError(f"MatrixFSDP collective mismatch across the data-parallel group: {described}")


def start_signature(group, unit_index: int, op: int, numel: int, device=None) -> SignatureCheck:
    """Start all-gathering (unit, op, numel). Every rank issues exactly one per owner collective, all
    of the same size, so these all-gathers match even when the collectives they describe do not:
    verifying one before waiting for its collective raises instead of hanging, without making the
    collective wait for the check (a blocking check's cost: benchmarks/results/cpu_costs.md)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([unit_index, op, numel], dtype=torch.int64, device=device)
    everyone = torch.empty(world * 3, dtype=torch.int64, device=device)
    return SignatureCheck(everyone, all_gather_single(everyone, mine, group=group, async_op=True), world)


def check_signature(group, unit_index: int, op: int, numel: int, device=None) -> None:
    """All-gather (unit, op, numel) now and raise on any mismatch."""
    start_signature(group, unit_index, op, numel, device).verify()
