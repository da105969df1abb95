"""Checks and derived values, before any process group, model or dataset exists.

Each check raises ValueError with the flag named (parse_args turns it into argparse's
exit 2). Derived values follow Megatron-LM's validate_args (megatron/training/arguments.py at
core_v0.16.1); where a flag parses but does not apply here, a one-line notice goes to
``args.notices`` and is printed at start-up.
"""

from __future__ import annotations

import os


def _fail(message: str) -> None:
    raise ValueError(message)


def validate_parallel(args) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.world_size % (tp * pp):
        _fail(
            f"world size {args.world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}"
        )
    args.data_parallel_size = args.world_size // (tp * pp)
    if args.data_parallel_size % args.mfsdp_replicate_size:
        _fail(
            f"--mfsdp-replicate-size {args.mfsdp_replicate_size} does not divide the data-parallel size "
            f"{args.data_parallel_size}"
        )
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False
        args.notices.append(
            "--sequence-parallel: disabled because tensor model parallelism is disabled (as Megatron-LM)"
        )
    if args.distributed_backend == "nccl" and not _has_cuda():
        args.distributed_backend = "gloo"
        args.notices.append("--distributed-backend nccl: no CUDA on this machine, gloo runs instead")
    # Megatron-LM's orders (megatron/training/initialize.py at core_v0.16.1), the expert groups' too
    args.parallel_order = "tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"
    _validate_virtual_pipeline(args)
    _validate_ranks_per_node(args)


