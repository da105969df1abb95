"""MatrixFSDPOptimizer: megatron-core's MegatronOptimizer interface over the
owner-sharded segments of MatrixFSDP chunks.

Every rank already holds, after the backward pass, the reduced gradient of exactly
what it owns: whole matrices and an even slice of the tail. So the step is local:
the shell keeps fp32 masters, computes gradient statistics (one all-reduce of two
scalars: squared norm and zero count, which loss scaling's inf/nan check, clipping
and logging need), clips, and hands each owned piece to its update rule from
``registry.py``. No tensor data moves (with tensor parallelism and a matrix rule's TP
mode 'duplicated' or 'distributed', owners of a TP shard also talk to their TP group:
see matrix.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig

from ..compat.cpu import cuda_on_cpu
from ..groups import group_rank, group_size
from ..placement.classes import MATRIX, WHOLE
from ..precision import new_fp8_state, quantization_error
from ..profiling import OPTIMIZER_STEP, RULE, profile_range
from . import registry
from .rule import GroupMatrix, OwnedPiece, StepContext, UpdateRule, never


class _ShardOptimizerState:
    """Stands where megatron's wrappers keep a torch optimizer: exposes
    ``param_groups`` (driven by OptimizerParamScheduler) and ``state``."""

    def __init__(self, param_groups):
        self.param_groups = param_groups
        self.state: dict[str, dict[str, torch.Tensor]] = {}


def _global_slot_name(chunk, slot) -> str:
    """A slot's name in the unsplit model: its parameter's global name (with the block's suffix)."""
    return chunk.global_names[slot.param_name] + slot.name[len(slot.param_name) :]


def no_weight_decay(name: str, shape) -> bool:
    """megatron-core's default: biases and 1D parameters (norms) take no weight decay."""
    return name.endswith(".bias") or len(shape) == 1


class _Fp8Unit:
    """A unit whose segment holds FP8 matrices as bytes: its fp32 master segment (element layout),
    the per-matrix FP8 state (delayed scaling's history and scale) and the optimizer keys."""

    def __init__(self, unit, master: torch.Tensor, config):
        self.codec, self.segment, self.master, self.config = unit.codec, unit.param_segment, master, config
        self.keys: dict[str, str] = {}  # FP8 matrix name -> its OwnedPiece key
        self.states: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, key: str) -> None:
        self.keys[name] = key
        self.states[name] = new_fp8_state(self.config, self.master.device)

    def encode(self, advance: bool) -> dict:
        return self.codec.encode(self.segment, self.master, self.states, advance)


NORM_ROW = 4096


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """sum(t * t) as an fp64 scalar without casting ``t``: fp32 norms of rows of NORM_ROW elements,
    squared and summed in fp64. Casting the tensor to fp64 first copies it whole (the two timed:
    benchmarks/bench_optimizer_step.py --grad-norm); one fp32 norm over all of it drifts by more
    than fp32 rounding on a large tensor, the rows do not (tests/unit/test_grad_norm_sum.py)."""
    flat = t.reshape(-1)
    whole = flat.numel() // NORM_ROW * NORM_ROW
    total = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), dim=1).double().square().sum()
    if whole < flat.numel():
        total = total + torch.linalg.vector_norm(flat[whole:], dtype=torch.float64).square()
    return total


