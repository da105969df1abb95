"""pretrain_gpt.py's flags: Megatron-LM's names, defaults and meaning; bad input named before any
work; Megatron-LM flags that do not apply here (accepted with a notice) or are refused (a clear error)."""

import pytest

from megatron_mfsdp.data.datasets import padded_vocab_size
from megatron_mfsdp.training.arguments import accepted, build_parser, parse_args
from tests.launch import TINY
from tests.launch import parse as _parse
from tests.launch import parse_error as _error

# The dest and default of every flag we share with Megatron-LM, as its own parser has them: the
# parser of megatron/training/arguments.py at tag core_v0.16.1 was built and read flag by flag
# (attention backend's enum default AttnBackend.auto written by its name). Written out here so
# that a change of ours that drifts from Megatron-LM fails.
MEGATRON_LM_0161 = {
    "--account-for-embedding-in-pipeline-split": ("account_for_embedding_in_pipeline_split", False),
    "--account-for-loss-in-pipeline-split": ("account_for_loss_in_pipeline_split", False),
    "--accumulate-allreduce-grads-in-fp32": ("accumulate_allreduce_grads_in_fp32", False),
    "--adam-beta1": ("adam_beta1", 0.9),
    "--adam-beta2": ("adam_beta2", 0.999),
    "--adam-eps": ("adam_eps", 1e-08),
    "--add-qkv-bias": ("add_qkv_bias", False),
    "--apply-layernorm-1p": ("layernorm_zero_centered_gamma", False),
    "--apply-query-key-layer-scaling": ("apply_query_key_layer_scaling", False),
    "--apply-wd-to-qk-layernorm": ("apply_wd_to_qk_layernorm", False),
    "--async-save": ("async_save", False),
    "--attention-backend": ("attention_backend", "auto"),
    "--attention-dropout": ("attention_dropout", 0.1),
    "--attention-softmax-in-fp32": ("attention_softmax_in_fp32", False),
    "--auto-detect-ckpt-format": ("auto_detect_ckpt_format", False),
    "--bf16": ("bf16", False),
    "--calculate-per-token-loss": ("calculate_per_token_loss", False),
    "--ckpt-assume-constant-structure": ("ckpt_assume_constant_structure", False),
    "--ckpt-format": ("ckpt_format", "torch_dist"),
    "--ckpt-fully-parallel-load": ("ckpt_fully_parallel_load", False),
    "--ckpt-fully-parallel-save": ("ckpt_fully_parallel_save_deprecated", False),
    "--ckpt-step": ("ckpt_step", None),
    "--clip-grad": ("clip_grad", 1.0),
    "--cross-entropy-fusion-impl": ("cross_entropy_fusion_impl", "native"),
    "--cross-entropy-loss-fusion": ("cross_entropy_loss_fusion", False),
    "--data-cache-path": ("data_cache_path", None),
    "--data-path": ("data_path", None),
    "--dataloader-type": ("dataloader_type", None),
    "--ddp-average-in-collective": ("ddp_average_in_collective", False),
    "--ddp-bucket-size": ("ddp_bucket_size", None),
    "--decoder-first-pipeline-num-layers": ("decoder_first_pipeline_num_layers", None),
    "--decoder-last-pipeline-num-layers": ("decoder_last_pipeline_num_layers", None),
    "--decoupled-lr": ("decoupled_lr", None),
    "--decoupled-min-lr": ("decoupled_min_lr", None),
    "--deterministic-mode": ("deterministic_mode", False),
    "--disable-bias-linear": ("add_bias_linear", True),
    "--disable-gloo-process-groups": ("enable_gloo_process_groups", True),
    "--disable-jit-fuser": ("disable_jit_fuser", False),
    "--disable-log-loss-scale-to-tensorboard": ("log_loss_scale_to_tensorboard", True),
    "--dist-ckpt-optim-fully-reshardable": ("dist_ckpt_optim_fully_reshardable", False),
    "--dist-ckpt-strictness": ("dist_ckpt_strictness", "assume_ok_unexpected"),
    "--distributed-backend": ("distributed_backend", "nccl"),
    "--distributed-timeout-minutes": ("distributed_timeout_minutes", 10),
    "--empty-unused-memory-level": ("empty_unused_memory_level", 0),
    "--end-weight-decay": ("end_weight_decay", None),
    "--eod-mask-loss": ("eod_mask_loss", False),
    "--eval-interval": ("eval_interval", None),
    "--eval-iters": ("eval_iters", 100),
    "--exit-duration-in-mins": ("exit_duration_in_mins", None),
    "--exit-interval": ("exit_interval", None),
    "--exit-on-missing-checkpoint": ("exit_on_missing_checkpoint", False),
    "--exit-signal-handler": ("exit_signal_handler", False),
    "--expert-model-parallel-size": ("expert_model_parallel_size", 1),
    "--expert-tensor-parallel-size": ("expert_tensor_parallel_size", None),
    "--ffn-hidden-size": ("ffn_hidden_size", None),
    "--finetune": ("finetune", False),
    "--first-last-layers-bf16": ("first_last_layers_bf16", False),
    "--fp16": ("fp16", False),
    "--fp32-residual-connection": ("fp32_residual_connection", False),
    "--fp8-amax-compute-algo": ("fp8_amax_compute_algo", "most_recent"),
    "--fp8-amax-history-len": ("fp8_amax_history_len", 1),
    "--fp8-format": ("fp8", None),
    "--fp8-margin": ("fp8_margin", 0),
    "--fp8-param-gather": ("fp8_param_gather", False),
    "--fp8-recipe": ("fp8_recipe", "delayed"),
    "--global-batch-size": ("global_batch_size", None),
    "--grad-reduce-in-bf16": ("grad_reduce_in_bf16", False),
    "--group-query-attention": ("group_query_attention", False),
    "--help": ("help", "==SUPPRESS=="),
    "--hidden-dropout": ("hidden_dropout", 0.1),
    "--hidden-size": ("hidden_size", None),
    "--hysteresis": ("hysteresis", 2),
    "--init-method-std": ("init_method_std", 0.02),
    "--initial-loss-scale": ("initial_loss_scale", 4294967296),
    "--kv-channels": ("kv_channels", None),
    "--load": ("load", None),
    "--local-rank": ("local_rank", 0),
    "--log-interval": ("log_interval", 100),
    "--log-memory-to-tensorboard": ("log_memory_to_tensorboard", False),
    "--log-num-zeros-in-grad": ("log_num_zeros_in_grad", False),
    "--log-params-norm": ("log_params_norm", False),
    "--log-throughput": ("log_throughput", False),
    "--log-timers-to-tensorboard": ("log_timers_to_tensorboard", False),
    "--log-validation-ppl-to-tensorboard": ("log_validation_ppl_to_tensorboard", False),
    "--log-world-size-to-tensorboard": ("log_world_size_to_tensorboard", False),
    "--loss-scale": ("loss_scale", None),
    "--loss-scale-window": ("loss_scale_window", 1000),
    "--lr": ("lr", None),
    "--lr-decay-iters": ("lr_decay_iters", None),
    "--lr-decay-samples": ("lr_decay_samples", None),
    "--lr-decay-style": ("lr_decay_style", "linear"),
    "--lr-warmup-fraction": ("lr_warmup_fraction", None),
    "--lr-warmup-init": ("lr_warmup_init", 0.0),
    "--lr-warmup-iters": ("lr_warmup_iters", 0),
    "--lr-warmup-samples": ("lr_warmup_samples", 0),
    "--lr-wsd-decay-iters": ("lr_wsd_decay_iters", None),
    "--lr-wsd-decay-samples": ("lr_wsd_decay_samples", None),
    "--lr-wsd-decay-style": ("lr_wsd_decay_style", "exponential"),
    "--make-vocab-size-divisible-by": ("make_vocab_size_divisible_by", 128),
    "--manual-gc": ("manual_gc", False),
    "--manual-gc-interval": ("manual_gc_interval", 0),
    "--max-position-embeddings": ("max_position_embeddings", None),
    "--merge-file": ("merge_file", None),
    "--micro-batch-size": ("micro_batch_size", None),
    "--microbatch-group-size-per-virtual-pipeline-stage": ("microbatch_group_size_per_vp_stage", None),
    "--min-loss-scale": ("min_loss_scale", 1.0),
    "--min-lr": ("min_lr", 0.0),
    "--mock-data": ("mock_data", False),
    "--moe-apply-probs-on-input": ("moe_apply_probs_on_input", False),
    "--moe-aux-loss-coeff": ("moe_aux_loss_coeff", 0.0),
    "--moe-expert-capacity-factor": ("moe_expert_capacity_factor", None),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", None),
    "--moe-grouped-gemm": ("moe_grouped_gemm", False),
    "--moe-input-jitter-eps": ("moe_input_jitter_eps", None),
    "--moe-layer-freq": ("moe_layer_freq", 1),
    "--moe-pad-expert-input-to-capacity": ("moe_pad_expert_input_to_capacity", False),
    "--moe-per-layer-logging": ("moe_per_layer_logging", False),
    "--moe-permute-fusion": ("moe_permute_fusion", False),
    "--moe-router-bias-update-rate": ("moe_router_bias_update_rate", 0.001),
    "--moe-router-dtype": ("moe_router_dtype", None),
    "--moe-router-enable-expert-bias": ("moe_router_enable_expert_bias", False),
    "--moe-router-force-load-balancing": ("moe_router_force_load_balancing", False),
    "--moe-router-fusion": ("moe_router_fusion", False),
    "--moe-router-group-topk": ("moe_router_group_topk", None),
    "--moe-router-load-balancing-type": ("moe_router_load_balancing_type", "aux_loss"),
    "--moe-router-num-groups": ("moe_router_num_groups", None),
    "--moe-router-pre-softmax": ("moe_router_pre_softmax", False),
    "--moe-router-score-function": ("moe_router_score_function", "softmax"),
    "--moe-router-topk": ("moe_router_topk", 2),
    "--moe-router-topk-scaling-factor": ("moe_router_topk_scaling_factor", None),
    "--moe-shared-expert-gate": ("moe_shared_expert_gate", False),
    "--moe-shared-expert-intermediate-size": ("moe_shared_expert_intermediate_size", None),
    "--moe-shared-expert-overlap": ("moe_shared_expert_overlap", False),
    "--moe-token-dispatcher-type": ("moe_token_dispatcher_type", "allgather"),
    "--moe-token-drop-policy": ("moe_token_drop_policy", "probs"),
    "--moe-z-loss-coeff": ("moe_z_loss_coeff", None),
    "--muon-extra-scale-factor": ("muon_extra_scale_factor", 1.0),
    "--muon-fp32-matmul-prec": ("muon_fp32_matmul_prec", "medium"),
    "--muon-momentum": ("muon_momentum", 0.9),
    "--muon-no-split-qkv": ("muon_split_qkv", True),
    "--muon-num-ns-steps": ("muon_num_ns_steps", 5),
    "--muon-scale-mode": ("muon_scale_mode", "spectral"),
    "--muon-tp-mode": ("muon_tp_mode", "blockwise"),
    "--muon-use-nesterov": ("muon_use_nesterov", False),
    "--no-align-grad-reduce": ("align_grad_reduce", True),
    "--no-align-param-gather": ("align_param_gather", True),
    "--no-bias-dropout-fusion": ("bias_dropout_fusion", True),
    "--no-bias-gelu-fusion": ("bias_gelu_fusion", True),
    "--no-bias-swiglu-fusion": ("bias_swiglu_fusion", True),
    "--no-check-for-nan-in-loss-and-grad": ("check_for_nan_in_loss_and_grad", True),
    "--no-ckpt-fully-parallel-save": ("ckpt_fully_parallel_save", True),
    "--no-create-attention-mask-in-dataloader": ("create_attention_mask_in_dataloader", True),
    "--no-gradient-accumulation-fusion": ("gradient_accumulation_fusion", True),
    "--no-load-optim": ("no_load_optim", None),
    "--no-load-rng": ("no_load_rng", None),
    "--no-manual-gc-eval": ("manual_gc_eval", True),
    "--no-masked-softmax-fusion": ("masked_softmax_fusion", True),
    "--no-mmap-bin-files": ("mmap_bin_files", True),
    "--no-overlap-p2p-communication": ("overlap_p2p_comm", True),
    "--no-persist-layer-norm": ("no_persist_layer_norm", False),
    "--no-position-embedding": ("add_position_embedding", True),
    "--no-rope-fusion": ("apply_rope_fusion", True),
    "--no-save-optim": ("no_save_optim", None),
    "--no-save-rng": ("no_save_rng", None),
    "--norm-epsilon": ("layernorm_epsilon", 1e-05),
    "--normalization": ("normalization", "LayerNorm"),
    "--num-attention-heads": ("num_attention_heads", None),
    "--num-dataset-builder-threads": ("num_dataset_builder_threads", 1),
    "--num-distributed-optimizer-instances": ("num_distributed_optimizer_instances", 1),
    "--num-experts": ("num_experts", None),
    "--num-layers": ("num_layers", None),
    "--num-layers-at-end-in-bf16": ("num_layers_at_end_in_bf16", 1),
    "--num-layers-at-start-in-bf16": ("num_layers_at_start_in_bf16", 1),
    "--num-layers-per-virtual-pipeline-stage": ("num_layers_per_virtual_pipeline_stage", None),
    "--num-query-groups": ("num_query_groups", 1),
    "--num-virtual-stages-per-pipeline-rank": ("num_virtual_stages_per_pipeline_rank", None),
    "--num-workers": ("num_workers", 2),
    "--openai-gelu": ("openai_gelu", False),
    "--optimizer": ("optimizer", "adam"),
    "--overlap-grad-reduce": ("overlap_grad_reduce", False),
    "--overlap-p2p-communication-warmup-flush": ("overlap_p2p_comm_warmup_flush", False),
    "--overlap-param-gather": ("overlap_param_gather", False),
    "--overlap-param-gather-with-optimizer-step": ("overlap_param_gather_with_optimizer_step", False),
    "--override-opt-param-scheduler": ("override_opt_param_scheduler", False),
    "--persistent-save-interval": ("save_interval", None),
    "--pipeline-model-parallel-size": ("pipeline_model_parallel_size", 1),
    "--position-embedding-type": ("position_embedding_type", "learned_absolute"),
    "--pretrained-checkpoint": ("pretrained_checkpoint", None),
    "--profile": ("profile", False),
    "--profile-ranks": ("profile_ranks", [0]),
    "--profile-step-end": ("profile_step_end", 12),
    "--profile-step-start": ("profile_step_start", 10),
    "--qk-layernorm": ("qk_layernorm", False),
    "--rampup-batch-size": ("rampup_batch_size", None),
    "--recompute-activations": ("recompute_activations", False),
    "--recompute-granularity": ("recompute_granularity", None),
    "--recompute-method": ("recompute_method", None),
    "--recompute-num-layers": ("recompute_num_layers", None),
    "--reset-attention-mask": ("reset_attention_mask", False),
    "--reset-position-ids": ("reset_position_ids", False),
    "--rope-scaling-factor": ("rope_scaling_factor", 8.0),
    "--multi-latent-attention": ("multi_latent_attention", False),
    "--q-lora-rank": ("q_lora_rank", None),
    "--kv-lora-rank": ("kv_lora_rank", 32),
    "--qk-head-dim": ("qk_head_dim", 128),
    "--qk-pos-emb-head-dim": ("qk_pos_emb_head_dim", 64),
    "--v-head-dim": ("v_head_dim", 128),
    "--rotary-scaling-factor": ("rotary_scaling_factor", 1.0),
    "--mscale": ("mscale", 1.0),
    "--mscale-all-dim": ("mscale_all_dim", 0.0),
    "--rope-type": ("rope_type", None),
    "--rotary-base": ("rotary_base", 10000),
    "--rotary-interleaved": ("rotary_interleaved", False),
    "--rotary-percent": ("rotary_percent", 1.0),
    "--rotary-seq-len-interpolation-factor": ("rotary_seq_len_interpolation_factor", None),
    "--save": ("save", None),
    "--save-retain-interval": ("save_retain_interval", None),
    "--seed": ("seed", 1234),
    "--seq-length": ("seq_length", None),
    "--sequence-parallel": ("sequence_parallel", False),
    "--sgd-momentum": ("sgd_momentum", 0.9),
    "--skip-train": ("skip_train", False),
    "--split": ("split", None),
    "--squared-relu": ("squared_relu", False),
    "--start-weight-decay": ("start_weight_decay", None),
    "--swiglu": ("swiglu", False),
    "--tensor-model-parallel-size": ("tensor_model_parallel_size", 1),
    "--tensorboard-dir": ("tensorboard_dir", None),
    "--tensorboard-log-interval": ("tensorboard_log_interval", 1),
    "--tensorboard-queue-size": ("tensorboard_queue_size", 1000),
    "--test-data-path": ("test_data_path", None),
    "--tiktoken-num-special-tokens": ("tiktoken_num_special_tokens", 1000),
    "--tiktoken-pattern": ("tiktoken_pattern", None),
    "--timing-log-level": ("timing_log_level", 0),
    "--timing-log-option": ("timing_log_option", "minmax"),
    "--tokenizer-model": ("tokenizer_model", None),
    "--tokenizer-special-tokens": ("tokenizer_special_tokens", None),
    "--tokenizer-type": ("tokenizer_type", None),
    "--train-data-path": ("train_data_path", None),
    "--train-iters": ("train_iters", None),
    "--train-samples": ("train_samples", None),
    "--transformer-impl": ("transformer_impl", "transformer_engine"),
    "--untie-embeddings-and-output-weights": ("untie_embeddings_and_output_weights", False),
    "--use-checkpoint-args": ("use_checkpoint_args", False),
    "--use-checkpoint-opt-param-scheduler": ("use_checkpoint_opt_param_scheduler", False),
    "--use-cpu-initialization": ("use_cpu_initialization", None),
    "--use-distributed-optimizer": ("use_distributed_optimizer", False),
    "--use-mcore-models": ("deprecated_use_mcore_models", False),
    "--use-persistent-ckpt-worker": ("use_persistent_ckpt_worker", False),
    "--use-pytorch-profiler": ("use_pytorch_profiler", False),
    "--use-rope-scaling": ("use_rope_scaling", False),
    "--use-rotary-position-embeddings": ("use_rotary_position_embeddings", False),
    "--use-tp-pp-dp-mapping": ("use_tp_pp_dp_mapping", False),
    "--valid-data-path": ("valid_data_path", None),
    "--vocab-extra-ids": ("vocab_extra_ids", 0),
    "--vocab-file": ("vocab_file", None),
    "--vocab-size": ("vocab_size", None),
    "--wandb-entity": ("wandb_entity", None),
    "--wandb-exp-name": ("wandb_exp_name", None),
    "--wandb-project": ("wandb_project", None),
    "--wandb-save-dir": ("wandb_save_dir", None),
    "--weight-decay": ("weight_decay", 0.01),
    "--weight-decay-incr-style": ("weight_decay_incr_style", "constant"),
}

