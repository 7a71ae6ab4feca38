"""Paged decode attention as a native XLA:CPU custom call (the "native" implementation).

What: `native_paged_attention(q, k_pages, v_pages, page_table, lengths, ...)`, the same contract as
`paged_attention_reference` (any number of queries per row, GQA, sliding window, softcap; pools of
float32, bfloat16 or bf16 bits), computed by `native.cc` through XLA's FFI.
Why: on XLA:CPU the plain-jnp decode attention ("ragged") ran at 4.4-5.7 ms per layer and step on
the realistic rollout shape against ~0.8 ms to stream its keys and values once (a third of the
decode time): small products, gathers and a short-axis softmax are what XLA:CPU emits slowest. The
C++ kernel reads each row's pages in place with an online softmax, on XLA's intra-op threads.
How: the source is compiled on first use with the host's C++ compiler (`$CXX`, default g++;
`-O3 -march=native`, ~4 s) into a cache directory (`$RLVR_KERNEL_CACHE`, default
~/.cache/rlvr/kernels), keyed by the source, jaxlib's version, the compiler and the CPU's flags,
then registered as the FFI target `rlvr_paged_attention` for the CPU platform.
`native_unavailable_reason()` says why it cannot run (not a CPU backend, no compiler, a failed
build: the compiler's message), else None; `paged_attention` then falls back to plain XLA.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = Path(__file__).with_name("native.cc")
HEADER = Path(__file__).parent.parent / "native_parallel.h"  # shared by the native kernels
TARGET = "rlvr_paged_attention"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w")
_lock = threading.Lock()
_built: dict[str, str | None] = {}  # "reason": None once registered, else why not


class NativeDecode(NamedTuple):
    """Passed as `paged_attention(..., ragged=NativeDecode())` (and so through the model's decode
    cache): decode with the native kernel, which reads the page table itself (no host-built page
    list). A pytree without leaves: the choice is part of the traced program's structure."""


def native_unavailable_reason() -> str | None:
    """Why the native kernel cannot run on the default backend (None if it can); builds and
    registers it on the first call."""
    backend = jax.default_backend()
    if backend != "cpu":
        return f"the native paged-attention kernel is an XLA:CPU custom call and the default backend is {backend!r}"
    with _lock:
        if "reason" not in _built:
            _built["reason"] = _build_and_register()
        return _built["reason"]


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("RLVR_KERNEL_CACHE") or Path.home() / ".cache" / "rlvr" / "kernels")


def _build_and_register() -> str | None:
    return build_and_register(SOURCE, "RlvrPagedAttention", TARGET)


def build_and_register(source: Path, symbol: str, target: str) -> str | None:
    """Compiles `source` (cached, `_library`) and registers its FFI handler `symbol` as the CPU
    custom-call target `target`; returns None, or why it cannot (no compiler, the build's error)."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return (f"no C++ compiler {os.environ.get('CXX', 'g++')!r} on PATH to build {source.name} "
                f"(apt-get install -y g++, or set CXX)")
    try:
        library = _library(compiler, source)
    except (OSError, subprocess.SubprocessError) as error:
        return f"building {source.name} failed: {str(error)[-2000:]}"
    handler = getattr(ctypes.cdll.LoadLibrary(str(library)), symbol)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return None


def _library(compiler: str, source: Path) -> Path:
    """The compiled `source`, built into the cache directory if not there yet (atomically: a
    concurrent build by another process leaves one complete file)."""
    import jaxlib

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [source.read_bytes(), HEADER.read_bytes(), jaxlib.__version__.encode(), version.encode(),
             " ".join(FLAGS).encode(), _cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    path = kernel_cache_dir() / f"{source.parent.name}_{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        command = [compiler, *FLAGS, "-I", jax.ffi.include_dir(), "-I", str(HEADER.parent), str(source), "-o",
                   str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise subprocess.SubprocessError(f"{' '.join(command)}: {result.stderr}")
        os.replace(built, path)
    return path


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native code must not run on a CPU without them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def native_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                           lengths: jax.Array, *, layer=None, sliding_window: int = 0, softcap: float = 0.0,
                           scale: float | None = None) -> jax.Array:
    """q [B, Q, H, D]; pools [N, P, KVH, D] or [L, N, P, KVH, D] (+ `layer`); page_table [B, R];
    lengths [B] (clipped to R·P by the caller). Returns [B, Q, H, D] in q's dtype."""
    reason = native_unavailable_reason()
    if reason:
        raise RuntimeError(f"paged_attention: implementation='native' cannot run: {reason}.")
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    out = call(q.astype(jnp.float32), k_pages, v_pages, page_table.astype(jnp.int32), lengths.astype(jnp.int32),
               jnp.asarray(layer, jnp.int32).reshape(1), sliding_window=np.int64(sliding_window),
               softcap=np.float32(softcap), scale=np.float32(scale))
    return out.astype(q.dtype)
