"""The rollout engine's device programs compiled ahead of time for a mesh, from abstract params.

    from rlvr.kernels.target import compile_for
    with compile_for("v5p:2x2x1") as topo:
        mesh = sharding.make_mesh({"tensor": 2, "data": 2}, topo.devices)
        programs = engine_programs(cfg, params_shapes, mesh, max_slots=128, max_len=1536, page_size=64)
        print({name: compiled_report(compiled) for name, compiled in programs.items()})

`engine_programs` lowers and compiles the same jitted functions `Engine` calls
(`device_fns.prefill` and `device_fns.decode`, with the arguments `Dispatch` passes) for
`jax.ShapeDtypeStruct` params with their shardings on `mesh`: nothing is allocated and nothing
runs, so a pod's engine is checked on a CPU host with the TPU compiler (libtpu, deviceless; see
`rlvr.kernels.target`). The pool and the decode state are laid out as the engine lays them out
(`Engine.pool_sharding`: KV heads over `tensor`), the decode's attention is the engine's on that
platform (the paged Pallas kernel on TPU, inside a shard_map on a multi-device mesh), and
`rlvr.kernels.target.compiled_report` gives per-chip memory (argument, output, temp, alias: XLA's
memory analysis), FLOPs and bytes (its cost analysis) and the Mosaic kernels in the program (none:
a silent XLA fallback).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlvr.kernels.paged_attention import ragged_pages
from rlvr.models.config import ModelConfig
from rlvr.rollout import device_fns
from rlvr.rollout.sequence import sampling_table


def decode_params_shapes(cfg: ModelConfig, params_shapes, dtype: str) -> dict:
    """The engine's decode tree (`Dispatch._decode_params`) of the trainer's params as ShapeDtypeStructs
    (either layer layout): per-layer `layers_i` (a stacked axis and its sharding entry dropped), a
    tied embedding's output projection as its own `lm_head` kernel [E, V] (the transposed sharding),
    floats in `dtype`. Sharded params are not fused (`fuse_projections` leaves them), so neither
    are these."""
    dtype = jnp.dtype(dtype)

    def shape(x, drop_first=False, transpose=False):
        spec = tuple(x.sharding.spec) + (None,) * (len(x.shape) - len(x.sharding.spec))
        dims = x.shape
        if drop_first:
            dims, spec = dims[1:], spec[1:]
        if transpose:
            dims, spec = dims[::-1], spec[::-1]
        float_dtype = dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jax.ShapeDtypeStruct(dims, float_dtype, sharding=NamedSharding(x.sharding.mesh, P(*spec)))

    params = {name: jax.tree.map(shape, sub) for name, sub in params_shapes.items() if name != "layers"}
    for i in range(cfg.num_layers if "layers" in params_shapes else 0):  # per-layer shapes pass as they are
        params[f"layers_{i}"] = jax.tree.map(lambda x: shape(x, drop_first=True), params_shapes["layers"])
    if cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": shape(params_shapes["embed_tokens"], transpose=True)}
    return params


def pool_spec(cfg: ModelConfig, mesh: Mesh) -> P:
    """The page pool's [L, N, P, KVH, D] layout on `mesh`: KV heads over `tensor` where it divides
    them (each tensor-parallel device keeps the pages of its heads), else replicated."""
    tensor = mesh.shape.get("tensor", 1)
    return P(None, None, None, "tensor") if tensor > 1 and cfg.num_kv_heads % tensor == 0 else P()


def _abstract(tree, mesh: Mesh):
    """ShapeDtypeStructs of the arrays in `tree`, replicated on `mesh`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=NamedSharding(mesh, P())), tree)


