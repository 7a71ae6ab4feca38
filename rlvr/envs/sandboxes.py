"""Sandbox plumbing of the environments: shared warm pools, repository templates, run records.

- `shared_pool(size, limits)`: one warm `rlvr.sandbox.Pool` per (size, limits) for the whole process,
  started on first use and shared by every episode (episodes run on many threads; a Pool is
  thread-safe). `make_env(..., sandbox_workers=N)` uses it for stateless runs (the python tool of the
  tool-use environment, the host-judged verdicts of code repair); `close_shared_pools()` stops them
  (atexit does too).
- `TemplateCache`: a prepared `rlvr.sandbox.workspace.Template` per repository content (the files of a
  code-repair task), reference-counted: the group of episodes of one task shares one template layer,
  and at most `keep` unused ones stay cached.
- `record(result, what)`: a JSON summary of one sandbox `Result` for the episode trace.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

from rlvr.envs.tools import truncate

_pools: dict[tuple[int, str, str], Any] = {}
_pools_lock = threading.Lock()


def shared_pool(size: int, limits: Any, backend: str = "runsc") -> Any:
    """The process-wide warm pool of `size` sandboxes with `limits` (None for the runsc backend only:
    the weaker development backends have no pool; callers then run fresh sandboxes)."""
    if size <= 0 or backend != "runsc":
        return None
    key = (size, json.dumps(limits.to_json(), sort_keys=True), backend)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            from rlvr.sandbox import Pool

            pool = _pools[key] = Pool(size, limits, trace_path=False)
        return pool


CODE_POOL_WALL_S = 10.0  # the code pool's sandbox limits: code_limits of a 10 s verdict (each verdict brings its own)


def code_pool_limits() -> Any:
    """The code pool's sandbox limits: each field the pool clamps a task's limits to (rlvr.sandbox.pool._clamp) is
    the larger of a code verdict's (`code_limits`) and an environment run's (DEFAULT_LIMITS_JSON), so that
    neither kind of verdict gets tighter limits on the pool than in a fresh sandbox."""
    import dataclasses

    from rlvr.sandbox import Limits
    from rlvr.tasks.verifiers import code_limits

    code, env = code_limits(CODE_POOL_WALL_S), Limits(**DEFAULT_LIMITS_JSON)
    fields = ("memory_bytes", "nproc", "nofile", "file_bytes", "output_bytes")
    return dataclasses.replace(code, **{f: max(getattr(code, f), getattr(env, f)) for f in fields})


def use_code_pool(size: int) -> None:
    """Code verdicts (`verify_code`, code-repair scoring) outside any `code_executor` block run on the shared warm
    pool of `size` sandboxes (started on the first verdict; its dead and re-run sandboxes count in
    `pool_counters`, a stalled verdict still raises SandboxStalled); 0 = a fresh sandbox per verdict. The pool
    exists for the runsc backend only: with RLVR_CODE_EXECUTOR=process|bwrap verdicts stay fresh. The CAD
    domain's candidate runs follow the same size unless RLVR_CAD_POOL says otherwise (`code_pool_size`)."""
    from rlvr.tasks.verifiers import executor_backend, set_default_code_executor

    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"rl.code_pool={size!r}: give the number of warm sandboxes for code verdicts (0 = a fresh "
                         "sandbox per verdict)")
    previous, _code_pool[0] = _code_pool[0], size
    limits = code_pool_limits()
    set_default_code_executor((lambda: shared_pool(size, limits, executor_backend())) if size else None)
    if previous and previous != size:  # the pool of the previous setting is nobody's default any more
        with _pools_lock:
            stale = _pools.pop((previous, json.dumps(limits.to_json(), sort_keys=True), "runsc"), None)
        if stale is not None:
            stale.close()


def code_pool_size() -> int:
    """The size `use_code_pool` set (0: none)."""
    return _code_pool[0]


_code_pool = [0]


