"""Attention implementations side by side: correctness against the float32 reference and speed, in
one JSON line.

    .venv/bin/python benchmarks/attention.py [--shapes 1x512x8x2x64,2x256x4x4x64] [--dtype float32]
        [--no-causal] [--sliding-window 0] [--segments 1] [--branches 0 --prompt_len 0] [--repeats 5]
        [--implementations xla_dense,xla_causal_blocks,native_cpu,xla_blockwise,pallas]

A shape is BxTxHxKVHxD (self-attention, S = T); `--segments N` packs N equal documents into each row
(segment ids, positions restarting at each), as SFT's packed rows arrive; `--branches N --prompt_len P`
makes each row a shared-prompt row as GRPO trains it (`rl.share_prompts`: a prompt of P tokens, then N
completions side by side, each seeing the prompt and itself; the implementations that take a dense
mask only, checked against float32 dense attention at HIGHEST precision). Per shape and
implementation: max abs error of the output and of dq, dk, dv (loss = sum(out * w), w fixed random) against
`rlvr.kernels.flash_attention.reference_attention` (float32, HIGHEST precision), and the median
time of the jitted forward and forward+backward with the achieved TFLOP/s. FLOPs count only
visible (query, key) pairs: forward 4*D per pair and head, forward+backward 3.5x that (the
FlashAttention-2 convention: 2 matmuls forward, 5 backward).

On CPU the Pallas kernels run in interpret mode: checked for correctness, never timed. On GPU/TPU
the "pallas_speedup" entries are xla_dense time / pallas time. To add a row (ring or Ulysses
attention, say), add an `Impl` to `IMPLEMENTATIONS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, time_calls  # noqa: E402
from rlvr.kernels.flash_attention import flash_attention, reference_attention, reference_mask  # noqa: E402
from rlvr.kernels.flash_attention.api import current_platform  # noqa: E402

from rlvr.models.transformer import causal_attention, dot_product_attention, in_token_order  # noqa: E402


def packed_layout(batch: int, length: int, segments: int) -> dict:
    """Segment ids and positions of rows packed with `segments` equal documents (the last one takes
    the remainder), as `flash_attention`'s keyword arguments."""
    size = length // segments
    index = jnp.minimum(jnp.arange(length) // size, segments - 1)
    ids = jnp.broadcast_to(index + 1, (batch, length)).astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length) - index * size, (batch, length)).astype(jnp.int32)
    return {"q_segment_ids": ids, "kv_segment_ids": ids, "q_positions": positions, "kv_positions": positions}