# The least a Megatron-LM user must give; everything else at Megatron-LM's defaults.
MINIMAL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "3",
    "--lr",
    "1e-3",
    "--mock-data",
    "--vocab-size",
    "128",
]


def _without(argv, *flags):
    """argv less the given flags and their values."""
    out, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token in flags
        if not skipping:
            out.append(token)
    return out


def test_every_shared_flag_has_megatron_lms_dest_and_default():
    actions = build_parser()._option_string_actions
    assert len(MEGATRON_LM_0161) == 263
    wrong = []
    for flag, (dest, default) in MEGATRON_LM_0161.items():
        action = actions.get(flag)
        if action is None or action.dest != dest or action.default != default:
            wrong.append((flag, getattr(action, "dest", None), getattr(action, "default", None), dest, default))
    assert not wrong, wrong


def test_defaults_after_validation_are_megatron_lms():
    """The defaults the issue names, and the values validate_args derives from them."""
    args = _parse(MINIMAL)
    assert args.optimizer == "adam" and not args.use_matrix_fsdp
    assert (args.adam_beta1, args.adam_beta2, args.adam_eps) == (0.9, 0.999, 1e-8)
    assert args.hidden_dropout == args.attention_dropout == 0.1
    assert (args.lr_warmup_iters, args.lr_decay_style, args.clip_grad, args.weight_decay) == (0, "linear", 1.0, 0.01)
    assert args.global_batch_size == 2 and args.num_microbatches == 1  # micro batch x DP
    assert args.ffn_hidden_size == 256 and args.kv_channels == 16
    assert args.check_for_nan_in_loss_and_grad and args.split is None
    assert (args.muon_momentum, args.muon_use_nesterov, args.muon_coefficient_type) == (0.9, False, "quintic")
    assert (args.muon_num_ns_steps, args.muon_scale_mode, args.muon_extra_scale_factor) == (5, "spectral", 1.0)
    assert args.muon_split_qkv and args.muon_tp_mode == "blockwise" and args.muon_fp32_matmul_prec == "medium"