def close_shared_pools() -> None:
    """Stop every shared pool (a later `shared_pool` call starts a fresh one)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


atexit.register(close_shared_pools)


def pool_counters() -> dict[str, float]:
    """Fault counters summed over the shared pools (cumulative): sandboxes retired (limits hit),
    task attempts lost to a dead sandbox, and re-runs of those on another sandbox."""
    with _pools_lock:
        pools = list(_pools.values())
    return {f"sandbox/{name}": float(sum(getattr(p, name, 0) for p in pools))
            for name in ("retired", "lost", "reruns")} if pools else {}


def record(result: Any, what: str, limit_chars: int = 2000) -> dict[str, Any]:
    """A trace entry for one sandbox run: what ran, status, limit hit, capped outputs, digests, timings."""
    return {"what": what, "backend": result.backend, "exit_code": result.exit_code, "signal": result.signal,
            "limit_hit": result.limit_hit, "stdout": truncate(result.text(), limit_chars),
            "stderr": truncate(result.text("stderr"), limit_chars),
            "digest_before": result.digest_before, "digest_after": result.digest_after,
            "sandbox_id": result.sandbox_id,
            "timings": {"queue_s": round(result.timings.queue_s, 4), "start_s": round(result.timings.start_s, 4),
                        "run_s": round(result.timings.run_s, 4)}}


def files_digest(files: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(sorted(files.items()))).encode()).hexdigest()[:20]


class TemplateCache:
    """Prepared template layers keyed by repository content, shared and reference-counted."""

    def __init__(self, keep: int = 64):
        self.keep = keep
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], list[Any]] = {}  # key -> [template, users]
        self._idle: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    def acquire(self, files: Mapping[str, str], backend: str) -> tuple[tuple[str, str], Any]:
        """(key, Template) holding `files`; give the key back with `release` when the episode ends."""
        from rlvr.sandbox import api
        from rlvr.sandbox.workspace import Template

        key = (files_digest(files), backend)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry[1] += 1
                self._idle.pop(key, None)
                return key, entry[0]
        source = tempfile.mkdtemp(prefix="rlvr-env-repo-")
        try:
            for path, text in files.items():
                full = os.path.join(source, path)
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "w", encoding="utf-8") as f:
                    f.write(text)
            template = Template(source, api._owner(backend))
        finally:
            shutil.rmtree(source, ignore_errors=True)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:  # another thread prepared it meanwhile: use theirs
                entry[1] += 1
                self._idle.pop(key, None)
                spare, chosen = template, entry[0]
            else:
                self._entries[key] = [template, 1]
                spare, chosen = None, template
        if spare is not None:
            spare.close()
        return key, chosen

    def release(self, key: tuple[str, str]) -> None:
        evict = []
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                self._idle[key] = None
            while len(self._idle) > self.keep:
                old, _ = self._idle.popitem(last=False)
                evict.append(self._entries.pop(old)[0])
        for template in evict:
            template.close()

    def clear(self) -> None:
        """Remove the unused layers (those still in use stay)."""
        with self._lock:
            evict = [self._entries.pop(k)[0] for k in list(self._idle)]
            self._idle.clear()
        for template in evict:
            template.close()


TEMPLATES = TemplateCache()
atexit.register(TEMPLATES.clear)


DEFAULT_LIMITS_JSON = {"wall_s": 10.0, "cpu_s": 10, "memory_bytes": 512 << 20, "output_bytes": 256 << 10}


class SandboxOptions:
    """How an episode runs code: backend ("runsc" unless RLVR_CODE_EXECUTOR says otherwise), limits of one
    run, and an optional warm pool for stateless runs (`pool`, or a shared pool of `sandbox_workers`)."""

    def __init__(self, backend: str | None = None, limits: Any = None, sandbox_workers: int = 0, pool: Any = None,
                 trace_path: str | bool | None = False):
        from rlvr.sandbox import Limits
        from rlvr.tasks.verifiers import executor_backend

        self.backend = backend or executor_backend()
        self.limits = limits or Limits(**DEFAULT_LIMITS_JSON)
        self.sandbox_workers = int(sandbox_workers or 0)
        self._pool = pool
        self.trace_path = trace_path

    def executor(self) -> Any:
        """The warm pool for stateless runs, or None (fresh sandboxes)."""
        return self._pool if self._pool is not None else shared_pool(self.sandbox_workers, self.limits, self.backend)

    def run_python(self, code: str, tag: str = "env python") -> Any:
        from rlvr.sandbox import run

        executor = self.executor()
        if executor is not None:
            return executor.run(python=code, limits=self.limits, tag=tag)
        return run(python=code, limits=self.limits, backend=self.backend, trace_path=self.trace_path, tag=tag)

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "limits": self.limits.to_json(), "sandbox_workers": self.sandbox_workers,
                "pool": type(self._pool).__name__ if self._pool is not None else None}
