"""Shared helpers for the benchmarks: timing, the matmul yardstick, the peer figures."""

from __future__ import annotations

import json
import time

from rlvr.train.flops import measure_matmul_peak

# Tunix 0.1.7 on the same fixed config and a 2-core CPU (../shared/peers/tunix/results_qwen3_r5.json).
# The yardstick-scaled ratio is only an estimate (it read ~1.3x optimistic on 2026-11-30); the real
# comparison is side by side in one window:
#   python3 -m venv /tmp/venv-tunix && /tmp/venv-tunix/bin/pip install google-tunix
#   cp ../shared/peers/tunix/bench_tunix.py /tmp && /tmp/venv-tunix/bin/python /tmp/bench_tunix.py --only sft,sampler
# then this repo's benchmarks immediately after.
TUNIX = {"sft_step_s": 0.7185, "sampler_tokens_per_s": 4047.6, "grpo_step_s": 2.0358,
         "calib_matmul_gflops": 285.15}


def calibrate_matmul_gflops(reps: int = 20) -> float:
    """The peer benchmark's yardstick of machine speed: median fp32 1024³ matmul GFLOP/s
    (`rlvr.train.flops.measure_matmul_peak`, the one the trainer's MFU uses)."""
    return measure_matmul_peak("float32", 1024, reps, median=True) / 1e9


def time_calls(fn, repeats: int) -> tuple[float, list[float]]:
    """(first call incl. compile, per-call times of `repeats` more calls); fn blocks itself."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, times


def emit(record: dict) -> None:
    print(json.dumps(record, sort_keys=True))
