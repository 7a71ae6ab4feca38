"""`run(...)`: one command or Python program in a fresh sandbox, with limits, a result and a trace record.

Backends, in the explicit table `BACKENDS`:
  runsc    gVisor (default): its own kernel, read-only root, no network, cgroups; see runsc.py.
  bwrap    bubblewrap: namespaces on the host kernel, no cgroups; development only (warns; see local.py).
  process  a plain subprocess with rlimits; development only, NOT isolation (warns; see local.py).
"""

from __future__ import annotations

import os
import signal as signals
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

from . import local, runsc, trace
from .capture import Captured
from .types import CPU, DISK, FILE_SIZE, MEMORY, Limits, Result, Timings
from .workspace import SANDBOX_UID, Template, Workspace, template_for

PYTHON = "/usr/bin/python3"  # Debian's interpreter: the venv's lives outside /usr, invisible in the sandbox
MAIN = "main.py"

BackendFn = Callable[..., tuple[Captured, str]]  # (argv, ws, limits, stdin, env, ro_binds) -> (run, sandbox id)
_slots = threading.BoundedSemaphore(int(os.environ.get("RLVR_SANDBOX_CONCURRENCY", 4 * (os.cpu_count() or 1))))
_warned: set[str] = set()


def _run_runsc(argv: list[str], ws: Workspace, limits: Limits, stdin: bytes, env: Mapping[str, str] | None,
               ro_binds: Mapping[str, str]) -> tuple[Captured, str]:
    return runsc.execute(argv, ws, limits, stdin, env, ro_binds)


def _run_bwrap(argv: list[str], ws: Workspace, limits: Limits, stdin: bytes, env: Mapping[str, str] | None,
               ro_binds: Mapping[str, str]) -> tuple[Captured, str]:
    return local.execute_bwrap(argv, ws, limits, stdin, env, ro_binds), "bwrap"


def _run_process(argv: list[str], ws: Workspace, limits: Limits, stdin: bytes, env: Mapping[str, str] | None,
                 ro_binds: Mapping[str, str]) -> tuple[Captured, str]:
    if ro_binds:
        raise ValueError("the process backend has no private mounts: ro_binds need backend 'runsc' or 'bwrap'")
    return local.execute_process(argv, ws, limits, stdin, env), "process"


BACKENDS: dict[str, BackendFn] = {"runsc": _run_runsc, "bwrap": _run_bwrap, "process": _run_process}
WEAK = {"bwrap": "bubblewrap shares the host kernel and has no cgroup limits",
        "process": "a plain subprocess can read host files, reach the network and signal host processes"}


def _warn_weak(backend: str) -> None:
    if backend in WEAK and backend not in _warned:
        _warned.add(backend)
        warnings.warn(f"sandbox backend {backend!r} is for development only: {WEAK[backend]} "
                      "(use backend='runsc'; apt-get install -y runsc)", RuntimeWarning, stacklevel=3)


def _owner(backend: str) -> int:
    return SANDBOX_UID if backend == "runsc" else local.owner_uid()


