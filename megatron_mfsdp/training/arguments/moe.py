"""Mixture-of-experts checks and derived values, before any process group, model or dataset exists.

Megatron-LM's validate_args (megatron/training/arguments.py at core_v0.16.1) derives the expert
tensor-parallel size and the expert FFN size, and collapses one-element lists; megatron-core's
TransformerConfig checks the rest of the MoE settings when it is built, which here happens once at
parse time, so its refusal names the run's flags before any work. Bad input (experts that do not
split over EP, expert groups that do not tile the world, more experts per token than experts) is
named here; what this machine cannot run gets a one-line notice saying what runs instead.
"""

from __future__ import annotations


def _fail(message: str) -> None:
    raise ValueError(message)


def validate_moe(args) -> None:
    """--num-experts and the flags that shape it; nothing to do for a dense model."""
    tp = args.tensor_model_parallel_size
    if args.num_experts == 0:
        args.num_experts = None  # Megatron-LM's rule: 0 experts is a dense model
    if args.num_experts is None:
        _dense(args, tp)
        return
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp  # Megatron-LM's default
    for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, dest)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, dest, value[0])  # Megatron-LM's validate_args does the same
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size  # Megatron-LM's default (it warns)
    _check_layout(args)
    _check_backend(args)
    _device_notices(args)
    _gelu_fusion(args)
    _check_with_megatron_core(args)


def _dense(args, tp: int) -> None:
    if args.expert_model_parallel_size > 1:
        _fail(
            f"--expert-model-parallel-size {args.expert_model_parallel_size} needs --num-experts (experts to "
            "split; as Megatron-LM)"
        )
    if args.expert_tensor_parallel_size not in (None, tp):
        # Megatron-LM's dense functional-test configs set it: it shapes only the expert groups
        args.notices.append(
            "--expert-tensor-parallel-size: no experts (--num-experts not given), so no expert groups: ignored"
        )
    args.expert_tensor_parallel_size = tp


def _check_layout(args) -> None:
    """The experts' split over EP, the expert groups' tiling of the world, the routing and the layer
    pattern: each named with its flags."""
    experts, ep, etp = args.num_experts, args.expert_model_parallel_size, args.expert_tensor_parallel_size
    pp = args.pipeline_model_parallel_size
    if experts % ep:
        _fail(f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}")
    if args.world_size % (ep * etp * pp):
        _fail(
            f"world size {args.world_size} is not divisible by --expert-model-parallel-size {ep} x "
            f"--expert-tensor-parallel-size {etp} x --pipeline-model-parallel-size {pp}"
        )
    args.expert_data_parallel_size = args.world_size // (ep * etp * pp)
    if args.use_tp_pp_dp_mapping and pp > 1 and args.expert_data_parallel_size != args.data_parallel_size:
        _fail(
            f"--use-tp-pp-dp-mapping with --pipeline-model-parallel-size {pp}: the expert data-parallel size "
            f"{args.expert_data_parallel_size} (world / (EP x expert TP x PP)) must equal the data-parallel size "
            f"{args.data_parallel_size}, megatron-core's rule when the ranks are not ordered pipeline-last"
        )
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        _fail(
            f"--num-experts with --tensor-model-parallel-size {args.tensor_model_parallel_size} needs "
            "--sequence-parallel (megatron-core's MoE layer refuses to train without it: moe_layer.py at "
            "core_v0.16.1)"
        )
    if etp > 1 and args.add_bias_linear:
        given = "" if "--expert-tensor-parallel-size" in args.explicit else " (by default the TP size)"
        _fail(
            f"--expert-tensor-parallel-size {etp}{given} with biases: megatron-core has MoE biases at expert TP 1 "
            "only (transformer_config.py at core_v0.16.1); add --disable-bias-linear or --expert-tensor-parallel-size 1"
        )
    if args.moe_router_topk > experts:
        _fail(f"--moe-router-topk {args.moe_router_topk} is larger than --num-experts {experts}")
    freq = args.moe_layer_freq
    if isinstance(freq, list) and len(freq) != args.num_layers:
        _fail(f"--moe-layer-freq gives {len(freq)} layers, --num-layers {args.num_layers}: one entry per layer")
    if args.moe_token_dispatcher_type == "flex":
        _fail(
            "--moe-token-dispatcher-type flex: the flex dispatcher runs DeepEP or HybridEP CUDA kernels, which "
            "megatron-mfsdp does not support; use allgather (the default) or alltoall"
        )


