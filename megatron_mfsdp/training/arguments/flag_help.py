"""pretrain_gpt.py --help: one line for every flag, grouped as Megatron-LM groups them.

``HELP`` holds the line of each of Megatron-LM's flags that pretrain_gpt.py implements (where the
``add_argument`` call gives none), in our words; a noticed flag's line is its notice (accepted.py).
``regroup`` moves every flag into its Megatron-LM argument group (megatron_lm_flags.txt, the titles of
megatron/training/arguments.py at HEAD), in Megatron-LM's order, and megatron-mfsdp's own flags into
one "MatrixFSDP" group. Each update rule's settings group (ours.add_rule_args) stays a group of its
own, shown right after Megatron-LM's "regularization" group (where Megatron-LM keeps its optimizers'
hyperparameters): a rule's flags read together under its name; a setting that has Megatron-LM's name
(--lion-beta1) sits in Megatron-LM's group, as there.
"""

from __future__ import annotations

import argparse

OURS = "MatrixFSDP (megatron-mfsdp's own flags)"

# The argument groups of Megatron-LM HEAD's parser in the order it creates them (add_megatron_arguments),
# then ModelOpt's and the groups of older releases' flags.
ORDER = (
    "transformer configuration",
    "network size",
    "regularization",
    "profiling",
    "training",
    "rl",
    "RNG and initialization",
    "learning rate and weight decay",
    "checkpointing",
    "mixed precision",
    "distributed init",
    "validation",
    "data and dataloader",
    "tokenizer",
    "autoresume",
    "biencoder",
    "vision",
    "moe",
    "mla",
    "experimental_attention_variant",
    "heterogeneous architecture",
    "logging",
    "opentelemetry",
    "Logits Distillation",
    "straggler",
    "workload inspector",
    "inference",
    "Transformer-Engine",
    "experimental",
    "one logger",
    "In-process restart",
    "ft_package",
    "rerun engine",
    "msc",
    "sft",
    "fault injector",
    "modelopt-generic",
    "distributed",
)

