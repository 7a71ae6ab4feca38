"""Episodes: several steps, one after another, against one persistent workspace; snapshots that replay exactly.

    with Episode(Limits(wall_s=5), template="repo/") as ep:       # workspace = the template's contents
        ep.write({"calc.py": "def add(a, b): return a - b\\n"})   # an agent edits a file
        r = ep.run(["/usr/bin/python3", "-m", "unittest", "-q"])  # runs the tests: fails
        if not r.ok:
            ep.snapshot("scene.tar.gz")                          # workspace + command log, self-contained
    # later, anywhere (the original workspace and template may be gone):
    #   python -m rlvr.sandbox.replay --episode scene.tar.gz       -> per step: replayed exactly or not

Design: each `run` is a FRESH sandbox (`runsc run`, ~0.3 s) over the episode's persistent workspace, not
`exec` into one long-lived sandbox. The only state a step hands to the next is the workspace: no process,
daemon, /tmp file or kernel state of an earlier step survives (each step is torn down like `api.run`), so
the command log plus the initial workspace determine the episode, which is what makes a snapshot replay
exactly. The price is a cold start per step (~0.3 s against ~0.1 s for exec), small next to an agent's
model call. The workspace is a size-capped tmpfs (root), or an overlay over a template's layer whose upper
dir is the episode's diff; closing the episode discards it.

A snapshot is one tar.gz: `episode.json` (backend, limits, template digest, every step: writes with their
file contents, runs with argv, input files, stdin, env, limits, outputs, status, limit hit, digests, timings),
`initial/` (the workspace the episode started from) and `final/` (the workspace when the snapshot was taken:
the error scene; whole trees, not overlay layers, so they unpack anywhere), and over a template the
overlay upper layer's summary (`changes`: paths written and deleted, `Workspace.changes`). Replay
(`replay_episode`) rebuilds `initial/` as a template, re-applies every write and re-runs every command in
fresh sandboxes, and compares each run's status, limit hit, outputs and workspace digests (timings are
reported, never compared), and the final workspace digest.

Steps' default environment (REPLAYABLE_ENV) avoids two common sources of spurious differences. The
workspace is sized by the episode's limits; a step's `limits` change only that step's other limits.

Not covered: processes do not live across steps (a server started in one step is gone in the next: start it
in the step that uses it); there is no episode-wide wall clock (each step has its limits); replaying a step
whose output is nondeterministic (time, randomness, thread races) reports that step as differing; note that
unittest's and pytest's own runners print elapsed times ("Ran 1 test in 0.001s"), so a task whose steps are
meant to replay exactly should report test results without timings (see tests/test_sandbox_episode.py).
"""

from __future__ import annotations

import atexit
import base64
import io
import json
import os
import sys
import tarfile
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from . import api, trace
from .types import Limits, Result, SandboxError
from .workspace import Template, template_for, tree_digest

FORMAT = "rlvr-sandbox-episode/1"
# Default environment of every step, for replays that match: no .pyc files (they embed source mtimes) and a
# fixed str hash seed (set iteration order). `python=` steps run with -I, which ignores both (-I -B anyway).
REPLAYABLE_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
_ids = iter(range(1 << 62))
_open: weakref.WeakSet[Episode] = weakref.WeakSet()
_lock = threading.Lock()


@atexit.register
def _close_open_episodes() -> None:
    """A forgotten episode still holds a mounted workspace: unmount it at exit."""
    for ep in list(_open):
        ep.close()


