"""Train-step throughput on the fixed tiny config, in one JSON line.

    .venv/bin/python benchmarks/train_step.py [--repeats 10]

Model: 4 layers, d_model 256, 4 heads / 2 KV heads, head_dim 64, MLP 1024, vocab 1024, fp32
(the `bench` preset, 4,459,264 params); batch 8 x 256 tokens; AdamW. SFT trains on every
token; DPO on 8 pairs x 256 tokens per side with precomputed reference log-probs. MFU is
against the fp32 matmul peak measured in the same run. No Tunix figure is printed: one from
another day's run is no comparison (this machine's speed drifts up to ~2x).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import jax
import numpy as np
import optax

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import calibrate_matmul_gflops, emit, time_calls  # noqa: E402

from rlvr import sharding  # noqa: E402
from rlvr.models import params as params_lib  # noqa: E402
from rlvr.models.config import PRESETS, ModelConfig  # noqa: E402
from rlvr.train import flops  # noqa: E402
from rlvr.train import step as step_lib  # noqa: E402
from rlvr.trainers.preference import preference_loss  # noqa: E402
from rlvr.trainers.sft import sft_loss  # noqa: E402

BATCH, SEQ = 8, 256


def _rows(rng, n):
    return {"tokens": rng.integers(0, 1024, (n, SEQ)).astype(np.int32),
            "positions": np.tile(np.arange(SEQ, dtype=np.int32), (n, 1)),
            "segment_ids": np.ones((n, SEQ), np.int32), "loss_mask": np.ones((n, SEQ), np.int32)}


def sft_batch(rng):
    return _rows(rng, BATCH)


def dpo_batch(rng):
    batch = {f"chosen_{k}": v for k, v in _rows(rng, BATCH).items()}
    batch.update({f"rejected_{k}": v for k, v in _rows(rng, BATCH).items()})
    batch["ref_chosen"] = rng.normal(-1800, 10, BATCH).astype(np.float32)
    batch["ref_rejected"] = rng.normal(-1800, 10, BATCH).astype(np.float32)
    return batch


def bench(cfg: ModelConfig, loss_fn, batch_np, rows: int, repeats: int, peak: float) -> dict:
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    optimizer = optax.adamw(1e-4)
    shardings = step_lib.state_shardings(cfg, optimizer, mesh)
    state = step_lib.init_state(params_lib.init_params(cfg, jax.random.key(0), mesh), optimizer, shardings)
    batch_sh = step_lib.batch_shardings(batch_np, mesh)
    step = step_lib.build_train_step(loss_fn, optimizer, mesh, shardings, batch_sh)
    batch, rng = jax.device_put(batch_np, batch_sh), jax.random.key(0)
    holder = {"state": state}

    def one():
        holder["state"], metrics = step(holder["state"], batch, rng, None, None)
        jax.block_until_ready(metrics)

    first, times = time_calls(one, repeats)
    step_s = statistics.median(times)
    tokens = rows * SEQ
    model_flops = flops.train_flops_per_token(cfg, SEQ) * tokens
    return {"step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s, 1),
            "first_step_incl_compile_s": round(first, 2), "model_tflops_per_step": round(model_flops / 1e12, 4),
            "mfu": round(model_flops / step_s / peak, 4), "all_step_s": [round(t, 4) for t in times]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    cfg = ModelConfig(**PRESETS["bench"])
    calib_before = calibrate_matmul_gflops()
    rng = np.random.default_rng(0)
    peak = calib_before * 1e9
    sft = bench(cfg, functools.partial(sft_loss, cfg), sft_batch(rng), BATCH, args.repeats, peak)
    pref_cfg = type("P", (), {"loss": "dpo", "beta": 0.1, "label_smoothing": 0.0})
    dpo = bench(cfg, functools.partial(preference_loss, cfg, pref_cfg), dpo_batch(rng), 2 * BATCH, args.repeats,
                peak)
    calib = (calib_before + calibrate_matmul_gflops()) / 2
    emit({
        "benchmark": "train_step", "model": "bench preset (4 layers, d256, 4.46M params, fp32)",
        "batch": f"{BATCH}x{SEQ}", "devices": str(jax.devices()[0]), "calib_matmul_gflops": round(calib, 1),
        "sft": sft, "dpo_8_pairs": dpo,
    })


if __name__ == "__main__":
    main()
