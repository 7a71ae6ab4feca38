"""benchmarks/rollout.py's cost model of continuous vs static batching, on synthetic call timings
whose costs are known (hand-computed ceilings)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import rollout  # noqa: E402


def _decode(steps, used, rows=16):
    """A decode call of 1 ms + 1 ms a loop step + 10 us a used row-step."""
    return "decode", (rows, 16, steps, used), 1e-3 + 1e-3 * steps + 1e-5 * used


def test_cost_model_recovers_the_costs_and_the_ideal_ceiling():
    timed = {"continuous": [("prefill", 256, 0.05), _decode(16, 250), ("step", 0.0, 0.002), ("prefill", 64, 0.03),
                            _decode(10, 120), _decode(4, 30)],
             "static": [("prefill", 256, 0.06), _decode(16, 200), ("step", 0.0, 0.003), _decode(16, 90),
                        _decode(7, 7, rows=2)]}
    model = rollout.cost_model(timed, {"static": 400, "lof": 250}, used_row_steps=1000)
    assert model["decode_fit"] == {"per_call_ms": pytest.approx(1.0, abs=1e-3),
                                   "per_loop_step_ms": pytest.approx(1.0, abs=1e-4),
                                   "per_used_row_step_us": pytest.approx(10.0, abs=1e-2), "calls_fit": 6}
    assert model["continuous"]["prefill_s"] == pytest.approx(0.08) and model["static"]["prefill_s"] == 0.06
    assert model["continuous"]["loop_steps"] == 30 and model["static"]["decode_calls"] == 3
    assert model["static"]["host_s"] == 0.003
    # Shared: the cheaper prefill (0.06 s) + 1,000 used row-steps x 10 us; then 400 vs 250 steps of 1 ms.
    assert model["ideal_ceiling"] == pytest.approx((0.06 + 0.01 + 0.4) / (0.06 + 0.01 + 0.25), abs=1e-3)
    assert model["ideal_ceiling_rows_free"] == pytest.approx(0.46 / 0.31, abs=1e-3)
