"""pretrain_gpt.py end to end on gloo ranks: Megatron log lines, DP invariance,
MatrixFSDP vs plain data parallelism, checkpoint resume, and bad-input errors."""

from tests.launch import ITERATION_LINE, TINY, VALIDATION_LINE, losses, pretrain_in_workers, run_pretrain


def test_pretrain_dp2_matrix_fsdp_log_lines_parse_and_resume(tmp_path):
    save = tmp_path / "ckpt"
    proc = run_pretrain(2, *TINY, "--use-matrix-fsdp", "--save", str(save), "--save-interval", "3", tmp_path=tmp_path)
    lines = [m for m in ITERATION_LINE.finditer(proc.stdout)]
    assert [int(m.group(1)) for m in lines] == [1, 2, 3, 4, 5]
    assert all(int(m.group(6)) == 8 and float(m.group(8)) == 1.0 for m in lines)
    assert int(lines[-1].group(3)) == 40  # consumed samples
    assert VALIDATION_LINE.search(proc.stdout)
    assert "MatrixFSDP plan: 5 units over 2 DP ranks" in proc.stdout  # tied embedding is its own unit
    assert "> intra-op threads per process: 1 (OMP_NUM_THREADS=1)" in proc.stdout  # run_pretrain's setting
    assert (tmp_path / "out" / "loss_curve.png").stat().st_size > 1000
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "5"

    # Resume from iteration 3 and reproduce iterations 4 and 5 exactly.
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = pretrain_in_workers(2, *TINY, "--use-matrix-fsdp", "--load", str(save), tmp_path=tmp_path)
    assert losses(resumed["stdout"]) == losses(proc.stdout)[3:]


def test_dp_invariance_and_plain_data_parallel_agree(tmp_path):
    """Same global batch at DP=1, 2, 4 (and plain data parallelism at DP=2): the same lm loss at
    every iteration."""
    runs = {
        f"mfsdp dp{n}": losses(pretrain_in_workers(n, *TINY, "--use-matrix-fsdp", tmp_path=tmp_path)["stdout"])
        for n in (1, 2, 4)
    }
    runs["plain dp2"] = losses(pretrain_in_workers(2, *TINY, tmp_path=tmp_path)["stdout"])
    reference = runs["mfsdp dp1"]
    assert len(reference) == 5 and reference[-1] < reference[0]
    worst = max(abs(a - b) for run in runs.values() for a, b in zip(run, reference))
    print(f"\nlargest lm loss difference across DP sizes and modes: {worst:.3e}")
    for name, run in runs.items():
        assert len(run) == 5
        for a, b in zip(run, reference):
            assert abs(a - b) <= 1e-5, (name, run, reference)


# TP2 x PP2 x DP2 with the distributed TP mode: the save run of test_checkpoint_resume.py, checked
# against 1 x 1 x 1 there (the duplicated TP mode differs from it only within TP: TP2 x DP2 here);
# TP2 x DP2 distributed without sequence parallelism: tests/distributed.
LAYOUTS = {
    "tp2 x dp2 duplicated": (4, ["--tensor-model-parallel-size", "2", "--muon-tp-mode", "duplicated"]),
    "tp2 x dp2 distributed sequence-parallel": (
        4,
        ["--tensor-model-parallel-size", "2", "--muon-tp-mode", "distributed", "--sequence-parallel"],
    ),
    "pp2 x dp2": (4, ["--pipeline-model-parallel-size", "2"]),
    "replicate2 x shard2": (4, ["--mfsdp-replicate-size", "2"]),
}


def test_pretrain_every_layout_matches_1x1x1(tmp_path):
    """pretrain_gpt.py's lm loss per iteration at each layout equals the 1 x 1 x 1 run's
    (4 micro-batches of 2 per global batch of 8 at DP=1; 2 or 1 per rank otherwise)."""
    flags = [*TINY, "--use-matrix-fsdp", "--eval-iters", "0"]
    reference = losses(pretrain_in_workers(1, *flags, tmp_path=tmp_path)["stdout"])
    assert len(reference) == 5
    for name, (nproc, extra) in LAYOUTS.items():
        got = losses(pretrain_in_workers(nproc, *flags, *extra, tmp_path=tmp_path)["stdout"])
        worst = max(abs(a - b) for a, b in zip(got, reference))
        print(f"\n{name}: max lm loss delta vs 1x1x1 = {worst:.2e}")
        assert len(got) == 5 and worst <= 1e-5, (name, got, reference)


def test_pretrain_pp2_interleaved_virtual_stages_dp2_matches_1x1x1(tmp_path):
    """Interleaved 1F1B: 4 layers as 2 pipeline ranks x 2 virtual stages of 1 layer."""
    flags = [*TINY, "--use-matrix-fsdp", "--eval-iters", "0", "--num-layers", "4"]
    reference = losses(pretrain_in_workers(1, *flags, tmp_path=tmp_path)["stdout"])
    layout = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    save = tmp_path / "ckpt"
    ranks = pretrain_in_workers(
        4, *flags, *layout, "--save", str(save), "--save-interval", "3", tmp_path=tmp_path, rank=None
    )
    got = losses(ranks[-1]["stdout"])
    worst = max(abs(a - b) for a, b in zip(got, reference))
    print(f"\npp2 x vp2 x dp2: max lm loss delta vs 1x1x1 = {worst:.2e}")
    assert "pipeline stage 1, virtual stage 1" in ranks[0]["stdout"]  # rank 0 prints the plans
    assert len(got) == len(reference) == 5 and worst <= 1e-5
    # Both virtual stages have a 'decoder.layers.0...': their optimizer state must not collide.
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = pretrain_in_workers(4, *flags, *layout, "--load", str(save), tmp_path=tmp_path)
    assert losses(resumed["stdout"]) == got[3:]
