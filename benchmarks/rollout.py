"""Rollout throughput of the embedded engine vs a naive cached loop and the Tunix peer.

    .venv/bin/python benchmarks/rollout.py [--repeats 3]

Fixed config (the `bench` preset: 4 layers, d256, 4.46M params, fp32). Workloads:
  batch:   32 prompts x 64 prompt tokens -> 64 new tokens (temperature 1, eos ignored)
  groups:  8 prompts x n=4 samples (prompt pages shared by the group)
  varied:  64 requests with max_new_tokens uniform in [8, 128] on 16 slots, continuous
           batching vs static batching (batches of 16, each waits for its longest)
The naive loop is `rlvr.models.generate` (one jitted scan, contiguous cache, static batch,
greedy). Compile counts are the jit cache sizes of the engine's prefill and decode.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import TUNIX, calibrate_matmul_gflops, emit, time_calls  # noqa: E402

from rlvr import sharding  # noqa: E402
from rlvr.models import params as params_lib  # noqa: E402
from rlvr.models.config import PRESETS, ModelConfig  # noqa: E402
from rlvr.models.generate import _greedy  # noqa: E402
from rlvr.rollout import device_fns  # noqa: E402
from rlvr.rollout.engine import Engine  # noqa: E402
from rlvr.rollout.types import Request, SamplingParams  # noqa: E402


def _requests(prompts, max_new, n=1, prefix="r"):
    return [Request(f"{prefix}{i}_{j}", p, SamplingParams(max_new_tokens=m, temperature=1.0, ignore_eos=True,
                                                          sampling_seed=i * 100 + j))
            for i, (p, m) in enumerate(zip(prompts, max_new, strict=True)) for j in range(n)]


def tokens_per_s(fn, tokens: int, repeats: int) -> dict:
    first, times = time_calls(fn, repeats)
    median = statistics.median(times)
    return {"tokens_per_s": round(tokens / median, 1), "median_s": round(median, 4),
            "first_call_incl_compile_s": round(first, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode_steps", type=int, default=16)
    args = parser.parse_args()
    cfg = ModelConfig(**PRESETS["bench"])
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    params = params_lib.init_params(cfg, jax.random.key(0), mesh)
    rng = np.random.default_rng(0)
    calib = calibrate_matmul_gflops()
    prompts = [rng.integers(0, 1024, 64).tolist() for _ in range(32)]
    opts = dict(max_len=192, page_size=16, decode_steps=args.decode_steps, prefill_rows=8, prefill_chunk=64)
    engine = Engine(cfg, params, max_slots=32, **opts)
    batch = tokens_per_s(lambda: engine.generate(_requests(prompts, [64] * 32)), 32 * 64, args.repeats)
    groups = tokens_per_s(lambda: engine.generate(_requests(prompts[:8], [64] * 8, n=4)), 32 * 64, args.repeats)
    compiles = {"prefill": device_fns.prefill._cache_size(), "decode": device_fns.decode._cache_size()}

    tokens = jnp.asarray(np.array(prompts, np.int32))
    lengths = jnp.full((32,), 64, jnp.int32)
    naive = tokens_per_s(lambda: jax.block_until_ready(_greedy(cfg, params, tokens, lengths, 64, -1)), 32 * 64,
                         args.repeats)

    varied_new = rng.integers(8, 129, 64).tolist()
    varied_prompts = [rng.integers(0, 1024, 32).tolist() for _ in range(64)]
    small = Engine(cfg, params, max_slots=16, **opts)
    total = sum(varied_new)
    continuous = tokens_per_s(lambda: small.generate(_requests(varied_prompts, varied_new)), total, args.repeats)

    def static():
        for start in range(0, 64, 16):
            small.generate(_requests(varied_prompts[start:start + 16], varied_new[start:start + 16], prefix="s"))

    static_batching = tokens_per_s(static, total, args.repeats)
    ratio = batch["tokens_per_s"] / TUNIX["sampler_tokens_per_s"]
    emit({
        "benchmark": "rollout", "model": "bench preset (4 layers, d256, 4.46M params, fp32)",
        "decode_steps_per_call": args.decode_steps, "calib_matmul_gflops": round(calib, 1),
        "engine_32x64_to_64": batch, "engine_8_prompts_n4": groups, "naive_cached_loop_32x64_to_64": naive,
        "engine_vs_naive": round(batch["tokens_per_s"] / naive["tokens_per_s"], 3),
        "varied_lengths_continuous": continuous, "varied_lengths_static": static_batching,
        "continuous_vs_static": round(continuous["tokens_per_s"] / static_batching["tokens_per_s"], 3),
        "compile_counts": compiles, "tunix_sampler_tokens_per_s": TUNIX["sampler_tokens_per_s"],
        "speedup_vs_tunix_raw": round(ratio, 3),
        "speedup_vs_tunix_calibrated": round(ratio * TUNIX["calib_matmul_gflops"] / calib, 3),
    })


if __name__ == "__main__":
    main()