def _validate_ranks_per_node(args) -> None:
    """--mfsdp-ranks-per-node (default: the launcher's LOCAL_WORLD_SIZE, else the world): whole nodes, and
    every DP shard group spread evenly over them (node_levels.py builds its levels from that)."""
    from ...node_levels import FLAG, node_layout

    n = args.mfsdp_ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    if args.world_size % n:
        _fail(f"{FLAG} {n} does not divide the world size {args.world_size} (nodes hold whole ranks)")
    tp, pp, dp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size
    stride = tp * pp if args.use_tp_pp_dp_mapping else tp  # megatron's DP stride in either order
    shard = dp // args.mfsdp_replicate_size
    for first in range(args.world_size):
        if ((first // stride) % dp) % shard == 0:  # the first rank of a shard group
            node_layout([first + k * stride for k in range(shard)], n)  # raises naming the flag
    args.mfsdp_ranks_per_node = n


def _validate_virtual_pipeline(args) -> None:
    pp, per_vp, vp = (
        args.pipeline_model_parallel_size,
        args.num_layers_per_virtual_pipeline_stage,
        args.num_virtual_stages_per_pipeline_rank,
    )
    if per_vp is not None and vp is not None:
        _fail("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank exclude each other")
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    extra = int(args.account_for_embedding_in_pipeline_split) + int(args.account_for_loss_in_pipeline_split)
    layers = (args.num_layers or 0) + extra
    args.virtual_pipeline_model_parallel_size = None
    if per_vp is not None:
        if uneven:
            _fail(
                "uneven pipeline stages (--decoder-first/last-pipeline-num-layers) need "
                "--num-virtual-stages-per-pipeline-rank, not --num-layers-per-virtual-pipeline-stage"
            )
        if pp < 2 or layers % pp or (layers // pp) % per_vp:
            _fail(
                f"--num-layers-per-virtual-pipeline-stage {per_vp} needs --pipeline-model-parallel-size > 1 and "
                f"must divide the {layers // pp} layers of each pipeline stage"
            )
        vp = layers // pp // per_vp
    elif not uneven and layers % pp:
        _fail(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if vp is not None and vp > 1:
        if pp < 2 or (pp == 2 and not args.overlap_p2p_comm):
            _fail(
                "the interleaved schedule needs --pipeline-model-parallel-size > 1 (> 2 with "
                "--no-overlap-p2p-communication)"
            )
        args.virtual_pipeline_model_parallel_size = vp
    if getattr(args, "virtual_pipeline_model_parallel_size", None) is None:
        # Megatron-LM's validate_args: only the interleaved schedule overlaps p2p or aligns the gathers
        args.overlap_p2p_comm = args.align_param_gather = False


def validate_model(args) -> None:
    for flag, value in (
        ("--num-layers", args.num_layers),
        ("--hidden-size", args.hidden_size),
        ("--num-attention-heads", args.num_attention_heads),
        ("--seq-length", args.seq_length),
        ("--max-position-embeddings", args.max_position_embeddings),
    ):
        if value is None:
            _fail(f"{flag} is required")
    if args.seq_length > args.max_position_embeddings:
        _fail(f"--max-position-embeddings {args.max_position_embeddings} must be >= --seq-length {args.seq_length}")
    if args.ffn_hidden_size is None:
        # Megatron-LM's rule: with SwiGLU keep the parameter count of a 4h MLP, a multiple of 64.
        args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads:
            _fail(
                f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                f"{args.num_attention_heads} (or give --kv-channels)"
            )
        args.kv_channels = args.hidden_size // args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    if args.num_attention_heads % groups:
        _fail(f"--num-query-groups {groups} must divide --num-attention-heads {args.num_attention_heads}")
    tp = args.tensor_model_parallel_size
    for flag, value in (
        ("--num-attention-heads", args.num_attention_heads),
        ("--num-query-groups", groups),
        ("--ffn-hidden-size", args.ffn_hidden_size),
    ):
        if value % tp:
            _fail(f"{flag} {value} is not divisible by --tensor-model-parallel-size {tp}")
    if args.mfsdp_vocab_padding_independent_of_tp and args.make_vocab_size_divisible_by % tp:
        _fail(
            f"--mfsdp-vocab-padding-independent-of-tp: --make-vocab-size-divisible-by "
            f"{args.make_vocab_size_divisible_by} must be a multiple of --tensor-model-parallel-size {tp}"
        )
    _validate_model_kinds(args)
    _validate_mla(args)
    _validate_qk_clip(args)


def _validate_mla(args) -> None:
    """Megatron-LM's checks of multi-latent attention (validate_args and core_transformer_config_from_args at
    core_v0.16.1)."""
    from ...models.gpt.config import MLA_YARN_FIELDS

    yarn = [f"--{d.replace('_', '-')}" for d in MLA_YARN_FIELDS if getattr(args, d) is not None]
    if not args.multi_latent_attention:
        if args.rope_type == "yarn":  # Megatron-LM's assert in core_transformer_config_from_args
            _fail(
                '--rope-type yarn: standard attention supports rope_type="rope" only (as Megatron-LM); YaRN '
                "applies to --multi-latent-attention"
            )
        if yarn:
            _fail(
                f"{yarn[0]}: the --yarn-* settings apply to --multi-latent-attention's YaRN here; standard "
                "attention's YaRN (--position-embedding-type yarn) is not supported"
            )
        return
    if args.yarn_correction_range_round_to_int is False:
        _fail(
            "--no-yarn-correction-range-round-to-int: megatron-core 0.16.1's MLASelfAttention always rounds YaRN's "
            "correction range (its YarnRotaryEmbedding gets no such setting from MLATransformerConfig)"
        )
    if yarn and args.rope_type == "rope":
        _fail(f"{yarn[0]} with --rope-type rope: the --yarn-* settings apply to MLA's YaRN (--rope-type yarn)")
    if args.group_query_attention:
        _fail("--group-query-attention and --multi-latent-attention exclude each other (as Megatron-LM)")


def _validate_qk_clip(args) -> None:
    """Megatron-LM's checks (arguments.py at core_v0.16.1, whose TE >= 2.9 need our CPU attention does not
    have: it computes the max logits itself), and where the clip cannot hold."""
    if not args.qk_clip:
        return
    if not 0.0 < args.qk_clip_alpha < 1.0:
        _fail(f"--qk-clip-alpha {args.qk_clip_alpha} must be between 0 and 1 (exclusive), as Megatron-LM's")
    if args.qk_clip_threshold <= 0:
        _fail(f"--qk-clip-threshold {args.qk_clip_threshold} must be greater than 0, as Megatron-LM's")
    from ..setup import MEGATRON_OPTIMIZERS

    if not args.use_matrix_fsdp and args.optimizer in MEGATRON_OPTIMIZERS:
        _fail(
            f"--qk-clip with --optimizer {args.optimizer} without --use-matrix-fsdp: the clip is not built for "
            "megatron-core's optimizers (Megatron-LM rescales the weights and their main_param after the step, "
            "which its DistributedOptimizer keeps in byte shards where a head's rows are not whole); use "
            "--use-matrix-fsdp (each linear_qkv's owner rescales its own fp32 master), or "
            "--log-max-attention-logit to log without clipping"
        )
    if args.qk_layernorm and not args.multi_latent_attention:  # MLA's norms act before its up projections
        args.notices.append(
            "--qk-clip with --qk-layernorm: the norms rescale queries and keys after linear_qkv, so scaling its "
            "rows leaves the logits as they are (megatron-core clips the weights the same way)"
        )


def _validate_model_kinds(args) -> None:
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    kinds = {"yarn": "YaRN", "mrope": "multimodal RoPE", "relative": "relative"}
    if args.position_embedding_type in kinds:
        _fail(
            f"--position-embedding-type {args.position_embedding_type}: {kinds[args.position_embedding_type]} "
            "position embeddings are not supported by megatron-mfsdp yet"
        )
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        _fail("--no-position-embedding is deprecated: use --position-embedding-type (rope or none)")
    activations = [
        f
        for f, on in (
            ("--swiglu", args.swiglu),
            ("--squared-relu", args.squared_relu),
            ("--openai-gelu", args.openai_gelu),
        )
        if on
    ]
    if len(activations) > 1:
        _fail(f"{' and '.join(activations)} exclude each other")
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "selective" and args.recompute_method is not None:
        _fail("--recompute-method applies to --recompute-granularity full only")
    if args.recompute_granularity == "full" and args.recompute_method is None:
        _fail("--recompute-granularity full needs --recompute-method uniform or block")
    _validate_recompute_modules(args)


# megatron-core's selective recomputation (TransformerConfig.recompute_modules at core_v0.16.1): the parts a
# dense GPT layer has; Megatron-LM HEAD's others belong to features refused here.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")
RECOMPUTE_MODULES_OF = {
    "moe_act": "MoE layers (the experts' activation)",
    "moe": "MoE layers (the whole layer)",
    "shared_experts": "MoE layers (the shared experts)",
    "mla_up_proj": "multi-latent attention (its up projections)",
    "gdn_norm_out": "gated delta net layers",
    "gdp_in_proj": "Gated DeltaProduct layers",
    "gdp_qkv": "Gated DeltaProduct layers",
    "mhc": "hyper-connections (mHC)",
}


def _validate_recompute_modules(args) -> None:
    modules = args.recompute_modules
    if modules is None:
        return
    for module in modules:
        if module in RECOMPUTE_MODULES_OF:
            _fail(
                f"--recompute-modules {module}: recomputing a part of {RECOMPUTE_MODULES_OF[module]} is not "
                "supported by megatron-mfsdp yet"
            )
        if module not in RECOMPUTE_MODULES:
            _fail(f"--recompute-modules {module}: choose from {', '.join(RECOMPUTE_MODULES)}")
    if args.recompute_granularity != "selective":
        args.notices.append(
            "--recompute-modules: applies to --recompute-granularity selective (or --recompute-activations); "
            "nothing is recomputed by it in this run"
        )


def validate_precision(args) -> None:
    if args.fp16 and args.bf16:
        _fail("--fp16 and --bf16 are mutually exclusive")
    if args.fp16 and not args.loss_scale and args.check_for_nan_in_loss_and_grad:
        args.check_for_nan_in_loss_and_grad = False  # dynamic loss scaling handles inf/nan (as Megatron-LM)
    if args.bf16 and args.grad_reduce_in_bf16:
        args.accumulate_allreduce_grads_in_fp32 = False
    elif args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    validate_fp8(args)


def validate_fp8(args) -> None:
    """FP8 parameters quantized by their owners (precision/): what cannot work fails here, before any work."""
    if args.fp8 is None:
        if args.fp8_param_gather:
            _fail("--fp8-param-gather needs --fp8-format (as Megatron-LM: FP8 parameters need FP8 mode)")
        return
    if not args.use_matrix_fsdp:
        # A Megatron-LM FP8 launch script still runs unmodified (issue 8): bf16, with one notice.
        args.notices.append(
            f"--fp8-format {args.fp8}: Megatron's own FP8 path runs inside Transformer Engine on CUDA (not "
            "wired into megatron-mfsdp); this run computes in bf16. With --use-matrix-fsdp --fp8-param-gather "
            "each owner quantizes its own matrices"
        )
        args.fp8, args.fp8_param_gather = None, False
        return
    if not args.bf16:
        _fail(f"--fp8-format {args.fp8} needs --bf16: FP8 weights are cast from bf16 and the rest computes in bf16")
    if _matrix_rule(args).storage != "whole":
        _fail(
            f"--fp8-format with --use-matrix-fsdp and --optimizer {args.optimizer}: owners quantize the matrices "
            "they hold whole, which needs --optimizer muon or another matrix optimizer (split matrices would need "
            "an amax all-reduce)"
        )
    from ...precision import check_shape
    from ..configs import fp8_config_from_args

    try:
        config = fp8_config_from_args(args)
    except (NotImplementedError, ValueError) as err:
        _fail(str(err))
    _validate_bf16_layers(args, config)
    if config.fp8_recipe == "blockwise" and _has_fp8_layers(args):
        for name, shape in _tp_local_matrix_shapes(args).items():
            try:
                check_shape(shape, "blockwise", name)
            except ValueError as err:
                _fail(f"{err} (--hidden-size, --ffn-hidden-size, --kv-channels, --tensor-model-parallel-size)")
    if not args.fp8_param_gather:
        args.notices.append(
            f"--fp8-format {args.fp8} without --fp8-param-gather: weights stay and travel in bf16 and FP8 GEMMs "
            "need Transformer Engine on CUDA; this run computes in bf16 (add --fp8-param-gather for FP8 weights)"
        )
        args.fp8 = None


def _validate_bf16_layers(args, config) -> None:
    if not args.first_last_layers_bf16:
        return
    if config.fp8_recipe == "delayed":
        _fail("--fp8-recipe delayed does not support --first-last-layers-bf16 (as Megatron-LM)")
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    for flag, value in (
        ("--num-layers-at-start-in-bf16", args.num_layers_at_start_in_bf16),
        ("--num-layers-at-end-in-bf16", args.num_layers_at_end_in_bf16),
    ):
        if value > per_stage:
            _fail(f"{flag} {value} must be between 0 and the layers per pipeline stage ({per_stage})")


def _has_fp8_layers(args) -> bool:
    if not args.first_last_layers_bf16:
        return True
    return args.num_layers_at_start_in_bf16 + args.num_layers_at_end_in_bf16 < args.num_layers


def _tp_local_matrix_shapes(args) -> dict:
    """(rows, cols) of each transformer-layer matrix on one TP rank (megatron's column/row split)."""
    tp, heads, kv = args.tensor_model_parallel_size, args.num_attention_heads, args.kv_channels
    groups = args.num_query_groups if args.group_query_attention else heads
    ffn_out = args.ffn_hidden_size * (2 if args.swiglu else 1)
    mlp = {
        "linear_fc1.weight": (ffn_out // tp, args.hidden_size),
        "linear_fc2.weight": (args.hidden_size, args.ffn_hidden_size // tp),
    }
    if args.multi_latent_attention:
        from ...models.gpt.mla import attention_shapes

        return {name: shape for name, shape in attention_shapes(vars(args), tp) if len(shape) == 2} | mlp
    return {
        "linear_qkv.weight": ((heads + 2 * groups) * kv // tp, args.hidden_size),
        "linear_proj.weight": (args.hidden_size, heads * kv // tp),
    } | mlp


def validate_schedule(args) -> None:
    """Iteration- or sample-based training and its lr schedule, as Megatron-LM's validate_args (at
    HEAD, which lets --rampup-batch-size ramp the batch of iteration-based training too)."""
    if (args.train_iters is None) == (args.train_samples is None):
        _fail("give exactly one of --train-iters and --train-samples")
    if args.lr is None:
        _fail("--lr is required")
    if args.min_lr > args.lr:
        _fail(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.train_iters is not None:
        for flag, value, empty in (
            ("--train-samples", args.train_samples, None),
            ("--lr-decay-samples", args.lr_decay_samples, None),
            ("--lr-warmup-samples", args.lr_warmup_samples, 0),
            ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples, None),
        ):
            if value != empty:
                _fail(f"{flag} is sample-based and does not combine with --train-iters (use --train-samples)")
        if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
            _fail("give only one of --lr-warmup-fraction and --lr-warmup-iters")
    else:
        for flag, value, empty in (
            ("--lr-decay-iters", args.lr_decay_iters, None),
            ("--lr-warmup-iters", args.lr_warmup_iters, 0),
            ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters, None),
        ):
            if value != empty:
                _fail(f"{flag} is iteration-based and does not combine with --train-samples (use --train-iters)")
        if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
            _fail("give only one of --lr-warmup-fraction and --lr-warmup-samples")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
        _fail("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
    if args.weight_decay_incr_style == "constant":
        if args.start_weight_decay is not None or args.end_weight_decay is not None:
            _fail("--start/--end-weight-decay need --weight-decay-incr-style linear or cosine")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        _fail(
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
            "--end-weight-decay"
        )
    _validate_batches(args)
    _validate_lr_lengths(args)


def _validate_lr_lengths(args) -> None:
    """What megatron-core's OptimizerParamScheduler asserts, said with the flags' names."""
    if args.lr_warmup_init > args.lr:
        _fail(f"--lr-warmup-init {args.lr_warmup_init} is larger than --lr {args.lr}")
    if args.end_weight_decay < args.start_weight_decay:
        _fail(f"--end-weight-decay {args.end_weight_decay} is smaller than --start-weight-decay")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        _fail("give only one of --override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler")
    if args.train_iters is not None and args.train_samples is None:
        unit, decay = "iterations", args.lr_decay_iters or args.train_iters
        decay_flag = "--lr-decay-iters" if args.lr_decay_iters else "--train-iters"
        warmup, warmup_flag, wsd = args.lr_warmup_iters, "--lr-warmup-iters", args.lr_wsd_decay_iters
    else:
        unit, decay = "samples", args.lr_decay_samples or args.train_samples
        decay_flag = "--lr-decay-samples" if args.lr_decay_samples else "--train-samples"
        warmup, warmup_flag, wsd = args.lr_warmup_samples, "--lr-warmup-samples", args.lr_wsd_decay_samples
    if args.lr_warmup_fraction is not None:
        warmup, warmup_flag = args.lr_warmup_fraction * decay, f"--lr-warmup-fraction {args.lr_warmup_fraction}"
    if warmup >= decay:
        _fail(
            f"{warmup_flag} gives {warmup:g} warmup {unit}, not fewer than the {decay} {unit} the lr decays "
            f"over ({decay_flag}); shorten the warmup (--lr-warmup-fraction scales with the run)"
        )
    if args.lr_decay_style == "WSD" and wsd is not None and wsd > decay:
        _fail(f"the WSD decay ({wsd} {unit}) is longer than the {decay} {unit} of {decay_flag}")


def _validate_batches(args) -> None:
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    if mbs is None:
        _fail("--micro-batch-size is required")
    if args.step_batch_size_schedule is not None:
        _validate_step_schedule(args)
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    if args.global_batch_size % (mbs * dp):
        _fail(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size {mbs} x "
            f"data-parallel size {dp}"
        )
    if args.rampup_batch_size is not None:
        start, increment, _ = args.rampup_batch_size
        if start % (mbs * dp) or increment % (mbs * dp) or (args.global_batch_size - start) % increment:
            _fail(
                f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: start and increment must be "
                f"multiples of micro batch x DP = {mbs * dp}, and reach --global-batch-size in whole increments"
            )
    args.num_microbatches = args.global_batch_size // (mbs * dp)
    if args.optimizer == "dist_muon":
        args.optimizer = "muon"
        args.notices.append("--optimizer dist_muon: deprecated in Megatron-LM; runs as --optimizer muon")


def _validate_step_schedule(args) -> None:
    """Megatron-LM HEAD refuses --global-batch-size with a step schedule; we also take it when it
    equals the schedule's last batch size (HEAD's own examples/gpt3 script gives both)."""
    from ..schedule import parse_step_schedule

    if args.rampup_batch_size is not None:
        _fail("--rampup-batch-size and --step-batch-size-schedule exclude each other")
    steps = parse_step_schedule(
        args.step_batch_size_schedule, args.seq_length, args.micro_batch_size * args.data_parallel_size
    )
    final = steps[-1][1]
    if args.global_batch_size not in (None, final):
        _fail(
            f"--global-batch-size {args.global_batch_size} differs from the last batch size of "
            f"--step-batch-size-schedule ({final}): give one of them"
        )
    args.global_batch_size = final


def validate_io(args) -> None:
    """Checkpoint and log destinations, before any work."""
    if args.save is not None:
        if args.save_interval is None:
            _fail("--save needs --save-interval (as Megatron-LM)")
        _writable_dir(args.save, "--save")
    if args.save_retain_interval is not None and (
        args.save_interval is None or args.save_retain_interval % args.save_interval
    ):
        _fail("--save-retain-interval must be a multiple of --save-interval")
    for flag, path in (
        ("--tensorboard-dir", args.tensorboard_dir),
        ("--output-dir", args.output_dir),
        ("--wandb-save-dir", args.wandb_save_dir),
    ):
        if path is not None:
            _writable_dir(path, flag)
    _validate_checkpoint_format(args)
    _validate_run_control(args)
    if args.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            _fail(f"--wandb-project {args.wandb_project}: the wandb package is not installed (pip install wandb)")
    _validate_profile(args)


def _validate_checkpoint_format(args) -> None:
    """Megatron-LM's four --ckpt-format values: torch_dist and torch are written (torch by every backend:
    checkpoint/local.py); the other two are refused here, not at the first save."""
    if args.ckpt_format == "torch_dcp":
        _fail(
            "--ckpt-format torch_dcp: torch.distributed.checkpoint's own format is not supported by megatron-mfsdp; "
            "use torch_dist (the default: megatron-core dist_checkpointing over the same torch.distributed."
            "checkpoint storage, resharding to any TP x PP x DP)"
        )
    if args.ckpt_format == "fsdp_dtensor":
        _fail(
            "--ckpt-format fsdp_dtensor: Megatron-FSDP's DTensor format needs Megatron-FSDP (--use-megatron-fsdp), "
            "which megatron-mfsdp does not have; use torch_dist (the default), which --use-matrix-fsdp saves "
            "resharding to any TP x PP x DP"
        )
    if args.pretrained_checkpoint is not None and not os.path.isdir(args.pretrained_checkpoint):
        _fail(f"--pretrained-checkpoint {args.pretrained_checkpoint}: no such folder")


def _validate_run_control(args) -> None:
    """Flags whose effect needs another flag, or CUDA, said at start-up."""
    if "--exit-signal" in args.explicit and not args.exit_signal_handler:
        args.notices.append(f"--exit-signal {args.exit_signal}: acts with --exit-signal-handler only (as Megatron-LM)")
    if args.log_progress and args.save is None:
        args.notices.append("--log-progress: progress.txt is written in --save, which is not given: nothing is written")
    if args.empty_unused_memory_level and not _has_cuda():
        args.notices.append(
            f"--empty-unused-memory-level {args.empty_unused_memory_level}: no CUDA on this machine, so the CUDA "
            "caching allocator holds nothing to release"
        )


def _validate_profile(args) -> None:
    """--profile's two modes as Megatron-LM's train() (megatron/training/training.py at
    core_v0.16.1); where Megatron-LM would fail mid-run (no CUDA, no trace folder) we say so first."""
    if args.use_pytorch_profiler and not args.profile:
        args.notices.append("--use-pytorch-profiler without --profile: nothing is profiled (as Megatron-LM)")
    if not args.profile:
        return
    if args.profile_step_end <= args.profile_step_start:
        _fail(
            f"--profile-step-end {args.profile_step_end} must be after --profile-step-start {args.profile_step_start}"
        )
    if args.use_pytorch_profiler and args.tensorboard_dir is None and args.output_dir is None:
        _fail("--use-pytorch-profiler writes its trace to --tensorboard-dir (else --output-dir): give one of them")
    if not args.use_pytorch_profiler and not _has_cuda():
        args.notices.append(
            "--profile without --use-pytorch-profiler is nsys mode (cudaProfilerStart/Stop around iterations "
            f"{args.profile_step_start + 1}..{args.profile_step_end}, for nsys --capture-range=cudaProfilerApi): "
            "it needs CUDA and this machine has none, so nothing is captured; "
            "add --use-pytorch-profiler for a PyTorch trace"
        )


def _writable_dir(path: str, flag: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        _fail(f"{flag} {path}: cannot create the folder ({err.strerror})")
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        _fail(f"{flag} {path}: not a writable folder")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _validate_layout(args) -> None:
    """--mfsdp-layout even is the reconstruction baseline on one DP shard group: Muon on whole
    (TP-local) matrices, no FP8 owners."""
    if args.mfsdp_layout == "owner":
        return
    if not args.use_matrix_fsdp:
        _fail(f"--mfsdp-layout {args.mfsdp_layout} needs --use-matrix-fsdp (it is a MatrixFSDP layout)")
    if args.tensor_model_parallel_size > 1:
        _fail(f"--mfsdp-layout {args.mfsdp_layout} supports --tensor-model-parallel-size 1 only (no Muon TP modes)")
    if getattr(args, "fp8_param_gather", False):
        _fail(f"--mfsdp-layout {args.mfsdp_layout} does not support --fp8-param-gather (FP8 needs whole matrices)")


def _validate_collectives(args) -> None:
    """A forced owner-collective algorithm needs owners; one other than parts would replace the exact
    rank-order chain that an explicit --mfsdp-reduce-order rank asks for, so that pair is refused."""
    if args.mfsdp_collectives == "auto":
        return
    flag = f"--mfsdp-collectives {args.mfsdp_collectives}"
    if not args.use_matrix_fsdp:
        _fail(f"{flag} needs --use-matrix-fsdp (owner collectives are MatrixFSDP's)")
    if args.mfsdp_collectives != "parts" and args.mfsdp_reduce_order == "rank":
        _fail(
            f"{flag} with --mfsdp-reduce-order rank: the {args.mfsdp_collectives} reduction sums in its own "
            "order, not the exact rank order; force it with --mfsdp-reduce-order ring or auto"
        )


def _validate_qkv_owners(args) -> None:
    """Q, K and V apart are blocks of a matrix rule that updates them apart, on MatrixFSDP owners (the
    config checks the rest)."""
    if args.mfsdp_split_qkv_owners == "whole":
        return
    flag = f"--mfsdp-split-qkv-owners {args.mfsdp_split_qkv_owners}"
    rule = _matrix_rule(args)
    if not rule.splits_qkv(args):
        if rule.storage == "whole" and not getattr(args, "muon_split_qkv", True):
            _fail(f"{flag} places Q, K and V apart, which --muon-no-split-qkv orthogonalizes together")
        _fail(
            f"{flag} needs --optimizer muon (or another matrix optimizer that updates Q, K and V apart); "
            f"--optimizer {args.optimizer} updates a linear_qkv whole"
        )
    if args.mfsdp_layout != "owner":
        _fail(f"{flag} needs --mfsdp-layout owner (even shards have no owners)")
    if not args.use_matrix_fsdp:
        _fail(f"{flag} needs --use-matrix-fsdp (owners are a MatrixFSDP placement)")


def _matrix_rule(args):
    """The rule --optimizer runs on the model's matrices (optim/registry.py)."""
    from ...optim import registry

    return registry.optimizer_rule(args.optimizer)


def validate_optimizer(args) -> None:
    from ...optim import registry
    from ...placement.classes import parse_rule
    from ..setup import MEGATRON_OPTIMIZERS, optimizer_config, runtime_config

    args.muon_ns_dtype = args.muon_ns_dtype or _ns_dtype(args)
    args.param_rules = [parse_rule(rule, registry.rule_names()) for rule in args.mfsdp_param_rule]
    _validate_qkv_owners(args)  # flag-level reasons first; the configs then check their own fields
    _validate_layout(args)
    _validate_collectives(args)
    runtime_config(args)  # the configs validate their own fields (one source of truth)
    optimizer_config(args)
    if args.use_matrix_fsdp:
        for flag, on, instead in (
            (
                "--use-distributed-optimizer",
                args.use_distributed_optimizer,
                "optimizer state is already sharded by owner",
            ),
            (
                "--overlap-grad-reduce",
                args.overlap_grad_reduce,
                "each unit's reduction to its owners starts asynchronously when its gradients are ready",
            ),
            (
                "--overlap-param-gather",
                args.overlap_param_gather,
                "each unit's weights are prefetched from their owners --mfsdp-prefetch-depth units ahead",
            ),
        ):
            if on:
                args.notices.append(f"{flag} with --use-matrix-fsdp: {instead}")
    elif args.optimizer not in MEGATRON_OPTIMIZERS and (args.use_distributed_optimizer or args.overlap_param_gather):
        _fail(
            f"--optimizer {args.optimizer} with --use-distributed-optimizer or --overlap-param-gather needs "
            "--use-matrix-fsdp (megatron-core 0.16.1's own optimizer runs adam and sgd only, and Megatron-LM "
            "HEAD's layer-wise distributed optimizer for Muon is not built here; without --use-matrix-fsdp every "
            "rank would hold all optimizer state, with it each matrix's state is on its owner)"
        )
    elif args.overlap_param_gather and not args.use_distributed_optimizer:
        _fail("--overlap-param-gather needs --use-distributed-optimizer (as Megatron-LM)")


def _ns_dtype(args) -> str:
    """Newton-Schulz dtype when --muon-ns-dtype is not given: --muon-fp32-matmul-prec if given (as
    megatron-core: medium and low iterate in bf16, high in fp32), else bf16 on CUDA and by this
    CPU's capability (compat/cpu.py); a start-up notice says which and why."""
    if "--muon-fp32-matmul-prec" in args.explicit:
        dtype = "fp32" if args.muon_fp32_matmul_prec == "high" else "bf16"
        why = f"from --muon-fp32-matmul-prec {args.muon_fp32_matmul_prec} (as megatron-core)"
    elif _has_cuda():
        dtype, why = "bf16", "on CUDA"
    else:
        from ...compat.cpu import bf16_matmul_choice

        fast, reason = bf16_matmul_choice()
        dtype, why = ("bf16" if fast else "fp32"), f"on this CPU: {reason}"
    args.notices.append(f"--muon-ns-dtype not given: Newton-Schulz in {dtype} {why}")
    return dtype


def validate_data(args) -> None:
    """Data files checked against each other (.bin against .idx) and tokenizer files present,
    before any work; the tokenizer default is Megatron-LM's pretrain_gpt.py's."""
    from ...data.checks import check_data_prefixes

    _read_data_args_files(args)
    args.use_default_data = not (args.data_path or args.mock_data or args.train_data_path)
    if args.use_default_data:
        if args.tokenizer_model or args.vocab_file:
            _fail("a tokenizer given without --data-path or --mock-data: the embedded default data brings its own")
        args.tokenizer_type = "GPTSentencePieceTokenizer"  # its data ends documents with the model's </s>
        return
    if args.data_path and args.mock_data:
        _fail("--data-path and --mock-data exclude each other")
    if args.data_path and args.split is None:
        args.split = "969, 30, 1"
        args.notices.append('--split not given with --data-path: using Megatron-LM\'s legacy default "969, 30, 1"')
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        values = getattr(args, flag[2:].replace("-", "_"))
        data_prefixes(values, flag)  # the weights and prefixes alternate
        try:
            check_data_prefixes(values or [])
        except ValueError as err:
            _fail(f"{flag}: {err}")
    _validate_tokenizer(args)


def _read_data_args_files(args) -> None:
    """--data-args-path (--data-path's words in a file) and --per-split-data-args-path (a JSON object of the
    splits' words), as Megatron-LM reads them (get_blend_and_blend_per_split, megatron/training/utils/
    common_utils.py at HEAD)."""
    import json

    if args.data_args_path is not None:
        if args.data_path is not None:
            _fail("--data-args-path and --data-path exclude each other")
        args.data_path = _read_text(args.data_args_path, "--data-args-path").split()
    if args.per_split_data_args_path is not None:
        if args.train_data_path or args.valid_data_path or args.test_data_path:
            _fail("--per-split-data-args-path and --train/valid/test-data-path exclude each other")
        try:
            splits = json.loads(_read_text(args.per_split_data_args_path, "--per-split-data-args-path"))
            words = {k: v.split() if isinstance(v, str) else list(v) for k, v in splits.items()}
            args.train_data_path, args.valid_data_path = words["train"], words["valid"]
            args.test_data_path = words["test"]
        except (ValueError, KeyError, AttributeError, TypeError) as err:
            _fail(
                f"--per-split-data-args-path {args.per_split_data_args_path}: not a JSON object of train, valid "
                f"and test ({err})"
            )


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as err:
        _fail(f"{flag} {path}: cannot read it ({err.strerror})")


def _validate_tokenizer(args) -> None:
    if args.tokenizer_type is None:
        # Megatron-LM's pretrain_gpt.py defaults to GPT2BPETokenizer (args_defaults); mock data
        # without a tokenizer needs none, so NullTokenizer stands in there.
        args.tokenizer_type = "NullTokenizer" if args.mock_data and not args.vocab_file else "GPT2BPETokenizer"
    needs = {
        "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
        "NullTokenizer": ("--vocab-size",),
        "TikTokenizer": ("--tokenizer-model", "--tiktoken-pattern"),
    }.get(args.tokenizer_type, ("--tokenizer-model",))
    for flag in needs:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            _fail(f"--tokenizer-type {args.tokenizer_type} needs {flag}")
        if flag in ("--vocab-file", "--merge-file") or (
            flag == "--tokenizer-model" and args.tokenizer_type != "HuggingFaceTokenizer"
        ):
            if not os.path.isfile(value):
                _fail(f"{flag} {value}: no such file")
        elif flag == "--tokenizer-model" and not os.path.isdir(value):
            _fail(f"{flag} {value}: HuggingFaceTokenizer needs a local folder (no downloads here)")


def data_prefixes(values, flag: str) -> list:
    """The dataset prefixes of a Megatron-LM --data-path value: P1 P2 ... or W1 P1 W2 P2 ..."""
    if not values:
        return []
    if len(values) == 1:
        return list(values)
    weights, prefixes = values[0::2], values[1::2]
    try:
        [float(w) for w in weights]
    except ValueError:
        return list(values)
    if len(weights) != len(prefixes):
        _fail(f"{flag}: weights and prefixes must alternate (W1 P1 W2 P2 ...), got {len(values)} values")
    return list(prefixes)


def validate_device(args) -> None:
    """What this machine's megatron-core can run; what it cannot gets one notice."""
    te = _has_cuda() and _importable("transformer_engine")
    if args.transformer_impl == "inference_optimized":
        _fail("--transformer-impl inference_optimized is for inference only; use local or transformer_engine")
    if args.transformer_impl == "transformer_engine" and not te:
        args.transformer_impl = "local"
        args.notices.append(
            "--transformer-impl transformer_engine: Transformer Engine needs CUDA and is not available "
            "here; megatron-core's local layer spec runs (PyTorch SDPA core attention)"
        )
    if args.transformer_impl == "local" and args.attention_backend not in ("auto", "local"):
        args.notices.append(
            f"--attention-backend {args.attention_backend}: the local layer spec's core attention is PyTorch SDPA"
        )
    kernels = _importable("fused_weight_gradient_mlp_cuda") or te
    args.persist_layer_norm = not args.no_persist_layer_norm
    off = []
    for dest, label, available in (
        ("gradient_accumulation_fusion", "gradient accumulation (Apex or TE CUDA kernels)", kernels),
        ("persist_layer_norm", "persistent layer norm (TE or Apex)", te or _importable("apex")),
        ("apply_rope_fusion", "RoPE (TE)", te),
    ):
        if getattr(args, dest, False) and not available:
            setattr(args, dest, False)
            off.append(label)
    if args.cross_entropy_fusion_impl == "te" and not te:
        args.cross_entropy_fusion_impl = "native"
        off.append("TE cross entropy (the native fused one runs)")
    if off:
        args.notices.append("fusions not available on this machine, running without: " + ", ".join(off))
    if args.disable_jit_fuser:
        _disable_jit_fuser()
    if args.dataloader_type == "cyclic":
        _fail("--dataloader-type cyclic is not supported by megatron-mfsdp yet (single: Megatron-LM's default)")
    if "layernorm" in (args.recompute_modules or []) and args.transformer_impl != "transformer_engine":
        _fail(
            "--recompute-modules layernorm: megatron-core 0.16.1 recomputes the layernorms with its output-discarding "
            "checkpoint, which needs Transformer Engine (--transformer-impl transformer_engine, on CUDA); "
            "core_attn and mlp run with the local spec"
        )


def _disable_jit_fuser() -> None:
    """Megatron-LM's --disable-jit-fuser (megatron/training/global_vars.py at core_v0.16.1 calls
    megatron.core.jit.disable_jit_fuser). That swaps the decorator only for functions decorated
    later; megatron.core.fusions (bias-GeLU, bias-SwiGLU, ...) are decorated with torch.compile when
    imported, which happens before flags are parsed here, so the compiler's stance is set to eager
    too: no compilation (seconds per shape on a CPU, inductor's C++ build) for either."""
    import torch
    from megatron.core import jit

    jit.disable_jit_fuser()
    torch.compiler.set_stance("force_eager")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
