"""The SFT step with stacked (scanned) decoder layers against one module per layer, interleaved in one process.

    .venv/bin/python benchmarks/layer_layout.py [--rounds 16] [--calls 5] [--micro_batches 4]
        [--out benchmarks/results/layer_layout.json]

What: `benchmarks/train_step.py`'s SFT step (the `bench` preset, batch 8 x 256, AdamW) compiled twice,
with `model.scan_layers=True` (params `layers/...` stacked on axis 0) and `False` (`layers_0/...`, as the
engine decodes and as Tunix's model is built), both from the same weights. Rounds alternate the order
(ABBA); each round times `calls` calls of each and keeps their medians. Prints one JSON line: the
medians and the ratio scanned / per-layer per round and its median (that both layouts train the same
model is tests/test_train_step.py's check). Only ratios mean anything here.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_average, publish  # noqa: E402
from train_step import compiled_step, sft_batch  # noqa: E402

from rlvr.models.config import PRESETS, ModelConfig  # noqa: E402
from rlvr.trainers.sft import sft_loss  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=16, help="ABBA rounds")
    parser.add_argument("--calls", type=int, default=5, help="timed calls of each layout per round")
    parser.add_argument("--micro_batches", type=int, default=4)
    parser.add_argument("--out", default="", help="also record the result here (earlier records kept)")
    args = parser.parse_args()
    load_before = load_average()
    scanned = ModelConfig(**{**PRESETS["bench"], "scan_layers": True})
    layouts = {"scanned": scanned, "per_layer": dataclasses.replace(scanned, scan_layers=False)}
    batch = sft_batch(np.random.default_rng(0))
    steps = {name: compiled_step(cfg, functools.partial(sft_loss, cfg), batch, args.micro_batches)[0]
             for name, cfg in layouts.items()}
    medians: dict[str, list[float]] = {name: [] for name in layouts}
    for r in range(args.rounds):
        for name in list(layouts) if r % 2 == 0 else list(layouts)[::-1]:
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                steps[name]()
                times.append(time.perf_counter() - t0)
            medians[name].append(statistics.median(times))
    ratios = [round(a / b, 3) for a, b in zip(medians["scanned"], medians["per_layer"], strict=True)]
    record = {
        "benchmark": "layer_layout", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%MZ"),
        "command": "benchmarks/layer_layout.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (the load averages say how busy)",
        "model": "bench preset (4 layers, d256, 4.46M params, fp32)", "batch": "8x256",
        "micro_batches": args.micro_batches,
        "step_s": {name: round(statistics.median(m), 4) for name, m in medians.items()},
        "round_medians_s": {name: [round(t, 4) for t in m] for name, m in medians.items()},
        "speedup_per_layer_per_round": ratios, "speedup_per_layer": round(statistics.median(ratios), 3),
        "load_average_before": load_before, "load_average_after": load_average(),
    }
    publish(record, args.out)


if __name__ == "__main__":
    main()