class MatrixFSDPOptimizer(MegatronOptimizer):
    """fp32 masters, global grad-norm clipping and fp16 loss scaling around the update
    rules of the pieces this rank owns."""

    def __init__(self, config: OptimizerConfig, model_chunks: list):
        """``config`` is a MatrixFSDPOptimizerConfig (megatron's OptimizerConfig plus ours)."""
        self.model_chunks = model_chunks
        self._config = config  # the rules read it before MegatronOptimizer keeps it as self.config
        groups = model_chunks[0].groups
        # Norms and inf checks span every rank that holds distinct gradient elements
        # (DP shards, TP, PP); duplicates are excluded per piece.
        self.grad_stats_parallel_group = groups.grad_stats or dist.group.WORLD
        self.tp_group = groups.tp
        self.step_count = 0
        self._masters: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model segment, fp32 master)
        self._fp8_units: list[_Fp8Unit] = []  # units whose matrices the owner quantizes (precision/)
        self.fp8_track_error = False  # set before a step to measure FP8 rounding against the update
        self.fp8_errors: dict[str, float] = {}
        self.after_rules = None  # called with this optimizer after the rules' step, before the weights follow
        self._rules = {  # the rule that steps each placement class, resolved once per layout (registry.rule_set)
            layout: registry.rule_set((), config, layout) for layout in {c.ddp_config.layout for c in model_chunks}
        }
        param_groups = self._param_groups(config)
        for chunk in model_chunks:
            self._add_pieces(config, chunk, param_groups)
        self._matrices = self._group_matrices(config, param_groups)
        holder = _ShardOptimizerState(list(param_groups.values()))
        for group in holder.param_groups:
            for owned in group["params"]:
                holder.state[owned.key] = owned.state
        super().__init__(holder, config)
        self.is_stub_optimizer = False
        self.grad_scaler = self._grad_scaler(config)
        self.rederive_fp8_payload(first=True)

    # ------------------------------------------------------------- set-up
    def _rule_of(self, chunk, slot) -> UpdateRule:
        rules = self._rules[chunk.ddp_config.layout]
        if rules.storage(slot.rule) != slot.storage:
            raise ValueError(
                f"{slot.name}: MatrixFSDP placed it as {slot.storage}, but --optimizer {self._config.optimizer} "
                f"steps its class {slot.rule!r} as {rules.storage(slot.rule)}: build MatrixFSDPConfig's rules from "
                "this optimizer config (registry.rule_set)"
            )
        return registry.get(rules.update_rule(slot.rule))

    def _group_key(self, config, chunk, slot, param) -> tuple[str, float, bool]:
        """(update rule, weight-decay multiplier, decoupled lr): megatron-core's grouping, where biases
        and 1D parameters take no weight decay and, with --decoupled-lr, the input and output
        embeddings take their own lr."""
        wd_mult = 0.0 if no_weight_decay(slot.name, slot.shape) else 1.0
        decoupled = config.decoupled_lr is not None and getattr(param, "is_embedding_or_output_parameter", False)
        return self._rule_of(chunk, slot).name, wd_mult, bool(decoupled)

    def _param_groups(self, config) -> dict[tuple, dict]:
        """One lr/wd group per key used anywhere in the plan, so every rank has the same groups,
        even one that owns nothing."""
        keys = {
            self._group_key(config, chunk, slot, param)
            for chunk in self.model_chunks
            for unit in chunk.units
            for slot, param in unit.params
        }
        groups = {}
        for rule, wd_mult, decoupled in sorted(keys, key=lambda k: (registry.order(k[0]), -k[1], k[2])):
            lr = config.decoupled_lr if decoupled else config.lr
            min_lr = config.decoupled_min_lr if decoupled and config.decoupled_min_lr is not None else config.min_lr
            groups[(rule, wd_mult, decoupled)] = {
                "params": [],
                "optimizer": rule,
                "wd_mult": wd_mult,
                "lr_mult": 1.0,
                "lr": lr,
                "max_lr": lr,
                "min_lr": min_lr,
                "weight_decay": config.weight_decay * wd_mult,
                "is_decoupled_lr": decoupled,
                "default_config": not decoupled,
            }
        return groups

    def _group_matrices(self, config, param_groups) -> list[dict[str, list[GroupMatrix]]]:
        """Per lr group (in order), per shard domain ("dense", then "expert" where there is one), every
        rank's parameters of it with their per-rank bounds over that domain's shard group: what a rule
        that rebuilds whole matrices over the group needs (StepContext.matrices)."""
        domains = dict.fromkeys(name for chunk in self.model_chunks for name in chunk.domains)  # some lack experts
        members = {key: {name: [] for name in domains} for key in param_groups}
        for chunk in self.model_chunks:
            for unit in chunk.units:
                for slot, param in unit.params:
                    bounds = tuple(unit.layout.param_bounds(slot))
                    matrix = GroupMatrix(_global_slot_name(chunk, slot), tuple(slot.shape), slot.split_rows, bounds)
                    members[self._group_key(config, chunk, slot, param)][unit.domain.name].append(matrix)
        return list(members.values())

    def _add_pieces(self, config, chunk, param_groups) -> None:
        for unit in chunk.units:
            shard_rank, primary_replica = unit.domain.dp_rank, unit.domain.replica_rank == 0  # its shard domain's
            tp_group = unit.domain.tp  # TP for dense matrices, expert TP for experts
            tp_rank = group_rank(tp_group)
            master = self._seed_master(unit, chunk)
            for piece in unit.pieces:
                slot, param = piece.slot, unit.by_name[piece.slot.param_name]
                rule = self._rule_of(chunk, slot)
                seg = slice(piece.segment_offset, piece.segment_offset + piece.numel)
                shape = slot.shape if rule.storage == WHOLE else (piece.numel,)
                tp_split = bool(getattr(param, "tensor_model_parallel", False))
                tp = (group_size(tp_group), tp_rank) if tp_split else (1, 0)
                owned = OwnedPiece(
                    slot.name,
                    chunk.global_names[slot.param_name],
                    rule.name,
                    math.prod(unit.shapes[slot.param_name]),
                    piece.param_offset,
                    master[seg].view(shape),
                    unit.grad_segment[seg].view(shape),
                    split_rows=slot.split_rows if rule.splits_qkv(config) else None,
                    partition_dim=getattr(param, "partition_dim", 0) if tp_split else None,
                    in_grad_norm=primary_replica and (tp_split or tp_rank == 0) and not getattr(param, "shared", False),
                    tp_size=tp[0],
                    tp_rank=tp[1],
                    tp_group=tp_group if tp[0] > 1 else None,
                    state_over_tp=tp_split and tp[0] > 1 and rule.state_over_tp(config),
                    param_shape=tuple(slot.shape),
                    state_replica=_state_replica(unit.layout.param_bounds(slot), shard_rank),
                    runs=piece.runs(),
                )
                owned.state = rule.init_state(owned, rule.settings_in(config))
                if rule.check is not None:
                    rule.check(owned, config)
                param_groups[self._group_key(config, chunk, slot, param)]["params"].append(owned)
                if unit.codec is not None and unit.codec.records[slot.name].fp8 and rule.storage == WHOLE:
                    self._fp8_units[-1].add(slot.name, owned.key)

    def _seed_master(self, unit, chunk) -> torch.Tensor:
        """The fp32 master of a unit's segment: the segment itself for fp32 parameters, else a copy;
        a unit with FP8 matrices seeds it from its high-precision initial weights, never from FP8."""
        if unit.codec is None:
            master = unit.param_segment if unit.param_segment.dtype == torch.float32 else unit.param_segment.float()
            self._masters.append((unit.param_segment, master))
            return master
        if unit.initial_values is None:
            raise RuntimeError(
                f"unit {unit.layout.name}: its FP8 weights already seeded an optimizer's fp32 masters; build "
                "one MatrixFSDPOptimizer per MatrixFSDP chunk (masters are never seeded from FP8)"
            )
        master = unit.initial_values.float().clone()
        unit.initial_values = None  # the masters hold the weights from here on
        self._fp8_units.append(_Fp8Unit(unit, master, chunk.ddp_config.fp8))
        return master

    @staticmethod
    def _grad_scaler(config):
        if not config.fp16:
            return None
        from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

        with cuda_on_cpu():
            if config.loss_scale:
                return ConstantGradScaler(config.loss_scale)
            return DynamicGradScaler(
                initial_scale=config.initial_loss_scale,
                min_scale=config.min_loss_scale,
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=config.loss_scale_window,
                hysteresis=config.hysteresis,
            )

    # ------------------------------------------------------------- helpers
    def _pieces(self):
        for group in self.optimizer.param_groups:
            for owned in group["params"]:
                yield group, owned

    def owned_pieces(self) -> list[OwnedPiece]:
        """Every piece this rank owns, in step order."""
        return [owned for _, owned in self._pieces()]

    def _grad_segments(self):
        for chunk in self.model_chunks:
            for unit in chunk.units:
                yield unit.grad_segment

    def _sync_model_from_masters(self, after_step: bool = False, before=None) -> None:
        for model_segment, master in self._masters:
            if model_segment is not master:
                model_segment.copy_(master)
        if after_step:
            self._quantize_after_step(before)
        else:
            self.rederive_fp8_payload()

    @torch.no_grad()
    def rederive_fp8_payload(self, first: bool = False) -> None:
        """Rewrite every FP8 segment (payload, scale-inverses, tail bytes) from the fp32 masters, as a
        checkpoint load must: the payload is never saved. Delayed scaling reuses the scale each payload
        was made with (saved with the optimizer state), so the bytes equal those before the save.
        ``first`` (at construction) is the first quantization: delayed scaling records its amax."""
        for unit in self._fp8_units:
            unit.encode(advance=first)

    def fp8_matrices(self):
        """(piece key, fp32 master view, current FP8 weight) of every FP8 matrix this rank owns."""
        for unit in self._fp8_units:
            for name, key in unit.keys.items():
                yield key, unit.codec.owned_view(unit.master, name), unit.codec.owned_weight(unit.segment, name)

    def _quantize_after_step(self, before) -> None:
        """The owner quantizes its updated matrices from the fp32 masters (no collective); given the
        masters ``before`` the step, it also measures ||Q(W) - W|| / ||update|| per matrix."""
        for i, unit in enumerate(self._fp8_units):
            made = unit.encode(advance=True)
            if before is None:
                continue
            for name, weight in made.items():
                master = unit.codec.owned_view(unit.master, name)
                update = master - unit.codec.owned_view(before[i], name)
                self.fp8_errors[unit.keys[name]] = quantization_error(master, weight, update).item()

    @torch.no_grad()
    def _grad_stats(self) -> tuple[bool, float, float | None]:
        """(found inf/nan, global grad norm, zero count or None) with one scalar all-reduce.

        A non-finite gradient makes the sum of squares non-finite (so does a row of 4096 whose
        fp32 norm overflows, which needs elements beyond about 3e17): no separate isfinite pass.
        Zeros are counted only when megatron's ``log_num_zeros_in_grad`` asks for them."""
        count_zeros = self.config.log_num_zeros_in_grad
        local = torch.zeros(2, dtype=torch.float64, device=self.model_chunks[0].device)
        for _, owned in self._pieces():
            if owned.in_grad_norm:
                local[0] += sum_of_squares(owned.grad)
                if count_zeros:
                    local[1] += owned.grad.numel() - torch.count_nonzero(owned.grad)
        if dist.get_world_size(self.grad_stats_parallel_group) > 1:
            dist.all_reduce(local, group=self.grad_stats_parallel_group)
        sumsq = local[0].item()
        return not math.isfinite(sumsq), math.sqrt(sumsq), local[1].item() if count_zeros else None

    @torch.no_grad()
    def params_norm(self) -> float:
        """L2 norm of the weights (the owners' fp32 masters), each element counted once."""
        local = torch.zeros(1, dtype=torch.float64, device=self.model_chunks[0].device)
        for _, owned in self._pieces():
            if owned.in_grad_norm:
                local += sum_of_squares(owned.master)
        if dist.get_world_size(self.grad_stats_parallel_group) > 1:
            dist.all_reduce(local, group=self.grad_stats_parallel_group)
        return math.sqrt(local.item())

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
        before = [u.master.clone() for u in self._fp8_units] if self.fp8_track_error else None
        for group, matrices in zip(self.optimizer.param_groups, self._matrices):
            rule = registry.get(group["optimizer"])
            if not (group["params"] or rule.collective):
                continue
            with profile_range(RULE.format(rule.name)):
                for params, ctx in self._step_calls(group, matrices, rule):
                    rule.step(params, ctx)
        if self.after_rules is not None:  # QK-clip (training/qk_clip.py): rows of the masters rescaled
            self.after_rules(self)
        self._sync_model_from_masters(after_step=True, before=before)
        return True

    @torch.no_grad()
    def scale_rows(self, scales: dict[str, torch.Tensor]) -> int:
        """Multiply this rank's pieces of the parameters named in ``scales`` (global name -> one multiplier
        per row of the TP-local parameter) in their fp32 masters, element by element through each piece's
        place in the parameter (whole matrices, Q/K/V blocks and even slices alike); no collective. The
        weights follow at the step's sync. Returns how many pieces were scaled."""
        scaled = 0
        for group in self.optimizer.param_groups:
            for piece in group["params"]:
                rows = scales.get(piece.global_name)
                if rows is None or piece.runs is None:
                    continue
                first, run, stride, count = piece.runs
                flat = first + (torch.arange(count)[:, None] * stride + torch.arange(run)[None, :]).reshape(-1)
                row_of = flat // (piece.param_numel // rows.numel())
                piece.master.view(-1).mul_(rows.to(piece.master.device)[row_of.to(piece.master.device)])
                scaled += 1
        return scaled

    def _step_calls(self, group, matrices: dict[str, list[GroupMatrix]], rule):
        """(pieces, StepContext) of each call of ``rule`` on an lr group: one call on the owner's pieces;
        a collective rule (the even layout's) once per shard domain, over that domain's shard group with
        its matrices, dense first on every rank."""
        domains = {name: d for chunk in reversed(self.model_chunks) for name, d in chunk.domains.items()}

        def context(shard, members):
            ctx = StepContext(
                self.config, self.step_count, group["lr"], group["weight_decay"], self.tp_group, shard, members
            )
            ctx.settings = rule.settings_in(self.config)
            return ctx

        if not rule.collective:
            return [(group["params"], context(domains["dense"].shard, [m for ms in matrices.values() for m in ms]))]
        calls = []
        for name, members in matrices.items():
            names = {m.global_name for m in members}
            mine = [p for p in group["params"] if p.global_name in names]
            calls.append((mine, context(domains[name].shard, members)))
        return calls

    @torch.no_grad()
    def step(self):
        """Returns (success, grad norm, zero count), as megatron-core's optimizers do."""
        with profile_range(OPTIMIZER_STEP):
            return self._unscale_clip_and_step()

    def _unscale_clip_and_step(self):
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
        """Refresh fp32 masters from the model's segments (after loading weights). Units with FP8
        matrices are skipped: their segments hold FP8, and masters are never seeded from FP8."""
        for model_segment, master in self._masters:
            if model_segment is not master:
                master.copy_(model_segment)

    # ---------------------------------------------------------- state dicts
    def _layout_digest(self) -> list[str]:
        return [chunk.plan_digest() for chunk in self.model_chunks]

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
            "fp8": {key: {k: v.clone() for k, v in st.items()} for key, st in self._fp8_states()},
        }

    def _fp8_states(self):
        """(piece key, FP8 state) of every owned FP8 matrix that keeps one (delayed scaling)."""
        for unit in self._fp8_units:
            for name, key in unit.keys.items():
                if unit.states[name]:
                    yield key, unit.states[name]

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        if state_dict["layout_digest"] != self._layout_digest():
            raise ValueError(
                "optimizer checkpoint was saved with a different MatrixFSDP layout "
                "(DP size, planner or model); resharding is not supported by this format"
            )
        self.step_count = state_dict["step"]
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update(saved)
        for _, owned in self._pieces():
            owned.master.copy_(state_dict["master"][owned.key])
            for k, v in state_dict["state"][owned.key].items():
                owned.state[k].copy_(v)
        for key, st in self._fp8_states():
            for k, v in state_dict["fp8"][key].items():
                st[k].copy_(v)
        self._sync_model_from_masters()
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            with cuda_on_cpu():
                self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _state_tensors(self, owned: OwnedPiece):
        """(megatron's state name, tensor) of what a checkpoint splits like the parameter: the master
        (DistributedOptimizer's ``param``) and the rule's elementwise state."""
        rule = registry.get(owned.rule)
        return [("param", owned.master)] + sorted((k, v) for k, v in owned.state.items() if rule.resharded(k))

    def _matrix_states(self):
        """(key, tensor, replica id) of every state tensor a rule keeps of a whole matrix (factors,
        eigenbases, moments in a rotated basis), saved whole under its matrix's global name: any DP or PP
        layout reads it. State of a TP shard (blockwise) carries the TP size and rank in its key (it
        means nothing at another TP size); state of the whole TP-split matrix (an exact TP mode) is
        saved once, by TP rank 0."""
        for _, owned in self._pieces():
            rule = registry.get(owned.rule)
            chunk = next(c for c in self.model_chunks if owned.global_name in c.global_names.values())
            replica = group_rank(chunk.groups.replica)
            for tag, tensor in sorted(owned.state.items()):
                if rule.resharded(tag):
                    continue
                name, tp = owned.key.rsplit("@", 1)[0], 0
                if owned.tp_size > 1 and owned.state_over_tp:
                    tp = owned.tp_rank  # the whole matrix's state: the same on every TP rank
                elif owned.tp_size > 1:
                    name += f".tp{owned.tp_size}_{owned.tp_rank}"
                yield f"optimizer.state.{tag}.{name}", tensor, (owned.state_replica, tp, replica)

    def _sharded_groups(self) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
        """(chunk index, state name) -> {slot name (the local parameter name, NAME[q] for a block):
        that state's tensor of the owned piece}."""
        where = {glob: i for i, chunk in enumerate(self.model_chunks) for glob in chunk.global_names.values()}
        groups: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for _, owned in self._pieces():
            index = where[owned.global_name]
            for tag, tensor in self._state_tensors(owned):
                groups.setdefault((index, tag), {})[owned.name] = tensor
        return groups

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False, metadata=None):
        """Masters and moments as megatron-core ShardedTensors under DistributedOptimizer's keys in
        its reshardable layout (megatron/core/optimizer/distrib_optimizer.py at core_v0.16.1:
        ``sharded_param_state_fully_reshardable``): ``optimizer.state.<param|exp_avg|exp_avg_sq|
        momentum_buffer>.<model key>`` with the model tensor's TP offsets, each rank saving the
        element range it owns (no gather). So any TP, PP, DP or replica layout reads what another
        saved. Step counts and lr groups travel in :meth:`common_state_dict`."""
        from megatron.core.dist_checkpointing import ShardedTensor

        sharded = {}
        for (index, tag), tensors in self._sharded_groups().items():
            chunk = self.model_chunks[index]
            for local, shards in chunk.piece_shards(tensors, f"optimizer.state.{tag}.", metadata).items():
                sharded[f"{index}.{tag}.{local}"] = shards
        for key, st in self._fp8_states():  # a whole matrix's small state lives on its owner alone
            name = key.rsplit("@", 1)[0]
            for tag, tensor in sorted(st.items()):
                sharded[f"fp8_{tag}.{key}"] = ShardedTensor.from_rank_offsets(f"optimizer.fp8_{tag}.{name}", tensor)
        for key, tensor, replica_id in self._matrix_states():
            sharded[f"matrix.{key}"] = ShardedTensor.from_rank_offsets(key, tensor, replica_id=replica_id)
        return sharded

    @torch.no_grad()
    def load_sharded_state_dict(self, loaded) -> None:
        """Apply what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict`."""
        for (index, tag), tensors in self._sharded_groups().items():
            for local, tensor in tensors.items():
                flat, at = tensor.view(-1), 0
                for value in loaded[f"{index}.{tag}.{local}"]:
                    if value.data_ptr() != flat[at:].data_ptr():
                        flat[at : at + value.numel()].copy_(value.reshape(-1))
                    at += value.numel()
        for key, st in self._fp8_states():
            for tag, tensor in st.items():
                value = loaded[f"fp8_{tag}.{key}"]
                if value.data_ptr() != tensor.data_ptr():
                    tensor.copy_(value)
        for key, tensor, _ in self._matrix_states():
            value = loaded[f"matrix.{key}"]
            if value.data_ptr() != tensor.data_ptr():
                tensor.copy_(value)
        self._sync_model_from_masters()

    def common_state_dict(self) -> dict:
        """What is the same on every rank: step count, lr groups, loss scaler (plain values and tensors)."""
        return {
            "step": self.step_count,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
        }

    def load_common_state_dict(self, state: dict) -> None:
        """The lr groups' values come back to the group of the same rule, weight-decay multiplier and
        decoupled lr (a checkpoint from before muon_tp was folded into muon names it so); groups of a rule
        this run does not have (another layout's) are left. The scheduler sets lr and wd on load anyway."""
        self.step_count = state["step"]
        saved = {_group_identity(g): g for g in state["param_groups"]}
        for group in self.optimizer.param_groups:
            match = saved.get(_group_identity(group))
            if match is not None:
                group.update({k: v for k, v in match.items() if k != "optimizer"})
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            with cuda_on_cpu():
                self.grad_scaler.load_state_dict(state["grad_scaler"])

    def local_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the optimizer (masters beyond fp32 params, states)."""
        masters = sum(m.numel() * 4 for seg, m in self._masters if seg is not m)
        masters += sum(u.master.numel() * 4 for u in self._fp8_units)
        states = sum(t.numel() * t.element_size() for st in self.optimizer.state.values() for t in st.values())
        states += sum(t.numel() * t.element_size() for _, st in self._fp8_states() for t in st.values())
        return {"masters": masters, "optimizer_state": states}


def _group_identity(group: dict) -> tuple:
    """What tells an lr group apart: its rule (by today's name, registry.RENAMED), wd multiplier, decoupled lr."""
    rule = registry.RENAMED.get(group["optimizer"], group["optimizer"])
    return rule, group.get("wd_mult"), group.get("is_decoupled_lr")


def _state_replica(bounds, rank: int) -> int:
    """0 on the first rank that holds part of a parameter, 1 on the others: of the copies of a whole
    matrix's state an even layout keeps on every holder, the first rank's is saved."""
    first = next(r for r in range(len(bounds) - 1) if bounds[r + 1] > bounds[r])
    return int(rank != first)


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: list) -> MatrixFSDPOptimizer:
    """Mirror of megatron-core's ``get_megatron_optimizer(config, model_chunks)`` for
    MatrixFSDP-wrapped chunks."""
    matrix_rule = registry.optimizer_rule(config.optimizer)
    for chunk in model_chunks:
        if not hasattr(chunk, "plan") or not hasattr(chunk, "units"):
            raise TypeError(f"model chunk {type(chunk).__name__} is not wrapped in MatrixFSDP")
        planned = chunk.ddp_config.rules.splits_qkv(MATRIX)
        if matrix_rule.splits_qkv is not never and planned != matrix_rule.splits_qkv(config):
            raise ValueError(
                f"--optimizer {config.optimizer} updates Q, K and V {'apart' if not planned else 'together'} "
                "(--muon-split-qkv), but MatrixFSDP planned them the other way: build its rules from this config "
                "(MatrixFSDPConfig(rules=registry.rule_set(..., config)))"
            )
    return MatrixFSDPOptimizer(config, model_chunks)
