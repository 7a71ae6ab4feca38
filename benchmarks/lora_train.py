"""LoRA / QLoRA against full fine-tuning: memory from the ahead-of-time analysis, and the SFT step time.

    .venv/bin/python benchmarks/lora_train.py [--repeats 7] [--out benchmarks/results/lora_train.json]
    .venv/bin/python benchmarks/lora_train.py --tunix_python=/path/to/.venv-tunix/bin/python [--rounds 2] \
        [--repeats 5] --out benchmarks/results/lora_vs_tunix.json   # beside Tunix's LoRA step, same window
    .venv/bin/python benchmarks/lora_train.py --memory_only --out benchmarks/results/lora_memory.json

Memory (nothing allocated: `rlvr.aot.analyze` compiles the SFT train step on one CPU device and reads
XLA's memory analysis) for the fixed config (the `bench` preset, 4.46M params, batch 8 x 256) and a
~150M-parameter Qwen3-style config (12 layers, d768, vocab 32768, batch 8 x 1024, remat): bytes of
what trains, of the optimizer state, of all weights (the frozen base included: int8 / int4 for QLoRA),
and XLA's per-device peak (arguments + outputs + temporaries - aliased). LoRA is rank 16, alpha 32 on
all seven projections (Tunix's peer LoRA step: qwix, same rank and targets).

Step time (the fixed config, AdamW, fp32): full fine-tuning and LoRA / QLoRA steps interleaved, medians,
beside the roofline of each step: its model FLOPs at the fp32 matmul peak measured in the same run.
Tunix's LoRA step is compared only side by side: with `--tunix_python` (a venv with google-tunix), in one window: the
peer script's LoRA step (`benchmarks/peers/bench_tunix.py --only sft_lora`, a fresh process, its median)
and ours (with the full step beside it) alternately in ABBA order. A LoRA step's FLOPs: forward and
input gradients of every matmul (4 per weight and token) plus the adapters' own 6, and attention; the
frozen weights get no weight gradient.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import calibrate_matmul_gflops, emit  # noqa: E402
from train_step import BATCH, SEQ, sft_batch  # noqa: E402

from rlvr import aot, config_lib, sharding  # noqa: E402
from rlvr.models import lora  # noqa: E402
from rlvr.models import params as params_lib  # noqa: E402
from rlvr.models.config import PRESETS, LoraConfig, ModelConfig  # noqa: E402
from rlvr.train import flops  # noqa: E402
from rlvr.train import step as step_lib  # noqa: E402
from rlvr.train.optimizer import build_optimizer  # noqa: E402
from rlvr.trainers.sft import sft_loss  # noqa: E402

LORA = {"rank": 16, "alpha": 32.0, "targets": "all"}
VARIANTS = {"full": {"rank": 0}, "lora": LORA, "qlora_int8": {**LORA, "quantize": "int8"},
            "qlora_int4": {**LORA, "quantize": "int4"}}
LARGE = dict(family="qwen3", vocab_size=32768, hidden_size=768, intermediate_size=2048, num_layers=12,
             num_heads=12, num_kv_heads=4, head_dim=64, rope_theta=1e6, max_position_embeddings=4096)


def _config(model: dict, variant: dict, batch: int, seq: int, remat: str):
    c = config_lib.base_config()
    c.job = "sft"
    for key, value in model.items():
        c.model[key] = value
    c.model.remat_policy = remat
    for key, value in variant.items():
        c.lora[key] = value
    c.data.batch_size, c.data.seq_len = batch, seq
    c.mesh.data = 1
    return c


def memory(model: dict, batch: int, seq: int, remat: str) -> dict:
    out = {}
    for name, variant in VARIANTS.items():
        report = aot.analyze(_config(model, variant, batch, seq, remat))
        out[name] = {"params": report["params"], "trained_param_bytes": report["trained_param_bytes"],
                     "optimizer_state_bytes": report["optimizer_state_bytes"],
                     "param_bytes_total": report["param_bytes_total"],
                     "peak_bytes": report["per_device_total_bytes"], "temp_bytes": report["per_device_bytes"]["temp"]}
    full = out["full"]
    for name in VARIANTS:
        if name != "full":
            out[name]["optimizer_state_over_full"] = round(out[name]["optimizer_state_bytes"]
                                                           / full["optimizer_state_bytes"], 5)
            out[name]["peak_over_full"] = round(out[name]["peak_bytes"] / full["peak_bytes"], 4)
    return out


def _step_fn(cfg: ModelConfig, batch_np):
    """(one blocking step, its model FLOPs)."""
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    optimizer = build_optimizer(config_lib.base_config().optimizer, 1000)
    shardings = step_lib.state_shardings(cfg, optimizer, mesh)
    params = params_lib.init_params(lora.without_lora(cfg), jax.random.key(0), mesh)
    base = None
    if cfg.lora.enabled:
        params, base = lora.split(lora.attach(cfg, params, jax.random.key(1), mesh))
    state = step_lib.init_state(params, optimizer, shardings)
    batch_sh = step_lib.batch_shardings(batch_np, mesh)
    step = step_lib.build_train_step(lambda *a: sft_loss(cfg, *a), optimizer, mesh, shardings, batch_sh,
                                     base_sharding=step_lib.base_shardings(cfg, mesh))
    batch, rng, holder = jax.device_put(batch_np, batch_sh), jax.random.key(0), {"state": state}

    def one():
        holder["state"], metrics = step(holder["state"], batch, rng, None, base)
        jax.block_until_ready(metrics)

    per_token = flops.train_flops_per_token(cfg, SEQ)
    if cfg.lora.enabled:
        per_token -= 2 * flops.matmul_params(cfg)  # no weight gradients for the frozen base
        per_token += 6 * lora.adapter_count(cfg)
    return one, per_token * BATCH * SEQ


def step_times(repeats: int, peak: float, variants: tuple[str, ...] = tuple(VARIANTS)) -> dict:
    fixed = ModelConfig(**PRESETS["bench"])
    batch = sft_batch(np.random.default_rng(0))
    steps = {}
    for name, variant in ((n, VARIANTS[n]) for n in variants):
        cfg = dataclasses.replace(fixed, lora=LoraConfig.from_mapping(variant))
        steps[name] = _step_fn(cfg, batch)
        steps[name][0]()  # compile
    times = {name: [] for name in steps}
    for r in range(repeats):  # interleaved, order alternating
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            t0 = time.perf_counter()
            steps[name][0]()
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, (_, model_flops) in steps.items():
        step_s = statistics.median(times[name])
        out[name] = {"step_s": round(step_s, 4), "tokens_per_s": round(BATCH * SEQ / step_s, 1),
                     "model_gflops_per_step": round(model_flops / 1e9, 2),
                     "roofline_step_s": round(model_flops / peak, 4), "mfu": round(model_flops / step_s / peak, 4)}
    for name in variants:
        if name != "full":
            out[name]["step_over_full"] = round(out[name]["step_s"] / out["full"]["step_s"], 3)
    return out


def tunix_lora_step(python: str) -> float:
    """Tunix's LoRA SFT step (qwix rank 16, all projections, 8 x 256, AdamW), median of its own
    timed calls, from the peer script in a fresh process."""
    peer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "bench_tunix.py")
    out = subprocess.run([python, peer, "--only", "sft_lora", "--repeats", "1"], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["summary"]["sft_lora_step_s"]


def vs_tunix(python: str, rounds: int, repeats: int) -> dict:
    """Our LoRA (and full) SFT step and Tunix's LoRA step alternately (ABBA), `rounds` pairs, in one
    window: both medians, each pair's ratio, and the roofline at the matmul peak measured meanwhile."""
    ours, theirs, pairs, peaks = [], [], [], []
    for r in range(rounds):
        pair = {}
        for who in ("tunix", "ours") if r % 2 == 0 else ("ours", "tunix"):
            if who == "tunix":
                pair["tunix"] = tunix_lora_step(python)
            else:
                peaks.append(calibrate_matmul_gflops() * 1e9)
                pair["ours"] = step_times(repeats, peaks[-1], ("full", "lora"))
        theirs.append(pair["tunix"])
        ours.append(pair["ours"])
        pairs.append(round(pair["tunix"] / pair["ours"]["lora"]["step_s"], 3))
    median = lambda xs: statistics.median(xs)
    lora_s = median([o["lora"]["step_s"] for o in ours])
    peak = median(peaks)
    lora_flops = ours[0]["lora"]["model_gflops_per_step"] * 1e9
    return {"tunix_lora_step_s": round(median(theirs), 4), "tunix_runs": theirs,
            "ours_lora_step_s": round(lora_s, 4), "ours_lora_runs": [o["lora"]["step_s"] for o in ours],
            "ours_full_step_s": round(median([o["full"]["step_s"] for o in ours]), 4),
            "speedup_ours_over_tunix": round(median(theirs) / lora_s, 3), "speedup_per_pair": pairs,
            "lora_model_gflops_per_step": ours[0]["lora"]["model_gflops_per_step"],
            "roofline_lora_step_s": round(lora_flops / peak, 4), "calib_matmul_gflops": round(peak / 1e9, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="")
    parser.add_argument("--tunix_python", default="", help="only the same-window comparison with Tunix's LoRA "
                        "step: the python of a venv with google-tunix (e.g. .venv-tunix/bin/python)")
    parser.add_argument("--rounds", type=int, default=2, help="with --tunix_python: ABBA pairs")
    parser.add_argument("--memory_only", action="store_true", help="only the AOT memory figures (no timing)")
    args = parser.parse_args()
    if args.tunix_python:
        record = {"benchmark": "lora_vs_tunix", "date": datetime.date.today().isoformat(),
                  "machine": f"{platform.machine()}, {jax.device_count()} CPU device(s), shared 2-core VM",
                  "command": "benchmarks/lora_train.py " + " ".join(sys.argv[1:]),
                  "workload": "SFT step, bench preset (4.46M params, fp32), 8 x 256 tokens, AdamW; LoRA rank 16, "
                              "alpha 32, all 7 projections (Tunix: qwix LoraProvider, same targets)",
                  **vs_tunix(args.tunix_python, args.rounds, args.repeats)}
        emit(record, args.out, sort_keys=True)
        return
    record = {"benchmark": "lora_train", "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()}, {jax.device_count()} CPU device(s), shared 2-core VM",
              "command": "benchmarks/lora_train.py " + " ".join(sys.argv[1:]),
              "lora": "rank 16, alpha 32, all 7 projections; QLoRA: the frozen projections int8 / int4, block 64",
              "memory_fixed": {"model": "bench preset (4.46M params, fp32)", "batch": f"{BATCH}x{SEQ}",
                               **memory(PRESETS["bench"], BATCH, SEQ, "none")}}
    large_params = ModelConfig(**LARGE).num_params()
    record["memory_large"] = {"model": f"qwen3-style 12 layers d768 vocab 32768 ({large_params / 1e6:.0f}M params, "
                                       "fp32, remat full)", "batch": "8x1024",
                              **memory(LARGE, 8, 1024, "full")}
    if args.memory_only:
        record["benchmark"] = "lora_memory"
        emit(record, args.out, sort_keys=True)
        return
    calib = calibrate_matmul_gflops()
    record["step_fixed"] = step_times(args.repeats, calib * 1e9)
    record["calib_matmul_gflops"] = round((calib + calibrate_matmul_gflops()) / 2, 1)
    emit(record, args.out, sort_keys=True)


if __name__ == "__main__":
    main()
