"""pretrain_gpt.py's run control on gloo ranks: flags compared across ranks, NaN stops,
exits, schedules that used to crash, TensorBoard tags, and the quickstart's own flags."""

import math
import re
import shlex

import pytest

from tests.launch import ROOT, TINY, losses, pretrain_in_workers, train_losses


def _rank_flags_worker(rank, world_size, argv, rank1_extra):
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import pretrain

    extra = list(rank1_extra) if rank == 1 else []
    try:
        pretrain(parse_args([*argv, *extra], world_size=world_size))
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("mode", [["--use-matrix-fsdp"], []], ids=["mfsdp", "megatron-ddp"])
def test_a_rank_launched_with_different_flags_raises_naming_them(mode, tmp_path):
    """Megatron-LM hangs (different --train-iters) or runs silently (different --lr); we raise
    on every rank before the model is built, naming each flag and each rank's value."""
    argv = [*TINY, *mode, "--output-dir", str(tmp_path / "out")]
    from megatron_mfsdp.testing import run_workers

    errors = run_workers(2, _rank_flags_worker, argv, ["--train-iters", "6", "--lr", "1e-3"], timeout=120)
    for error in errors:
        assert error is not None and error.startswith("ranks were launched with different flags"), error
        assert "--lr: rank 0=0.003, rank 1=0.001" in error
        assert "--train-iters: rank 0=5, rank 1=6" in error


def test_a_nan_loss_stops_the_run_naming_iteration_and_rank(tmp_path):
    flags = [*TINY, "--use-matrix-fsdp", "--optimizer", "adam", "--lr", "1e6", "--lr-warmup-iters", "0"]
    with pytest.raises(RuntimeError) as caught:
        pretrain_in_workers(2, *flags, "--train-iters", "20", tmp_path=tmp_path)
    message = str(caught.value)
    found = re.search(r"iteration (\d+): the (lm loss is (nan|inf)|gradient norm is not finite)", message)
    assert found, message[-2000:]
    assert "--check-for-nan-in-loss-and-grad is on" in message
    assert 1 < int(found.group(1)) <= 20


def test_eval_iters_0_wsd_decay_and_exit_interval(tmp_path):
    """--eval-iters 0 (no evaluation at all), WSD decay and --exit-interval together, the
    first two of which crashed before (as did leaving out --eval-interval, whose default is
    None as in Megatron-LM); training stops after iteration 4 of 6."""
    at = TINY.index("--eval-interval")
    flags = [*TINY[:at], *TINY[at + 2 :], "--use-matrix-fsdp", "--train-iters", "6", "--eval-iters", "0"]
    flags += ["--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear", "--lr-wsd-decay-iters", "3"]
    first, result = pretrain_in_workers(2, *flags, "--exit-interval", "4", tmp_path=tmp_path, rank=None)
    assert re.search(r"\[exiting program at iteration 4\] datetime: \d{4}-\d\d-\d\d [\d:.]+ ", first["stdout"])
    assert [i for i, _ in result["history"]["train"]] == [1, 2, 3, 4]
    assert result["history"]["valid"] == []
    assert "validation loss" not in result["stdout"]
    lrs = [float(x) for x in re.findall(r"learning rate: ([\d.E+-]+)", result["stdout"])]
    # warmup 1 iteration, then the stable phase at --lr until the last 3 of 6 iterations.
    assert lrs[:3] == [3e-3, 3e-3, 3e-3] and lrs[3] < 3e-3


def test_tensorboard_tags_are_megatrons(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    flags = [*TINY, "--use-matrix-fsdp", "--tensorboard-dir", str(tb), "--log-memory-to-tensorboard"]
    flags += ["--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard"]
    pretrain_in_workers(2, *flags, tmp_path=tmp_path)
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    # megatron/training/training.py (training_log, evaluate_and_print_results) at core_v0.16.1
    expected = {"lm loss", "lm loss vs samples", "learning-rate", "grad-norm", "batch-size", "iteration-time"}
    expected |= {"lm loss validation", "lm loss validation ppl", "loss-scale"}
    assert expected <= tags, sorted(expected - tags)
    assert any(t.startswith("mem-") for t in tags), sorted(tags)
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4, 5]


def _quickstart_flags() -> list:
    """pretrain_gpt.py's flags as scripts/quickstart.sh passes them."""
    text = open(f"{ROOT}/scripts/quickstart.sh").read().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ".venv/bin/torchrun" in ln and "pretrain_gpt.py" in ln)
    words = shlex.split(line.split("pretrain_gpt.py", 1)[1])
    return [w for w in words if not w.startswith("$")]  # the run folder's flags and the extra arguments


