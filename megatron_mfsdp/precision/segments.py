"""Owner segments that hold FP8 matrices, as bytes.

A unit with FP8 matrices keeps, on each rank, one uint8 segment: the owner's matrices as
packed FP8 records (``fp8.to_uint8_bytes``: fp32 scale-inverses, then the e4m3 payload)
and its tail slice as the parameter dtype's bytes. ``UnitCodec.wire`` is the unit's layout
measured in bytes (a ``UnitLayout`` whose elements are bytes), so the communication layer
gathers a byte segment like any other and never sees FP8. The owner encodes its segment
from its fp32 masters after the step (``encode``); every rank decodes the gathered bytes
with the same elementwise arithmetic (``decode``), so all ranks compute with the owner's
quantized weight bit for bit. No amax leaves the owner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..placement.classes import WHOLE
from ..placement.layout import ParamSlot, UnitLayout
from .fp8 import (
    Fp8Config,
    Fp8Weight,
    check_shape,
    delayed_scale,
    dequantize,
    from_uint8_bytes,
    new_delayed_state,
    packed_nbytes,
    quantize,
    quantize_with_scale,
    record_amax,
    to_uint8_bytes,
    weight_amax,
)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def in_bf16_layers(global_name: str, num_layers: int, bf16_layers: tuple[int, int]) -> bool:
    """Whether a parameter sits in the first or last transformer layers kept in bf16
    (--first-last-layers-bf16 with --num-layers-at-start/end-in-bf16, global layer numbers, as
    megatron/core/fp8_utils.py: is_first_last_bf16_layer at core_v0.16.1)."""
    match = _LAYER.search(global_name)
    if match is None:
        return False
    layer, (start, end) = int(match.group(1)), bf16_layers
    return layer < start or layer >= num_layers - end


def fp8_slot_names(
    layout: UnitLayout, global_names: dict, num_layers: int, bf16_layers: tuple[int, int] = (0, 0)
) -> set[str]:
    """The unit's matrices stored in FP8: whole 2D matrices (one owner each) outside the bf16 layers."""
    return {
        s.name
        for s in layout.slots
        if s.storage == WHOLE
        and len(s.shape) == 2
        and not in_bf16_layers(global_names.get(s.name, s.name), num_layers, bf16_layers)
    }


@dataclass(frozen=True)
class ByteRecord:
    """Where one parameter's bytes lie in the unit's full byte buffer."""

    slot: ParamSlot
    offset: int
    nbytes: int
    fp8: bool


def new_fp8_state(config: Fp8Config, device=None) -> dict[str, torch.Tensor]:
    """Per-matrix state the optimizer keeps and checkpoints: for delayed scaling the amax history
    (``fp8.new_delayed_state``) and the scale the current payload was made with; else nothing."""
    if config.fp8_recipe != "delayed":
        return {}
    return {"delayed": new_delayed_state(config, device), "scale": torch.zeros(1, dtype=torch.float32, device=device)}


