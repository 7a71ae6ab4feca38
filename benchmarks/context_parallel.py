"""Context parallelism on 8 fake CPU devices: correctness and the longest trainable context, one JSON line.

    .venv/bin/python benchmarks/context_parallel.py [--budget_mib 256] [--max_len 131072]

Per implementation — "xla" (dense mask) and "flash" without context parallelism, "ring" and
"ulysses" over mesh.sequence = 8:
  * correctness: max |error| of the attention output and of dq/dk/dv against the float32
    reference (2 rows x 256 positions of packed segments, 8 heads / 2 KV heads, causal);
  * memory: the longest row (batch 1) whose SFT train step fits `--budget_mib` per device,
    from XLA's AOT memory analysis of the compiled step (`rlvr.aot.analyze`: arguments + outputs
    + temporaries - aliased), searched by doubling then bisection to a multiple of 1024. Without
    context parallelism the row is replicated on every device (mesh.data = 8, batch 1), i.e. the
    one-device figure.
Model: the tiny preset with 8 heads of 16 dims (so Ulysses can split heads 8 ways), float32, AdamW.
These are XLA:CPU figures: buffer assignment and fusion differ on TPU/GPU, and on CPU the local
attention is the flash kernel's blockwise "xla" implementation (the Pallas kernels would run on
an accelerator). Nothing is executed for the memory part, only compiled.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402
from rlvr.kernels import context_parallel as cp  # noqa: E402

from rlvr import config_lib, sharding  # noqa: E402
from rlvr.aot import analyze  # noqa: E402
from rlvr.models.transformer import attention_mask, dot_product_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16
SETUPS = {  # attention -> (mesh overrides, devices a row's positions are split over)
    "xla": ({"mesh.data": 8, "mesh.sequence": 1}, 1),
    "flash": ({"mesh.data": 8, "mesh.sequence": 1}, 1),
    "ring": ({"mesh.data": 1, "mesh.sequence": 8}, 8),
    "ulysses": ({"mesh.data": 1, "mesh.sequence": 8}, 8),
}


def _dense(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, mesh=None):
    del mesh
    return dot_product_attention(q, k, v, attention_mask(q_pos, q_seg, kv_pos, kv_seg))


def _flash(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, mesh=None):
    del mesh
    return cp.local_attention(q, k, v, q_seg, kv_seg, q_pos, kv_pos, return_lse=False)


KERNELS = {"xla": _dense, "flash": _flash, "ring": cp.ring_attention, "ulysses": cp.ulysses_attention}


def correctness(name: str) -> dict[str, float]:
    b, t = 2, 256
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, HEADS, HEAD_DIM))
    k, v = (jax.random.normal(key, (b, t, KV_HEADS, HEAD_DIM)) for key in keys[1:3])
    w = jax.random.normal(keys[3], q.shape)
    rng = np.random.default_rng(0)
    seg = np.zeros((b, t), np.int32)
    pos = np.zeros((b, t), np.int32)
    for row in range(b):
        bounds = [0, *sorted(rng.choice(np.arange(1, t - 8), 3, replace=False)), t - 8]  # 8 pad positions
        for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            seg[row, lo:hi], pos[row, lo:hi] = s + 1, np.arange(hi - lo)
    seg, pos = jnp.asarray(seg), jnp.asarray(pos)
    real = (seg != 0)[..., None, None]

    def loss(fn, q, k, v):
        out = jnp.where(real, fn(q, k, v, seg, seg, pos, pos), 0.0)
        return jnp.sum(out * w), out

    mesh = sharding.make_mesh({"sequence": SETUPS[name][1], "data": 8 // SETUPS[name][1]})
    fn = functools.partial(KERNELS[name], mesh=mesh)
    grad = lambda f: jax.jit(jax.value_and_grad(functools.partial(loss, f), (0, 1, 2), has_aux=True))(q, k, v)
    (_, out), grads = grad(fn)
    (_, want), want_grads = grad(cp.reference_attention)
    return {"out_max_abs_err": float(jnp.max(jnp.abs(out - want))),
            "grad_max_abs_err": max(float(jnp.max(jnp.abs(g - r))) for g, r in zip(grads, want_grads, strict=True))}


def per_device_bytes(name: str, length: int) -> int:
    overrides = {"data.seq_len": length, "data.batch_size": 1, "model.attention": name,
                 "model.num_heads": HEADS, "model.num_kv_heads": KV_HEADS, "model.head_dim": HEAD_DIM,
                 "model.max_position_embeddings": max(length, 2048), **SETUPS[name][0]}
    return analyze(config_lib.load_config("configs/long_context.py", overrides))["per_device_total_bytes"]


def longest_fitting(name: str, budget: int, max_len: int, step: int = 1024) -> dict[str, int]:
    """The longest multiple of `step` whose train step fits `budget` bytes per device."""
    sizes: dict[int, int] = {}

    def fits(length: int) -> bool:
        sizes[length] = per_device_bytes(name, length)
        return sizes[length] <= budget

    low, high = 0, step
    while high <= max_len and fits(high):
        low, high = high, high * 2
    high = min(high, max_len + step)
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    return {"max_seq_len": low, "per_device_bytes_at_max": sizes.get(low, 0),
            "compiles": len(sizes), "capped": low >= max_len}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget_mib", type=float, default=256.0)
    parser.add_argument("--max_len", type=int, default=131072)
    parser.add_argument("--only", default=",".join(SETUPS), help="comma-separated implementations")
    args = parser.parse_args()
    budget = int(args.budget_mib * 2**20)
    record: dict = {"benchmark": "context_parallel", "devices": jax.device_count(), "backend": jax.default_backend(),
                    "budget_mib": args.budget_mib, "model": f"tiny preset, {HEADS} heads / {KV_HEADS} KV heads x "
                    f"{HEAD_DIM}", "note": "XLA:CPU AOT memory figures on fake devices, not TPU/GPU"}
    for name in args.only.split(","):
        t0 = time.perf_counter()
        shards = SETUPS[name][1]
        fit = longest_fitting(name, budget, args.max_len)
        record[name] = {"sequence_shards": shards, **correctness(name), **fit,
                        "per_device_positions_at_max": fit["max_seq_len"] // shards,
                        "seconds": round(time.perf_counter() - t0, 1)}
    base = record.get("xla", {}).get("max_seq_len") or None
    for name in ("flash", "ring", "ulysses"):
        if base and name in record:
            record[name]["context_vs_xla"] = round(record[name]["max_seq_len"] / base, 2)
    emit(record)


if __name__ == "__main__":
    main()
