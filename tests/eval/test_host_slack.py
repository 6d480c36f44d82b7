"""eval/host_slack.py's helpers (CPU): the host spin, the delayed attend and the slope."""
import time

import pytest

from qvg.eval.host_slack import delayed, slope, spin


def test_spin_waits_at_least_that_long():
    t = time.perf_counter()
    spin(2000)
    assert time.perf_counter() - t >= 2e-3


def test_delayed_attend_spins_then_calls_through():
    class Cache:
        def attend(self, layer, q, scale=None):
            return (layer, q, scale)
    c, knob = Cache(), [0.0]
    delayed(c, knob)
    assert c.attend(3, "q", scale=0.5) == (3, "q", 0.5)
    knob[0] = 3000
    t = time.perf_counter()
    c.attend(1, "q")
    assert time.perf_counter() - t >= 3e-3


def test_slope_of_chunk_time_over_delay():
    rows = [{"delay_us": d, "chunk_ms": 500 + 0.15 * d} for d in (0, 50, 100, 200)]
    assert slope(rows) == pytest.approx(0.15)
    assert slope([{"delay_us": 0, "chunk_ms": 1.0}]) == 0.0


def test_bad_delays_give_one_error_line(capsys):
    from qvg.eval.host_slack import main
    for bad in ("0,-5", "0,nan", "0,inf", "x"):
        assert main(["--delays", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
    assert main(["--methods", "bf16,nope"]) == 2
    assert "unknown cache method 'nope'" in capsys.readouterr().err
