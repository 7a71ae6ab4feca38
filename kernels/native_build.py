"""Building and registering the native XLA:CPU kernels (`paged_attention/native.cc`,
`packed_matmul/native.cc`, both including `native_parallel.h`).

What: `unavailable_reason(source, symbol, target, what)` builds `source` on first use and registers
its FFI handler `symbol` as the CPU custom-call target `target`; it returns None once registered, or
why the kernel cannot run (not a CPU backend, no compiler, the build's error), remembered per target;
a kernel that cannot be built is logged once (a warning with the compiler's message), since callers
asking for "auto" then run the slower plain-XLA path without a word.
How: the host's C++ compiler (`$CXX`, default g++; `-O3 -march=native -Wall -Wextra`, ~4 s; warnings
are logged) into a cache directory (`$RLVR_KERNEL_CACHE`, default ~/.cache/rlvr/kernels), keyed by the
source, the shared header, jaxlib's version, the compiler, the flags and the CPU's flags.
`RLVR_NATIVE_SANITIZE=1` builds with AddressSanitizer and UndefinedBehaviorSanitizer instead, into the
cache's `sanitize/` folder (the host process needs libasan preloaded: benchmarks/native_sanitizers.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
from rlvr.kernels.target import target_platform

logger = logging.getLogger(__name__)
HEADER = Path(__file__).with_name("native_parallel.h")
# -Wno-psabi: GCC notes that passing 64-byte vectors by value changes the ABI without AVX-512; the
# kernels' vector functions have internal linkage, so no call crosses that boundary.
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra", "-Wno-psabi")
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g")
_lock = threading.Lock()
_built: dict[str, str | None] = {}  # per target: None once registered, else why not


def unavailable_reason(source: Path, symbol: str, target: str, what: str) -> str | None:
    """Why the kernel `what` (built from `source`) cannot run on the default backend, None if it
    can; builds and registers it on the first call for `target`. The platform is the one programs
    are compiled for (`rlvr.kernels.target`), not necessarily the host's."""
    platform = target_platform()
    if platform != "cpu":
        return f"{what} is an XLA:CPU custom call and the target platform is {platform!r}"
    with _lock:
        if target not in _built:
            _built[target] = build_and_register(source, symbol, target)
            if _built[target] is not None:
                logger.warning("%s cannot run; its callers use their plain-XLA fallback: %s", what, _built[target])
        return _built[target]


def sanitized() -> bool:
    """Whether kernels are built with AddressSanitizer and UBSan (`RLVR_NATIVE_SANITIZE=1`)."""
    return os.environ.get("RLVR_NATIVE_SANITIZE", "") not in ("", "0")


def kernel_cache_dir() -> Path:
    base = Path(os.environ.get("RLVR_KERNEL_CACHE") or Path.home() / ".cache" / "rlvr" / "kernels")
    return base / "sanitize" if sanitized() else base


def flags() -> tuple[str, ...]:
    return FLAGS + SANITIZE_FLAGS if sanitized() else FLAGS


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
             " ".join(flags()).encode(), _cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    path = kernel_cache_dir() / f"{source.parent.name}_{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        command = [compiler, *flags(), "-isystem", jax.ffi.include_dir(), "-I", str(HEADER.parent), str(source),
                   "-o", str(built)]  # jaxlib's headers as system headers: their warnings are not ours
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise subprocess.SubprocessError(f"{' '.join(command)}: {result.stderr}")
        if result.stderr.strip():
            logger.warning("building %s: the compiler's warnings:\n%s", source.name, result.stderr[-4000:])
        os.replace(built, path)
    return path


def cpu_has(flag: str) -> bool:
    """Whether the CPU reports feature `flag` (e.g. "avx512f") in /proc/cpuinfo."""
    return flag in _cpu_flags().split()


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native code must not run on a CPU without them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine
