"""Agreement checks across ranks, so that ranks that diverged fail loudly instead of
hanging in (or corrupting) a collective: the plan digest at start-up, and a
3-integer signature with every owner collective.

The signature is one MAX all-reduce of (unit, op, numel, -unit, -op, -numel): the ranks agree exactly
when the maxima equal the minima. An all-reduce of 48 bytes runs as NCCL's tree (about log2 W network
latencies, where an all-gather's ring takes W), so the check costs little at a thousand ranks; a
mismatch is reported as this rank's signature and the range over the group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import Plan

GATHER, REDUCE = 1, 2
_OP_NAMES = {GATHER: "gather", REDUCE: "reduce"}
ALGORITHM_STRIDE = 10  # a signature's op is GATHER or REDUCE + this x the algorithm's index (runtime/comm.py)


def _op_name(op: int) -> str:
    name = _OP_NAMES.get(op % ALGORITHM_STRIDE, str(op))
    return f"{name} (algorithm {op // ALGORITHM_STRIDE})" if op >= ALGORITHM_STRIDE else name


def verify_plan_agreement(plan: Plan, group) -> None:
    """Compare the plan's agreement digest (its layout and, once chosen, its collective algorithms)
    across the group; raise naming the ranks that disagree."""
    if group is None or dist.get_world_size(group) == 1:
        return
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, plan.agreement_digest(), group=group)
    if len(set(digests)) != 1:
        by_digest: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            by_digest.setdefault(d, []).append(r)
        groups = "; ".join(f"ranks {ranks}: {d[:12]}" for d, ranks in by_digest.items())
        raise RuntimeError(
            "MatrixFSDP ranks computed different placement plans or collective algorithms (different "
            f"models, parameter rules, planner or --mfsdp-collectives settings per rank?): {groups}"
        )


class SignatureCheck:
    """A signature all-reduce in flight; :meth:`verify` waits for it and raises on a mismatch."""

    def __init__(self, reduced: torch.Tensor, mine: list[int], rank: int, work):
        self._reduced, self._mine, self._rank, self._work = reduced, mine, rank, work

    def verify(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        values = self._reduced.tolist()
        top, low = values[:3], [-v for v in values[3:]]
        if top != low:
            u, op, n = self._mine
            ranges = ", ".join(f"{what} {a} to {b}" for what, a, b in zip(("units", "ops", "sizes"), low, top))
            raise RuntimeError(
                "MatrixFSDP collective mismatch across the data-parallel group: rank "
                f"{self._rank}: {_op_name(op)} unit {u} ({n} elements); over the group {ranges} (an op is "
                f"{', '.join(f'{k} {v}' for k, v in _OP_NAMES.items())}, + {ALGORITHM_STRIDE} x the algorithm)"
            )


def start_signature(group, unit_index: int, op: int, numel: int, device=None) -> SignatureCheck:
    """Start the MAX all-reduce of (unit, op, numel) and their negatives. Every rank issues exactly one per
    owner collective, all of the same size, so these match even when the collectives they describe do
    not: verifying one before waiting for its collective raises instead of hanging, without making the
    collective wait for the check (a blocking check's cost: benchmarks/results/cpu_costs.md)."""
    mine = [unit_index, op, numel]
    reduced = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=device)
    work = dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group, async_op=True)
    return SignatureCheck(reduced, mine, dist.get_rank(group), work)


def check_signature(group, unit_index: int, op: int, numel: int, device=None) -> None:
    """Compare (unit, op, numel) across the group now and raise on any mismatch."""
    start_signature(group, unit_index, op, numel, device).verify()
