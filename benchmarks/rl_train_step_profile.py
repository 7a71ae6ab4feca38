"""Where the realistic RL train step's time goes: loss + gradient of one micro-batch (2 packed rows of
1,024 tokens, two 512-token sequences each, the last 128 tokens of each sampled) at the `bench_32k`
shape of `rl_step_realistic.py`, compiled once per variant: compile seconds, XLA's cost analysis
(FLOPs of the whole micro-batch when the layers are unrolled; of one layer's scan body otherwise),
and wall and process CPU seconds per call (CPU seconds hold up better than wall time on a shared
machine).

    .venv/bin/python benchmarks/rl_train_step_profile.py [--out FILE]

Variants: the benchmark's own (full logits, layers unrolled: scan_unroll=6), chunked log-probs
(train.logprob_chunk_size=512: never the [rows, 1024, 32768] logits) and scanned layers
(scan_unroll=1: one layer body compiled, not six).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402
from rl_step_realistic import bench_config  # noqa: E402

from rlvr import api  # noqa: E402
from rlvr.rl.objective import Objective, rl_loss  # noqa: E402

ROWS, T, SEQ, NEW = 2, 1024, 512, 128
VARIANTS = {"benchmark (full logits, scan_unroll=6)": ({}, 0), "chunked log-probs (512)": ({}, 512),
            "scanned layers (scan_unroll=1)": ({"scan_unroll": 1}, 0)}


def micro_batch(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """ROWS rows of two SEQ-token sequences whose last NEW tokens are sampled (loss_mask 1)."""
    col = np.arange(T)
    b = {"tokens": rng.integers(10, 32000, (ROWS, T)).astype(np.int32),
         "positions": np.tile(col % SEQ, (ROWS, 1)).astype(np.int32),
         "segment_ids": np.tile(col // SEQ + 1, (ROWS, 1)).astype(np.int32),
         "loss_mask": np.tile(col % SEQ >= SEQ - NEW, (ROWS, 1)).astype(np.int32)}
    b["seq_index"] = b["segment_ids"] - 1
    b["advantages"] = (rng.normal(size=(ROWS, T)) * b["loss_mask"]).astype(np.float32)
    b["behaviour_logp"] = np.full((ROWS, T), -3.0, np.float32)
    b["token_weight"] = b["loss_mask"].astype(np.float32)
    b["row_weight"] = np.full((ROWS,), 2.0 * NEW, np.float32)
    return b


def measure(model_fields: dict, chunk: int, batch, runs: int) -> dict:
    config = bench_config(tempfile.mkdtemp(), 1, cache_dir="")
    config.unlock()
    config.train.logprob_chunk_size = chunk
    for k, v in model_fields.items():
        config.model[k] = v
    config.lock()
    model = api.build_model(config)
    loss = functools.partial(rl_loss, model.cfg, Objective.from_config(config))
    fn = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, jax.random.key(0), None), has_aux=True))
    t = time.perf_counter()
    compiled = fn.lower(model.params, batch).compile()
    compile_s = time.perf_counter() - t
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    calls = []
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(model.params, batch))
        calls.append({"wall_s": round(time.perf_counter() - t, 2), "cpu_s": round(time.process_time() - c, 2)})
    return {"compile_s": round(compile_s, 1), "cost_analysis_gflop": round(cost.get("flops", 0) / 1e9),
            "cost_analysis_gbytes": round(cost.get("bytes accessed", 0) / 1e9, 1), "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    batch = micro_batch(np.random.default_rng(0))
    results = {name: measure(fields, chunk, batch, args.runs) for name, (fields, chunk) in VARIANTS.items()}
    emit({"benchmark": "rl_train_step_profile", "micro_batch": f"{ROWS} rows x {T} tokens", "cpu_count": os.cpu_count(),
          "model_gflop_per_token_fwd_bwd": round(6 * 34.9e6 / 1e9, 3), "variants": results}, args.out)


if __name__ == "__main__":
    main()
