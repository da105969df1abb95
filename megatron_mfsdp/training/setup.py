"""From parsed flags to megatron-core objects: configs, the process groups, the model,
the wrapper, the optimizer and the learning-rate scheduler."""

from __future__ import annotations

import torch

from ..config import MatrixFSDPConfig, MatrixFSDPOptimizerConfig
from ..groups import ProcessGroups


def optimizer_config(args) -> MatrixFSDPOptimizerConfig:
    """megatron-core OptimizerConfig fields from the same-named flags, plus ours."""
    return MatrixFSDPOptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        bf16=args.bf16,
        fp16=args.fp16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        muon_momentum=args.muon_momentum,
        muon_use_nesterov=args.muon_nesterov,
        muon_num_ns_steps=args.muon_ns_steps,
        muon_coefficients=args.muon_coefficients,
        muon_ns_dtype=args.muon_ns_dtype,
        muon_scale_mode=args.muon_scale_mode,
        muon_extra_scale_factor=args.muon_extra_scale_factor,
        muon_split_qkv=args.muon_split_qkv,
        muon_tp_mode=args.muon_tp_mode,
    )


def runtime_config(args) -> MatrixFSDPConfig:
    return MatrixFSDPConfig(
        param_rules=args.param_rules,
        planner=args.mfsdp_planner,
        optimizer=args.optimizer,
        muon_split_qkv=args.muon_split_qkv,
        verify_collectives=args.mfsdp_verify_collectives,
    )


def transformer_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        init_method_std=args.init_method_std,
        use_cpu_initialization=args.use_cpu_initialization or not torch.cuda.is_available(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        deterministic_mode=args.deterministic_mode,
    )


def build_model_and_optimizer(args, vocab_size: int):
    """The process groups, the GPT model chunks (one per virtual pipeline stage) wrapped in
    MatrixFSDP, their optimizer and the lr scheduler.

    Without --use-matrix-fsdp the same wrapper runs as plain data parallelism (shard
    groups of one rank, replicated over all DP ranks): every rank holds and updates
    everything, with the same optimizer math, the baseline to compare with.
    """
    from megatron.core import parallel_state
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from ..models.gpt import build_gpt_model, initialize_by_global_name
    from ..optim.optimizer import get_megatron_optimizer
    from ..runtime.wrapper import MatrixFSDP

    config = transformer_config(args)
    groups = ProcessGroups.from_parallel_state(
        args.mfsdp_replicate_size if args.use_matrix_fsdp else args.data_parallel_size
    )
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
            position_embedding_type=args.position_embedding_type,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            vp_stage=vp,
        )
        if config.use_cpu_initialization:
            # Layout-independent start: every TP x PP x DP run begins from the 1 x 1 x 1 weights.
            initialize_by_global_name(
                model, config, args.seed, parallel_state.get_tensor_model_parallel_rank(), groups.tp_size
            )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(MatrixFSDP(config, runtime_config(args), model, groups))
    optimizer = get_megatron_optimizer(optimizer_config(args), chunks)
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
    return config, groups, chunks, optimizer, scheduler
