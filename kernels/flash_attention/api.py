"""`flash_attention`: the public entry point. Validates the call, fills in defaults, picks the
implementation, and returns `out` (and `lse`).

Implementations (`IMPLEMENTATIONS`, chosen at call time, never at import):
  "pallas"  the Pallas kernels (`pallas.py`): compiled on TPU (Mosaic) and GPU (Triton); on CPU, asking
            for it explicitly runs it in interpret mode (slow; for correctness checks and tests).
  "xla"     memory-efficient blockwise attention in plain jnp (`xla.py`); runs anywhere.
`implementation=None` picks "pallas" on TPU and GPU and "xla" on CPU, and on GPU falls back to "xla"
when Triton cannot take the head dim (not a power of two >= 16); the choice is logged once per
(platform, implementation, reason). An explicitly requested implementation that cannot run raises.
The platform is the one the program is compiled for (`rlvr.kernels.target.target_platform`),
which need not be the host's: under `compile_for(topology)` a CPU host builds the TPU kernels.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers

import jax
import jax.numpy as jnp
from rlvr.kernels.target import target_platform, tpu_generation

from .common import AttentionSpec
from .config import PLATFORMS, BlockSizes, default_block_sizes
from .pallas import flash_attention_pallas
from .xla import flash_attention_xla

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = ("pallas", "xla")
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_LOGGED: set[tuple[str, str, str]] = set()


def flash_attention(q, k, v, *, q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
                    causal=True, sliding_window=0, softcap=0.0, scale=None, block_sizes=None,
                    implementation=None, return_lse=False):
    """Attention without materialising the [T, S] probabilities, forward and backward.

    q [B,T,H,D], k/v [B,S,KVH,D] (H a multiple of KVH: GQA/MQA). Returns out [B,T,H,D] in q.dtype
    (and lse [B,H,T] float32 when return_lse).

    Key j is visible to query i iff q_segment_ids[i] == kv_segment_ids[j] != 0 and (not causal or
    kv_positions[j] <= q_positions[i]) and (sliding_window == 0 or q_positions[i] - kv_positions[j] <
    sliding_window) -- the mask of `rlvr.models.transformer.attention_mask`. Segment ids default to
    all ones (pass both or neither), positions to arange(T) / arange(S) (each on its own, so a query
    block can carry global positions for ring attention). Logits are scale * q.k (scale defaults to
    1/sqrt(D)), soft-capped to softcap * tanh(logits / softcap) when softcap > 0, then masked.
    Inputs may be float32, bfloat16 or float16; softmax statistics and accumulations are float32.

    A query that sees no key gets out = 0 and lse = -inf, with zero (finite) gradients, and any
    cotangent on such an lse is ignored. `lse` is exact (float32 log-sum-exp of the visible
    logits) and differentiable, so partial results over key blocks can be merged by online softmax:
    out = sum_b exp(lse_b - lse) out_b with lse = logsumexp_b lse_b (guard blocks whose lse is -inf).

    block_sizes: a `BlockSizes` (default: `config.DEFAULTS[platform]`, on TPU per generation:
    `config.TPU_GENERATIONS`). implementation: None,
    "pallas" or "xla" (see the module docstring).
    """
    b, t, h, d, s, kvh = _check_qkv(q, k, v)
    _check_segments(q_segment_ids, kv_segment_ids, b, t, s)
    _check_ids("q_positions", q_positions, (b, t))
    _check_ids("kv_positions", kv_positions, (b, s))
    spec = _check_spec(causal, sliding_window, softcap, scale, d)
    if not isinstance(return_lse, bool):
        raise TypeError(f"flash_attention: return_lse must be a bool, got {return_lse!r}")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"flash_attention: block_sizes must be a rlvr.kernels.flash_attention.BlockSizes or None, "
                        f"got {type(block_sizes).__name__}")

    platform = current_platform()
    name = choose_implementation(implementation, platform, d)
    blocks = block_sizes or default_block_sizes(platform if platform in PLATFORMS else "cpu", tpu_generation())
    if name == "pallas":
        blocks.validate(platform)
    run = functools.partial(_run, name=name, spec=spec, blocks=blocks, platform=platform)
    mesh = partitioned_mesh() if name == "pallas" else None
    if mesh is not None:
        run = _over_mesh(run, mesh, b, h, kvh)
    out, lse = run(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    return (out, lse) if return_lse else out


def partitioned_mesh():
    """The multi-device mesh the call is traced under (`rlvr.sharding.activation_sharding`, else
    `jax.set_mesh`), or None: none, one device, or already inside a `shard_map` (ring/Ulysses call the
    kernel per device block). A Pallas call cannot be partitioned by XLA ("Mosaic kernels cannot be
    automatically partitioned"), so under such a mesh it runs inside `shard_map` (`_over_mesh`)."""
    from rlvr import sharding

    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty and abstract.manual_axes:
        return None
    mesh = sharding.active_mesh() or (None if abstract.empty else abstract)
    return mesh if mesh is not None and mesh.size > 1 else None


def _over_mesh(run, mesh, batch: int, heads: int, kv_heads: int):
    """`run` inside `jax.shard_map`: rows over the mesh's batch axes (data, fsdp) and heads over
    `tensor`, each where it divides (`context_parallel.layout.specs`); the sequence stays whole on
    a device (long sequences over devices are ring/Ulysses attention's job) and every other axis
    replicates the call. Attention is independent across rows and heads, so no collective is needed."""
    from rlvr.kernels.context_parallel import layout

    qkv_spec, ids_spec, _ = layout.specs(mesh, None, batch, heads, kv_heads)
    b_axes, h_axes = qkv_spec[0], qkv_spec[2]
    lse_spec = jax.sharding.PartitionSpec(b_axes, h_axes, None)

    def filled(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        b, t, s = q.shape[0], q.shape[1], k.shape[1]
        ones = lambda n: jnp.ones((b, n), jnp.int32)
        arange = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
        ids = (ones(t) if q_seg is None else q_seg, ones(s) if kv_seg is None else kv_seg,
               arange(t) if q_pos is None else q_pos, arange(s) if kv_pos is None else kv_pos)
        body = jax.shard_map(run, mesh=mesh, in_specs=(qkv_spec,) * 3 + (ids_spec,) * 4,
                             out_specs=(qkv_spec, lse_spec), check_vma=False)
        return body(q, k, v, *ids)

    return filled


@functools.partial(jax.jit, static_argnames=("name", "spec", "blocks", "platform"))
def _run(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, name: str, spec: AttentionSpec, blocks: BlockSizes,
         platform: str):
    """Defaults filled in and the implementation called under one jit: a compiled program when called
    eagerly (no host-to-device transfers of the defaults), simply inlined under an outer jit."""
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    ones = lambda n: jnp.ones((b, n), jnp.int32)
    arange = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    q_seg = ones(t) if q_seg is None else q_seg.astype(jnp.int32)
    kv_seg = ones(s) if kv_seg is None else kv_seg.astype(jnp.int32)
    q_pos = arange(t) if q_pos is None else q_pos.astype(jnp.int32)
    kv_pos = arange(s) if kv_pos is None else kv_pos.astype(jnp.int32)
    if name == "pallas":
        return flash_attention_pallas(q, k, v, q_seg, kv_seg, q_pos, kv_pos, spec=spec, blocks=blocks,
                                      platform=platform, interpret=platform == "cpu")
    return flash_attention_xla(q, k, v, q_seg, kv_seg, q_pos, kv_pos, spec=spec, blocks=blocks)


def current_platform() -> str:
    """'cpu', 'gpu' or 'tpu': the platform the program is compiled for (`rlvr.kernels.target`)."""
    return target_platform()


def choose_implementation(implementation: str | None, platform: str, head_dim: int) -> str:
    """The implementation to run, or a ValueError when an explicitly requested one cannot run."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"flash_attention: unknown implementation={implementation!r}; "
                         f"use None, {' or '.join(repr(n) for n in IMPLEMENTATIONS)}")
    pallas_problem = _pallas_problem(platform, head_dim)
    if implementation == "pallas" and pallas_problem:
        raise ValueError(f"flash_attention: implementation='pallas' cannot run here: {pallas_problem}; "
                         f"use implementation='xla' (or None to fall back automatically)")
    if implementation is not None:
        reason = "requested" + (" (interpret mode on CPU: slow, for correctness checks)"
                                if implementation == "pallas" and platform == "cpu" else "")
        _log_once(platform, implementation, reason)
        return implementation
    if platform == "cpu":
        _log_once(platform, "xla", "default on CPU (Pallas only runs interpreted there; ask for it explicitly)")
        return "xla"
    if pallas_problem:
        _log_once(platform, "xla", f"fallback: {pallas_problem}")
        return "xla"
    _log_once(platform, "pallas", "default on accelerators")
    return "pallas"


def _pallas_problem(platform: str, head_dim: int) -> str:
    if platform not in PLATFORMS:
        return f"no Pallas backend for platform {platform!r} (only {', '.join(PLATFORMS)})"
    if platform == "gpu" and (head_dim < 16 or head_dim & (head_dim - 1)):
        return f"Triton needs a power-of-two head dim >= 16, got D={head_dim} (pad the head dim)"
    return ""


def _log_once(platform: str, implementation: str, reason: str) -> None:
    key = (platform, implementation, reason)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("flash_attention: using the %r implementation on %s: %s", implementation, platform, reason)


def _check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            layout = "[batch, q_len, heads, head_dim]" if name == "q" else "[batch, kv_len, kv_heads, head_dim]"
            raise ValueError(f"flash_attention: {name} must be 4-D {layout}, got shape {getattr(x, 'shape', None)}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"flash_attention: {name} has dtype {x.dtype}; use float32, bfloat16 or float16")
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k {k.shape} and v {v.shape} must have the same shape [B, S, KVH, D]")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"flash_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one")
    (b, t, h, d), (bk, s, kvh, dk) = q.shape, k.shape
    if b != bk:
        raise ValueError(f"flash_attention: q has batch {b} but k/v have batch {bk}")
    if d != dk:
        raise ValueError(f"flash_attention: q has head_dim {d} but k/v have head_dim {dk}")
    if min(t, s, h, kvh, d) < 1:
        raise ValueError(f"flash_attention: empty dimension in q {q.shape} or k/v {k.shape}")
    if h % kvh:
        raise ValueError(f"flash_attention: q has {h} heads, not a multiple of k's {kvh} kv heads")
    return b, t, h, d, s, kvh


def _check_ids(name: str, x, shape: tuple[int, int]) -> None:
    if x is None:
        return
    if getattr(x, "shape", None) != shape:
        raise ValueError(f"flash_attention: {name} must have shape {shape} ([batch, len] of q or k), "
                         f"got {getattr(x, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"flash_attention: {name} must be integers, got {x.dtype}; cast with .astype(jnp.int32)")


def _check_segments(q_segment_ids, kv_segment_ids, b: int, t: int, s: int) -> None:
    if (q_segment_ids is None) != (kv_segment_ids is None):
        given, missing = ("q", "kv") if kv_segment_ids is None else ("kv", "q")
        raise ValueError(f"flash_attention: {given}_segment_ids given without {missing}_segment_ids; pass both "
                         f"(for self-attention, the same array twice) or neither")
    _check_ids("q_segment_ids", q_segment_ids, (b, t))
    _check_ids("kv_segment_ids", kv_segment_ids, (b, s))


def _check_spec(causal, sliding_window, softcap, scale, head_dim: int) -> AttentionSpec:
    if not isinstance(causal, bool):
        raise TypeError(f"flash_attention: causal must be a Python bool, got {causal!r}")
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 0:
        raise ValueError(f"flash_attention: sliding_window must be a Python int >= 0 (0 = no window), "
                         f"got {sliding_window!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or softcap < 0:
        raise ValueError(f"flash_attention: softcap must be a Python float >= 0 (0 = off), got {softcap!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0:
        raise ValueError(f"flash_attention: scale must be a positive Python float (or None for 1/sqrt(D)), "
                         f"got {scale!r}")
    return AttentionSpec(causal, int(sliding_window), float(softcap), float(scale))
