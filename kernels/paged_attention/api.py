"""`paged_attention`: shape checks, implementation choice (Pallas on TPU, XLA elsewhere), dispatch."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from rlvr.kernels.bits import from_bits
from rlvr.kernels.paged_attention.native import NativeDecode, native_paged_attention, native_unavailable_reason
from rlvr.kernels.paged_attention.pallas import paged_attention_pallas
from rlvr.kernels.paged_attention.ragged import RaggedPages, ragged_paged_attention
from rlvr.kernels.paged_attention.reference import paged_attention_reference
from rlvr.kernels.target import target_platform

logger = logging.getLogger(__name__)
IMPLEMENTATIONS = ("pallas", "native", "ragged", "xla")
_logged: set[tuple[str, str]] = set()


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                    lengths: jax.Array, *, layer=None, sliding_window: int = 0, softcap: float = 0.0,
                    scale: float | None = None, implementation: str | None = None,
                    interpret: bool = False, ragged: RaggedPages | NativeDecode | None = None) -> jax.Array:
    """Decode attention of a few new tokens per row over a paged KV cache.

    q: [B, H, D] (one query per row) or [B, Q, H, D] (the last Q tokens of each row, e.g. a
    chunk or speculative tokens; causal among themselves). k_pages / v_pages: the engine's pool,
    one layer [N, P, KVH, D] or all layers [L, N, P, KVH, D] with `layer` (int or traced int32
    scalar) choosing one without copying it out. page_table [B, R] int: position p of row b is
    slot p % P of page page_table[b, p // P]. lengths [B] int: valid KV tokens of each row, the
    queries' own included (already written to the pool); 0 = idle row (output zeros); clipped to
    R·P. H must be a multiple of KVH (GQA). `sliding_window` W > 0: a query at position t sees
    keys t-W < kv <= t. `scale` defaults to 1/sqrt(D); `softcap` > 0 caps the scores.

    ragged: the rows' pages as one flat list (`ragged.ragged_pages`, built by the caller); with one
    query per row it enables the "ragged" implementation, whose work follows the pages the rows
    hold rather than the table width. `NativeDecode()` instead asks for the "native" kernel.

    implementation: None picks "pallas" on TPU (or anywhere with `interpret=True`), else "native"
    when `ragged` is NativeDecode(), else "ragged" when `ragged` is a page list with one query per
    row, else "xla" (logged once). "native" (`native.py`: a C++ XLA:CPU custom call, built on first
    use; any number of queries) also runs when asked for by name. An explicit "pallas" or "native"
    that cannot run here raises RuntimeError. Returns q's shape and dtype; softmax and accumulation
    are float32.
    """
    single = q.ndim == 3
    q4 = q[:, None] if single else q
    _validate(q4, k_pages, v_pages, page_table, lengths, layer, sliding_window, softcap)
    capacity = page_table.shape[1] * k_pages.shape[-3]
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, capacity)
    page_table = page_table.astype(jnp.int32)
    options = dict(layer=layer, sliding_window=int(sliding_window), softcap=float(softcap), scale=scale)
    native = isinstance(ragged, NativeDecode)
    if native and implementation is None and pallas_unavailable_reason(interpret):
        implementation = "native"
    choice = _choose(implementation, interpret, ragged is not None and not native and q4.shape[1] == 1)
    if choice == "native":
        out = native_paged_attention(q4, k_pages, v_pages, page_table, lengths, **options)
    elif choice == "ragged":
        if not isinstance(ragged, RaggedPages) or q4.shape[1] != 1:
            raise ValueError("paged_attention: implementation='ragged' needs ragged= and one query per row.")
        out = ragged_paged_attention(q4[:, 0], k_pages, v_pages, ragged, lengths, **options)[:, None]
    elif choice == "pallas":  # (a bits pool, see rlvr.kernels.bits, is read as its bf16 values)
        k_pages, v_pages = from_bits(k_pages, k_pages.dtype), from_bits(v_pages, v_pages.dtype)
        out = sharded_pallas(q4, k_pages, v_pages, page_table, lengths, interpret=interpret, **options)
    else:
        out = paged_attention_reference(q4, k_pages, v_pages, page_table, lengths, **options)
    return out[:, 0] if single else out


def sharded_pallas(q, k_pages, v_pages, page_table, lengths, *, layer=None, mesh=None, **options) -> jax.Array:
    """`paged_attention_pallas`, inside `jax.shard_map` when a mesh of more than one device is in
    context (`mesh`, else `rlvr.sharding.activation_sharding`'s, else `jax.set_mesh`'s): a Mosaic
    kernel cannot be partitioned by XLA ("Please wrap the call in a shard_map"). Heads (q's H and the
    pool's KV heads) split over the `tensor` axis and rows over `data`/`fsdp` where they divide them;
    each device then runs the kernel on its rows and heads with its shard of the pool (the engine
    shards the pool over KV heads: `rlvr.rollout.engine.Engine._new_pool`) and the rows' page
    table and lengths. Other axes see the arguments replicated."""
    from rlvr.kernels.context_parallel.layout import BATCH_AXES, HEAD_AXES, dividing_axes

    mesh = _kernel_mesh(mesh)
    kernel = functools.partial(paged_attention_pallas, **options)
    if mesh is None:
        return kernel(q, k_pages, v_pages, page_table, lengths, layer=layer)
    rows = dividing_axes(mesh, BATCH_AXES, q.shape[0])
    heads = tuple(a for a in dividing_axes(mesh, HEAD_AXES, q.shape[2], k_pages.shape[-2]) if a not in rows)
    row, head = (None if not a else a[0] if len(a) == 1 else a for a in (rows, heads))
    pool = P(*([None] * (k_pages.ndim - 2)), head, None)
    q_spec = P(row, None, head, None)
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
    layered = k_pages.ndim == 5

    def local(q, k, v, table, lens, layer):
        return kernel(q, k, v, table, lens, layer=layer if layered else None)

    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, pool, pool, P(row, None), P(row), P()),
                         out_specs=q_spec, check_vma=False)(q, k_pages, v_pages, page_table, lengths, layer)


def _kernel_mesh(mesh=None):
    """The mesh a kernel call runs on (see `sharded_pallas`), None when it has one device."""
    if mesh is None:
        from rlvr import sharding

        mesh = sharding.active_mesh()
    if mesh is None:
        abstract = jax.sharding.get_abstract_mesh()
        mesh = None if abstract.empty else abstract
    return mesh if mesh is not None and mesh.size > 1 else None


def pallas_unavailable_reason(interpret: bool = False) -> str | None:
    """Why the Pallas kernel cannot run on the target platform (None if it can)."""
    if interpret:
        return None
    backend = target_platform()
    if backend != "tpu":
        return (f"the Pallas paged-attention kernel is a Mosaic TPU kernel (scalar-prefetched page table), and the "
                f"target platform is {backend!r}; pass interpret=True to run it in the Pallas interpreter "
                f"(slow; for tests) or use implementation='xla'")
    return None


def _choose(implementation: str | None, interpret: bool, can_ragged: bool = False) -> str:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"paged_attention: implementation={implementation!r} is not one of "
                         f"{(None, *IMPLEMENTATIONS)}.")
    if implementation in ("xla", "ragged"):
        return implementation
    if implementation == "native":
        reason = native_unavailable_reason()
        if reason:
            raise RuntimeError(f"paged_attention: implementation='native' was requested but cannot run: {reason}.")
        return "native"
    reason = pallas_unavailable_reason(interpret)
    if implementation == "pallas":
        if reason:
            raise RuntimeError(f"paged_attention: implementation='pallas' was requested but cannot run: {reason}.")
        return "pallas"
    if reason:
        fallback = "ragged" if can_ragged else "xla"
        if (reason, fallback) not in _logged:
            _logged.add((reason, fallback))
            logger.info("paged_attention: using the %s implementation because %s.",
                        "ragged XLA" if can_ragged else "XLA", reason)
        return fallback
    return "pallas"


def _is_int(x) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype, jnp.integer)


def _validate(q, k_pages, v_pages, page_table, lengths, layer, sliding_window, softcap) -> None:
    def fail(message):
        raise ValueError(f"paged_attention: {message}")

    if q.ndim != 4:
        fail(f"q must be [batch, heads, head_dim] or [batch, queries, heads, head_dim], got shape {q.shape}.")
    if k_pages.shape != v_pages.shape:
        fail(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must have the same shape.")
    if k_pages.ndim not in (4, 5):
        fail(f"k_pages must be one layer's pool [pages, page_size, kv_heads, head_dim] or the whole pool "
             f"[layers, pages, page_size, kv_heads, head_dim], got shape {k_pages.shape}.")
    if k_pages.ndim == 5 and layer is None:
        fail(f"k_pages {k_pages.shape} holds all layers: pass layer= (which layer to attend over).")
    if k_pages.ndim == 4 and layer is not None:
        fail(f"layer={layer!r} given but k_pages {k_pages.shape} is a single layer's pool.")
    if layer is not None:
        if not _is_int(layer) or jnp.ndim(layer) != 0:
            fail(f"layer must be an integer scalar, got {layer!r}.")
        if isinstance(layer, int) and not 0 <= layer < k_pages.shape[0]:
            fail(f"layer={layer} is out of range for a pool of {k_pages.shape[0]} layers.")
    b, _, h, d = q.shape
    kvh, kd = k_pages.shape[-2:]
    if kd != d:
        fail(f"head_dim of q ({d}) and of the pool ({kd}) differ.")
    if h % kvh:
        fail(f"q's {h} heads must be a multiple of the pool's {kvh} kv heads (GQA).")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        fail(f"page_table must be [batch={b}, pages_per_row], got shape {page_table.shape}.")
    if not _is_int(page_table):
        fail(f"page_table must hold integer page ids, got {page_table.dtype}.")
    if lengths.shape != (b,):
        fail(f"lengths must be [batch={b}], got shape {lengths.shape}.")
    if not _is_int(lengths):
        fail(f"lengths must be integers, got {lengths.dtype}.")
    if sliding_window < 0:
        fail(f"sliding_window must be 0 (off) or positive, got {sliding_window}.")
    if softcap < 0:
        fail(f"softcap must be 0 (off) or positive, got {softcap}.")
