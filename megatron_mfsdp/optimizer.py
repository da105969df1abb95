"""MatrixFSDPOptimizer: megatron-core's MegatronOptimizer interface over the
owner-sharded segments of :class:`~megatron_mfsdp.runtime.MatrixFSDP` chunks.

Every rank already holds, after the backward pass, the reduced gradient of
exactly what it owns: whole Muon matrices and an even slice of the AdamW tail.
So the step is local. The only collective is one all-reduce of two scalars
(squared grad norm, zero count) that loss scaling's inf/nan check, global
grad-norm clipping and logging need; no tensor data moves. (With tensor
parallelism and ``muon_tp_mode`` 'duplicated' or 'distributed', owners of a TP
shard also talk to their TP group: see tp_muon.py.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.optimizer import MegatronOptimizer

from .config import MatrixFSDPOptimizerConfig
from .cpu_compat import cuda_on_cpu
from .tp_muon import tp_muon_step_
from .model import global_parameter_names
from .placement import MUON, qkv_block_rows
from .runtime import MatrixFSDP

_NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class OwnedPiece:
    """One parameter's part in this rank's segment, with its optimizer state.
    For a Muon matrix the part is the whole matrix (views are 2D)."""

    name: str  # the parameter's name in its model chunk
    global_name: str  # its name in the unsplit model: unique across virtual and pipeline stages
    param_numel: int  # elements of the whole (TP-local) parameter
    param_offset: int
    master: torch.Tensor  # fp32, a view into the master segment
    grad: torch.Tensor  # fp32, a view into the gradient segment
    state: Dict[str, torch.Tensor] = field(default_factory=dict)
    qkv_rows: Optional[Tuple[int, int, int]] = None
    partition_dim: Optional[int] = None  # TP split dimension, None if not TP-sharded
    in_grad_norm: bool = True  # False for TP duplicates off TP rank 0, replicas, shared copies

    @property
    def key(self) -> str:
        return f"{self.global_name}@{self.param_offset}"


class _ShardOptimizerState:
    """Stands where megatron's wrappers keep a torch optimizer: exposes
    ``param_groups`` (driven by OptimizerParamScheduler) and ``state``."""

    def __init__(self, param_groups):
        self.param_groups = param_groups
        self.state: Dict[str, Dict[str, torch.Tensor]] = {}


def _no_weight_decay(name: str, shape) -> bool:
    """megatron-core's default: biases and 1D parameters (norms) take no weight decay."""
    return name.endswith(".bias") or len(shape) == 1