def test_quickstart_flags_with_train_iters_10(tmp_path):
    """The README's default run, cut to 10 iterations as a user would (a later flag wins):
    a warmup of 20 iterations used to outlast it and crash (now --lr-warmup-fraction, and a
    warmup longer than the decay is a named error); 2 evaluation batches keep the test short."""
    flags = _quickstart_flags()
    assert "--use-matrix-fsdp" in flags and flags[flags.index("--optimizer") + 1] == "muon"
    result = pretrain_in_workers(2, *flags, "--train-iters", "10", "--eval-iters", "2", tmp_path=tmp_path)
    got = train_losses(result)
    assert len(got) == 10 and all(math.isfinite(x) for x in got)
    assert got[-1] < got[0]
    assert len(losses(result["stdout"])) == 1  # --log-interval 10
    assert len(result["history"]["valid"]) == 1  # the end-of-training validation


def test_start_up_facts_print_in_megatrons_order_and_text(tmp_path):
    """Rank 0's start-up as Megatron-LM prints it (core_v0.16.1): the arguments dump
    (arguments.py _print_args), the parameter count of the (0, 0) pair (training.py get_model),
    then after iterations 1 and 2 (report_memory_flag, --log-interval 1) the theoretical memory
    footprints (theoretical_memory_usage.py; ours for the owner layout after it) and the memory
    line (utils.py report_memory), with --log-memory-to-tensorboard's tags every iteration.
    TINY's GPT has 110208 parameters: word embedding 256 x 64 (vocab 201 padded to 256) and
    positions 32 x 64, per layer two LayerNorms 2 x 128, QKV (4 + 2 x 2) x 16 = 128 rows x 64 with
    bias, proj 64 x 64 + 64, fc1 256 x 64 + 256, fc2 64 x 256 + 64 (45824), final LayerNorm 128."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    flags = [*TINY, "--use-matrix-fsdp", "--tensorboard-dir", str(tb), "--log-memory-to-tensorboard"]
    first, last = pretrain_in_workers(2, *flags, tmp_path=tmp_path, rank=None)
    out = first["stdout"]
    lines = out.splitlines()
    head = lines.index("------------------------ arguments ------------------------")
    end = lines.index("-------------------- end of arguments ---------------------")
    dump = lines[head + 1 : end]
    assert dump == sorted(dump, key=str.lower) and len(dump) > 300
    for line in dump:
        name = re.match(r"^  (\S+) ", line).group(1)
        assert line.startswith(f"  {name} {'.' * (48 - len(name))} "), line
    assert f"  use_matrix_fsdp {'.' * 33} True" in dump and f"  world_size {'.' * 38} 2" in dump
    count = re.compile(r"^ > number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)$")
    counts = [m.groups() for m in map(count.match, lines) if m]
    assert counts == [("0", "0", "110208")]
    assert not any(map(count.match, last["stdout"].splitlines()))  # DP rank 1 prints none
    memory = re.compile(
        r"^\[Rank 0\] \(after (\d+) iterations\) memory \(MB\) \| allocated: [\d.]+ \| max allocated: [\d.]+ \|"
        r" reserved: [\d.]+ \| max reserved: [\d.]+ \| RSS: "
    )
    reports = [i for i, line in enumerate(lines) if memory.match(line)]
    assert [memory.match(lines[i]).group(1) for i in reports] == ["1", "2"]  # then report_memory_flag is off
    theoretical = [i for i, line in enumerate(lines) if line.startswith("Theoretical memory footprints: weight")]
    ours = [i for i, line in enumerate(lines) if line.startswith("Theoretical memory footprints, MatrixFSDP")]
    plan = next(i for i, line in enumerate(lines) if "MatrixFSDP plan:" in line)
    assert end < next(i for i, line in enumerate(lines) if count.match(line)) < plan < theoretical[0]
    assert len(theoretical) == len(ours) == 2
    assert theoretical[0] < ours[0] < reports[0] < theoretical[1] < ours[1] < reports[1]
    predicted = re.search(r"weight and optimizer=([\d.]+) MB on the busiest rank", lines[ours[0]]).group(1)
    assert f"measured per rank: max {predicted} MB" in lines[ours[0]]
    assert "memory (MB)" not in last["stdout"]
    events = EventAccumulator(str(tb))
    events.Reload()
    mem_tags = {t for t in events.Tags()["scalars"] if t.startswith("mem-")}
    # training.py training_log's tags (mem-allocated-count needs the CUDA allocator)
    assert mem_tags == {"mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes"}
    assert [e.step for e in events.Scalars("mem-allocated-bytes")] == [1, 2, 3, 4, 5]  # --tensorboard-log-interval 1
