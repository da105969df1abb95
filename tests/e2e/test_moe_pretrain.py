"""pretrain_gpt.py with Megatron-LM's MoE flags: a tiny MoE GPT (4 experts, top-2, sigmoid scores, load-balancing
aux loss, z-loss, aux-loss-free expert bias) trains on megatron-core's MoE layer. megatron-core's DDP at EP 2 on 2
ranks (allgather and alltoall dispatchers) and MatrixFSDP at EP 1 (DP 2, TP 2, PP 2) give the single-process
run's losses (within the 1e-5 of the other pretrain layout tests), and the log carries Megatron-LM's MoE loss
entries."""

import re

import pytest

from tests.launch import TINY, losses, pretrain_in_workers, train_losses

MOE = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "64",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
    "--moe-router-score-function",
    "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate",
    "1e-2",
    "--eval-iters",
    "0",
]
AUX = re.compile(r" (load_balancing_loss|z_loss): ([\d.E+-]+) \|")


def _aux(stdout: str) -> list[dict]:
    """Each iteration line's MoE loss entries."""
    return [dict(AUX.findall(m.group(0))) for m in re.finditer(r"iteration\s+\d+/.*", stdout)]


def _close(run, reference, tol=1e-5) -> float:
    worst = max(abs(a - b) for a, b in zip(run, reference))
    assert len(run) == len(reference) == 5 and worst <= tol, (run, reference)
    return worst


def test_megatron_ddp_ep2_allgather_and_alltoall_train_as_one_process(tmp_path):
    """EP 2 on 2 ranks (2 experts per rank, expert DP 1; dense DP 2) with either dispatcher: the 1-rank run's
    lm and auxiliary losses, which fall; without the expert bias the run differs (the bias is stepped)."""
    flags = [*TINY, *MOE, "--optimizer", "adam"]
    one = pretrain_in_workers(1, *flags, tmp_path=tmp_path)
    reference = train_losses(one)
    assert reference[-1] < reference[0] - 0.1, reference
    aux = _aux(one["stdout"])
    assert len(aux) == 5 and all(set(a) == {"load_balancing_loss", "z_loss"} for a in aux), aux
    for dispatcher in ("allgather", "alltoall"):
        ranks = pretrain_in_workers(
            2,
            *flags,
            "--expert-model-parallel-size",
            "2",
            "--moe-token-dispatcher-type",
            dispatcher,
            tmp_path=tmp_path,
            rank=None,
        )
        worst = _close(train_losses(ranks[-1]), reference)
        print(f"\nmegatron DDP EP2 {dispatcher}: max lm loss delta vs 1 rank = {worst:.2e}")
        # megatron-core averages the load-balancing loss over DP; the z-loss it tracks without a reduce group
        # (router.py apply_z_loss), so the log shows the last rank's own, as Megatron-LM's does.
        for got, ref in zip(_aux(ranks[-1]["stdout"]), aux):
            assert abs(float(got["load_balancing_loss"]) - float(ref["load_balancing_loss"])) <= 1e-5, (got, ref)
            assert set(got) == set(ref)
        layout = f"EP=2 (2 experts per rank) x expert TP=1 x expert DP=1, {dispatcher} dispatcher"
        assert layout in ranks[0]["stdout"]
    unbiased = [f for f in flags if f != "--moe-router-enable-expert-bias"]
    assert train_losses(pretrain_in_workers(1, *unbiased, tmp_path=tmp_path)) != reference


def test_megatron_ddp_tp2_ep2_alltoall_on_4_ranks_as_one_process(tmp_path):
    """TP 2 (sequence-parallel, no expert biases: megatron-core's rules for MoE with TP) x EP 2 on 4 ranks with the
    all-to-all dispatcher, whose gathers over TP are uneven (gloo's all-gather padded, compat/cpu.py): the 1-rank
    run's losses."""
    flags = [*TINY, *MOE, "--optimizer", "adam", "--disable-bias-linear"]
    reference = train_losses(pretrain_in_workers(1, *flags, tmp_path=tmp_path))
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
    four = pretrain_in_workers(4, *flags, *layout, "--moe-token-dispatcher-type", "alltoall", tmp_path=tmp_path)
    worst = _close(train_losses(four), reference)
    print(f"\nmegatron DDP TP2 x EP2 alltoall: max lm loss delta vs 1 rank = {worst:.2e}")
    assert reference[-1] < reference[0] - 0.1, reference