def shared_prompt_mask(batch: int, length: int, prompt: int, branches: int) -> jax.Array:
    """Bool [B, T, T] of shared-prompt rows: a prompt of `prompt` tokens (plus the remainder), then
    `branches` equal completions, each seeing the prompt and itself (causally), not its siblings."""
    size = (length - prompt) // branches
    start = length - size * branches
    owner = jnp.where(jnp.arange(length) < start, -1, (jnp.arange(length) - start) // size)
    index = jnp.arange(length)
    visible = (index[None] <= index[:, None]) & ((owner[None] == -1) | (owner[None] == owner[:, None]))
    return jnp.broadcast_to(visible, (batch, length, length))


def _model_mask(q, k, mask_kwargs):
    """The model's [B, 1, 1, T, S] mask (`mask_kwargs`: the rule and the rows' layout, `packed_layout`,
    or a dense `mask`, `shared_prompt_mask`)."""
    m = mask_kwargs
    if "mask" in m:
        return m["mask"][:, None, None]
    return reference_mask(m["q_segment_ids"], m["kv_segment_ids"], m["q_positions"], m["kv_positions"],
                          causal=m["causal"], sliding_window=m["sliding_window"])[:, None, None]


def _dense(q, k, v, mask_kwargs):
    """The model's plain-XLA attention (materialises the [T, S] logits), in the input dtype."""
    return dot_product_attention(q, k, v, _model_mask(q, k, mask_kwargs))


def _causal_blocks(q, k, v, mask_kwargs):
    """The model's training-path attention (`causal_attention`: dense products in query blocks that
    skip the keys after them; the dense form up to 1,024 tokens), in the input dtype."""
    return causal_attention(q, k, v, in_token_order(_model_mask(q, k, mask_kwargs)))


def _native_cpu(q, k, v, mask_kwargs):
    """The training path's attention on XLA:CPU (`rlvr.kernels.causal_attention`: native forward and
    backward kernels; float32, masks in token order)."""
    from rlvr.kernels.causal_attention import native_causal_attention

    return native_causal_attention(q, k, v, in_token_order(_model_mask(q, k, mask_kwargs)))


def _flash(q, k, v, mask_kwargs, implementation):
    return flash_attention(q, k, v, implementation=implementation, **mask_kwargs)


@dataclasses.dataclass(frozen=True)
class Impl:
    fn: Callable  # (q, k, v, mask_kwargs) -> out [B, T, H, D]
    timed_on: tuple[str, ...]  # platforms on which its speed means something
    why_untimed: str = ""


IMPLEMENTATIONS = {
    "xla_dense": Impl(_dense, ("cpu", "gpu", "tpu")),
    "xla_causal_blocks": Impl(_causal_blocks, ("cpu", "gpu", "tpu")),
    "native_cpu": Impl(_native_cpu, ("cpu",), "an XLA:CPU custom call"),
    "xla_blockwise": Impl(functools.partial(_flash, implementation="xla"), ("cpu", "gpu", "tpu")),
    "pallas": Impl(functools.partial(_flash, implementation="pallas"), ("gpu", "tpu"),
                   "interpret mode on CPU: correctness only"),
}


def _parse_shape(text: str) -> tuple[int, ...]:
    dims = tuple(int(x) for x in text.lower().split("x"))
    if len(dims) != 5:
        raise argparse.ArgumentTypeError(f"shape {text!r}: want BxTxHxKVHxD, e.g. 1x512x8x2x64")
    return dims


def _inputs(shape, dtype):
    b, t, h, kvh, d = shape
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, d), dtype)
    k, v = (jax.random.normal(key, (b, t, kvh, d), dtype) for key in keys[1:3])
    return (q, k, v), jax.random.normal(keys[3], (b, t, h, d), jnp.float32)


def _fwd_and_grad(fn, weights):
    fwd = jax.jit(fn)
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * weights)
    return fwd, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _max_err(actual, expected) -> float:
    return float(f"{float(jnp.max(jnp.abs(actual.astype(jnp.float32) - expected.astype(jnp.float32)))):.3g}")


def _median_s(fn, args, repeats: int) -> float:
    _, times = time_calls(lambda: jax.block_until_ready(fn(*args)), repeats)
    return statistics.median(times)


def _dense_reference(q, k, v, mask_kwargs):
    """float32 dense attention over the dense mask at HIGHEST precision (the error reference of rows
    `flash_attention`'s segment ids cannot state)."""
    with jax.default_matmul_precision("highest"):
        return dot_product_attention(q, k, v, _model_mask(q, k, mask_kwargs))


