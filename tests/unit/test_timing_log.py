"""The iteration line's times are the slowest rank's; --timing-log-option adds the spread
(Megatron's timers' max / minmax / all, megatron/core/timers.py at core_v0.16.1)."""

from megatron_mfsdp.training import logging

PER_RANK = [(0.100, 0.252), (0.120, 0.509), (0.110, 0.300)]  # (iteration s, optimizer step s) per rank


def _line(option):
    elapsed, step = (max(c) for c in zip(*PER_RANK))
    extra = dict(tflops=None, step_ms=step * 1000, tokens_per_s=1.0, spread=logging.timing_spread(option, PER_RANK))
    return logging.iteration_line(None, 1, 2, 8, elapsed * 1000, 1e-3, 8, 2.0, 1.0, 0.5, None, None, 0, 0, extra)


def test_line_shows_the_slowest_rank_and_the_option_adds_the_spread():
    for option in ("max", "minmax", "all"):
        assert "elapsed time per iteration (ms): 120.0 |" in _line(option)
        assert "optimizer step time (ms): 509.0 |" in _line(option)
    assert _line("max").endswith("tokens per second: 1.0 |")
    assert "optimizer step time min/max over ranks (ms): 252.0/509.0 |" in _line("minmax")
    assert "iteration time min/max over ranks (ms): 100.0/120.0 |" in _line("minmax")
    assert "optimizer step time per rank (ms): 252.0, 509.0, 300.0 |" in _line("all")
    assert logging.timing_spread("minmax", PER_RANK[:1]) == ""