def engine_programs(cfg: ModelConfig, params_shapes, mesh: Mesh, *, max_slots: int, max_len: int, page_size: int,
                    num_pages: int | None = None, dtype: str = "bfloat16", kv_dtype: str | None = None,
                    decode_steps: int = 8, prefill_rows: int = 4, prefill_chunk: int = 64,
                    programs: tuple[str, ...] = ("prefill", "decode")) -> dict[str, Any]:
    """{"prefill": compiled, "decode": compiled}: the engine's largest prefill program ([prefill_rows,
    prefill_chunk]) and its decode program over the page pool (the ragged/paged path; the window
    path is the engine's choice only for tiny pools), compiled for `mesh`'s devices (a TPU topology's
    `topo.devices`, or any). `params_shapes`: the trainer's params as ShapeDtypeStructs with
    NamedShardings on `mesh` (`rlvr.models.params.abstract_params` + `param_shardings`); the other
    arguments are `Engine`'s; `programs`: which to compile. The seconds each compile took go to
    `compile_seconds[name]`."""
    unknown = set(programs) - {"prefill", "decode"}
    if unknown:
        raise ValueError(f"programs={programs!r}: {sorted(unknown)} unknown; use 'prefill' and/or 'decode'")
    decode_cfg = dataclasses.replace(cfg, scan_layers=False, dtype=dtype, param_dtype=dtype,
                                     tie_word_embeddings=False)
    params = decode_params_shapes(cfg, params_shapes, dtype)
    pages_per_row = max_len // page_size
    pool = pool_shapes(cfg, mesh, max_slots=max_slots, max_len=max_len, page_size=page_size, num_pages=num_pages,
                       kv_dtype=kv_dtype or dtype)
    state = _abstract(jax.eval_shape(lambda: device_fns.init_state(max_slots)), mesh)
    sampling = sampling_table(max_slots)
    rows = {k: v[:prefill_rows] for k, v in sampling.items()}
    table = np.zeros((max_slots, pages_per_row), np.int32)
    ragged = ragged_pages(table, np.zeros(max_slots, np.int64), page_size)
    prefill_args = (params, pool, np.zeros((prefill_rows, pages_per_row), np.int32),
                    *(np.zeros((prefill_rows, prefill_chunk), np.int32) for _ in range(3)), state,
                    np.zeros(prefill_rows, np.int32), np.zeros(prefill_rows, bool), rows)
    decode_args = (params, pool, table, ragged, state, np.zeros(max_slots, bool), sampling)
    calls = {
        "prefill": (device_fns.prefill, (decode_cfg, False, *_replicated(prefill_args, mesh)), {}),
        "decode": (device_fns.decode, (decode_cfg, decode_steps, False, *_replicated(decode_args, mesh)),
                   {"limit": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}),
    }
    compiled = {}
    with jax.default_device(mesh.devices.flat[0]), jax.set_mesh(mesh):
        for name in programs:
            fn, args, kwargs = calls[name]
            start = time.perf_counter()
            compiled[name] = fn.lower(*args, **kwargs).compile()
            compile_seconds[name] = time.perf_counter() - start
    return compiled


def pool_shapes(cfg: ModelConfig, mesh: Mesh, *, max_slots: int, max_len: int, page_size: int,
                num_pages: int | None = None, kv_dtype: str = "bfloat16") -> dict[str, jax.ShapeDtypeStruct]:
    """The engine's page pool (k and v [L, N, P, KVH, D], `Engine._new_pool`) as ShapeDtypeStructs
    laid out on `mesh` (`pool_spec`); N defaults to the engine's (every slot's pages + the null page)."""
    if max_len % page_size:
        raise ValueError(f"max_len={max_len} must be a multiple of page_size={page_size}")
    num_pages = num_pages or max_slots * (max_len // page_size) + 1
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    sharding = NamedSharding(mesh, pool_spec(cfg, mesh))
    return {name: jax.ShapeDtypeStruct(shape, jnp.dtype(kv_dtype), sharding=sharding) for name in ("k", "v")}


def per_chip_bytes(tree) -> int:
    """Bytes of the largest device's shard of every ShapeDtypeStruct in `tree` (a sharded leaf's shard)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def engine_sizes(cfg: ModelConfig, params_shapes, mesh: Mesh, *, max_slots: int, max_len: int, page_size: int,
                 num_pages: int | None = None, dtype: str = "bfloat16", kv_dtype: str | None = None,
                 **_unused) -> dict[str, int]:
    """Per-chip bytes of the engine's decode params and of its page pool (`engine_programs`' arguments)."""
    pool = pool_shapes(cfg, mesh, max_slots=max_slots, max_len=max_len, page_size=page_size, num_pages=num_pages,
                       kv_dtype=kv_dtype or dtype)
    return {"params": per_chip_bytes(decode_params_shapes(cfg, params_shapes, dtype)), "pool": per_chip_bytes(pool)}


compile_seconds: dict[str, float] = {}  # the last `engine_programs` call's compile time per program


def _replicated(args: tuple, mesh: Mesh) -> tuple:
    """Host (numpy) arguments as replicated ShapeDtypeStructs on `mesh`; abstract ones unchanged."""
    return tuple(jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else _abstract(x, mesh), a)
                 for a in args)