def bench_shape(shape, dtype, rule, layout: dict, names, repeats: int, platform: str) -> dict:
    """`layout`: {"segments": N} or {"prompt": P, "branches": N} (shared-prompt rows)."""
    (q, k, v), weights = _inputs(shape, dtype)
    b, t, h, _, d = shape
    if layout.get("branches"):
        mask_kwargs = {**rule, "mask": shared_prompt_mask(b, t, layout["prompt"], layout["branches"])}
        ref = lambda q, k, v: _dense_reference(q, k, v, mask_kwargs)
    else:
        mask_kwargs = {**rule, **packed_layout(b, t, layout["segments"])}
        ref = lambda q, k, v: reference_attention(q, k, v, **mask_kwargs)[0]
    pairs = int(jnp.sum(_model_mask(q, k, mask_kwargs)))  # over the batch, per head
    fwd_flops = 4 * d * h * pairs
    ref32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_fwd, ref_grad = _fwd_and_grad(ref, weights)
    ref_out, (_, ref_grads) = ref_fwd(*ref32), ref_grad(*ref32)
    rows = {}
    for name in names:
        impl = IMPLEMENTATIONS[name]
        fwd, grad = _fwd_and_grad(lambda q, k, v, fn=impl.fn: fn(q, k, v, mask_kwargs), weights)
        out, (_, grads) = fwd(q, k, v), grad(q, k, v)
        row = {"max_abs_err": {"out": _max_err(out, ref_out),
                               **{n: _max_err(g, r)
                                  for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True)}}}
        if platform in impl.timed_on:
            fwd_s, both_s = _median_s(fwd, (q, k, v), repeats), _median_s(grad, (q, k, v), repeats)
            row.update(fwd_s=round(fwd_s, 5), fwd_bwd_s=round(both_s, 5),
                       fwd_tflops=round(fwd_flops / fwd_s / 1e12, 4),
                       fwd_bwd_tflops=round(3.5 * fwd_flops / both_s / 1e12, 4))
        else:
            row["timed"] = impl.why_untimed
        rows[name] = row
    result = {"shape": "x".join(map(str, shape)), "visible_pairs_per_head": pairs,
              "fwd_gflop": round(fwd_flops / 1e9, 3), "rows": rows}
    if "fwd_s" in rows.get("pallas", {}) and "fwd_s" in rows.get("xla_dense", {}):
        result["pallas_speedup_vs_xla_dense"] = {
            key: round(rows["xla_dense"][key] / rows["pallas"][key], 3) for key in ("fwd_s", "fwd_bwd_s")}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x512x8x2x64,2x256x4x4x64",
                        type=lambda s: [_parse_shape(x) for x in s.split(",")])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--sliding-window", type=int, default=0)
    parser.add_argument("--segments", type=int, default=1, help="documents packed into each row")
    parser.add_argument("--branches", type=int, default=0, help="shared-prompt rows: completions per row")
    parser.add_argument("--prompt_len", type=int, default=0, help="shared-prompt rows: the prompt's tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--implementations", default=None, type=lambda s: [x for x in s.split(",") if x],
                        help="default: all (the causal ones, xla_causal_blocks and native_cpu, only with causal "
                             "masks; native_cpu only on CPU in float32)")
    args = parser.parse_args()
    causal_only = {"xla_causal_blocks", "native_cpu"}
    platform = current_platform()
    dense_mask_only = {"xla_dense", "xla_causal_blocks", "native_cpu"}
    if args.implementations is None:
        args.implementations = [name for name in IMPLEMENTATIONS if (args.causal or name not in causal_only)
                                and (name != "native_cpu" or (platform == "cpu" and args.dtype == "float32"))
                                and (not args.branches or name in dense_mask_only)]
    if args.branches and (not args.causal or args.sliding_window or args.segments != 1
                          or set(args.implementations) - dense_mask_only):
        parser.error(f"--branches: causal rows without --sliding-window or --segments, implementations among "
                     f"{sorted(dense_mask_only)} (the others cannot take a shared-prompt mask)")
    if not args.causal and causal_only & set(args.implementations):
        parser.error("xla_causal_blocks and native_cpu are the causal training path: drop them or --no-causal")
    unknown = set(args.implementations) - set(IMPLEMENTATIONS)
    if unknown:
        parser.error(f"unknown implementations {sorted(unknown)}; known: {list(IMPLEMENTATIONS)}")
    rule = {"causal": args.causal, "sliding_window": args.sliding_window}
    layout = ({"prompt": args.prompt_len, "branches": args.branches} if args.branches
              else {"segments": args.segments})
    shapes = [bench_shape(shape, jnp.dtype(args.dtype), rule, layout, args.implementations, args.repeats, platform)
              for shape in args.shapes]
    emit({"benchmark": "attention", "devices": str(jax.devices()[0]), "platform": platform, "dtype": args.dtype,
          "causal": args.causal, "sliding_window": args.sliding_window, "layout": layout,
          "repeats": args.repeats,
          "error_reference": ("dot_product_attention over the dense mask" if args.branches else "reference_attention")
          + ", float32, HIGHEST precision", "shapes": shapes,
          "note": ("pallas runs in interpret mode on CPU: correctness only, no speed figure" if platform == "cpu"
                   else "pallas_speedup = xla_dense time / pallas time")})


if __name__ == "__main__":
    main()
