"""Running OpenSCAD: the model's scripts inside the sandbox (gVisor by default), the references on the host.

A candidate script runs as `openscad -o - --export-format binstl model.scad` in a sandbox whose /workspace
holds only the script (and, in an episode, the files the model wrote): the binary STL comes back on stdout as
bytes, which the host parses and judges (rlvr.domains.cad.verify). Nothing the sandbox prints is a verdict;
its stderr is shown to the model as diagnostics (ERROR / WARNING lines only).

Reference scripts are trusted: `target_stl` runs them on the host, once per script (cached in memory and in
`TARGET_DIR`, a host directory the sandbox cannot see: the "reads the reference" audit probe names a real
file there). OpenSCAD is Debian's `openscad` package (`make install-test` installs it as root).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

from rlvr.domains.cad import verify
from rlvr.tasks.base import Task
from rlvr.tasks.verifiers import strip_fences

OPENSCAD = "/usr/bin/openscad"
MAIN = "model.scad"
ARGV = [OPENSCAD, "-o", "-", "--export-format", "binstl", MAIN]
TARGET_DIR = os.path.join(tempfile.gettempdir(), "rlvr-cad-targets")
_DIAGNOSTIC = re.compile(r"^(ERROR|WARNING|TRACE|ECHO)\b.*$", re.MULTILINE)
INSTALL_HINT = "OpenSCAD is missing: apt-get install -y openscad (make install-test installs it)"


def require_openscad() -> None:
    if not os.path.exists(OPENSCAD):
        raise RuntimeError(INSTALL_HINT)


def limits(base: Any = None) -> Any:
    """Sandbox limits for one OpenSCAD run: `base` (or the defaults) with room for CGAL and a large STL."""
    from rlvr.sandbox import Limits

    base = base or Limits(wall_s=30.0, cpu_s=30)
    return dataclasses.replace(base, memory_bytes=max(base.memory_bytes, 1 << 30),
                               output_bytes=max(base.output_bytes, 12 << 20),
                               wall_s=max(base.wall_s, 20.0), cpu_s=max(base.cpu_s, 20))


def diagnostics(stderr: str, limit: int = 1500) -> str:
    """OpenSCAD's ERROR / WARNING / ECHO lines (not its cache statistics)."""
    return "\n".join(m.group(0) for m in _DIAGNOSTIC.finditer(stderr))[:limit]


def pool(backend: str) -> Any:
    """The process-wide warm pool of N sandboxes for candidate runs when the backend is runsc, else None (a fresh
    sandbox per run). N is RLVR_CAD_POOL when set (0: fresh sandboxes), else the RL run's `rl.code_pool`
    (rlvr.envs.sandboxes.use_code_pool). A warm pool halves the sandbox's share of a step
    (benchmarks/cad_sandbox.py)."""
    from rlvr.envs.sandboxes import code_pool_size, shared_pool

    size = int(os.environ.get("RLVR_CAD_POOL", "") or code_pool_size())
    return shared_pool(size, limits(), backend) if size > 0 else None


def run_candidate(script: str, *, backend: str = "runsc", base_limits: Any = None, episode: Any = None,
                  executor: Any = None) -> tuple[Any, bytes | None]:
    """(sandbox Result, STL bytes or None) of the model's `script`: in `episode`'s workspace when given, else in
    `executor` (a warm pool) or a fresh sandbox. The STL is None unless OpenSCAD exited 0 with no limit hit and
    wrote something."""
    require_openscad()
    if episode is not None:
        result = episode.run(ARGV, files={MAIN: script}, tag="cad openscad")
    elif executor is not None:
        result = executor.run(ARGV, files={MAIN: script}, tag="cad openscad")
    else:
        from rlvr.sandbox import run

        result = run(ARGV, files={MAIN: script}, limits=limits(base_limits), backend=backend, trace_path=False,
                     tag="cad openscad")
    stl = result.stdout if result.ok and not result.stdout_truncated and result.stdout else None
    return result, stl


def with_count(stl: bytes) -> bytes:
    """The binary STL with its triangle count filled in: written to a pipe, OpenSCAD 2021 cannot seek back to it
    and leaves 0 (a file with 0 there is one OpenSCAD's own import() reads as empty)."""
    if len(stl) < 84 or (len(stl) - 84) % 50:
        return stl
    return stl[:80] + ((len(stl) - 84) // 50).to_bytes(4, "little") + stl[84:]


def target_path(script: str) -> str:
    return os.path.join(TARGET_DIR, hashlib.sha256(script.encode()).hexdigest()[:24] + ".stl")


@functools.lru_cache(maxsize=256)
def target_stl(script: str) -> bytes:
    """The reference script's mesh (binary STL), built on the host (trusted code) and cached on disk."""
    path = target_path(script)
    if os.path.exists(path):
        with open(path, "rb") as f:
            return f.read()
    require_openscad()
    os.makedirs(TARGET_DIR, exist_ok=True)
    work = tempfile.mkdtemp(prefix="rlvr-cad-")
    try:
        with open(os.path.join(work, MAIN), "w") as f:
            f.write(script)
        done = subprocess.run(ARGV, cwd=work, capture_output=True, timeout=120)
        if done.returncode != 0 or not done.stdout:
            raise RuntimeError(f"reference script failed (rc {done.returncode}): "
                               f"{diagnostics(done.stderr.decode(errors='replace'))}")
        stl = with_count(done.stdout)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(stl)
        with open(os.path.join(work, MAIN)) as src, open(path[:-4] + ".scad", "w") as dst:
            dst.write(src.read())
        os.replace(tmp, path)
        return stl
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- a model's answer, run and judged ------------------------------------------------------------------

def script_of(answer: str) -> str:
    """The OpenSCAD program in an answer (the last fenced block, or the text)."""
    return strip_fences(answer).strip()


def score_script(script: str, task: Task, backend: str | None = None,
                 episode: Any = None) -> tuple[dict[str, float], bytes | None]:
    """(the layered score, the mesh) of `script` for `task`: run in the sandbox (or `episode`), judged on the host."""
    from rlvr.tasks.verifiers import executor_backend

    target = verify.target(target_stl(task.metadata["script"]))
    if not script.strip():
        return verify.score(None, target), None
    backend = backend or executor_backend()
    executor = pool(backend) if episode is None else None
    _, stl = run_candidate(script, backend=backend, episode=episode, executor=executor)
    return verify.score(stl, target), stl