HELP = {
    # transformer configuration / network size
    "--num-layers": "number of transformer layers",
    "--hidden-size": "transformer hidden size",
    "--num-attention-heads": "number of attention heads",
    "--group-query-attention": "grouped-query attention: --num-query-groups key/value heads",
    "--num-query-groups": "key/value head groups with --group-query-attention",
    "--max-position-embeddings": "largest sequence length the position embeddings cover",
    "--position-embedding-type": "learned_absolute, rope or none (mrope and relative are refused)",
    "--rotary-base": "RoPE base period",
    "--rotary-percent": "share of each head's channels that RoPE rotates",
    "--rotary-interleaved": "rotate interleaved channel pairs instead of halves",
    "--rotary-seq-len-interpolation-factor": "RoPE position interpolation: positions divided by this factor",
    "--rope-scaling-factor": "the llama3.x RoPE scaling factor (--use-rope-scaling)",
    "--normalization": "LayerNorm or RMSNorm",
    "--norm-epsilon": "epsilon of the normalization layers",
    "--qk-layernorm": "normalize queries and keys before attention",
    "--disable-bias-linear": "no biases in the linear layers",
    "--add-qkv-bias": "biases in the QKV projection only (with --disable-bias-linear)",
    "--swiglu": "SwiGLU MLP (gated SiLU) instead of GELU",
    "--squared-relu": "squared-ReLU MLP activation",
    "--untie-embeddings-and-output-weights": "an output layer of its own instead of the input embedding",
    "--hidden-dropout": "dropout after the attention and MLP blocks",
    "--attention-dropout": "dropout of the attention probabilities",
    "--attention-softmax-in-fp32": "attention masking and softmax in fp32",
    "--fp32-residual-connection": "keep the residual stream in fp32",
    "--recompute-granularity": "activation recomputation: full (whole layers) or selective (--recompute-modules)",
    "--recompute-method": "with full recomputation: uniform (every N layers) or block (the first N per stage)",
    "--recompute-num-layers": "layers per recomputation group (uniform) or recomputed layers per stage (block)",
    # initialization
    "--seed": "random seed of the weights, dropout and data order",
    "--init-method-std": "standard deviation of the normal weight initialization",
    # fusions
    "--no-masked-softmax-fusion": "do not fuse scaling, masking and softmax",
    "--no-bias-gelu-fusion": "do not fuse the bias and GELU",
    "--no-bias-swiglu-fusion": "do not fuse the bias and SwiGLU",
    "--no-bias-dropout-fusion": "do not fuse the bias and dropout",
    "--no-rope-fusion": "do not fuse RoPE (a Transformer Engine kernel)",
    "--no-persist-layer-norm": "do not use the persistent layer-norm kernel",
    "--no-gradient-accumulation-fusion": "do not fuse weight-gradient accumulation into the GEMM (Apex or TE)",
    "--cross-entropy-loss-fusion": "fused cross entropy (megatron-core's)",
    "--cross-entropy-fusion-impl": "the fused cross entropy: native (megatron-core) or te (Transformer Engine)",
    # mixed precision and FP8
    "--fp16": "fp16 compute with loss scaling",
    "--bf16": "bf16 compute",
    "--initial-loss-scale": "starting loss scale of dynamic loss scaling (fp16)",
    "--min-loss-scale": "smallest loss scale of dynamic loss scaling",
    "--loss-scale-window": "iterations without overflow before the loss scale grows",
    "--hysteresis": "overflows tolerated before the loss scale shrinks",
    "--accumulate-allreduce-grads-in-fp32": "accumulate and reduce gradients in fp32",
    "--grad-reduce-in-bf16": "reduce gradients in bf16",
    "--fp8-format": "FP8 weights: e4m3 or hybrid (with --use-matrix-fsdp --fp8-param-gather; else bf16, noticed)",
    "--fp8-recipe": "FP8 scaling: delayed, tensorwise, mxfp8 or blockwise",
    "--fp8-margin": "FP8 scaling margin (delayed scaling)",
    "--fp8-amax-history-len": "amax history length of delayed scaling",
    "--fp8-amax-compute-algo": "most_recent or max over the amax history",
    "--fp8-param-gather": "keep and gather weights in FP8; with --use-matrix-fsdp each owner quantizes its matrices",
    "--first-last-layers-bf16": "keep the first and last layers in bf16 under FP8",
    "--num-layers-at-start-in-bf16": "layers kept in bf16 at the start (--first-last-layers-bf16)",
    "--num-layers-at-end-in-bf16": "layers kept in bf16 at the end (--first-last-layers-bf16)",
    # regularization
    "--weight-decay": "weight decay (decoupled, AdamW's)",
    "--start-weight-decay": "weight decay at the start (with --weight-decay-incr-style linear or cosine)",
    "--end-weight-decay": "weight decay at the end (with --weight-decay-incr-style linear or cosine)",
    "--weight-decay-incr-style": "how weight decay goes from start to end: constant, linear or cosine",
    "--apply-wd-to-qk-layernorm": "also decay the Q/K layernorm weights",
    "--adam-beta1": "Adam's first-moment decay",
    "--adam-beta2": "Adam's second-moment decay",
    "--adam-eps": "Adam's epsilon",
    "--sgd-momentum": "SGD momentum (--optimizer sgd)",
    "--muon-momentum": "Muon's momentum",
    "--muon-no-split-qkv": "orthogonalize linear_qkv whole instead of Q, K and V apart",
    "--muon-use-nesterov": "Nesterov momentum in Muon (also --muon-nesterov, Megatron-LM HEAD's name)",
    "--muon-scale-mode": "how Muon scales its orthogonalized update (spectral, unit_rms_norm, shape_scaling)",
    "--muon-coefficient-type": "Newton-Schulz coefficients (megatron-core's names)",
    "--muon-num-ns-steps": "Newton-Schulz iterations",
    "--muon-extra-scale-factor": "extra factor on Muon's update",
    # training
    "--micro-batch-size": "samples per micro batch on each data-parallel rank",
    "--rampup-batch-size": "ramp the global batch size: START INCREMENT RAMPUP_SAMPLES",
    "--train-iters": "iterations to train (or --train-samples)",
    "--train-samples": "samples to train (or --train-iters)",
    "--exit-interval": "exit after an iteration divisible by this (saving first with --save)",
    "--exit-duration-in-mins": "exit after this many minutes (saving first with --save)",
    "--no-check-for-nan-in-loss-and-grad": "do not stop at a non-finite loss or gradient norm",
    "--calculate-per-token-loss": "average the loss over all tokens of the global batch, not per micro batch",
    "--manual-gc": "disable Python's automatic garbage collection and collect at set iterations",
    "--manual-gc-interval": "with --manual-gc: collect every N iterations (0: only at start)",
    "--no-manual-gc-eval": "with --manual-gc: no collection before and after each evaluation",
    "--empty-unused-memory-level": "release the CUDA caching allocator's unused memory: 1 after each forward-backward "
    "and evaluation, 2 also after each optimizer step (nothing to release without CUDA)",
    "--deterministic-mode": "deterministic algorithms only (torch.use_deterministic_algorithms)",
    "--skip-train": "only evaluate (validation and test), no training",
    # learning rate
    "--lr": "peak learning rate",
    "--min-lr": "learning rate floor of the decay",
    "--lr-decay-style": "constant, linear, cosine, inverse-square-root or WSD",
    "--lr-wsd-decay-style": "the WSD annealing: exponential, linear, cosine or minus_sqrt",
    "--lr-decay-iters": "iterations of the decay (default: --train-iters)",
    "--lr-decay-samples": "samples of the decay (default: --train-samples)",
    "--lr-wsd-decay-iters": "iterations of WSD's annealing phase",
    "--lr-wsd-decay-samples": "samples of WSD's annealing phase",
    "--lr-warmup-fraction": "share of the decay spent warming up",
    "--lr-warmup-iters": "warmup iterations",
    "--lr-warmup-samples": "warmup samples",
    "--lr-warmup-init": "learning rate at the start of the warmup",
    "--decoupled-min-lr": "learning rate floor of the embeddings (--decoupled-lr)",
    "--override-opt_param-scheduler": "on resume, take the schedule from this command line",
    "--use-checkpoint-opt_param-scheduler": "on resume, take the schedule from the checkpoint",
    # checkpointing
    "--save": "folder to save checkpoints in",
    "--save-interval": "iterations between saves (also --persistent-save-interval)",
    "--save-retain-interval": "keep only the checkpoints of iterations divisible by this, and the latest",
    "--load": "folder to resume from",
    "--pretrained-checkpoint": "without a checkpoint in --load: start from this one as --finetune does",
    "--ckpt-step": "iteration to load (default: the latest)",
    "--no-save-optim": "save without the optimizer state",
    "--no-save-rng": "save without the generator states",
    "--no-load-optim": "load without the optimizer state",
    "--no-load-rng": "load without the generator states",
    "--finetune": "load the weights only and start at iteration 0",
    "--use-checkpoint-args": "take the model's arguments from the checkpoint in --load",
    "--exit-on-missing-checkpoint": "stop when --load holds no checkpoint instead of starting from scratch",
    "--ckpt-format": "torch_dist (megatron-core dist_checkpointing, loads at any layout) or torch (per-rank files of "
    "one layout); torch_dcp and fsdp_dtensor are refused",
    "--async-save": "write checkpoints in the background from host copies",
    "--dist-ckpt-strictness": "what to do with keys the checkpoint and this run do not share",
    # distributed
    "--tensor-model-parallel-size": "tensor-parallel size",
    "--pipeline-model-parallel-size": "pipeline-parallel size",
    "--num-layers-per-virtual-pipeline-stage": "layers per virtual stage (interleaved schedule)",
    "--num-virtual-stages-per-pipeline-rank": "virtual stages per pipeline rank (interleaved schedule)",
    "--decoder-first-pipeline-num-layers": "layers of the first pipeline stage (uneven stages)",
    "--decoder-last-pipeline-num-layers": "layers of the last pipeline stage (uneven stages)",
    "--account-for-embedding-in-pipeline-split": "count the embedding as a layer when splitting stages",
    "--account-for-loss-in-pipeline-split": "count the loss as a layer when splitting stages",
    "--microbatch-group-size-per-virtual-pipeline-stage": "micro batches per virtual stage before switching "
    "(interleaved schedule)",
    "--sequence-parallel": "shard activations along the sequence over TP",
    "--no-overlap-p2p-communication": "do not overlap pipeline sends and receives with compute",
    "--overlap-p2p-communication-warmup-flush": "overlap pipeline communication in warmup and flush too",
    "--no-align-grad-reduce": "start gradient reductions per virtual stage, not aligned",
    "--no-align-param-gather": "start parameter gathers per virtual stage, not aligned",
    "--use-tp-pp-dp-mapping": "rank order TP, CP, EP, PP, DP instead of TP, CP, EP, DP, PP",
    "--distributed-timeout-minutes": "timeout of the process groups' collectives",
    "--use-distributed-optimizer": "megatron-core's DistributedOptimizer (ZeRO-1); with --use-matrix-fsdp noticed",
    "--overlap-grad-reduce": "overlap gradient reductions with the backward pass",
    "--overlap-param-gather": "overlap parameter gathers with the forward pass",
    "--overlap-param-gather-with-optimizer-step": "start parameter gathers during the optimizer step",
    "--ddp-average-in-collective": "average gradients inside the reduction",
    "--ddp-bucket-size": "elements per DDP gradient bucket",
    "--num-distributed-optimizer-instances": "distributed-optimizer instances (replicas of its shards)",
    "--disable-gloo-process-groups": "do not create gloo process groups beside the main ones",
    # validation
    "--eval-iters": "global batches per evaluation",
    "--eval-interval": "iterations between evaluations",
    # data
    "--train-data-path": "prefixes of the training split's datasets (weighted like --data-path)",
    "--valid-data-path": "prefixes of the validation split's datasets",
    "--test-data-path": "prefixes of the test split's datasets",
    "--mock-data": "random tokens instead of a dataset",
    "--data-cache-path": "folder for the dataset index caches",
    "--no-mmap-bin-files": "read the .bin files instead of memory-mapping them",
    "--no-create-attention-mask-in-dataloader": "let the model build the causal mask instead of the data loader",
    "--num-dataset-builder-threads": "threads building the dataset indexes",
    "--seq-length": "tokens per sample",
    "--reset-position-ids": "restart position ids after each end-of-document token",
    "--reset-attention-mask": "no attention across end-of-document tokens",
    "--eod-mask-loss": "no loss on end-of-document tokens",
    "--dataloader-type": "single (each sample once, Megatron-LM's default); cyclic is refused",
    # tokenizer
    "--tokenizer-type": "the tokenizer (Megatron-LM's names)",
    "--tokenizer-model": "the tokenizer's model file or Hugging Face folder",
    "--vocab-file": "vocabulary file (GPT2BPETokenizer)",
    "--merge-file": "BPE merges file (GPT2BPETokenizer)",
    "--vocab-size": "vocabulary size (NullTokenizer)",
    "--vocab-extra-ids": "extra sentinel tokens appended to the vocabulary",
    "--tokenizer-special-tokens": "special tokens of TikTokenizer",
    "--tiktoken-pattern": "TikTokenizer's split pattern (v1 or v2)",
    "--tiktoken-num-special-tokens": "ids reserved for TikTokenizer's special tokens",
    # logging
    "--log-interval": "iterations between iteration lines",
    "--log-throughput": "print TFLOP/s per GPU in the iteration line",
    "--log-params-norm": "print the parameters' L2 norm in the iteration line",
    "--log-num-zeros-in-grad": "print the gradient's zero count in the iteration line",
    "--log-timers-to-tensorboard": "write timers to TensorBoard",
    "--log-memory-to-tensorboard": "write memory statistics to TensorBoard",
    "--log-validation-ppl-to-tensorboard": "write validation perplexity to TensorBoard",
    "--log-world-size-to-tensorboard": "write the world size to TensorBoard",
    "--no-log-loss-scale-to-tensorboard": "do not write the loss scale to TensorBoard",
    "--timing-log-level": "timers: 0 iteration time only, 1 forward-backward and optimizer, 2 finer",
    "--timing-log-option": "timers across ranks: max, minmax or all",
    "--tensorboard-dir": "TensorBoard folder",
    "--tensorboard-log-interval": "iterations between TensorBoard writes",
    "--tensorboard-queue-size": "TensorBoard events queued before a flush",
    "--wandb-project": "Weights & Biases project (needs the wandb package)",
    "--wandb-exp-name": "Weights & Biases run name",
    "--wandb-save-dir": "Weights & Biases local folder",
    "--wandb-entity": "Weights & Biases entity",
    # ours
    "--mfsdp-planner": "how owners are chosen for the matrices (see docs/design.md, Placement)",
}


