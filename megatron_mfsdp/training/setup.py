"""From parsed flags to megatron-core objects: configs, process groups, model chunks, the
data-parallel wrapper, the optimizer and the learning-rate scheduler.

Three ways to run, chosen by the flags:

- ``--use-matrix-fsdp``: MatrixFSDP (owner-sharded ZeRO-3) and its optimizer;
- otherwise with --optimizer adam or sgd: megatron-core's DistributedDataParallel and
  ``get_megatron_optimizer`` (its DistributedOptimizer with --use-distributed-optimizer):
  Megatron itself, the baseline;
- otherwise with --optimizer muon: megatron-core's Muon needs the emerging_optimizers package,
  so MatrixFSDP's Muon runs as plain data parallelism (every rank holds and updates everything).
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import MatrixFSDPConfig, MatrixFSDPOptimizerConfig
from ..groups import ProcessGroups
from ..optim import registry

MATRIX_FSDP, MEGATRON_DDP, REPLICATED = "matrix_fsdp", "megatron_ddp", "replicated"


MEGATRON_OPTIMIZERS = ("adam", "sgd")
"""What megatron-core 0.16.1's own DDP and optimizer run; any other --optimizer runs on the replicated backend."""


def backend(args) -> str:
    if args.use_matrix_fsdp:
        return MATRIX_FSDP
    return MEGATRON_DDP if args.optimizer in MEGATRON_OPTIMIZERS else REPLICATED


def runtime_config(args, on_cpu: bool | None = None) -> MatrixFSDPConfig:
    """The runtime config of the flags; ``on_cpu`` (default: no GPU here) is where the optimizer
    steps, which the planner's Newton-Schulz cost follows (tools/plan.py plans for GPUs)."""
    # Megatron-LM reduces bf16 gradients in fp32 unless --grad-reduce-in-bf16, fp16 ones in fp16 unless
    # --accumulate-allreduce-grads-in-fp32 (validate_args); the owner accumulates in fp32 either way.
    low_precision = args.bf16 or args.fp16
    return MatrixFSDPConfig(
        param_rules=args.param_rules,
        planner=args.mfsdp_planner,
        layout=args.mfsdp_layout,
        split_qkv_owners=args.mfsdp_split_qkv_owners,
        rules=registry.rule_set(
            args.param_rules,
            optimizer_config(args),
            args.mfsdp_layout,
            not torch.cuda.is_available() if on_cpu is None else on_cpu,
        ),
        verify_collectives=args.mfsdp_verify_collectives,
        reduce_order=args.mfsdp_reduce_order,
        collectives=args.mfsdp_collectives,
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 or not low_precision,
        prefetch_depth=args.mfsdp_prefetch_depth,
        overlap_grad_reduce=overlap_grad_reduce(args),
        **fp8_runtime_fields(args),
    )


def fp8_runtime_fields(args) -> dict:
    """FP8 parameters (validate_fp8 kept --fp8-format only with --use-matrix-fsdp --fp8-param-gather)."""
    from .configs import fp8_config_from_args

    fp8 = fp8_config_from_args(args) if getattr(args, "fp8_param_gather", False) else None
    if fp8 is None:
        return {}
    bf16_layers = (
        (args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16) if args.first_last_layers_bf16 else (0, 0)
    )
    return {"fp8": fp8, "fp8_bf16_layers": bf16_layers}


def overlap_grad_reduce(args) -> bool:
    """MatrixFSDP overlaps its reductions with --overlap-grad-reduce, and by default on CUDA (where the
    wire runs beside the compute); on a CPU the backend's threads compete with the compute for cores."""
    return bool(args.overlap_grad_reduce or torch.cuda.is_available())


def _same_named(cls, args, **overrides) -> dict:
    """Megatron-LM copies every argument named as a config field (training.py, get_model and
    get_megatron_optimizer_config at core_v0.16.1); so do we."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kw.update(overrides)
    return kw


def rule_settings(args) -> dict[str, object]:
    """Each update rule's settings from its own flags (optim/registry.py: setting_dest of each field)."""
    out = {}
    for rule in registry.settings_rules():
        fields = dataclasses.fields(rule.settings)
        out[rule.name] = rule.settings(**{f.name: getattr(args, registry.setting_dest(rule, f.name)) for f in fields})
    return out