def test_swiglu_ffn_size_as_megatron_computes_it():
    # validate_args: int((4 * hidden * 2 / 3) / 64) * 64 (Llama-2-7B's 4096 -> 10880; 64 -> 128).
    big = [v if v != "64" else "4096" for v in MINIMAL]
    assert _parse(big + ["--swiglu", "--num-attention-heads", "32"]).ffn_hidden_size == 10880
    assert _parse(MINIMAL + ["--swiglu"]).ffn_hidden_size == 128
    assert _parse(MINIMAL + ["--swiglu", "--ffn-hidden-size", "96"]).ffn_hidden_size == 96


def test_vocab_padding_is_multiplied_by_tp():
    """_vocab_size_with_padding in megatron/training/tokenizer/tokenizer.py: multiple of divisor x TP."""
    assert padded_vocab_size(50257, 128, 1) == 50304  # GPT-2's "47 dummy tokens"
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(32000, 128, 2) == 32000
    assert padded_vocab_size(200, 128, 2) == 256 and padded_vocab_size(257, 128, 2) == 512


def test_train_iters_or_samples_required_and_exclusive(capsys):
    no_length = _without(MINIMAL, "--train-iters")
    assert "give exactly one of --train-iters and --train-samples" in _error(no_length, capsys)
    both = MINIMAL + ["--train-samples", "12"]
    assert "give exactly one of --train-iters and --train-samples" in _error(both, capsys)
    assert _parse(no_length + ["--train-samples", "12"]).train_samples == 12