class MatrixFSDPOptimizer(MegatronOptimizer):
    """Muon on owned matrices and AdamW on owned tail slices, with fp32 masters,
    global grad-norm clipping and fp16 loss scaling."""

    def __init__(self, config: MatrixFSDPOptimizerConfig, model_chunks: List[MatrixFSDP],
                 grad_stats_group=None, tp_group=None):
        self.model_chunks = model_chunks
        # Norms and inf checks span every rank that holds distinct gradient elements
        # (DP shards, TP, PP); duplicates are excluded per piece below.
        self.grad_stats_parallel_group = grad_stats_group or dist.group.WORLD
        self.tp_group = tp_group if tp_group is not None else model_chunks[0].tp_group
        tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        self.step_count = 0
        groups = {
            kind_wd: {"params": [], "optimizer": kind_wd[0], "wd_mult": kind_wd[1], "lr_mult": 1.0,
                      "lr": config.lr, "max_lr": config.lr, "min_lr": config.min_lr,
                      "weight_decay": config.weight_decay * kind_wd[1], "is_decoupled_lr": False,
                      "default_config": True}
            for kind_wd in (("muon", 1.0), ("adamw", 1.0), ("adamw", 0.0))
        }
        self._masters: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (model segment, fp32 master)
        for chunk in model_chunks:
            global_names = global_parameter_names(chunk.module)
            qkv_rows = qkv_block_rows(chunk.config) if config.muon_split_qkv else None
            primary_replica = chunk.replica_group is None or dist.get_rank(chunk.replica_group) == 0
            for unit in chunk.units:
                params = {slot.name: p for slot, p in unit.params}
                master = unit.param_segment if unit.param_segment.dtype == torch.float32 \
                    else unit.param_segment.float()
                self._masters.append((unit.param_segment, master))
                for piece in unit.pieces:
                    slot = piece.slot
                    seg = slice(piece.segment_offset, piece.segment_offset + piece.numel)
                    muon = slot.kind == MUON and config.optimizer == "muon"
                    shape = slot.shape if muon else (piece.numel,)
                    param = params[slot.name]
                    tp_split = bool(getattr(param, "tensor_model_parallel", False))
                    if muon and tp_split and config.muon_tp_mode != "blockwise" \
                            and getattr(param, "partition_dim", None) not in (0, 1):
                        raise ValueError(f"--muon-tp-mode {config.muon_tp_mode}: {slot.name} is tensor-parallel "
                                         "but its split dimension (partition_dim) is unknown; use blockwise")
                    owned = OwnedPiece(slot.name, global_names[slot.name], slot.numel, piece.param_offset,
                                       master[seg].view(shape),
                                       unit.grad_segment[seg].view(shape),
                                       partition_dim=getattr(param, "partition_dim", 0) if tp_split else None,
                                       in_grad_norm=primary_replica and (tp_split or tp_rank == 0)
                                       and not getattr(param, "shared", False))
                    if muon:
                        owned.state["momentum_buffer"] = torch.zeros_like(owned.master)
                        if slot.name.endswith("linear_qkv.weight"):
                            owned.qkv_rows = qkv_rows
                        key = ("muon", 1.0)
                    else:
                        owned.state["exp_avg"] = torch.zeros_like(owned.master)
                        owned.state["exp_avg_sq"] = torch.zeros_like(owned.master)
                        key = ("adamw", 0.0 if _no_weight_decay(slot.name, slot.shape) else 1.0)
                    groups[key]["params"].append(owned)
        holder = _ShardOptimizerState(list(groups.values()))
        for group in holder.param_groups:
            for owned in group["params"]:
                holder.state[owned.key] = owned.state
        super().__init__(holder, config)
        self.is_stub_optimizer = False
        self.grad_scaler = None
        if config.fp16:
            from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

            with cuda_on_cpu():
                self.grad_scaler = ConstantGradScaler(config.loss_scale) if config.loss_scale else \
                    DynamicGradScaler(initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                                      growth_factor=2.0, backoff_factor=0.5,
                                      growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)

    # ------------------------------------------------------------- helpers
    def _pieces(self):
        for group in self.optimizer.param_groups:
            for owned in group["params"]:
                yield group, owned

    def _grad_segments(self):
        for chunk in self.model_chunks:
            for unit in chunk.units:
                yield unit.grad_segment

    @torch.no_grad()
    def _grad_stats(self) -> Tuple[bool, float, Optional[float]]:
        """(found inf/nan, global grad norm, zero count or None) with one scalar all-reduce.

        Squares of fp32 values cannot overflow in fp64, so a non-finite sum of squares
        means a non-finite gradient: no separate isfinite pass. Zeros are counted only
        when megatron's ``log_num_zeros_in_grad`` asks for them."""
        count_zeros = self.config.log_num_zeros_in_grad
        local = torch.zeros(2, dtype=torch.float64, device=self.model_chunks[0].device)
        for _, owned in self._pieces():
            if owned.in_grad_norm:
                local[0] += torch.linalg.vector_norm(owned.grad, dtype=torch.float64).square()
                if count_zeros:
                    local[1] += owned.grad.numel() - torch.count_nonzero(owned.grad)
        if dist.get_world_size(self.grad_stats_parallel_group) > 1:
            dist.all_reduce(local, group=self.grad_stats_parallel_group)
        sumsq = local[0].item()
        return not math.isfinite(sumsq), math.sqrt(sumsq), local[1].item() if count_zeros else None

    # ---------------------------------------------------- MegatronOptimizer
    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler is None:
            return torch.tensor([1.0], device=self.model_chunks[0].device)
        return self.grad_scaler.scale

    def prepare_grads(self) -> bool:
        """Unscale gradients (fp16); return whether any rank found inf/nan."""
        if self.grad_scaler is not None:
            inv = self.grad_scaler.inv_scale.item()
            for grad in self._grad_segments():
                grad.mul_(inv)
        found_inf, self._last_norm, self._last_zeros = self._grad_stats()
        return found_inf

    def get_grad_norm(self):
        """The norm computed by the last ``prepare_grads`` (no second all-reduce)."""
        return self._last_norm

    def count_zeros(self) -> float:
        return self._last_zeros

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.step_count += 1
        cfg = self.config
        ns_dtype = _NS_DTYPES[cfg.muon_ns_dtype]
        beta1, beta2 = cfg.adam_beta1, cfg.adam_beta2
        bias1, bias2 = 1 - beta1 ** self.step_count, 1 - beta2 ** self.step_count
        for group, owned in self._pieces():
            lr, wd = group["lr"], group["weight_decay"]
            if group["optimizer"] == "muon":
                tp_muon_step_(owned.master, owned.grad, owned.state["momentum_buffer"], mode=cfg.muon_tp_mode,
                              tp_group=self.tp_group, partition_dim=owned.partition_dim, lr=lr, weight_decay=wd,
                              momentum=cfg.muon_momentum, nesterov=cfg.muon_use_nesterov,
                              ns_steps=cfg.muon_num_ns_steps, coefficients=cfg.muon_coefficients,
                              ns_dtype=ns_dtype, scale_mode=cfg.muon_scale_mode,
                              extra_scale_factor=cfg.muon_extra_scale_factor, qkv_split_shapes=owned.qkv_rows)
            else:
                adamw_step_(owned.master, owned.grad, owned.state["exp_avg"], owned.state["exp_avg_sq"],
                            lr=lr, weight_decay=wd, beta1=beta1, beta2=beta2, eps=cfg.adam_eps,
                            bias_correction1=bias1, bias_correction2=bias2)
        for model_segment, master in self._masters:
            if model_segment is not master:
                model_segment.copy_(master)
        return True

    @torch.no_grad()
    def step(self):
        """Returns (success, grad norm, zero count), as megatron-core's optimizers do."""
        found_inf = self.prepare_grads()
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
        if found_inf:
            return False, None, None
        grad_norm = self._last_norm
        if self.config.clip_grad > 0:
            coeff = self.config.clip_grad / (grad_norm + 1.0e-6)
            if coeff < 1.0:
                for grad in self._grad_segments():
                    grad.mul_(coeff)
        success = self.step_with_ready_grads()
        return success, grad_norm, self._last_zeros

    def zero_grad(self, set_to_none: bool = True):
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()

    def reload_model_params(self, state_dict=None):
        """Refresh fp32 masters from the model's segments (after loading weights)."""
        for model_segment, master in self._masters:
            if model_segment is not master:
                master.copy_(model_segment)

    def _layout_digest(self) -> List[str]:
        return [chunk.plan.digest() for chunk in self.model_chunks]

    def state_dict(self):
        """This rank's optimizer state: masters and moments of the pieces it owns,
        keyed by global parameter name and offset, plus the layout digest they belong to."""
        return {
            "layout_digest": self._layout_digest(),
            "step": self.step_count,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "master": {owned.key: owned.master.clone() for _, owned in self._pieces()},
            "state": {key: {k: v.clone() for k, v in st.items()} for key, st in self.optimizer.state.items()},
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        if state_dict["layout_digest"] != self._layout_digest():
            raise ValueError("optimizer checkpoint was saved with a different MatrixFSDP layout "
                             "(DP size, planner or model); resharding is not supported by this format")
        self.step_count = state_dict["step"]
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update(saved)
        for _, owned in self._pieces():
            owned.master.copy_(state_dict["master"][owned.key])
            for k, v in state_dict["state"][owned.key].items():
                owned.state[k].copy_(v)
        for model_segment, master in self._masters:
            if model_segment is not master:
                model_segment.copy_(master)
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            with cuda_on_cpu():
                self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False, metadata=None):
        """Optimizer state as megatron-core dist_checkpointing ShardedTensors.

        Each global parameter's master and moments are saved as a flat 1-D tensor of its
        full numel; every owned piece is the uneven shard ``[param_offset, +numel)`` of it
        (no regular grid: coverage is checked by DCP). Keys hold global names, so a load
        at another DP size reads the same tensors with different offsets. Loading fills
        the tensors of this dict in place; call ``reload_model_params``-like syncs after."""
        from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

        sharded = {}
        for _, owned in self._pieces():
            for tag, tensor in [("master", owned.master)] + sorted(owned.state.items()):
                flat = tensor.view(-1)
                sharded[f"{tag}.{owned.key}"] = ShardedTensor(
                    key=f"optimizer.{tag}.{owned.global_name}", data=flat, dtype=flat.dtype,
                    local_shape=(flat.numel(),), global_shape=(owned.param_numel,),
                    global_offset=(owned.param_offset,), axis_fragmentations=None)
        sharded["step"] = ShardedObject("optimizer.step", self.step_count, (1,), (0,),
                                        replica_id=dist.get_rank())
        return sharded

    def load_sharded_state_dict(self, loaded) -> None:
        """Apply what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict`."""
        with torch.no_grad():
            for _, owned in self._pieces():
                for tag, tensor in [("master", owned.master)] + sorted(owned.state.items()):
                    value = loaded[f"{tag}.{owned.key}"]
                    if value.data_ptr() != tensor.data_ptr():
                        tensor.view(-1).copy_(value)
            for model_segment, master in self._masters:
                if model_segment is not master:
                    model_segment.copy_(master)
        self.step_count = loaded["step"]

    def local_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds for the optimizer (masters beyond fp32 params, states)."""
        masters = sum(m.numel() * 4 for seg, m in self._masters if seg is not m)
        states = sum(t.numel() * t.element_size() for st in self.optimizer.state.values() for t in st.values())
        return {"masters": masters, "optimizer_state": states}


@torch.no_grad()
def adamw_step_(param, grad, exp_avg, exp_avg_sq, *, lr: float, weight_decay: float, beta1: float,
                beta2: float, eps: float, bias_correction1: float, bias_correction2: float) -> None:
    """Decoupled-weight-decay Adam, elementwise and in place: the same numbers on a
    slice as on the whole tensor, so an evenly sharded tail matches a single device."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def get_megatron_optimizer(config: MatrixFSDPOptimizerConfig, model_chunks: List[MatrixFSDP],
                           grad_stats_group=None, tp_group=None) -> MatrixFSDPOptimizer:
    """Mirror of megatron-core's ``get_megatron_optimizer(config, model_chunks)`` for
    MatrixFSDP-wrapped chunks."""
    for chunk in model_chunks:
        if not isinstance(chunk, MatrixFSDP):
            raise TypeError(f"model chunk {type(chunk).__name__} is not wrapped in MatrixFSDP")
        if chunk.ddp_config.muon_split_qkv != config.muon_split_qkv:
            raise ValueError("--muon-split-qkv must be the same for the planner and the optimizer")
    return MatrixFSDPOptimizer(config, model_chunks, grad_stats_group, tp_group)