def optimizer_config(args) -> MatrixFSDPOptimizerConfig:
    """megatron-core's OptimizerConfig fields and ours from the flags of their names, and each update
    rule's settings from its own flags (optim/registry.py)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    settings = rule_settings(args)
    return MatrixFSDPOptimizerConfig(
        **_same_named(MatrixFSDPOptimizerConfig, args, params_dtype=dtype, timers=None, rule_settings=settings)
    )


def megatron_optimizer_config(args):
    from megatron.core.optimizer import OptimizerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return OptimizerConfig(**_same_named(OptimizerConfig, args, params_dtype=dtype, timers=None))


def ddp_config(args):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        **_same_named(
            DistributedDataParallelConfig,
            args,
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
            average_in_collective=args.ddp_average_in_collective,
            bucket_size=args.ddp_bucket_size if args.overlap_grad_reduce else None,
        )
    )


def seed_cuda_rng_tracker(seed: int, on_cuda: bool | None = None) -> None:
    """megatron-core's CUDA RNG tracker seeded as Megatron-LM's _set_random_seed seeds it
    (megatron/training/initialize.py at core_v0.16.1): seed + 100 x the pipeline rank, through
    tensor_parallel.model_parallel_cuda_manual_seed, which adds the default, tensor-parallel and
    expert-parallel states that megatron-core's layers fork to initialize their weights on the GPU and to
    drop out (without them building a GPTModel on CUDA fails: "cuda rng state model-parallel-rng is not
    added"). Where there is no GPU the CPU generator serves and nothing is done, unless ``on_cuda`` says
    otherwise (the tests run it under compat.cpu.cuda_on_cpu)."""
    from megatron.core import parallel_state, tensor_parallel

    if on_cuda if on_cuda is not None else torch.cuda.device_count() > 0:
        tensor_parallel.model_parallel_cuda_manual_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())


def build_model_chunks(args, vocab_size: int, config, groups):
    """The GPT chunks of this rank, one per virtual pipeline stage, with layout-independent weights."""
    from megatron.core import parallel_state

    from ..models.gpt import build_gpt_model, initialize_by_global_name
    from .configs import gpt_model_kwargs_from_args

    chunks = []
    for vp in range(args.virtual_pipeline_model_parallel_size or 1):
        vp = vp if args.virtual_pipeline_model_parallel_size else None
        torch.manual_seed(args.seed)  # identical initial weights on every rank
        model = build_gpt_model(
            config,
            vocab_size=vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            use_transformer_engine=args.transformer_impl == "transformer_engine",
            vp_stage=vp,
            **gpt_model_kwargs_from_args(args),
        )
        if config.use_cpu_initialization:
            # Layout-independent start: every TP x PP x DP run begins from the 1 x 1 x 1 weights.
            initialize_by_global_name(
                model,
                config,
                args.seed,
                parallel_state.get_tensor_model_parallel_rank(),
                groups.tp_size,
                parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size(),
            )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def build_model_and_optimizer(args, vocab_size: int):
    """The process groups, wrapped model chunks, optimizer and lr scheduler of one job."""
    from .configs import transformer_config_from_args
    from .schedule import build_scheduler

    config = transformer_config_from_args(args)
    mode = backend(args)
    replicate = args.mfsdp_replicate_size if mode == MATRIX_FSDP else args.data_parallel_size
    groups = ProcessGroups.from_parallel_state(
        replicate if mode != MEGATRON_DDP else 1, args.mfsdp_ranks_per_node if mode != MEGATRON_DDP else None
    )
    models = build_model_chunks(args, vocab_size, config, groups)
    if mode == MEGATRON_DDP:
        chunks, optimizer = _megatron_ddp(args, config, models)
    else:
        from ..optim.optimizer import get_megatron_optimizer
        from ..runtime.wrapper import MatrixFSDP

        chunks = [MatrixFSDP(config, runtime_config(args), model, groups) for model in models]
        optimizer = get_megatron_optimizer(optimizer_config(args), chunks)
    return config, groups, chunks, optimizer, build_scheduler(args, optimizer)


def _megatron_ddp(args, config, models):
    """megatron-core's own DDP and optimizer: the baseline is Megatron itself (CPU through compat/)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer

    from ..compat.cpu import cuda_on_cpu

    with cuda_on_cpu():
        chunks = [
            DistributedDataParallel(config, ddp_config(args), model, disable_bucketing=i > 0)
            for i, model in enumerate(models)
        ]
        optimizer = get_megatron_optimizer(megatron_optimizer_config(args), chunks)
    for chunk in chunks:
        chunk.device = next(chunk.parameters()).device
    return chunks, optimizer


def configure_schedule(args, chunks, optimizer) -> None:
    """Point the chunks' TransformerConfig at the data-parallel wrapper's hooks, as Megatron-LM's
    setup does for its DDP (no_sync, grad/param sync, finalize_model_grads, loss scaling)."""
    if backend(args) != MEGATRON_DDP:
        from ..runtime.pipeline import configure_schedule as configure_mfsdp

        configure_mfsdp(chunks, optimizer)
        return
    from megatron.core.distributed import finalize_model_grads

    config = chunks[0].config
    one = len(chunks) == 1
    config.no_sync_func = chunks[0].no_sync if one else [c.no_sync for c in chunks]
    if args.overlap_grad_reduce and args.align_grad_reduce:
        config.grad_sync_func = chunks[0].start_grad_sync if one else [c.start_grad_sync for c in chunks]
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = chunks[0].start_param_sync if one else [c.start_param_sync for c in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss


NS_DTYPE_FLAGS = ("--muon-ns-dtype", "--muon-fp32-matmul-prec")
NS_DTYPE_NOTICE = "--muon-ns-dtype not given:"  # the start of validate.py's notice of the default


def agree_ns_dtype(args) -> None:
    """One Newton-Schulz dtype on every rank. Without NS_DTYPE_FLAGS each rank chose it from its
    own hardware (validate.py), so ranks on different machine types could iterate in different
    dtypes: then all take fp32, which every rank can run, and the notice names the ranks. Needs
    the process group; one process makes no collective."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if world == 1:
        return
    mine = None if set(NS_DTYPE_FLAGS) & set(args.explicit) else args.muon_ns_dtype
    choices = [None] * world
    dist.all_gather_object(choices, mine)  # flags that differ between ranks: check_ranks_agree says so
    chosen = sorted({c for c in choices if c is not None})
    if mine is None or len(chosen) < 2:
        return
    ranks = "; ".join(f"{d} on rank(s) {', '.join(str(r) for r, c in enumerate(choices) if c == d)}" for d in chosen)
    args.muon_ns_dtype = "fp32"
    args.notices = [n for n in args.notices if not n.startswith(NS_DTYPE_NOTICE)] + [
        f"{NS_DTYPE_NOTICE} Newton-Schulz in fp32 on every rank: the ranks' hardware chose differently ({ranks})"
    ]
