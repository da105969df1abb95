"""The torch.distributed calls made in a block, each charged at the call site with the bytes it moves
in and out of this rank as NCCL's ring algorithms move them (traffic.py's table):
``with count_collectives() as calls: ...`` gives a :class:`CallLog`. The tests hold SegmentComm's
own counters and the start-up prediction against it (tests count collectives through
megatron_mfsdp.testing, which re-exports it); at_scale.py and tools/plan.py --traffic count the calls
of a unit operation on the fake backend with it."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .traffic import all_reduce_link, broadcast_link, reduce_link, slices_link

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "all_gather_object",
    "broadcast_object_list",
    "barrier",
    "all_reduce_coalesced",
)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group(kwargs, call_args, at: int):
    group = kwargs.get("group", call_args[at] if len(call_args) > at else None)
    return group if group is not None else dist.group.WORLD


def _root(kwargs, group, which: str) -> int:
    if kwargs.get(f"group_{which}") is not None:
        return kwargs[f"group_{which}"]
    return dist.get_group_rank(group, kwargs[which])


def _all_to_all(call_args, kwargs, rank, world) -> tuple[int, int]:
    out, inp = call_args[0], call_args[1]
    outs = kwargs.get("output_split_sizes") or (call_args[2] if len(call_args) > 2 else None)
    ins = kwargs.get("input_split_sizes") or (call_args[3] if len(call_args) > 3 else None)
    row_out, row_in = _nbytes(out) // max(1, out.numel()), _nbytes(inp) // max(1, inp.numel())
    outs = outs or [out.numel() // world] * world
    ins = ins or [inp.numel() // world] * world
    return (sum(outs) - outs[rank]) * row_out, (sum(ins) - ins[rank]) * row_in


def link_bytes(name: str, call_args: tuple, kwargs: dict) -> tuple[int, int]:
    """(bytes in, bytes out) of this rank for one call of ``name``; (0, 0) for what moves no tensor
    (object collectives, barriers) or for calls this table does not know."""
    if name in ("isend", "send", "irecv", "recv"):
        n = _nbytes(call_args[0])
        return (0, n) if name in ("isend", "send") else (n, 0)
    if name == "batch_isend_irecv":
        return tuple(map(sum, zip((0, 0), *(link_bytes(op.op.__name__, (op.tensor,), {}) for op in call_args[0]))))
    at = {"broadcast": 2, "reduce": 3, "all_reduce": 2, "all_to_all_single": 4}.get(name, 2)
    group = _group(kwargs, call_args, at)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if name == "broadcast":
        return broadcast_link(_nbytes(call_args[0]), rank, _root(kwargs, group, "src"), world)
    if name == "reduce":
        return reduce_link(_nbytes(call_args[0]), rank, _root(kwargs, group, "dst"), world)
    if name in ("all_gather_single", "all_gather_into_tensor"):
        return slices_link(_nbytes(call_args[1]), world)
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return slices_link(_nbytes(call_args[0]), world)
    if name == "all_reduce":
        return all_reduce_link(_nbytes(call_args[0]), world)
    if name == "all_to_all_single":
        return _all_to_all(call_args, kwargs, rank, world)
    return 0, 0


class Call(tuple):
    """One collective call: compares as ``(name, tensor elements)``, and also carries ``nbytes``
    (elements times element size, over every tensor argument), ``dtypes`` (in argument order) and
    ``link``: (bytes in, bytes out) of this rank as NCCL's ring algorithms move them (:func:`link_bytes`)."""

    def __new__(cls, name: str, numel: int, nbytes: int = 0, dtypes: tuple = (), link: tuple = (0, 0)):
        call = super().__new__(cls, (name, numel))
        call.nbytes, call.dtypes, call.link = nbytes, tuple(dtypes), tuple(link)
        return call

    def __reduce__(self):
        return Call, (self[0], self[1], self.nbytes, self.dtypes, self.link)

    @property
    def name(self) -> str:
        return self[0]


class CallLog(list):
    """A :class:`Call` (name, tensor elements; ``nbytes``, ``dtypes``) per collective call, in call order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.tensors: list[list[tuple[int, torch.dtype]]] = []  # per call: (elements, dtype) of each tensor

    def bytes_of(self, name: str, which=slice(None)) -> list[int]:
        """Per call of ``name``: bytes of its tensors (``which`` picks them: 0 = the first, an output)."""
        out = []
        for (n, _), tensors in zip(self, self.tensors):
            if n == name:
                picked = tensors[which] if isinstance(which, slice) else [tensors[which]]
                out.append(sum(k * dtype.itemsize for k, dtype in picked))
        return out

    def summary(self):
        """(number of calls other than barriers, {name: (calls, elements)})."""
        tensor_calls = [(n, k) for n, k in self if n != "barrier"]
        by_name = {}
        for n, k in tensor_calls:
            c, e = by_name.get(n, (0, 0))
            by_name[n] = (c + 1, e + k)
        return len(tensor_calls), by_name

    def bytes_by(self, name: str, dtype: torch.dtype | None = None) -> int:
        """Bytes passed to the calls of one collective, optionally only those whose tensors have ``dtype``."""
        return sum(c.nbytes for c in self if c[0] == name and (dtype is None or dtype in c.dtypes))

    def calls_of(self, name: str) -> int:
        """Number of calls of one collective."""
        return sum(1 for c in self if c[0] == name)


class count_collectives:
    """Record every torch.distributed collective made inside the block;
    ``with count_collectives() as calls: ...`` gives a :class:`CallLog`. A call that torch makes
    through another public one (``all_gather_into_tensor`` calls ``all_gather_single``) counts once."""

    def __enter__(self) -> CallLog:
        self.calls = CallLog()
        self._saved = {}
        depth = [0]
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            @functools.wraps(fn)
            def wrapper(*args, _name=name, _fn=fn, **kwargs):
                if depth[0]:
                    return _fn(*args, **kwargs)
                tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                numel = sum(t.numel() for t in tensors)
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                link = link_bytes(_name, args, kwargs)
                self.calls.append(Call(_name, numel, nbytes, tuple(t.dtype for t in tensors), link))
                self.calls.tensors.append([(t.numel(), t.dtype) for t in tensors])
                depth[0] += 1
                try:
                    return _fn(*args, **kwargs)
                finally:
                    depth[0] -= 1

            setattr(dist, name, wrapper)
        return self.calls

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        return False
