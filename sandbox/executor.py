"""The scale-out seam: `Executor`, the one interface the RL side should depend on to run sandboxed code.

    class Executor(Protocol):
        def run(self, command=None, *, python=None, files=None, stdin=b"", env=None, limits=None,
                tag=None) -> Result: ...
        def close(self) -> None: ...

Implemented here by `Local` (a fresh sandbox per call: `api.run` with a fixed backend and limits) and by
`pool.Pool` (warm sandboxes on this machine); `verify.verify_program(..., pool=executor)` takes any of them.
Everything that crosses the interface is plain data: argv (list of str), Python source (str), files
(relative path -> bytes), stdin (bytes), env (str -> str), `Limits` (`to_json`/`from_json`), a tag (str),
and back a `Result` (`to_json`/`from_json`, outputs as base64). So an executor on another machine only has
to move two JSON documents: `encode_request(...)` -> the worker -> `serve(executor, request)` -> the reply ->
`decode_result(...)`. A remote worker, for example a Ray actor wrapping a `Pool` on another node:

    @ray.remote
    class SandboxWorker:                      # on each node
        def __init__(self, size, limits_json):
            self.pool = Pool(size, Limits.from_json(limits_json))
        def run(self, request_json: str) -> str:
            return serve(self.pool, request_json)
        def close(self):
            self.pool.close()

    class RayExecutor:                        # on the trainer: an Executor like any other
        def __init__(self, actors): self.actors, self.next = actors, itertools.cycle(actors)
        def run(self, command=None, **request):
            return decode_result(ray.get(next(self.next).run.remote(encode_request(command, **request))))
        def close(self): ray.get([a.close.remote() for a in self.actors])

`JsonExecutor` below is that round trip in one process (no transport): it proves the interface is
transport-safe and is what the tests use. Contract for implementers: `run` is thread-safe and blocking; a
failure of the *program* is a `Result` (exit code, signal, limit hit), a failure of the *sandbox machinery*
raises `SandboxError` (remote: send `{"error": ...}` and raise it on the caller's side, as `serve` and
`decode_result` do); `close` releases every sandbox and is idempotent. Not in the interface: templates and
read-only binds (host paths mean nothing on another machine; ship their files instead), episodes (stateful:
one `Episode` per worker, addressed by id, would be the remote form).
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from . import api
from .types import Limits, Result, SandboxError


@runtime_checkable
class Executor(Protocol):
    """Runs one command or Python program in a sandbox and returns its Result (see the module doc)."""

    def run(self, command: Sequence[str] | None = None, *, python: str | None = None,
            files: Mapping[str, bytes | str] | None = None, stdin: bytes = b"", env: Mapping[str, str] | None = None,
            limits: Limits | None = None, tag: str | None = None) -> Result: ...

    def close(self) -> None: ...


class Local:
    """A fresh sandbox per call (`api.run`) as an Executor: backend, default limits and trace file fixed."""

    def __init__(self, backend: str = "runsc", limits: Limits | None = None, trace_path: str | None | bool = None):
        if backend not in api.BACKENDS:
            raise ValueError(f"sandbox backend {backend!r}: choose one of {sorted(api.BACKENDS)}")
        self.backend, self.limits, self.trace_path = backend, limits or Limits(), trace_path

    def run(self, command: Sequence[str] | None = None, *, python: str | None = None,
            files: Mapping[str, bytes | str] | None = None, stdin: bytes = b"", env: Mapping[str, str] | None = None,
            limits: Limits | None = None, tag: str | None = None) -> Result:
        return api.run(command, python=python, files=files, limits=limits or self.limits, backend=self.backend,
                       stdin=stdin, env=env, trace_path=self.trace_path, tag=tag)

    def close(self) -> None:
        """Nothing to release: every call's sandbox is already gone (its deletion is on the reaper)."""

    def __enter__(self) -> Local:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def encode_request(command: Sequence[str] | None = None, *, python: str | None = None,
                   files: Mapping[str, bytes | str] | None = None, stdin: bytes = b"",
                   env: Mapping[str, str] | None = None, limits: Limits | None = None, tag: str | None = None) -> str:
    """A run request as JSON text (bytes as base64)."""
    blobs = {k: (v.encode() if isinstance(v, str) else bytes(v)) for k, v in (files or {}).items()}
    return json.dumps({"command": list(command) if command is not None else None, "python": python,
                       "files": {k: base64.b64encode(v).decode() for k, v in blobs.items()},
                       "stdin": base64.b64encode(stdin).decode(), "env": dict(env) if env is not None else None,
                       "limits": limits.to_json() if limits is not None else None, "tag": tag})


def decode_request(text: str) -> dict[str, Any]:
    """The keyword arguments of `Executor.run` from `encode_request`'s JSON."""
    data = json.loads(text)
    return {"command": data["command"], "python": data["python"],
            "files": {k: base64.b64decode(v) for k, v in data["files"].items()},
            "stdin": base64.b64decode(data["stdin"]), "env": data["env"],
            "limits": Limits.from_json(data["limits"]) if data["limits"] is not None else None, "tag": data["tag"]}


def serve(executor: Executor, request: str) -> str:
    """The worker side: run one JSON request on a local executor; the JSON reply (a Result or an error)."""
    try:
        result = executor.run(**decode_request(request))
    except (SandboxError, ValueError) as e:
        return json.dumps({"error": f"{type(e).__name__}: {e}"})
    return json.dumps({"result": result.to_json()})


def decode_result(reply: str) -> Result:
    """The caller side: a Result from `serve`'s reply; SandboxError when the worker reported an error."""
    data = json.loads(reply)
    if "error" in data:
        raise SandboxError(f"remote executor: {data['error']}")
    return Result.from_json(data["result"])


class JsonExecutor:
    """An Executor that sends every request and result through JSON text to an inner executor: the
    transport a remote worker needs, without the network (see the module doc)."""

    def __init__(self, inner: Executor):
        self.inner = inner
        self.bytes_sent = self.bytes_received = 0
        self._lock = threading.Lock()

    def run(self, command: Sequence[str] | None = None, *, python: str | None = None,
            files: Mapping[str, bytes | str] | None = None, stdin: bytes = b"", env: Mapping[str, str] | None = None,
            limits: Limits | None = None, tag: str | None = None) -> Result:
        request = encode_request(command, python=python, files=files, stdin=stdin, env=env, limits=limits, tag=tag)
        reply = serve(self.inner, request)
        with self._lock:
            self.bytes_sent += len(request)
            self.bytes_received += len(reply)
        return decode_result(reply)

    def close(self) -> None:
        self.inner.close()
