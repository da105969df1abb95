"""Batch-size and learning-rate schedules as Megatron-LM derives them (training.py's update_train_iters
and get_optimizer_param_scheduler), on megatron-core's calculator and OptimizerParamScheduler."""

from types import SimpleNamespace

import pytest
import torch

from megatron_mfsdp.training import schedule


def _args(**kw):
    base = dict(
        rank=0,
        micro_batch_size=1,
        data_parallel_size=2,
        global_batch_size=8,
        seq_length=4,
        rampup_batch_size=None,
        step_batch_size_schedule=None,
        train_iters=None,
        train_samples=None,
        lr_decay_iters=None,
        lr_wsd_decay_iters=None,
        lr_warmup_iters=0,
        lr_decay_samples=None,
        lr_wsd_decay_samples=None,
        lr_warmup_samples=0,
        lr_warmup_fraction=None,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_step_schedule_of_megatron_lms_gpt3_175b_example():
    """HEAD's examples/gpt3/train_gpt3_175b_distributed.sh: its token thresholds at --seq-length 2048
    land on the samples of 0.16.1's --rampup-batch-size 16 16 5859375 (12B tokens = 5859375 samples)."""
    steps = schedule.parse_step_schedule("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048, 16)
    assert steps == [(0, 16), (1171875, 320), (2343750, 624), (3515625, 928), (4687500, 1232), (5859375, 1536)]
    assert schedule.parse_step_schedule("0:4,1k:8", 10, 4) == [(0, 4), (100, 8)]


@pytest.mark.parametrize(
    "text,message",
    [
        ("16", "entry '16' is not THRESHOLD:BATCH_SIZE"),
        ("0:16 x:32", "entry 'x:32' is not THRESHOLD:BATCH_SIZE"),
        ("100:16", "the first threshold must be 0"),
        ("0:16 2:32", "two thresholds fall on the same sample (0)"),
        ("0:16 1K:20", "batch size 20 is not a positive multiple of micro batch x DP = 8"),
    ],
)
def test_step_schedule_errors_name_the_flag(text, message):
    with pytest.raises(ValueError, match="--step-batch-size-schedule") as err:
        schedule.parse_step_schedule(text, 4, 8)
    assert message in str(err.value)


def test_step_schedule_drives_megatrons_calculator_and_train_iters():
    args = _args(step_batch_size_schedule="0:4 40:8", train_samples=30)  # 40 tokens = 10 samples
    schedule.init_microbatches(args)
    assert schedule.current_batch(0) == (4, 2)
    assert schedule.current_batch(9) == (4, 2) and schedule.current_batch(10) == (8, 4)
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    assert get_num_microbatches() == 4  # megatron's own getters see the same schedule
    schedule.update_train_iters(args)
    # 0 -> 4 -> 8 -> 12 (now batch 8) -> 20 -> 28 -> 36: six iterations reach 30 samples.
    assert args.train_iters == 6 and schedule.current_batch(0) == (4, 2)


def test_rampup_train_iters_count_the_ramp_batch_by_batch():
    """--rampup-batch-size 2 2 8 to 8: batches 2, 4, 6 while consumed <= 8 ... as update_train_iters."""
    args = _args(rampup_batch_size=[2, 2, 8], train_samples=40)
    schedule.init_microbatches(args)
    schedule.update_train_iters(args)
    # Megatron-LM's loop: consumed 0 (bs 2) -> 2 (2) -> 4 (4) -> 8 (6) -> 14, i.e. 4 ramp iterations,
    # then (40 - 14) // 8 = 3 more.
    assert args.train_iters == 7


def test_scheduler_steps_iteration_and_sample_based():
    steps = schedule.scheduler_steps(_args(train_iters=10, lr_warmup_iters=2, lr_wsd_decay_iters=3))
    assert steps == dict(lr_warmup_steps=16, lr_decay_steps=80, wd_incr_steps=80, wsd_decay_steps=24)
    steps = schedule.scheduler_steps(_args(train_samples=100, lr_warmup_fraction=0.1, lr_decay_samples=50))
    assert steps == dict(lr_warmup_steps=5.0, lr_decay_steps=50, wd_incr_steps=100, wsd_decay_steps=None)


def test_wsd_schedule_holds_then_decays():
    """WSD (it crashed before): constant after warmup, then decays over the last --lr-wsd-decay-iters."""
    args = _args(
        train_iters=10,
        lr_wsd_decay_iters=4,
        lr=1.0,
        min_lr=0.0,
        lr_warmup_init=0.0,
        lr_decay_style="WSD",
        lr_wsd_decay_style="linear",
        start_weight_decay=0.0,
        end_weight_decay=0.0,
        weight_decay_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
    )

    class _Opt:
        param_groups = [{"params": [torch.zeros(1)], "lr": 0.0, "weight_decay": 0.0}]

    sched = schedule.build_scheduler(args, _Opt())
    lrs = []
    for _ in range(10):
        sched.step(increment=args.global_batch_size)
        lrs.append(_Opt.param_groups[0]["lr"])
    # After step k megatron-core reads lr at k x 8 samples; decay starts past 80 - 32 = 48 samples.
    assert lrs[:6] == [1.0] * 6
    assert lrs[6:] == pytest.approx([0.75, 0.5, 0.25, 0.0])
