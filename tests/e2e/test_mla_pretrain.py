"""pretrain_gpt.py with Megatron-LM's multi-latent attention flags: a tiny MLA GPT (megatron-core's
MLASelfAttention on the local spec, query and key/value latents, YaRN at factor 1) trains on one rank and on
MatrixFSDP at DP 2 to the same losses, saves and resumes under megatron-core's own keys, and --qk-clip clips it;
TP 2 clips as one rank; the inference-only MLA flags are refused by name."""

import re

from tests.launch import TINY, parse_error, pretrain_in_workers, train_losses, without_query_groups

BASE = without_query_groups(TINY)
MLA = [
    *BASE,
    "--multi-latent-attention",
    "--q-lora-rank",
    "24",
    "--kv-lora-rank",
    "16",
    "--qk-head-dim",
    "8",
    "--qk-pos-emb-head-dim",
    "8",
    "--v-head-dim",
    "16",
    "--qk-layernorm",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--eval-iters",
    "0",
]
MFSDP = "--use-matrix-fsdp"
LOGIT = re.compile(r" max_attention_logit: ([\d.E+-]+) \|")


def test_mla_trains_at_dp2_as_one_process_and_resumes(tmp_path):
    """1 rank and DP 2 on MatrixFSDP (Muon on every MLA projection, each whole on its owner): the same losses
    within 1e-5, falling; a checkpoint saved at iteration 3 of the DP 2 run (megatron-core's sharded keys of
    linear_q_down_proj, ...) resumes at TP 2 (megatron-core's resharding of each TP-split projection) to the
    uninterrupted run's last losses."""
    one = train_losses(pretrain_in_workers(1, *MLA, MFSDP, tmp_path=tmp_path))
    save = tmp_path / "ckpt"
    two = train_losses(
        pretrain_in_workers(2, *MLA, MFSDP, "--save", str(save), "--save-interval", "3", tmp_path=tmp_path)
    )
    worst = max(abs(a - b) for a, b in zip(one, two))
    print(f"\nMLA DP 2 against one process: losses {worst:.2e} apart")
    assert len(one) == len(two) == 5 and worst <= 1e-5, (one, two)
    assert one[-1] < one[0] - 0.1, one
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(save / "iter_0000003")).read_metadata().state_dict_metadata
    for proj in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj"):
        assert f"decoder.layers.self_attention.{proj}.weight" in keys, sorted(keys)
    assert "decoder.layers.self_attention.kv_layernorm.weight" in keys
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--muon-tp-mode", "duplicated"]
    resumed = train_losses(pretrain_in_workers(2, *MLA, MFSDP, *tp2, "--load", str(save), tmp_path=tmp_path))
    worst = max(abs(a - b) for a, b in zip(resumed, one[3:]))
    print(f"MLA resumed at iteration 3 at TP 2: last losses {worst:.2e} from the uninterrupted run")
    assert len(resumed) == 2 and worst <= 1e-5, (resumed, one)


def test_mla_qk_clip_clips_and_mla_refusals(tmp_path, capsys):
    """A threshold below the first max logit: the logged max logits of the clipped run stay below the
    unclipped run's after step 1 and its losses differ; at TP 2 with sequence parallelism (each TP rank clips its
    own heads; megatron-core's MLA repaired by compat/mla.py) the clipped run is the one-rank run's within 1e-5.
    --cache-mla-latents exits 2 by name."""
    flags = [*MLA, MFSDP, "--log-max-attention-logit"]
    free = pretrain_in_workers(1, *flags, tmp_path=tmp_path)
    free_logits = [float(v) for v in LOGIT.findall(free["stdout"])]
    threshold = free_logits[0] / 2
    clipped = pretrain_in_workers(1, *flags, "--qk-clip", "--qk-clip-threshold", str(threshold), tmp_path=tmp_path)
    logits = [float(v) for v in LOGIT.findall(clipped["stdout"])]
    print(f"\nMLA max logits without the clip {free_logits}, with threshold {threshold:.4g}: {logits}")
    assert len(logits) == len(free_logits) == 5 and logits[0] == free_logits[0] > threshold
    assert all(a < b for a, b in zip(logits[1:], free_logits[1:])), (logits, free_logits)
    assert train_losses(clipped)[1:] != train_losses(free)[1:]
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--muon-tp-mode", "duplicated"]
    clipped_tp = pretrain_in_workers(
        2, *flags, *tp, "--qk-clip", "--qk-clip-threshold", str(threshold), tmp_path=tmp_path
    )
    worst = max(abs(a - b) for a, b in zip(train_losses(clipped_tp), train_losses(clipped)))
    logits_tp = [float(v) for v in LOGIT.findall(clipped_tp["stdout"])]
    with capsys.disabled():
        print(f"\nMLA TP 2 clipped: losses within {worst:.2e} of one rank, max logits {logits_tp} vs {logits}")
    assert len(train_losses(clipped_tp)) == 5 and worst <= 1e-5
    assert max(abs(a - b) / b for a, b in zip(logits_tp, logits)) <= 1e-4, (logits_tp, logits)
    assert "--cache-mla-latents" in parse_error([*MLA, "--cache-mla-latents"], capsys)
    assert "exclude each other" in parse_error([*MLA, "--group-query-attention"], capsys)
    assert "--rope-type yarn" in parse_error([*BASE, "--rope-type", "yarn"], capsys)
    assert "apply to --multi-latent-attention" in parse_error([*BASE, "--yarn-beta-fast", "1"], capsys)
    assert "always rounds" in parse_error([*MLA, "--no-yarn-correction-range-round-to-int"], capsys)
    assert "--yarn-beta-slow with --rope-type rope" in parse_error(
        [*MLA, "--rope-type", "rope", "--yarn-beta-slow", "2"], capsys
    )