def run(command: Sequence[str] | None = None, *, python: str | None = None,
        files: Mapping[str, bytes | str] | None = None, limits: Limits | None = None, backend: str = "runsc",
        stdin: bytes = b"", env: Mapping[str, str] | None = None, ro_binds: Mapping[str, str] | None = None,
        trace_path: str | None | bool = None, tag: str | None = None, template: str | Template | None = None) -> Result:
    """Run `command` (argv, cwd /workspace) or Python source `python` (as /workspace/main.py) in a fresh sandbox.

    `template` (a host directory or a prepared `workspace.Template`): the workspace starts as its contents,
    as an overlay whose writes are discarded after the call; the template itself never changes (see
    workspace.py). `files` (relative path -> content) are then written into the private workspace. `ro_binds`
    maps sandbox paths to host directories bound read-only. A trace record is appended to `trace_path`
    (default `trace.default_path()`; False: none). Raises SandboxUnavailable when the backend cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"sandbox backend {backend!r}: choose one of {sorted(BACKENDS)}")
    argv, inputs = build_command(command, python, files)
    limits = limits or Limits()
    _warn_weak(backend)
    layer = template_for(template, _owner(backend)) if template is not None else None
    queued = time.perf_counter()
    with _slots:
        result = _run_once(argv, inputs, limits, backend, stdin, env, ro_binds or {}, queued, layer)
    if trace_path is not False:
        entry = trace.record(argv, inputs, stdin, limits, result, env, tag, ro_binds or {})
        if layer is not None:
            entry["template"] = {"source": layer.source, "digest": layer.digest}
        trace.append(trace_path or trace.default_path(), entry)
    return result


def build_command(command: Sequence[str] | None, python: str | None,
                  files: Mapping[str, bytes | str] | None) -> tuple[list[str], dict[str, bytes]]:
    """(argv, files as bytes) from exactly one of a command or Python source (shared with the pool)."""
    inputs = {k: (v.encode() if isinstance(v, str) else bytes(v)) for k, v in (files or {}).items()}
    if (command is None) == (python is None):
        raise ValueError("give exactly one of `command` (argv) or `python` (source)")
    if python is None:
        return [str(a) for a in command], inputs
    if MAIN in inputs:
        raise ValueError(f"`python` source is written to {MAIN}; do not also pass a file of that name")
    return [PYTHON, "-I", "-B", MAIN], {**inputs, MAIN: python.encode()}


def new_workspace(limits: Limits, backend: str, template: Template | None = None) -> Workspace:
    """A fresh workspace for `backend` (owned by the uid its programs run as), optionally over a template."""
    return Workspace(limits.workspace_bytes, limits.workspace_inodes, owner_uid=_owner(backend),
                     parent=runsc.workspaces_dir(), template=template)


def _run_once(argv: list[str], inputs: dict[str, bytes], limits: Limits, backend: str, stdin: bytes,
              env: Mapping[str, str] | None, ro_binds: Mapping[str, str], queued: float,
              template: Template | None = None) -> Result:
    start = time.perf_counter()
    ws = new_workspace(limits, backend, template)
    try:
        return run_in(ws, argv, inputs, limits, backend, stdin, env, ro_binds, queued, start)
    finally:
        ws.close()


def run_in(ws: Workspace, argv: list[str], inputs: dict[str, bytes], limits: Limits, backend: str, stdin: bytes,
           env: Mapping[str, str] | None, ro_binds: Mapping[str, str], queued: float, start: float) -> Result:
    """One fresh sandbox over an existing workspace (an episode's step, or `run`'s single call)."""
    ws.write(inputs)
    before = ws.digest()
    launched = time.perf_counter()
    got, sandbox_id = BACKENDS[backend](argv, ws, limits, stdin, env, ro_binds)
    exit_code, sig = _status(got.returncode, backend)
    timings = Timings(queue_s=start - queued, start_s=launched - start, run_s=got.run_s)
    return Result(backend, exit_code, sig, got.stdout, got.stderr, got.stdout_truncated, got.stderr_truncated,
                  _limit_hit(got, sig, ws), timings, before, ws.digest(), sandbox_id, got.cpu_s)


def _status(returncode: int, backend: str) -> tuple[int | None, int | None]:
    """(exit code, signal): Popen reports a signal as a negative code; runsc and bwrap as 128 + signal."""
    if returncode < 0:
        return None, -returncode
    if backend in ("runsc", "bwrap") and 128 < returncode <= 128 + 64:
        return None, returncode - 128
    return returncode, None


def _limit_hit(got: Captured, sig: int | None, ws: Workspace) -> str | None:
    """Which limit ended or hobbled the run: the harness's kill reason first, then the evidence."""
    if got.killed_for:
        return got.killed_for
    tail = got.stderr[-4096:]
    if sig == signals.SIGXCPU:
        return CPU
    if sig == signals.SIGXFSZ or b"[Errno 27] File too large" in tail:
        return FILE_SIZE
    if b"MemoryError" in tail:
        return MEMORY  # a clean MemoryError (RLIMIT_AS); a cgroup OOM kill comes as killed_for
    free_bytes, free_inodes = ws.free_fraction()
    if min(free_bytes, free_inodes) < 0.01:
        return DISK
    return None
