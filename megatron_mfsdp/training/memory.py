"""Memory footprints at start-up: Megatron-LM's theoretical figures as Megatron-LM prints them
(megatron/training/theoretical_memory_usage.py at core_v0.16.1, reimplemented from its formulas),
then ours for the owner layout, predicted from the plans and measured on the ranks.

Megatron's formulas cover MoE, multi-latent attention, MTP and hybrid models; the last three are
refused here (arguments/refused.py), so its dense-GPT and MoE terms are reimplemented."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..groups import group_rank
from ..optim import registry
from .logging import moe_layer_count

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


def parameter_counts(args) -> dict[str, float]:
    """Megatron's parameter counts (compute_weight_and_optimizer_memory): its own model of a layer (no
    linear biases, no position embedding, no router), as it prints them; an MoE layer holds every expert
    and the shared experts (Megatron's figure does not divide the experts by EP)."""
    h, heads = args.hidden_size, args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    query_to_hidden = args.kv_channels * heads / h
    gated = 3 / 2 if args.swiglu else 1
    norm = 1 if args.normalization == "RMSNorm" else 2  # LayerNorm has a bias, RMSNorm not
    attention = 2 * h * h * ((1 + groups / heads) * query_to_hidden)
    layer = 2 * h * (args.ffn_hidden_size * gated + norm) + attention
    moe_layers, moe_layer = moe_layer_count(args), 0.0
    if moe_layers:
        experts = args.moe_ffn_hidden_size * args.num_experts + (args.moe_shared_expert_intermediate_size or 0)
        moe_layer = 2 * h * (experts * gated + norm) + attention
    embedding = h * args.padded_vocab_size
    embeddings = 2 * embedding if args.untie_embeddings_and_output_weights else embedding
    block = layer * (args.num_layers - moe_layers) + moe_layer * moe_layers + norm * h
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    # The most loaded shard: 1/PP of the layers and the input embedding (the output layer too at PP 1).
    most_loaded = (block / pp + embedding) / tp
    if args.untie_embeddings_and_output_weights and pp == 1:
        most_loaded += embedding / tp
    return {
        "block": block,
        "embeddings": embeddings,
        "total": block + embeddings,
        "most_loaded": most_loaded,
        "other": block / (pp * tp),
    }


def weight_and_optimizer_bytes(args, out: list[str]) -> float:
    """Megatron's figure for the most loaded shard: 18 bytes a parameter (bf16 weight and fp32
    gradient, master and two Adam moments), 6 + 12 / DP with its distributed optimizer."""
    n = parameter_counts(args)
    out.append(f"Number of parameters in transformer block in billions: {n['block'] / 10**9: .2f}")
    out.append(f"Number of parameters in embedding layers in billions: {n['embeddings'] / 10**9:.2f}")
    out.append(f"Total number of parameters in billions: {n['total'] / 10**9:.2f}")
    out.append(f"Number of parameters in most loaded shard in billions: {n['most_loaded'] / 10**9:.4f}")
    if args.pipeline_model_parallel_size > 1:
        out.append(f"Number of parameters in other shards in billions: {n['other'] / 10**9:.4f}")
    per_parameter = 6 + 12 / args.data_parallel_size if args.use_distributed_optimizer else 18
    return n["most_loaded"] * per_parameter


def _in_flight_factor(args, num_microbatches, out: list[str]) -> float:
    """Megatron's scaling of the first stage's activations by the micro-batches in flight: the
    interleaved schedule's penalty, or fewer micro-batches than stages."""
    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if vp is not None:
        penalty = 1 + (pp - 1) / (pp * vp)
        out.append(f"Memory penalty from interleaved schedule: {penalty:.2f}")
        out.append(f"Number of in-flight microbatches: {math.ceil(penalty * pp)}")
        return penalty
    if pp == 1:
        return 1
    in_flight = pp if num_microbatches is None else min(num_microbatches, pp)
    out.append(f"Number of in-flight microbatches: {in_flight}")
    return 1 if num_microbatches is None else min(1, num_microbatches / pp)


def _layers_and_embedding(args, per_layer: float) -> float:
    """Every layer, then the input to the embedding and its dropout (PP micro-batches in flight),
    summed in Megatron's order."""
    s, b, pp = args.seq_length, args.micro_batch_size, args.pipeline_model_parallel_size
    memory = per_layer * args.num_layers
    memory += 8 * s * b * pp
    memory += s * b * args.hidden_size * pp
    return memory


def activation_bytes_with_sp(args, num_microbatches, out: list[str]) -> float:
    """compute_activation_memory: Table 2 of arXiv 2205.05198 (sequence parallelism, selective
    recomputation), the first pipeline stage's, divided by TP."""
    s, b, h, tp = args.seq_length, args.micro_batch_size, args.hidden_size, args.tensor_model_parallel_size
    memory = (s * b * h) * (18 + 4 * (args.ffn_hidden_size / h))
    out.append(f"Activation memory footprint per transformer layer: {memory / NUM_BYTES_IN_MEGABYTE / tp:.1f} MB")
    memory = _layers_and_embedding(args, memory)
    memory *= _in_flight_factor(args, num_microbatches, out)
    if args.pipeline_model_parallel_size == 1:  # inputs to the output layer and the cross entropy
        memory += s * b * h * 4 * (1 + args.padded_vocab_size / h)
    return memory / tp


def activation_bytes_without_sp(args, num_microbatches, out: list[str]) -> float:
    """compute_activation_memory_without_sp: per layer s*b*h*(10 + 24/TP), logits split over TP,
    plus 5% for temporaries."""
    s, b, h, tp = args.seq_length, args.micro_batch_size, args.hidden_size, args.tensor_model_parallel_size
    per_layer = s * b * h * (10 + 24 / tp)
    out.append(
        "Activation memory footprint per transformer layer (precise, without SP): "
        f"{per_layer / NUM_BYTES_IN_MEGABYTE:.1f} MB"
    )
    memory = _layers_and_embedding(args, per_layer)
    memory *= _in_flight_factor(args, num_microbatches, out)
    if args.pipeline_model_parallel_size == 1:  # logits (split over TP) and the final layernorm's output
        memory += (s * b * args.padded_vocab_size / tp + s * b * h) * 2
    return memory * 1.05


def theoretical_memory(args, num_microbatches=None) -> tuple[list[str], float]:
    """Megatron's report_theoretical_memory(verbose=True): the lines it prints, in its order, and
    its weight-and-optimizer figure in MB. The activation formula with sequence parallelism applies
    to SP with selective recomputation, as there."""
    out: list[str] = []
    weights = weight_and_optimizer_bytes(args, out) / NUM_BYTES_IN_MEGABYTE
    if args.sequence_parallel and args.recompute_granularity == "selective":
        out.append("compute_activation_memory with SP")
        activation = activation_bytes_with_sp(args, num_microbatches, out) / NUM_BYTES_IN_MEGABYTE
    else:
        out.append("compute_activation_memory_without_sp")
        activation = activation_bytes_without_sp(args, num_microbatches, out) / NUM_BYTES_IN_MEGABYTE
    out.append(
        f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB, "
        f"activation={activation:.2f} MB, total={weights + activation:.2f} MB\n"
    )
    return out, weights


def owner_bytes(chunks, optimizer, dp_rank: int, domain: str = "dense") -> dict[str, int]:
    """What rank ``dp_rank`` of the chunks' plans in shard ``domain`` ("dense" over DP, "expert" over
    expert DP) holds for the whole run: its parameter segment
    (parameter dtype), its fp32 gradient segment, fp32 masters where the parameters are not fp32,
    and each piece's rule state (the rule's own count: Adam two moments, Muon and SGD one momentum,
    a factored rule its factors). ``optimizer``: its config, or an
    --optimizer name with the defaults. FP8 matrices, stored as bytes, are not modelled: the measured
    figure is."""
    from ..config import MatrixFSDPOptimizerConfig
    from ..optim.rule import CostContext
    from ..placement.classes import WHOLE

    config = MatrixFSDPOptimizerConfig(optimizer=optimizer) if isinstance(optimizer, str) else optimizer
    held = dict(params=0, grads=0, masters=0, optimizer_state=0)
    for chunk in (c for c in chunks if domain in c.domains):
        masters = 0 if chunk.param_dtype == torch.float32 else 4
        rules = registry.rule_set((), config, chunk.ddp_config.layout)
        plan = chunk.domains[domain].plan
        for unit in plan.units:
            for piece in unit.local_pieces(dp_rank):
                held["params"] += piece.numel * plan.element_size
                held["grads"] += piece.numel * 4
                held["masters"] += piece.numel * masters
                rule = registry.get(rules.update_rule(piece.slot.rule))
                shape = tuple(piece.slot.shape) if rule.storage == WHOLE else (piece.numel,)
                held["optimizer_state"] += rule.resident_bytes(shape, CostContext(config))
    return held


def _owner_figures(args, chunks, optimizer, groups) -> tuple | None:
    """This rank's part of the owner lines: what its plans say it holds (predicted, both shard domains),
    its dense DP rank and size, its pipeline stage, what it holds (measured: MatrixFSDP.local_bytes and
    the optimizer's local_bytes), and at EP above 1 (its expert bytes, ZeRO-3's even share of them)."""
    if not all(hasattr(c, "domains") for c in chunks):
        return None
    config = getattr(optimizer, "config", args.optimizer)
    dense = chunks[0].domains["dense"]
    held = owner_bytes(chunks, config, dense.dp_rank)
    experts = None
    with_experts = [c for c in chunks if "expert" in c.domains]  # a virtual stage may hold dense layers only
    if with_experts:
        domain = with_experts[0].domains["expert"]
        mine = owner_bytes(chunks, config, domain.dp_rank, "expert")
        held = {k: v + mine[k] for k, v in held.items()}
        every = [sum(owner_bytes(chunks, config, r, "expert").values()) for r in range(domain.dp_size)]
        experts = (sum(mine.values()), sum(every) / len(every))
    measured = sum(sum(c.local_bytes().values()) for c in chunks) + sum(optimizer.local_bytes().values())
    return held, dense.dp_rank, dense.dp_size, group_rank(groups.pp), measured, experts


def owner_line(everyone: list, megatron_mb: float) -> str:
    """Ours, after Megatron's line: the plans' busiest rank, and the bytes every rank holds."""
    mb = NUM_BYTES_IN_MEGABYTE
    held, dp_rank, world, stage = max(everyone, key=lambda f: sum(f[0].values()))[:4]
    total = sum(held.values())
    measured = [f[4] for f in everyone]
    top = max(range(len(measured)), key=measured.__getitem__)
    return (
        f"Theoretical memory footprints, MatrixFSDP owner layout: weight and optimizer={total / mb:.2f} MB "
        f"on the busiest rank (DP rank {dp_rank} of {world}, pipeline stage {stage}: params="
        f"{held['params'] / mb:.2f} MB, fp32 grads={held['grads'] / mb:.2f} MB, fp32 masters="
        f"{held['masters'] / mb:.2f} MB, optimizer state={held['optimizer_state'] / mb:.2f} MB; "
        f"x{total / mb / megatron_mb if megatron_mb else 0:.3f} of Megatron's figure) | measured per rank: "
        f"max {measured[top] / mb:.2f} MB (rank {top}), min {min(measured) / mb:.2f} MB"
    )


def expert_line(everyone: list) -> str | None:
    """The experts' part of the busiest rank's bytes against ZeRO-3's even split of the same experts
    over expert DP; None without an expert domain."""
    figures = [f[5] for f in everyone if len(f) > 5 and f[5] is not None]
    if not figures:
        return None
    mb = NUM_BYTES_IN_MEGABYTE
    top = max(range(len(figures)), key=lambda i: figures[i][0])
    held, even = figures[top]
    return (
        f"Theoretical memory footprints, experts: the busiest rank holds {held / mb:.2f} MB of expert weights, "
        f"gradients, masters and optimizer state; ZeRO-3's even split over expert DP {even / mb:.2f} MB "
        f"(x{held / even if even else 0:.3f})"
    )


def report(args, chunks, optimizer, groups, iteration: int, num_microbatches: int) -> None:
    """Collective. After a logged iteration, as Megatron-LM's training_log: rank 0 prints the
    theoretical footprints (and ours for the owner layout), then every DP rank 0 its memory."""
    from .logging import report_memory

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _owner_figures(args, chunks, optimizer, groups))  # also orders the output
    if dist.get_rank() == 0:
        lines, weights = theoretical_memory(args, num_microbatches)
        if all(f is not None for f in everyone):
            lines += [line for line in (owner_line(everyone, weights), expert_line(everyone)) if line]
        for line in lines:
            print(line, flush=True)
    report_memory(f"(after {iteration} iterations)", groups)