def test_no_abbreviations(capsys):
    """allow_abbrev=False, as Megatron-LM: a prefix is not silently taken for a flag."""
    assert "unrecognized arguments: --micro-batch 2" in _error(TINY + ["--micro-batch", "2"], capsys)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--micro-batch-size", "0"], "argument --micro-batch-size: must be a positive integer, got 0"),
        (["--seq-length", "0"], "argument --seq-length: must be a positive integer, got 0"),
        (["--num-layers", "0"], "argument --num-layers: must be a positive integer, got 0"),
        (["--hidden-size", "-64"], "argument --hidden-size: must be a positive integer, got -64"),
        (["--log-interval", "0"], "argument --log-interval: must be a positive integer, got 0"),
        (["--eval-interval", "0"], "argument --eval-interval: must be a positive integer"),
        (["--save-interval", "0"], "--save-interval/--persistent-save-interval: must be a positive integer"),
        (["--tensor-model-parallel-size", "0"], "argument --tensor-model-parallel-size: must be a positive integer"),
        (["--tensor-model-parallel-size", "-1"], "argument --tensor-model-parallel-size: must be a positive integer"),
        (["--pipeline-model-parallel-size", "0"], "argument --pipeline-model-parallel-size: must be a positive"),
        (["--lr", "nan"], "argument --lr: must be a finite number, got 'nan'"),
        (["--lr", "inf"], "argument --lr: must be a finite number, got 'inf'"),
        (["--lr", "-1"], "argument --lr: must be >= 0"),
        (["--min-lr", "nan"], "argument --min-lr: must be a finite number"),
        (["--weight-decay", "inf"], "argument --weight-decay: must be a finite number"),
        (["--clip-grad", "-1"], "argument --clip-grad: must be >= 0"),
        (["--global-batch-size", "0"], "argument --global-batch-size: must be a positive integer"),
        (["--global-batch-size", "-8"], "argument --global-batch-size: must be a positive integer"),
        (["--train-iters", "0"], "argument --train-iters: must be a positive integer"),
        (["--train-iters", "-3"], "argument --train-iters: must be a positive integer"),
        (["--eval-iters", "-1"], "argument --eval-iters: must be >= 0"),
        (["--hidden-dropout", "1.5"], "argument --hidden-dropout: must be in [0, 1]"),
        (["--adam-eps", "0"], "argument --adam-eps: must be > 0"),
        (["--rotary-percent", "0"], "argument --rotary-percent: must be in (0, 1]"),
        (["--muon-num-ns-steps", "0"], "argument --muon-num-ns-steps: must be a positive integer"),
        (["--muon-momentum", "1.5"], "argument --muon-momentum: must be in [0, 1]"),
        (["--exit-interval", "0"], "argument --exit-interval: must be a positive integer"),
        (["--num-workers", "-1"], "argument --num-workers: must be >= 0"),
        (["--micro-batch-size", "two"], "argument --micro-batch-size: expected an integer, got 'two'"),
        (["--global-batch-size", "6"], "--global-batch-size 6 is not divisible"),
        (["--fp16", "--bf16"], "--fp16 and --bf16"),
        (["--num-attention-heads", "3"], "--hidden-size 64 is not divisible by --num-attention-heads 3"),
        (["--optimizer", "lamb"], "argument --optimizer: invalid choice: 'lamb'"),
        (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        (["--train-samples", "40"], "give exactly one of --train-iters and --train-samples"),
        (["--lr-warmup-samples", "4"], "--lr-warmup-samples is sample-based and does not combine with --train-iters"),
        (["--min-lr", "1"], "--min-lr 1.0 is larger than --lr 0.003"),
        (["--seq-length", "64"], "--max-position-embeddings 32 must be >= --seq-length 64"),
        (["--swiglu", "--squared-relu"], "--swiglu and --squared-relu exclude each other"),
        (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
        (
            ["--tensor-model-parallel-size", "2", "--num-query-groups", "1"],
            "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2",
        ),
        (["--tensor-model-parallel-size", "4"], "world size 2 is not divisible by --tensor-model-parallel-size 4"),
        (["--mfsdp-replicate-size", "3"], "--mfsdp-replicate-size 3 does not divide the data-parallel size 2"),
        (["--mfsdp-ranks-per-node", "3"], "--mfsdp-ranks-per-node 3 does not divide the world size 2"),
        (["--mfsdp-ranks-per-node", "0"], "argument --mfsdp-ranks-per-node: must be a positive integer"),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
            "--num-layers-per-virtual-pipeline-stage 2 needs",
        ),
        (["--muon-tp-mode", "sharded"], "argument --muon-tp-mode: invalid choice"),
        (["--muon-scale-mode", "frobenius"], "argument --muon-scale-mode: invalid choice"),
        (
            ["--muon-coefficient-type", "quintic", "--muon-num-ns-steps", "7"],
            "--muon-num-ns-steps 7 must be a multiple",
        ),
        (["--save", "/proc/forbidden", "--save-interval", "5"], "--save /proc/forbidden: cannot create the folder"),
        (["--save", "/tmp"], "--save needs --save-interval"),
        (["--dataloader-type", "cyclic"], "--dataloader-type cyclic is not supported by megatron-mfsdp yet"),
        # megatron-core's OptimizerParamScheduler asserts these (a bare AssertionError in Megatron-LM)
        (["--lr-warmup-iters", "5"], "--lr-warmup-iters gives 5 warmup iterations, not fewer than the 5 iterations"),
        (
            ["--lr-warmup-iters", "0", "--lr-warmup-fraction", "1"],
            "--lr-warmup-fraction 1.0 gives 5 warmup iterations, not fewer than the 5",
        ),
        (["--lr-warmup-init", "0.01"], "--lr-warmup-init 0.01 is larger than --lr 0.003"),
        (
            ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "9"],
            "the WSD decay (9 iterations) is longer than the 5 iterations of --train-iters",
        ),
        (
            ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
            "give only one of --override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler",
        ),
        # Q, K and V apart (placement/blocks.py): the blocks are owned Muon matrices updated apart.
        (["--mfsdp-split-qkv-owners", "bogus"], "argument --mfsdp-split-qkv-owners: invalid choice: 'bogus'"),
        (
            ["--mfsdp-split-qkv-owners", "contiguous", "--muon-no-split-qkv"],
            "--mfsdp-split-qkv-owners contiguous places Q, K and V apart, which --muon-no-split-qkv orthogonalizes",
        ),
        (
            ["--mfsdp-split-qkv-owners", "contiguous", "--mfsdp-layout", "even"],
            "--mfsdp-split-qkv-owners contiguous needs --mfsdp-layout owner",
        ),
        (
            ["--mfsdp-split-qkv-owners", "contiguous"],
            "--mfsdp-split-qkv-owners contiguous needs --use-matrix-fsdp",
        ),
        (
            ["--mfsdp-split-qkv-owners", "contiguous", "--use-matrix-fsdp", "--optimizer", "adam"],
            "--mfsdp-split-qkv-owners contiguous needs --optimizer muon",
        ),
    ],
)
def test_bad_values_exit_2_naming_the_flag(flags, message, capsys):
    assert message in _error(TINY + flags, capsys)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--moe-use-upcycling"], "--moe-use-upcycling: MoE upcycling (a dense checkpoint turned into experts) is"),
        (["--num-experts", "4", "--moe-enable-deepep"], "--moe-enable-deepep: the flex token dispatcher (DeepEP,"),
        (["--context-parallel-size", "2"], "--context-parallel-size: context parallelism is not supported"),
        (["--cache-mla-latents"], "--cache-mla-latents: caching multi-latent attention's latents"),
        (["--use-megatron-fsdp"], "--use-megatron-fsdp: Megatron-FSDP and torch FSDP2 (use --use-matrix-fsdp"),
        (["--fim-data"], "--fim-data: FIM datasets is not supported by megatron-mfsdp yet"),
    ],
)
def test_unsupported_megatron_features_give_one_clear_error(flags, message, capsys):
    err = _error(TINY + flags, capsys)
    assert message in err and "unrecognized arguments" not in err