class Episode:
    """A multi-step session over one workspace; use as a context manager (or call `close()`)."""

    def __init__(self, limits: Limits | None = None, backend: str = "runsc", template: str | Template | None = None,
                 trace_path: str | None | bool = None, env: Mapping[str, str] | None = None):
        if backend not in api.BACKENDS:
            raise ValueError(f"sandbox backend {backend!r}: choose one of {sorted(api.BACKENDS)}")
        api._warn_weak(backend)
        self.limits = limits or Limits()
        self.backend = backend
        self.trace_path = trace_path
        self.env = {**REPLAYABLE_ENV, **(env or {})}
        with _lock:
            self.id = f"ep-{os.getpid()}-{next(_ids)}-{time.strftime('%H%M%S')}"
        self.template = template_for(template, api._owner(backend)) if template is not None else None
        self.ws = api.new_workspace(self.limits, backend, self.template)
        self.initial_digest = self.ws.digest()
        self.steps: list[dict[str, Any]] = []
        self.closed = False
        _open.add(self)

    def write(self, files: Mapping[str, bytes | str]) -> None:
        """Write files into the workspace (paths relative; no symlink in the path is followed)."""
        self._check_open()
        data = {k: (v.encode() if isinstance(v, str) else bytes(v)) for k, v in files.items()}
        self.ws.write(data)
        self.steps.append({"kind": "write", "files": _b64(data), "digest_after": self.ws.digest()})

    def read(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        """A workspace file's first `max_bytes` bytes (regular files only; symlinks are never followed)."""
        self._check_open()
        return self.ws.read_file(path, max_bytes)

    def digest(self) -> str:
        return self.ws.digest()

    def changes(self) -> dict[str, list[str]] | None:
        """Paths written and deleted since the template (the overlay's upper layer); None without a template."""
        return self.ws.changes()

    def run(self, command: Sequence[str] | None = None, *, python: str | None = None,
            files: Mapping[str, bytes | str] | None = None, stdin: bytes = b"", env: Mapping[str, str] | None = None,
            limits: Limits | None = None, tag: str | None = None) -> Result:
        """One step: `command` (argv) or Python source (written to main.py) in a fresh sandbox whose
        /workspace is the episode's workspace; `files` are written first. Logged, and traced."""
        self._check_open()
        argv, inputs = api.build_command(command, python, files)
        limits = limits or self.limits
        environment = {**self.env, **(env or {})}
        queued = time.perf_counter()
        with api._slots:
            result = api.run_in(self.ws, argv, inputs, limits, self.backend, stdin, environment, {}, queued,
                                time.perf_counter())
        entry = trace.record(argv, inputs, stdin, limits, result, environment, tag or f"{self.id} step "
                             f"{len(self.steps)}", {})
        entry["files"] = _b64(inputs)  # kept whatever their size: the replay needs them
        entry["episode"] = self.id
        if self.trace_path is not False:
            trace.append(self.trace_path or trace.default_path(), entry)
        self.steps.append({"kind": "run", **entry})
        return result

    def snapshot(self, path: str) -> str:
        """Save the episode (log, initial and current workspace) as one self-contained tar.gz at `path`."""
        self._check_open()
        meta = {"format": FORMAT, "id": self.id, "backend": self.backend, "limits": self.limits.to_json(),
                "env": self.env, "template": ({"source": self.template.source, "digest": self.template.digest}
                                             if self.template else None),
                "initial_digest": self.initial_digest, "final_digest": self.ws.digest(),
                "changes": self.ws.changes(), "steps": self.steps,
                "time": time.time()}
        tmp = f"{path}.tmp-{os.getpid()}"
        with tarfile.open(tmp, "w:gz") as tar:
            body = json.dumps(meta, ensure_ascii=True, indent=1).encode()
            info = tarfile.TarInfo("episode.json")
            info.size, info.mtime, info.mode = len(body), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(body))
            initial = self.template.path if self.template else None
            _add_tree(tar, initial, "initial")
            _add_tree(tar, self.ws.path, "final")
        os.replace(tmp, path)
        return path

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"episode {self.id} is closed")

    def close(self) -> None:
        """Discard the workspace (the overlay's upper layer or the tmpfs goes with it). Idempotent."""
        if not self.closed:
            self.closed = True
            self.ws.close()
            _open.discard(self)

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _b64(files: Mapping[str, bytes]) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in files.items()}


def _add_tree(tar: tarfile.TarFile, top: str | None, arcname: str) -> None:
    """Add a directory tree (links stored as links, never followed; owners not kept), or an empty one."""
    if top is None:
        info = tarfile.TarInfo(arcname)
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
        tar.addfile(info)
        return

    def anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    tar.add(top, arcname=arcname, recursive=True, filter=anonymous)


