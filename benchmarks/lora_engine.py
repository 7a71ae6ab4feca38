"""Serving a LoRA policy in the embedded engine: merged on device at each weight sync, or unmerged.

    .venv/bin/python benchmarks/lora_engine.py [--repeats 3] [--out benchmarks/results/lora_engine.json]

The RL trainer pushes the policy to the engine after every step. With adapters there are two ways:
  merged     `lora.merge` folds B·A·alpha/rank (and a QLoRA base's dequantisation) into plain weights
             on device (one jitted pass), and the engine runs the plain model;
  unmerged   the engine runs the LoRA model itself: every projection adds (x·A)·B (QLoRA:
             dequantises its int8/int4 kernel) in every decode step.
For each base storage (none, int8, int4) it measures the sync (the update_weights call, merge
included) and rollout throughput on the fixed config (the `bench` preset, 4.46M params, fp32, rank 16
on all seven projections): 32 prompts x 64 tokens -> 64 new tokens. Merged and unmerged runs are
interleaved and the medians compared in the same run; the roofline beside each throughput is the
forward FLOPs of those tokens at the matmul peak measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import calibrate_matmul_gflops, emit  # noqa: E402

from rlvr import sharding  # noqa: E402
from rlvr.models import lora  # noqa: E402
from rlvr.models import params as params_lib  # noqa: E402
from rlvr.models.config import PRESETS, LoraConfig, ModelConfig  # noqa: E402
from rlvr.rollout.engine import Engine  # noqa: E402
from rlvr.rollout.types import Request, SamplingParams  # noqa: E402
from rlvr.train import flops  # noqa: E402

PROMPTS, PROMPT_LEN, NEW = 32, 64, 64


def _requests(prompts, tag):
    return [Request(f"{tag}{i}", p, SamplingParams(max_new_tokens=NEW, temperature=1.0, ignore_eos=True,
                                                    sampling_seed=i)) for i, p in enumerate(prompts)]


def _lora_params(cfg, mesh):
    base = params_lib.init_params(lora.without_lora(cfg), jax.random.key(0), mesh)
    params = lora.attach(cfg, base, jax.random.key(1), mesh)
    # a trained adapter: B no longer zero
    return jax.tree_util.tree_map_with_path(
        lambda p, x: 0.01 * jax.random.normal(jax.random.key(2), x.shape, x.dtype) if p[-1].key == "lora_b" else x,
        params)


def measure(quantize: str, repeats: int, prompts) -> dict:
    cfg = dataclasses.replace(ModelConfig(**PRESETS["bench"]),
                              lora=LoraConfig(rank=16, alpha=32.0, quantize=quantize))
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    params = _lora_params(cfg, mesh)
    opts = dict(max_slots=PROMPTS, max_len=192, page_size=16, decode_steps=16, prefill_rows=8, prefill_chunk=64)
    engines = {"merged": Engine(lora.without_lora(cfg), lora.merge(cfg, params), **opts),
               "unmerged": Engine(cfg, params, **opts)}
    syncs = {"merged": lambda e, v: e.update_weights(lora.merge(cfg, params), v),
             "unmerged": lambda e, v: e.update_weights(params, v)}
    times = {k: {"sync_s": [], "generate_s": []} for k in engines}
    for name, engine in engines.items():  # compile both first
        syncs[name](engine, 0)
        engine.generate(_requests(prompts, "w"))
    for r in range(repeats):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            engine = engines[name]
            t0 = time.perf_counter()
            syncs[name](engine, r + 1)
            jax.block_until_ready(engine.params)
            times[name]["sync_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.generate(_requests(prompts, f"r{r}"))
            times[name]["generate_s"].append(time.perf_counter() - t0)
    out = {}
    for name, t in times.items():
        gen = statistics.median(t["generate_s"])
        out[name] = {"sync_s": round(statistics.median(t["sync_s"]), 4), "generate_s": round(gen, 4),
                     "tokens_per_s": round(PROMPTS * NEW / gen, 1)}
    out["unmerged_over_merged_generate_s"] = round(out["unmerged"]["generate_s"] / out["merged"]["generate_s"], 3)
    out["merge_sync_s_over_generate_s"] = round(out["merged"]["sync_s"] / out["merged"]["generate_s"], 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1024, PROMPT_LEN).tolist() for _ in range(PROMPTS)]
    peak = calibrate_matmul_gflops() * 1e9
    cfg = ModelConfig(**PRESETS["bench"])
    # forward FLOPs of the generated tokens (2 per matmul weight + attention over ~the mean context)
    forward_flops = PROMPTS * NEW * flops.train_flops_per_token(cfg, PROMPT_LEN + NEW // 2) / 3
    record = {"benchmark": "lora_engine", "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()}, {jax.device_count()} CPU device(s), shared 2-core VM",
              "command": "benchmarks/lora_engine.py " + " ".join(sys.argv[1:]),
              "model": "bench preset (4 layers, d256, 4.46M params, fp32), LoRA rank 16 alpha 32 on all 7 projections",
              "workload": f"{PROMPTS} prompts x {PROMPT_LEN} tokens -> {NEW} new tokens, temperature 1",
              "calib_matmul_gflops": round(peak / 1e9, 1),
              "roofline_generate_s": round(forward_flops / peak, 4),
              "roofline_tokens_per_s": round(PROMPTS * NEW / (forward_flops / peak), 1)}
    for quantize in ("none", "int8", "int4"):
        record[quantize] = measure(quantize, args.repeats, prompts)
    emit(record)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