def test_unsupported_flags_at_their_harmless_values_parse():
    args = _parse(
        TINY
        + ["--num-experts", "0", "--context-parallel-size", "1", "--expert-model-parallel-size", "1"]
        + ["--expert-tensor-parallel-size", "4"]
    )
    assert args.tensor_model_parallel_size == 1
    assert any(n.startswith("--expert-tensor-parallel-size: no experts") for n in args.notices)


@pytest.mark.parametrize(
    "typo,meant",
    [
        ("--use-matrix-fsd", "--use-matrix-fsdp"),  # ours
        ("--tensor-model-paralel-size", "--tensor-model-parallel-size"),  # Megatron-LM's, implemented
        ("--num-expert", "--num-experts"),  # Megatron-LM's, refused
        ("--ckpt-fully-paralel-load", "--ckpt-fully-parallel-load"),  # Megatron-LM's, noticed
    ],
)
def test_a_mistyped_flag_gets_the_closest_known_names(typo, meant, capsys):
    err = _error(TINY + [typo, "2"], capsys)
    assert f"unrecognized arguments: {typo} 2" in err and f"{typo}: did you mean {meant}" in err


def test_an_unknown_flag_is_named_without_a_guess(capsys):
    err = _error(TINY + ["--bogus-flag"], capsys)
    assert "unrecognized arguments: --bogus-flag (not Megatron-LM flags either; see --help)" in err
    assert "did you mean" not in err


