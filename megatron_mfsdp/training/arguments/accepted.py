"""Megatron-LM flags that parse here but do not apply, and those refused with a clear error.

``NOT_APPLICABLE``: accepted with any value; start-up prints one line saying what happens
instead. ``UNSUPPORTED``: features megatron-mfsdp does not have yet (MoE, expert and context
parallelism, ...): giving the flag (at a value other than its harmless one) exits 2 naming it.
Any other Megatron-LM flag (megatron_lm_flags.txt) that is not accepted gets the same clear
error rather than argparse's generic one.
"""

from __future__ import annotations

import argparse
from importlib import resources

NOT_APPLICABLE = {
    "--rerun-mode": "megatron's rerun state machine is not used: results are not re-validated (--rerun-mode disabled)",
    "--error-injection-rate": "megatron's rerun state machine is not used: no errors are injected",
    "--error-injection-type": "megatron's rerun state machine is not used: no errors are injected",
    "--result-rejected-tracker-filename": "megatron's rerun state machine is not used",
    "--check-weight-hash-across-dp-replicas-interval": "not checked: with --use-matrix-fsdp every weight has one owner",
    "--verify-integrity": "on by default here (--no-verify-checkpoint-integrity turns it off): each rank "
    "checksums the files it writes and verifies its share before a load",
    "--tp-comm-overlap": "needs Transformer Engine userbuffers on CUDA: TP communication is not overlapped",
    "--tp-comm-overlap-cfg": "needs Transformer Engine userbuffers on CUDA: ignored",
    "--async-strategy": "--async-save writes with megatron-mfsdp's own background writer",
    "--async-ckpt-use-cpu-shm": "--async-save writes with megatron-mfsdp's own background writer",
    "--defer-embedding-wgrad-compute": "needs gradient-accumulation fusion (Apex or Transformer Engine): not deferred",
    "--wgrad-deferral-limit": "needs gradient-accumulation fusion (Apex or Transformer Engine): ignored",
    "--test-mode": "megatron's test-mode checks are not run",
    "--eval-global-batch-size": "evaluation uses --global-batch-size",
    "--use-flash-attn": "deprecated in Megatron-LM; the attention backend follows --attention-backend",
    "--use-sharp": "SHARP applies to NCCL on InfiniBand only: not used",
    "--nccl-communicator-config-path": "NCCL communicator configs are not applied",
    "--high-priority-stream-groups": "CUDA stream priorities are not set",
    "--log-energy": "energy monitoring needs NVML: not logged",
    "--log-straggler": "the straggler detector is not used",
    "--dataloader-fast-cache-load": "the dataset index cache is read as megatron-core builds it",
}

UNSUPPORTED = {
    "mixture of experts": ("--num-experts", "--moe-*", "--overlap-moe-expert-parallel-comm"),
    "expert parallelism": ("--expert-model-parallel-size", "--expert-tensor-parallel-size"),
    "context parallelism": (
        "--context-parallel-size",
        "--cp-comm-type",
        "--hierarchical-context-parallel-sizes",
        "--hybrid-context-parallel",
    ),
    "multi-latent attention": (
        "--multi-latent-attention",
        "--q-lora-rank",
        "--kv-lora-rank",
        "--qk-head-dim",
        "--qk-pos-emb-head-dim",
        "--v-head-dim",
        "--cache-mla-latents",
        "--mscale",
        "--mscale-all-dim",
        "--rotary-scaling-factor",
    ),
    "experimental attention variants": (
        "--experimental-attention-variant",
        "--attention-output-gate",
        "--linear-attention-freq",
        "--linear-conv-kernel-dim",
        "--linear-key-head-dim",
        "--linear-value-head-dim",
        "--linear-num-key-heads",
        "--linear-num-value-heads",
        "--dsa-indexer-n-heads",
        "--dsa-indexer-head-dim",
        "--dsa-indexer-topk",
        "--dsa-indexer-loss-coeff",
    ),
    "FIM datasets": ("--fim-data", "--fim-rate", "--fim-spm-rate"),
    "muP": ("--use-mup", "--mup-base-hidden-size"),
    "Megatron-FSDP and torch FSDP2 (use --use-matrix-fsdp, owner-sharded ZeRO-3)": (
        "--use-megatron-fsdp",
        "--use-torch-fsdp2",
        "--data-parallel-sharding-strategy",
        "--megatron-fsdp-main-params-dtype",
        "--megatron-fsdp-main-grads-dtype",
        "--megatron-fsdp-grad-comm-dtype",
    ),
    "ModelOpt export and distillation": ("--export-te-mcore-model", "--export-kd-teacher-load", "--export-kd-cfg"),
}