def _extract_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """tarfile's "tar" filter (no absolute paths, nothing outside `dest`, also not through an extracted
    symlink; no setuid/setgid/sticky bits), keeping group/other write bits (they are in the digest), and
    no device nodes."""
    if member.isdev():
        raise tarfile.FilterError(f"{member.name}: a device node in an episode snapshot")
    safe = tarfile.tar_filter(member, dest)
    return safe.replace(mode=member.mode & 0o777, deep=False) if member.mode is not None else safe


def load(snapshot: str) -> dict[str, Any]:
    """A snapshot's `episode.json` (the log), without extracting the workspaces."""
    with tarfile.open(snapshot, "r:gz") as tar:
        meta = json.loads(tar.extractfile("episode.json").read())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{snapshot}: not an episode snapshot ({meta.get('format')!r})")
    return meta


def replay_episode(snapshot: str, backend: str | None = None) -> dict[str, Any]:
    """Re-run a snapshot's episode from its initial workspace in fresh sandboxes and compare step by step.

    Returns {"replayed_exactly": bool, "steps": [{"step", "kind", "match", "differences"}], "final_digest":
    {"recorded", "replayed"}, ...}; `replayed_exactly` holds when every step and the final digest match."""
    meta = load(snapshot)
    with tempfile.TemporaryDirectory(prefix="rlvr-episode-replay-") as tmp:
        with tarfile.open(snapshot, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name == "initial" or m.name.startswith("initial/")]
            tar.extractall(tmp, members=members, filter=_extract_filter)
        initial = os.path.join(tmp, "initial")
        start = time.perf_counter()
        template = Template(initial) if os.listdir(initial) else None
        try:
            if tree_digest(initial) != meta["initial_digest"]:
                raise ValueError(f"{snapshot}: the saved initial workspace does not match its recorded digest")
            steps = []
            with Episode(Limits.from_json(meta["limits"]), backend or meta["backend"], template=template,
                         trace_path=False, env=meta["env"]) as ep:
                for i, step in enumerate(meta["steps"]):
                    steps.append(_replay_step(ep, i, step))
                final = ep.digest()
        finally:
            if template is not None:
                template.close()
    return {"snapshot": snapshot, "episode": meta["id"], "backend": backend or meta["backend"],
            "replayed_exactly": all(s["match"] for s in steps) and final == meta["final_digest"],
            "steps": steps, "final_digest": {"recorded": meta["final_digest"], "replayed": final},
            "replay_s": round(time.perf_counter() - start, 3)}


def _replay_step(ep: Episode, i: int, step: Mapping[str, Any]) -> dict[str, Any]:
    if step["kind"] == "write":
        ep.write(trace.decode_files(step["files"]))
        got = ep.digest()
        diff = {} if got == step["digest_after"] else {"digest_after": {"recorded": step["digest_after"],
                                                                        "replayed": got}}
        return {"step": i, "kind": "write", "match": not diff, "differences": diff}
    result = ep.run(step["argv"], files=trace.decode_files(step["files"]), stdin=base64.b64decode(step["stdin"]),
                    env=step["env"], limits=Limits.from_json(step["limits"]), tag=f"replay of {step['tag']}")
    diff = trace.compare(step, result)
    if result.digest_before != step["digest_before"]:
        diff["digest_before"] = {"recorded": step["digest_before"], "replayed": result.digest_before}
    return {"step": i, "kind": "run", "argv": step["argv"], "match": not diff, "differences": diff,
            "exit_code": result.exit_code, "run_s": {"recorded": step["timings"]["run_s"],
                                                     "replayed": result.timings.run_s}}


def main(argv: list[str] | None = None) -> int:
    """`python -m rlvr.sandbox.episode SNAPSHOT`: same as `python -m rlvr.sandbox.replay --episode SNAPSHOT`."""
    args = argv if argv is not None else sys.argv[1:]
    report = replay_episode(args[0], args[1] if len(args) > 1 else None)
    print(json.dumps(report))
    return 0 if report["replayed_exactly"] else 1


if __name__ == "__main__":
    sys.exit(main())