LAYOUTS = {
    "dp2": [],
    "tp2 sequence-parallel duplicated": ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    + ["--muon-tp-mode", "duplicated"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


def test_matrix_fsdp_ep1_pretrain_at_dp2_tp2_pp2_matches_one_process(tmp_path):
    """--use-matrix-fsdp (Muon on every expert, router and attention matrix) at EP 1 on 2 ranks as DP 2, TP 2
    (the experts' TP group is the dense one; megatron-core wants sequence parallelism and no expert biases
    there) and PP 2: the 1-rank run's losses at every iteration, and its load-balancing losses."""
    flags = [*TINY, *MOE, "--use-matrix-fsdp", "--disable-bias-linear"]
    one = pretrain_in_workers(1, *flags, tmp_path=tmp_path)
    reference = train_losses(one)
    assert reference[-1] < reference[0] - 0.1, reference
    for name, extra in LAYOUTS.items():
        two = pretrain_in_workers(2, *flags, *extra, tmp_path=tmp_path)
        worst = _close(train_losses(two), reference)
        print(f"\nMatrixFSDP EP1 {name}: max lm loss delta vs 1 rank = {worst:.2e}")
        for got, ref in zip(_aux(two["stdout"]), _aux(one["stdout"])):
            assert abs(float(got["load_balancing_loss"]) - float(ref["load_balancing_loss"])) <= 1e-5, (name, got, ref)
            assert set(got) == set(ref)
        assert len(losses(two["stdout"])) == 5  # the iteration line still parses with the MoE entries


@pytest.fixture(scope="module")
def matrix_fsdp_one_rank(tmp_path_factory):
    """The 1-rank --use-matrix-fsdp run of the MoE flags: the losses every expert-parallel layout must give."""
    losses = train_losses(
        pretrain_in_workers(1, *TINY, *MOE, "--use-matrix-fsdp", tmp_path=tmp_path_factory.mktemp("one"))
    )
    assert losses[-1] < losses[0] - 0.1, losses
    return losses


def test_matrix_fsdp_ep2_pretrain_matches_one_process_and_resumes_at_ep1(tmp_path, matrix_fsdp_one_rank):
    """--use-matrix-fsdp at EP 2 x expert DP 2 on 4 ranks (the expert domain): the 1-rank run's losses within
    1e-5; its checkpoint of iteration 3 (experts saved under megatron-core's keys with their global expert
    index, the routers' expert biases whole) resumed on 1 rank at EP 1 and on 4 ranks at EP 4 (one expert a
    rank, expert DP 1) gives the uninterrupted run's iterations 4-5."""
    flags = [*TINY, *MOE, "--use-matrix-fsdp"]
    reference = matrix_fsdp_one_rank
    save = tmp_path / "ckpt"
    ep2 = pretrain_in_workers(
        4, *flags, "--expert-model-parallel-size", "2", "--save", str(save), "--save-interval", "3",
        tmp_path=tmp_path, rank=None,
    )  # fmt: skip
    worst = _close(train_losses(ep2[-1]), reference)
    assert "EP=2 (2 experts per rank) x expert TP=1 x expert DP=2" in ep2[0]["stdout"]
    assert "Theoretical memory footprints, experts: the busiest rank holds" in ep2[0]["stdout"]
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    print(f"\nMatrixFSDP EP2 x expert DP2: max lm loss delta vs 1 rank = {worst:.2e}")
    for nproc, layout in ((1, []), (4, ["--expert-model-parallel-size", "4"])):
        resumed = train_losses(pretrain_in_workers(nproc, *flags, *layout, "--load", str(save), tmp_path=tmp_path))
        moved = max(abs(a - b) for a, b in zip(resumed, reference[3:]))
        print(f"resumed on {nproc} rank(s) {layout}: {moved:.2e}")
        assert len(resumed) == 2 and moved <= 1e-5, (layout, resumed, reference[3:])


def test_matrix_fsdp_tp2_ep2_pretrain_matches_one_process_and_resumes_at_tp1_ep1(tmp_path, matrix_fsdp_one_rank):
    """--use-matrix-fsdp at TP 2 (sequence-parallel) x EP 2 with expert TP 1 on 4 ranks (dense DP 2, expert DP 2;
    biases, which megatron-core allows at expert TP 1) and --muon-tp-mode duplicated (full-matrix Newton-Schulz,
    the 1-rank numbers): the 1-rank run's losses within 1e-5; its checkpoint of iteration 3 (dense matrices in
    TP halves, experts whole under their global expert index) resumed on 1 rank at TP 1 x EP 1 gives the
    uninterrupted run's iterations 4-5."""
    flags = [*TINY, *MOE, "--use-matrix-fsdp"]
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
    layout += ["--expert-tensor-parallel-size", "1", "--muon-tp-mode", "duplicated"]
    save = tmp_path / "ckpt"
    four = pretrain_in_workers(
        4, *flags, *layout, "--save", str(save), "--save-interval", "3", tmp_path=tmp_path, rank=None
    )
    worst = _close(train_losses(four[-1]), matrix_fsdp_one_rank)
    assert "EP=2 (2 experts per rank) x expert TP=1 x expert DP=2" in four[0]["stdout"]
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = train_losses(pretrain_in_workers(1, *flags, "--load", str(save), tmp_path=tmp_path))
    moved = max(abs(a - b) for a, b in zip(resumed, matrix_fsdp_one_rank[3:]))
    print(f"\nMatrixFSDP TP2 x EP2 (expert TP 1): {worst:.2e} against 1 rank; resumed at TP1 x EP1: {moved:.2e}")
    assert len(resumed) == 2 and moved <= 1e-5, (resumed, matrix_fsdp_one_rank[3:])


def test_replicated_muon_at_ep2_matches_one_process(tmp_path, matrix_fsdp_one_rank):
    """--optimizer muon without --use-matrix-fsdp (Megatron-LM's Muon configs: every matrix replicated over DP,
    stepped on every rank) at EP 2 on 4 ranks: the expert domain has 2 replicas of one owner each; the 1-rank
    run's losses within 1e-5."""
    four = pretrain_in_workers(4, *TINY, *MOE, "--expert-model-parallel-size", "2", tmp_path=tmp_path)
    worst = _close(train_losses(four), matrix_fsdp_one_rank)
    print(f"\nreplicated Muon at EP 2: max lm loss delta vs 1 rank = {worst:.2e}")
