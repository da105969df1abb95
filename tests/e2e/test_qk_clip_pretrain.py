"""pretrain_gpt.py with Megatron-LM's QK-clip flags (--qk-clip, --qk-clip-alpha, --qk-clip-threshold,
--log-max-attention-logit): the step's largest attention logit in the iteration line and TensorBoard, and
the clip acting on the owners' masters."""

import re

from tests.launch import TINY, parse_error, pretrain_in_workers, train_losses

LOGIT = re.compile(r" max_attention_logit: ([\d.E+-]+) \|")
FLAGS = [*TINY, "--disable-bias-linear", "--log-max-attention-logit"]


def test_qk_clip_lowers_the_max_logit_and_logs_it(tmp_path):
    """A threshold of 0.1 (below the tiny model's first max logit, 0.127): every iteration line carries
    max_attention_logit, TensorBoard gets Megatron-LM's tag, and the clipped run's logits stay below the
    unclipped run's and its losses leave them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    free = pretrain_in_workers(1, *FLAGS, tmp_path=tmp_path)
    tb = tmp_path / "tb"
    clipped = pretrain_in_workers(
        1, *FLAGS, "--qk-clip", "--qk-clip-threshold", "0.1", "--tensorboard-dir", str(tb), tmp_path=tmp_path
    )
    free_logits = [float(v) for v in LOGIT.findall(free["stdout"])]
    logits = [float(v) for v in LOGIT.findall(clipped["stdout"])]
    assert len(free_logits) == len(logits) == 5, clipped["stdout"][-2000:]
    assert logits[0] == free_logits[0] > 0.1  # the first step measured the same weights
    assert all(a < b for a, b in zip(logits[1:], free_logits[1:])), (logits, free_logits)
    assert train_losses(clipped)[1:] != train_losses(free)[1:]
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.step for e in events.Scalars("max_attention_logit")] == [1, 2, 3, 4, 5]


def test_megatron_core_optimizer_logs_the_max_logit_and_refuses_the_clip(tmp_path, capsys):
    adam = pretrain_in_workers(1, *FLAGS, "--optimizer", "adam", tmp_path=tmp_path)
    assert len(LOGIT.findall(adam["stdout"])) == 5
    err = parse_error([*FLAGS, "--optimizer", "adam", "--qk-clip"], capsys)
    assert "--qk-clip with --optimizer adam without --use-matrix-fsdp" in err
    assert "--qk-clip-alpha 1.0 must be between 0 and 1" in parse_error(
        [*FLAGS, "--qk-clip", "--qk-clip-alpha", "1"], capsys
    )