def test_every_flag_in_help_has_a_line_and_sits_in_megatron_lms_group():
    """pretrain_gpt.py --help: no flag without help (suppressed ones aside); Megatron-LM's flags under
    Megatron-LM's argument group titles, ours under one MatrixFSDP group, each update rule's settings in
    a group of its own right after Megatron-LM's regularization group."""
    import argparse

    from megatron_mfsdp.training.arguments import flag_help, full_parser

    parser = full_parser()
    groups = accepted.megatron_lm_groups()
    missing, misplaced = [], []
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS:
                continue
            if not action.help:
                missing.append(action.option_strings)
            megatron = [groups[f] for f in action.option_strings if f in groups]
            want = megatron[0] if megatron else (group.title if group in parser.rule_groups else flag_help.OURS)
            if action.option_strings != ["-h", "--help"] and group.title != want:
                misplaced.append((action.option_strings[0], group.title, want))
    assert not missing, missing
    assert not misplaced, misplaced
    titles = [g.title for g in parser._action_groups if g._group_actions]
    at = titles.index("regularization")
    rules = [g.title for g in parser.rule_groups if g._group_actions]
    assert titles[at + 1 : at + 1 + len(rules)] == rules
    assert titles[-1] == flag_help.OURS
    megatron_titles = [t for t in titles if t in flag_help.ORDER]
    assert megatron_titles == sorted(megatron_titles, key=flag_help.ORDER.index)


