"""Decode attention alone at the realistic rollout's page layout: the native C++ kernel against the
ragged XLA path, per layer and step, with the roofline of the same work.

    .venv/bin/python benchmarks/paged_attention_native.py [--rounds 3] [--dtype float32|bfloat16]

The layout is what the engine holds at the realistic shape (`rollout.py --only realistic`: bench_32k's
8 query heads over 2 kv heads of 64, 16-token pages): 64 rows, 8 groups of 8 whose prompts (120 to
900 tokens) are one set of pages per group (the prefix cache), each row ~160 tokens of its own
beyond (mean context ~629). Each implementation runs 24 layer-steps in a `fori_loop` (the layer
cycling over 6, as a decode step's layers do) per timed call; rounds alternate the two (ABAB) and
the medians are reported. Both are checked against each other (max abs difference).

Roofline: the attention's FLOPs (scores and weighted values, 4·rows·heads·context·head_dim) at
the measured 1024³ matmul rate, and its bytes (every page a row holds, a shared page once: keys and
values of one layer) at the measured streaming-read rate; the larger of the two times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, machine_peaks  # noqa: E402
from rlvr.kernels.paged_attention import NativeDecode, paged_attention, ragged_pages  # noqa: E402

PAGE, KV_HEADS, HEAD_DIM, HEADS, LAYERS, WIDTH = 16, 2, 64, 8, 6, 96
PROMPTS = (120, 250, 330, 410, 480, 560, 700, 900)  # one per group of 8 rows
OWN_TOKENS, STEPS = 160, 24


def layout(seed: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """(page table [64, WIDTH], lengths [64], pages in the pool): a group's prompt pages shared by
    its 8 rows, then each row's own pages."""
    rng = np.random.default_rng(seed)
    table, lengths, next_page = [], [], 1
    for prompt in PROMPTS:
        full = prompt // PAGE
        shared = list(range(next_page, next_page + full))
        next_page += full
        for _ in range(8):
            length = prompt + OWN_TOKENS + int(rng.integers(-40, 40))
            own = -(-length // PAGE) - full
            pages = shared + list(range(next_page, next_page + own))
            next_page += own
            table.append(pages + [0] * (WIDTH - len(pages)))
            lengths.append(length)
    return np.array(table, np.int32), np.array(lengths, np.int32), next_page + 8


def roofline_ms(table, lengths, itemsize: int, peaks: dict) -> dict:
    held = {page for row, length in zip(table, lengths, strict=True) for page in row[:-(-int(length) // PAGE)]}
    kv_bytes = 2 * len(held) * PAGE * KV_HEADS * HEAD_DIM * itemsize
    flop = 4 * int(lengths.sum()) * HEADS * HEAD_DIM
    compute, memory = flop / peaks["matmul_gflops"] / 1e6, kv_bytes / peaks["read_gbytes_per_s"] / 1e6
    return {"kv_mbytes": round(kv_bytes / 1e6, 2), "mflop": round(flop / 1e6, 1), "compute_ms": round(compute, 3),
            "memory_ms": round(memory, 3), "ms": round(max(compute, memory), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    table, lengths, pages = layout()
    rng = np.random.default_rng(1)
    shape = (LAYERS, pages, PAGE, KV_HEADS, HEAD_DIM)
    k, v = (jnp.asarray(rng.standard_normal(shape), args.dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((len(lengths), HEADS, HEAD_DIM)), jnp.float32)
    lists = {"ragged": ragged_pages(table, lengths + 16, PAGE), "native": NativeDecode()}
    table_j, lengths_j = jnp.asarray(table), jnp.asarray(lengths)

    def attend(name, q, k, v, layer):
        return paged_attention(q, k, v, table_j, lengths_j, layer=layer, implementation=name, ragged=lists[name])

    def steps(name):
        def run(q, k, v):
            body = lambda i, acc: acc + attend(name, q + acc * 1e-6, k, v, i % LAYERS)  # noqa: E731
            return jax.lax.fori_loop(0, STEPS, body, jnp.zeros_like(q))
        return jax.jit(run)

    calls = {name: steps(name) for name in lists}
    difference = float(jnp.max(jnp.abs(attend("native", q, k, v, 2) - attend("ragged", q, k, v, 2))))
    peaks_before = machine_peaks()
    times = {name: [] for name in calls}
    for call in calls.values():  # compile
        call(q, k, v).block_until_ready()
    for _ in range(args.rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call(q, k, v).block_until_ready()
            times[name].append((time.perf_counter() - start) / STEPS * 1e3)
    peaks = {key: max(value, machine_peaks()[key]) for key, value in peaks_before.items()}
    roofline = roofline_ms(table, lengths, jnp.dtype(args.dtype).itemsize, peaks)
    ms = {name: round(statistics.median(values), 3) for name, values in times.items()}
    emit({"benchmark": "paged_attention_native", "dtype": args.dtype, "rows": len(lengths),
          "context_mean": round(float(lengths.mean()), 1), "ms_per_layer_step": ms,
          "all_ms": {name: [round(t, 3) for t in values] for name, values in times.items()},
          "native_speedup": round(ms["ragged"] / ms["native"], 2), "max_abs_difference": difference,
          "machine_peaks": {key: round(value, 1) for key, value in peaks.items()}, "roofline": roofline,
          "vs_roofline": {name: round(roofline["ms"] / value, 3) for name, value in ms.items()},
          "devices": str(jax.devices()[0])})


if __name__ == "__main__":
    main()