# Values at which an unsupported flag changes nothing (megatron's own defaults). The expert
# tensor-parallel size only shapes the expert groups, so without --num-experts any value is
# harmless (Megatron-LM's dense functional-test configs set it).
HARMLESS = {"--context-parallel-size": ["1"], "--expert-model-parallel-size": ["1"], "--num-experts": ["0"]}


def _harmless(flag: str, value, args) -> bool:
    if flag == "--expert-tensor-parallel-size":
        return getattr(args, "accepted_num_experts", None) in (None, ["0"])
    return flag in HARMLESS and value == HARMLESS[flag]


def megatron_lm_flags() -> frozenset:
    text = resources.files(__package__).joinpath("megatron_lm_flags.txt").read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.startswith("--"))


def unsupported_names(known) -> dict:
    """flag -> feature, expanding the prefix patterns (--moe-*) over Megatron-LM's flag names."""
    out = {}
    for feature, patterns in UNSUPPORTED.items():
        for pattern in patterns:
            names = [n for n in known if n.startswith(pattern[:-1])] if pattern.endswith("*") else [pattern]
            out.update({n: feature for n in names})
    return out


def add_accepted_args(p: argparse.ArgumentParser) -> None:
    """Register the flags above so that they parse with any value (checked in validate.py)."""
    taken = set(p._option_string_actions)
    g = p.add_argument_group("Megatron-LM flags that do not apply here (accepted; see the start-up notices)")
    for flag, effect in NOT_APPLICABLE.items():
        if flag not in taken:
            g.add_argument(flag, nargs="*", default=None, dest=_dest(flag), help=effect)
    g = p.add_argument_group("Megatron-LM features not supported by megatron-mfsdp yet (refused)")
    for flag, feature in unsupported_names(megatron_lm_flags()).items():
        if flag not in taken:
            g.add_argument(flag, nargs="*", default=None, dest=_dest(flag), help=f"{feature}: not supported yet")


def _dest(flag: str) -> str:
    return "accepted_" + flag.lstrip("-").replace("-", "_")


def check_accepted(args, argv_flags) -> list:
    """Notices for the not-applicable flags given; raise ValueError for an unsupported one."""
    notices = []
    unsupported = unsupported_names(megatron_lm_flags())
    for flag in argv_flags:
        value = getattr(args, _dest(flag), None)
        if flag in NOT_APPLICABLE and value is not None:
            notices.append(f"{flag}: {NOT_APPLICABLE[flag]}")
        elif flag in unsupported and value is not None:
            if not _harmless(flag, value, args):
                raise ValueError(f"{flag}: {unsupported[flag]} is not supported by megatron-mfsdp yet")
            if flag == "--expert-tensor-parallel-size":
                notices.append(f"{flag}: no experts (--num-experts not given), so no expert groups: ignored")
    return notices


def explain_unrecognized(extra) -> str:
    """The error for arguments the parser does not know: Megatron-LM's own flags are named as such."""
    known = megatron_lm_flags()
    flags = [a.split("=", 1)[0] for a in extra if a.startswith("--")]
    megatron = [f for f in flags if f in known]
    if megatron:
        return (
            f"{', '.join(megatron)}: Megatron-LM flag{'s' if len(megatron) > 1 else ''} not supported by "
            "megatron-mfsdp yet"
        )
    return f"unrecognized arguments: {' '.join(extra)} (not Megatron-LM flags either; see --help)"