def _check_backend(args) -> None:
    """Experts on MatrixFSDP (and on its replicated backend, --optimizer muon and the other rules without
    --use-matrix-fsdp): at EP 1 whole matrices of the dense shard domain (their TP group the dense one); at
    EP above 1 whole (expert-TP-local) matrices of the expert domain, over megatron-core's
    expert-data-parallel group at any TP and expert TP (runtime/wrapper.py), in either layout."""
    ep, etp, tp = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.tensor_model_parallel_size
    if ep == 1 and etp == tp:
        return
    from ..setup import MEGATRON_OPTIMIZERS

    if ep > 1 and (args.use_matrix_fsdp or args.optimizer not in MEGATRON_OPTIMIZERS):
        return  # the expert domain, with gcd(--mfsdp-replicate-size, expert DP) replicas (groups.py)
    if args.use_matrix_fsdp:
        how = "--use-matrix-fsdp"
    elif args.optimizer not in MEGATRON_OPTIMIZERS:
        how = f"--optimizer {args.optimizer} without --use-matrix-fsdp (MatrixFSDP replicated over data parallelism)"
    else:
        return  # megatron-core's DDP and optimizer: expert gradients over the expert-data-parallel group
    _fail(
        f"--expert-tensor-parallel-size {etp} (not --tensor-model-parallel-size {tp}) at --expert-model-parallel-size "
        f"1 with {how}: experts get a shard domain of their own (expert matrices on owners over the "
        "expert-data-parallel group) at --expert-model-parallel-size above 1; at EP 1 they are dense matrices and "
        "their tensor parallelism must be the dense one. Use EP above 1, --expert-tensor-parallel-size equal to "
        "--tensor-model-parallel-size, or megatron-core's DDP "
        "(--optimizer adam or sgd without --use-matrix-fsdp)"
    )


def _device_notices(args) -> None:
    """CUDA-only MoE kernels on a machine without them: off, with what runs instead (validate_device kept
    --transformer-impl transformer_engine only where Transformer Engine runs)."""
    import torch

    te = args.transformer_impl == "transformer_engine"
    for dest, flag, instead in (
        (
            "moe_grouped_gemm",
            "--moe-grouped-gemm",
            "SequentialMLP runs the local experts one GEMM each (megatron-core's legacy GroupedMLP, its "
            "fallback, is not used: its one weight holds every expert)",
        ),
        ("moe_permute_fusion", "--moe-permute-fusion", "the tokens are permuted by megatron-core's torch code"),
        ("moe_router_fusion", "--moe-router-fusion", "the router's top-k and auxiliary losses run unfused"),
    ):
        if getattr(args, dest) and not te:
            setattr(args, dest, False)
            args.notices.append(f"{flag}: needs Transformer Engine on CUDA, not available here; {instead}")
    if args.moe_shared_expert_overlap and not torch.cuda.is_available():
        args.moe_shared_expert_overlap = False
        args.notices.append(
            "--moe-shared-expert-overlap: overlaps the shared experts with the dispatch on CUDA streams; on this "
            "CPU they run unoverlapped, before the router"
        )


def _gelu_fusion(args) -> None:
    """megatron-core's experts scale their activation by the routing weights, and its MLP fuses that only
    for SwiGLU and quick-GELU (transformer/mlp.py at core_v0.16.1 raises "Only support fusion of swiglu
    and quick_gelu with per_token_scale in MLP" at the first forward): with GELU the bias-GELU runs
    unfused, in every MLP of the model, as --no-bias-gelu-fusion."""
    gelu = not (args.swiglu or args.squared_relu or args.openai_gelu)
    if gelu and args.bias_gelu_fusion and args.add_bias_linear and not args.moe_apply_probs_on_input:
        args.bias_gelu_fusion = False
        args.notices.append(
            "--num-experts with GELU: megatron-core's experts cannot fuse the bias-GELU with their routing weights "
            "(it fuses SwiGLU only), so bias and GELU run unfused in every MLP, as with --no-bias-gelu-fusion"
        )


def _check_with_megatron_core(args) -> None:
    """megatron-core's own MoE checks (TransformerConfig.__post_init__), run now with the run's values."""
    from ..configs import transformer_config_from_args

    try:
        transformer_config_from_args(args)
    except (ValueError, AssertionError) as err:
        _fail(f"--num-experts {args.num_experts}: megatron-core refuses the MoE settings: {err}")


def expert_layout_line(args) -> str | None:
    """The start-up line of the expert layout; None for a dense model."""
    if args.num_experts is None:
        return None
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    shared = args.moe_shared_expert_intermediate_size
    return (
        f"> experts: {args.num_experts} per MoE layer, top-{args.moe_router_topk} "
        f"({args.moe_router_score_function}), EP={ep} ({args.num_experts // ep} experts per rank) x expert "
        f"TP={etp} x expert DP={args.expert_data_parallel_size}, {args.moe_token_dispatcher_type} dispatcher, "
        f"FFN {args.moe_ffn_hidden_size} per expert"
        + (f", shared experts FFN {shared}" if shared else "")
        + f", load balancing {args.moe_router_load_balancing_type}"
        + (", expert bias" if args.moe_router_enable_expert_bias else "")
    )