def fill_help(parser) -> None:
    """Give every flag its line: the notice of a noticed flag (accepted.py), else ``HELP``'s where the
    add_argument call gave none."""
    from .accepted import NOTICES

    for action in parser._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        noticed = [f for f in action.option_strings if f in NOTICES]
        if noticed:
            action.help = f"accepted, with a start-up notice: {NOTICES[noticed[0]]}"
        elif not action.help:
            action.help = next((HELP[f] for f in action.option_strings if f in HELP), None)


def regroup(parser, keep=()) -> None:
    """Megatron-LM's flags into Megatron-LM's groups, ours into OURS, the groups in ``keep`` (the rule
    settings groups) left whole but for Megatron-LM's flags in them; groups in Megatron-LM's order."""
    from .accepted import megatron_lm_groups

    titles = megatron_lm_groups()
    target = {g.title: g for g in parser._action_groups[2:] if g not in keep}
    for group in list(parser._action_groups[1:]):
        for action in list(group._group_actions):
            title = next((titles[f] for f in action.option_strings if f in titles), None)
            if title is None and (group in keep or group is parser._action_groups[1]):
                continue  # a rule's own setting, or -h
            title = title or OURS
            if title not in target:
                target[title] = parser.add_argument_group(title)
            if target[title] is not group:
                group._group_actions.remove(action)
                target[title]._group_actions.append(action)
    _order(parser, keep)


def _order(parser, keep) -> None:
    """Megatron-LM's groups in its order, the rule groups after "regularization", ours last but for
    groups a tool adds after (tools/plan.py's)."""
    head, rest = parser._action_groups[:2], parser._action_groups[2:]
    megatron = sorted((g for g in rest if g.title in ORDER and g not in keep), key=lambda g: ORDER.index(g.title))
    at = next((i + 1 for i, g in enumerate(megatron) if g.title == "regularization"), len(megatron))
    ordered = megatron[:at] + list(keep) + megatron[at:]
    others = [g for g in rest if g not in ordered]
    parser._action_groups[:] = head + ordered + others