class UnitCodec:
    """The byte layout of one unit with FP8 matrices, and its encode and decode."""

    def __init__(self, layout: UnitLayout, rank: int, fp8_names: set[str], config: Fp8Config, dtype: torch.dtype):
        self.layout, self.rank, self.config, self.dtype = layout, rank, config, dtype
        self.elsize = torch.empty(0, dtype=dtype).element_size()
        self.records: dict[str, ByteRecord] = {}
        byte_at, offset = {}, 0
        for slot in sorted((s for s in layout.slots if s.storage == WHOLE), key=lambda s: s.offset):
            fp8 = slot.name in fp8_names
            if fp8:
                check_shape(slot.shape, config.fp8_recipe, slot.name)
            nbytes = packed_nbytes(slot.shape, config.fp8_recipe) if fp8 else slot.numel * self.elsize
            byte_at[slot.offset] = offset
            self.records[slot.name] = ByteRecord(slot, offset, nbytes, fp8)
            offset += nbytes
        byte_at[layout.matrix_numel] = offset
        for slot in layout.slots:
            if slot.storage != WHOLE:
                start = offset + (slot.offset - layout.matrix_numel) * self.elsize
                self.records[slot.name] = ByteRecord(slot, start, slot.numel * self.elsize, False)
        self.wire = UnitLayout(
            layout.index,
            layout.name,
            layout.world_size,
            [],
            offset,
            layout.tail_numel * self.elsize,
            [byte_at[b] for b in layout.matrix_bounds],
            [b * self.elsize for b in layout.tail_bounds],
        )

    @property
    def fp8_names(self) -> list[str]:
        return [name for name, rec in self.records.items() if rec.fp8]

    def segment_nbytes(self, rank: int | None = None) -> int:
        return self.wire.segment_numel(self.rank if rank is None else rank)

    def owned_matrices(self) -> list[ByteRecord]:
        """This rank's matrix records, in segment order."""
        lo, hi = self.wire.matrix_range(self.rank)
        return [r for r in self.records.values() if r.slot.storage == WHOLE and lo <= r.offset < hi]

    def owned_view(self, master: torch.Tensor, name: str) -> torch.Tensor:
        """One owned matrix's 2D view of this rank's element-layout (master) segment."""
        slot = self.records[name].slot
        start = slot.offset - self.layout.matrix_range(self.rank)[0]
        return master[start : start + slot.numel].view(slot.shape)

    def quantize(self, name: str, master: torch.Tensor, state: dict, advance: bool) -> Fp8Weight:
        """One owned matrix from its fp32 master. Delayed scaling uses the scale its state holds;
        ``advance`` (after an optimizer step) takes the next scale and records this amax, while a
        re-derivation (after a load) reuses the scale the payload was made with."""
        if self.config.fp8_recipe != "delayed":
            return quantize(master, self.config, name=name)
        if advance or not bool(state["scale"].ne(0).all()):
            state["scale"].copy_(delayed_scale(master, self.config, state["delayed"]))
            if advance:
                record_amax(state["delayed"], weight_amax(master).to(state["delayed"].device), self.config)
        return quantize_with_scale(master, state["scale"], "delayed")

    @torch.no_grad()
    def encode(self, segment: torch.Tensor, master: torch.Tensor, states: dict, advance: bool) -> dict:
        """Write this rank's byte segment from its fp32 master segment (element layout); return the
        FP8 weights made, by name. ``states`` maps each FP8 matrix to its ``new_fp8_state``."""
        (m0, _), (w0, w1) = self.layout.matrix_range(self.rank), self.wire.matrix_range(self.rank)
        made = {}
        for rec in self.owned_matrices():
            value = self.owned_view(master, rec.slot.name)
            out = segment[rec.offset - w0 : rec.offset - w0 + rec.nbytes]
            if rec.fp8:
                made[rec.slot.name] = self.quantize(rec.slot.name, value, states.get(rec.slot.name, {}), advance)
                out.copy_(to_uint8_bytes(made[rec.slot.name]))
            else:
                out.copy_(value.reshape(-1).to(self.dtype).view(torch.uint8))
        m_elems = self.layout.matrix_range(self.rank)[1] - m0
        segment[w1 - w0 :].copy_(master[m_elems:].to(self.dtype).view(torch.uint8))
        return made

    def _raw(self, full: torch.Tensor, rec: ByteRecord) -> torch.Tensor:
        piece = full[rec.offset : rec.offset + rec.nbytes]
        if rec.offset % self.elsize:  # a view needs an aligned start; an odd-sized FP8 record before it
            piece = piece.clone()
        return piece.view(self.dtype).view(rec.slot.shape)

    def weight(self, full: torch.Tensor, name: str) -> Fp8Weight:
        """The FP8 weight of one matrix in the gathered byte buffer (payload viewed, scales copied)."""
        rec = self.records[name]
        return from_uint8_bytes(full[rec.offset : rec.offset + rec.nbytes], rec.slot.shape, self.config.fp8_recipe)

    def owned_weight(self, segment: torch.Tensor, name: str) -> Fp8Weight:
        """The FP8 weight of one owned matrix, read from this rank's own byte segment (no gather)."""
        rec, w0 = self.records[name], self.wire.matrix_range(self.rank)[0]
        piece = segment[rec.offset - w0 : rec.offset - w0 + rec.nbytes]
        return from_uint8_bytes(piece, rec.slot.shape, self.config.fp8_recipe)

    def decode(self, full: torch.Tensor, materialize=None) -> dict[str, torch.Tensor]:
        """Every parameter of the unit from its gathered bytes: FP8 matrices dequantized to the
        compute dtype (or ``materialize(fp8_weight, dtype)``, e.g. TE's FP8 tensor), the rest as views."""
        out = {}
        for name, rec in self.records.items():
            if rec.fp8:
                weight = self.weight(full, name)
                out[name] = dequantize(weight, self.dtype) if materialize is None else materialize(weight, self.dtype)
            else:
                out[name] = self._raw(full, rec)
        return out

    def decode_flat(self, full: torch.Tensor) -> torch.Tensor:
        """The unit's flat buffer in the parameter dtype (element layout), as every rank computes with."""
        flat = torch.empty(self.layout.numel, dtype=self.dtype, device=full.device)
        for name, value in self.decode(full).items():
            slot = self.records[name].slot
            flat[slot.offset : slot.offset + slot.numel].copy_(value.reshape(-1))
        return flat
