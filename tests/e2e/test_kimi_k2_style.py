"""A Kimi-K2-style model end to end, scaled down (arXiv 2507.20534's recipe on megatron-core's parts):
multi-latent attention, MoE layers with a shared expert and sigmoid routing with the aux-loss-free expert
bias, a dense first layer, Muon on every matrix with QK-clip, --use-matrix-fsdp at EP 2 on 4 ranks."""

from tests.launch import TINY, parse_error, pretrain_in_workers, train_losses, without_query_groups

KIMI = [
    *TINY,
    "--disable-bias-linear",
    "--multi-latent-attention",
    "--q-lora-rank",
    "24",
    "--kv-lora-rank",
    "16",
    "--qk-head-dim",
    "8",
    "--qk-pos-emb-head-dim",
    "4",
    "--v-head-dim",
    "12",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "32",
    "--moe-shared-expert-intermediate-size",
    "32",
    "--moe-router-score-function",
    "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate",
    "1e-2",
    "--moe-aux-loss-coeff",
    "1e-3",
    "--moe-layer-freq",
    "[0,1]",
    "--use-matrix-fsdp",
    "--qk-clip",
    "--qk-clip-threshold",
    "0.005",
    "--log-max-attention-logit",
    "--eval-iters",
    "0",
]


KIMI = without_query_groups(KIMI)


def test_kimi_k2_style_at_ep2_on_4_ranks_trains_as_one_process(tmp_path, capsys):
    """EP 2 x expert DP 2 on 4 ranks (dense DP 4), with a QK-clip threshold below the tiny model's logits (so
    every step clips; tests/e2e/test_mla_pretrain.py shows MLA's clip moving the losses): the 1-rank run's
    losses within 1e-5 at every iteration (measured 1.2e-7), and they fall; multi-token prediction, which
    Kimi K2 trained with and megatron-mfsdp lacks, is refused by name."""
    one = train_losses(pretrain_in_workers(1, *KIMI, tmp_path=tmp_path))
    assert one[-1] < one[0] - 0.1, one
    four = pretrain_in_workers(4, *KIMI, "--expert-model-parallel-size", "2", tmp_path=tmp_path)
    worst = max(abs(a - b) for a, b in zip(train_losses(four), one))
    print(f"\nKimi-K2-style, EP 2 on 4 ranks: max lm loss delta vs 1 rank = {worst:.2e}")
    assert len(train_losses(four)) == 5 and worst <= 1e-5, (train_losses(four), one)
    assert "multi-token prediction" in parse_error([*KIMI, "--mtp-num-layers", "1"], capsys)
