"""Start-up time: the persistent compilation cache and a per-program compile log.

  enable_cache(config)                  jax's persistent compilation cache in `compile.cache_dir`
  with CompileLog(workdir, print_min_s): every XLA compile of the job -> workdir/compile.jsonl
                                        (+ a printed line per program that took >= print_min_s)

The cache stores each compiled executable on disk keyed by its HLO, the compile options and the jax
and XLA versions, so a second process that builds the same programs (a rerun, a resumed job, the next
experiment of the same shape) loads them instead of compiling: what JAX reports as a cache hit.
XLA:CPU, GPU and TPU executables are all cached. `compile.cache_dir=""` turns it off.

The log listens to `jax.monitoring` events: JAX records a duration for each jaxpr -> MLIR lowering
and each backend compile (named after the jitted function), and a `cache_hits` event inside a
compile that was served from the persistent cache. A record per backend compile:

  {"program": "jit_step", "compile_s": 14.2, "lower_s": 0.8, "cache": "miss", "at_s": 35.1}

`cache` is "hit" (loaded from disk), "miss" (compiled, and written when it took at least
`compile.cache_min_compile_s`) or "off" (no persistent cache). `at_s`: seconds since the log opened.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import jax
from jax import monitoring

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
CACHE_MISS = "/jax/compilation_cache/cache_misses"
DEFAULT_CACHE_DIR = "~/.cache/rlvr/jax"


def enable_cache(cache_dir: str, min_compile_s: float = 1.0) -> str | None:
    """Points jax's persistent compilation cache at `cache_dir` (~ expanded; created); "" turns it off.
    Programs that compiled faster than `min_compile_s` are not written (loading them would save
    little). The default directory gives way to $JAX_COMPILATION_CACHE_DIR when that is set.
    Returns the directory in use, or None. Safe to call again (tests, several jobs in one process):
    a changed directory resets jax's cache handle so the next compile uses it."""
    from jax._src import compilation_cache

    if cache_dir == DEFAULT_CACHE_DIR and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        cache_dir = os.environ["JAX_COMPILATION_CACHE_DIR"]  # the user's own jax setting wins over the default
    path = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else None
    if path:
        os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()  # jax decides once per process whether the cache is used
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class CompileLog:
    """Context manager: while open, each XLA compile in this process (any thread) is appended to
    `workdir/compile.jsonl` (module docstring) and, when it took at least `print_min_s`, printed as
    one line. `records` holds them; `summary()` totals them."""

    def __init__(self, workdir: str | None, print_min_s: float = 1.0):
        self.path = os.path.join(workdir, "compile.jsonl") if workdir else None
        self.print_min_s = print_min_s
        self.records: list[dict[str, Any]] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._start = 0.0
        self._file = None

    def __enter__(self) -> CompileLog:
        self._start = time.perf_counter()
        if self.path:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = open(self.path, "a")  # noqa: SIM115 (closed in __exit__)
        monitoring.register_event_listener(self._on_event)
        monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_listener(self._on_event)
        monitoring.unregister_event_duration_listener(self._on_duration)
        if self._file is not None:
            self._file.close()
            self._file = None

    def _on_event(self, event: str, **kwargs) -> None:
        if event in (CACHE_HIT, CACHE_MISS):  # inside the backend compile of this thread's program
            self._local.cache = "hit" if event == CACHE_HIT else "miss"

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == LOWER:
            self._local.lower_s = duration
        elif event == BACKEND_COMPILE:
            cache = getattr(self._local, "cache", None) or ("miss" if jax.config.jax_compilation_cache_dir else "off")
            record = {"program": str(kwargs.get("fun_name", "?")), "compile_s": round(duration, 3),
                      "lower_s": round(getattr(self._local, "lower_s", 0.0), 3), "cache": cache,
                      "at_s": round(time.perf_counter() - self._start, 1)}
            self._local.cache, self._local.lower_s = None, 0.0
            self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records.append(record)
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
        if record["compile_s"] + record["lower_s"] >= self.print_min_s:
            print(f"compile {record['program']}: {record['compile_s']:.1f} s (+{record['lower_s']:.1f} s lowering, "
                  f"cache {record['cache']})", flush=True)

    def mark(self) -> int:
        """A position in the log, for `seconds_since`."""
        with self._lock:
            return len(self.records)

    def seconds_since(self, mark: int) -> float:
        """Compile + lowering seconds of the programs logged since `mark` (e.g. within one step)."""
        with self._lock:
            return round(sum(r["compile_s"] + r["lower_s"] for r in self.records[mark:]), 3)

    def summary(self) -> dict[str, float]:
        """{"compile/programs", "compile/seconds" (backend compiles), "compile/lower_seconds",
        "compile/cache_hits"} of the records so far."""
        with self._lock:
            records = list(self.records)
        return {"compile/programs": float(len(records)),
                "compile/seconds": round(sum(r["compile_s"] for r in records), 3),
                "compile/lower_seconds": round(sum(r["lower_s"] for r in records), 3),
                "compile/cache_hits": float(sum(r["cache"] == "hit" for r in records))}