def test_help_prints_the_groups_and_the_notices(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for title in ("transformer configuration:", "regularization:", "checkpointing:", "MatrixFSDP (megatron-mfsdp"):
        assert f"\n{title}" in text, title
    flat = " ".join(text.split())
    assert "--ckpt-fully-parallel-load accepted, with a start-up notice: each rank reads" in flat
    assert "--num-experts NUM_EXPERTS experts per MoE layer" in flat
    assert "--moe-use-upcycling" not in flat  # refused flags are hidden; the epilog says so
    assert "Every other flag of Megatron-LM's parser is refused before any work" in flat


def test_not_applicable_flags_parse_with_a_notice_each():
    args = _parse(TINY + ["--rerun-mode", "disabled", "--tp-comm-overlap", "--use-flash-attn"])
    for flag in ("--rerun-mode", "--tp-comm-overlap", "--use-flash-attn"):
        assert any(n.startswith(f"{flag}: {accepted.NOT_APPLICABLE[flag]}") for n in args.notices), flag
    assert not any("--rerun-mode" in n for n in _parse(TINY).notices)


def test_megatron_ddp_flags_with_matrix_fsdp_say_what_happens_instead():
    args = _parse(TINY + ["--use-matrix-fsdp", "--use-distributed-optimizer", "--overlap-grad-reduce"])
    assert any(n.startswith("--use-distributed-optimizer with --use-matrix-fsdp:") for n in args.notices)
    assert any(n.startswith("--overlap-grad-reduce with --use-matrix-fsdp:") for n in args.notices)
    adam = _without(TINY, "--optimizer") + ["--optimizer", "adam"]
    plain = _parse(adam + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"])
    assert plain.use_distributed_optimizer and not any("--use-distributed-optimizer" in n for n in plain.notices)


@pytest.mark.parametrize(
    "old,new_dest,value",
    [
        (["--muon-ns-steps", "10"], "muon_num_ns_steps", 10),
        (["--muon-coefficients", "jordan"], "muon_coefficient_type", "simple"),
        (["--muon-coefficients", "quintic"], "muon_coefficient_type", "polar_express_nanogpt"),
        (["--no-muon-nesterov"], "muon_use_nesterov", False),
        (["--muon-nesterov"], "muon_use_nesterov", True),
    ],
)
def test_old_muon_spellings_still_work(old, new_dest, value):
    args = _parse(TINY + old)
    assert getattr(args, new_dest) == value
    if old[0] != "--muon-nesterov":  # HEAD's name for --muon-use-nesterov, not deprecated
        assert any(n.startswith(f"{old[0]} is deprecated") for n in args.notices)


def test_ns_dtype_follows_fp32_matmul_prec_when_not_given():
    base = _without(TINY, "--muon-ns-dtype")
    assert _parse(base + ["--muon-fp32-matmul-prec", "high"]).muon_ns_dtype == "fp32"
    assert _parse(base + ["--muon-fp32-matmul-prec", "medium"]).muon_ns_dtype == "bf16"
    assert _parse(base + ["--muon-ns-dtype", "fp32", "--muon-fp32-matmul-prec", "low"]).muon_ns_dtype == "fp32"


FP8 = ["--use-matrix-fsdp", "--bf16", "--fp8-format", "hybrid", "--fp8-param-gather"]
WIDE = [f if f != "64" else "128" for f in TINY]  # hidden 128: TP-local dims divisible by 128


def test_fp8_flags_reach_the_runtime_config():
    from megatron_mfsdp.precision import Fp8Config
    from megatron_mfsdp.training.setup import runtime_config

    args = _parse(TINY + FP8 + ["--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"])
    assert args.fp8 == "hybrid" and args.fp8_param_gather
    config = runtime_config(args)
    assert config.fp8 == Fp8Config(fp8="hybrid", fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    assert config.fp8_bf16_layers == (0, 0)
    args = _parse(
        WIDE + FP8 + ["--fp8-recipe", "blockwise", "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "0"]
    )
    assert runtime_config(args).fp8_bf16_layers == (1, 0)


def test_fp8_without_matrix_fsdp_computes_in_bf16_with_a_notice():
    """Megatron-LM's FP8 scripts (TE on CUDA) parse and run here in bf16, saying so."""
    args = _parse(TINY + ["--bf16", "--fp8-format", "e4m3", "--fp8-param-gather"])
    assert args.fp8 is None and not args.fp8_param_gather
    assert any("Megatron's own FP8 path" in n and "computes in bf16" in n for n in args.notices)


def test_fp8_without_param_gather_computes_in_bf16_with_a_notice():
    args = _parse(TINY + ["--use-matrix-fsdp", "--bf16", "--fp8-format", "e4m3"])
    assert args.fp8 is None
    assert any("without --fp8-param-gather" in n and "computes in bf16" in n for n in args.notices)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--use-matrix-fsdp", "--fp8-format", "e4m3", "--fp8-param-gather"], "--fp8-format e4m3 needs --bf16"),
        (["--use-matrix-fsdp", "--bf16", "--fp8-param-gather"], "--fp8-param-gather needs --fp8-format"),
        (FP8 + ["--fp8-recipe", "mxfp8"], "MXFP8 scales 1x32 blocks"),
        (FP8 + ["--first-last-layers-bf16"], "--fp8-recipe delayed does not support --first-last-layers-bf16"),
        (
            FP8 + ["--fp8-recipe", "tensorwise", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "3"],
            "--num-layers-at-start-in-bf16 3 must be between 0 and the layers per pipeline stage (2)",
        ),
        (FP8 + ["--fp8-recipe", "blockwise"], "linear_qkv.weight has TP-local shape (128, 64): dimension 1 (64)"),
        (FP8 + ["--optimizer", "adam"], "needs --optimizer muon"),
    ],
)
def test_fp8_errors_before_any_work(flags, message, capsys):
    assert message in _error(TINY + flags, capsys)


def test_fp8_blockwise_checks_the_tp_local_shape(capsys):
    flags = WIDE + FP8 + ["--fp8-recipe", "blockwise", "--tensor-model-parallel-size", "2"]
    assert "linear_proj.weight has TP-local shape (128, 64)" in _error(flags, capsys, world_size=2)
    _parse(WIDE + FP8 + ["--fp8-recipe", "blockwise"])  # 128 on one TP rank is fine


def test_device_fallbacks_are_noticed():
    args = _parse(TINY + ["--transformer-impl", "transformer_engine", "--use-mcore-models"])
    assert args.transformer_impl == "local"
    assert any(n.startswith("--transformer-impl transformer_engine:") for n in args.notices)
    assert not args.gradient_accumulation_fusion
    assert any("fusions not available on this machine" in n for n in args.notices)


def test_sample_based_schedule_and_rampup_parse():
    base = _without(TINY, "--train-iters", "--lr-warmup-iters")
    args = _parse(base + ["--train-samples", "40", "--lr-warmup-samples", "8", "--lr-decay-samples", "32"])
    assert args.train_iters is None and args.train_samples == 40
    args = _parse(TINY + ["--rampup-batch-size", "4", "4", "16"])
    assert args.rampup_batch_size == [4, 4, 16]
    err_args = TINY + ["--rampup-batch-size", "3", "4", "16"]
    with pytest.raises(SystemExit):
        _parse(err_args)


def test_disable_jit_fuser_runs_megatrons_compiled_fusions_eagerly():
    """megatron.core.fusions decorate bias-GeLU with torch.compile at import; --disable-jit-fuser
    must still leave it uncompiled (dynamo's graph counter stays at 0)."""
    import torch
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
    from torch._dynamo.utils import counters

    try:
        torch.compiler.set_stance("default")  # an earlier parse with the flag (TINY) set it process-wide
        counters.clear()
        torch.compile(lambda t: t * 2, backend="eager")(torch.ones(2))  # the counter counts compiles
        assert counters["stats"]["unique_graphs"] == 1
        _parse([*MINIMAL, "--disable-jit-fuser"])
        counters.clear()
        x, bias = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
        bias_gelu_impl(x, bias).sum().backward()
        assert counters["stats"]["unique_graphs"] == 0 and x.grad is not None
    finally:
        torch.compiler.set_stance("default")


def test_checkpoint_integrity_is_verified_unless_opted_out():
    """Ours (issue 21): on by default; --no-verify-checkpoint-integrity turns it off and its help names
    the risk. Megatron-LM's --verify-integrity (an opt-in there, default off) asks for what is already
    on: it parses with its notice and changes nothing."""
    action = build_parser()._option_string_actions["--no-verify-checkpoint-integrity"]
    assert action.dest == "verify_checkpoint_integrity" and action.default is True
    assert "damaged or truncated file is then read as is" in action.help
    assert _parse(TINY).verify_checkpoint_integrity is True
    assert _parse(TINY + ["--no-verify-checkpoint-integrity"]).verify_checkpoint_integrity is False
    megatron = _parse(TINY + ["--verify-integrity"])
    assert megatron.verify_checkpoint_integrity is True
    assert any(n.startswith("--verify-integrity: ") for n in megatron.notices)
