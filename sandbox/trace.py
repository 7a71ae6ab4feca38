"""Trace records: one JSON line per sandboxed call, enough to audit it and to replay it.

A record holds the command, the limits, the input files (base64, when under `FILES_CAP` in total; else
only their digest), the workspace digest before and after, the capped outputs, status, limit hit and
timings. One file per run or pool; `default_path()` picks one per process unless RLVR_SANDBOX_TRACE names
a file (or RLVR_SANDBOX_TRACE_DIR a directory).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from .types import Limits, Result

FILES_CAP = 1 << 20  # input files stored in the record up to this total size
_locks: dict[str, threading.Lock] = {}
_locks_lock = threading.Lock()
_default: str | None = None


def default_path() -> str:
    """This process's trace file (created lazily): $RLVR_SANDBOX_TRACE, or a new file in the trace dir."""
    global _default
    if os.environ.get("RLVR_SANDBOX_TRACE"):
        return os.environ["RLVR_SANDBOX_TRACE"]
    if _default is None:
        directory = os.environ.get("RLVR_SANDBOX_TRACE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                            "rlvr-sandbox-traces")
        os.makedirs(directory, exist_ok=True)
        _default = os.path.join(directory, f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.jsonl")
    return _default


def encode_files(files: Mapping[str, bytes]) -> dict[str, str] | None:
    """Files as base64 text, or None when they are too large to keep in a trace."""
    if sum(len(v) for v in files.values()) > FILES_CAP:
        return None
    return {k: base64.b64encode(v).decode() for k, v in files.items()}


def read_tree(top: str) -> dict[str, bytes]:
    """The regular files under a directory (relative path -> bytes), links not followed."""
    out = {}
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                with open(full, "rb") as f:
                    out[os.path.relpath(full, top)] = f.read()
    return out


def decode_files(files: Mapping[str, str]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in files.items()}


def record(argv: list[str], files: Mapping[str, bytes], stdin: bytes, limits: Limits, result: Result,
           env: Mapping[str, str] | None, tag: str | None, ro_binds: Mapping[str, str]) -> dict[str, Any]:
    """The JSON-ready trace record of one call (read-only binds are kept as snapshots of their files)."""
    binds = {dest: encode_files(read_tree(src)) for dest, src in ro_binds.items()}
    return {"time": time.time(), "tag": tag, "backend": result.backend, "sandbox_id": result.sandbox_id,
            "argv": argv, "env": dict(env or {}), "limits": limits.to_json(), "files": encode_files(files),
            "ro_binds": binds,
            "stdin": base64.b64encode(stdin).decode(), "digest_before": result.digest_before,
            "digest_after": result.digest_after, "exit_code": result.exit_code, "signal": result.signal,
            "limit_hit": result.limit_hit, "timings": dataclasses.asdict(result.timings), "cpu_s": result.cpu_s,
            "stdout": result.text("stdout"), "stderr": result.text("stderr"),
            "stdout_truncated": result.stdout_truncated, "stderr_truncated": result.stderr_truncated}


def append(path: str, entry: Mapping[str, Any]) -> None:
    """Append one JSON line (a lock per file: concurrent calls never interleave their lines)."""
    with _locks_lock:
        lock = _locks.setdefault(path, threading.Lock())
    line = json.dumps(entry, ensure_ascii=True) + "\n"
    with lock, open(path, "a", encoding="utf-8") as f:
        f.write(line)


def read(path: str) -> list[dict[str, Any]]:
    """All records of a trace file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


COMPARED = ("exit_code", "signal", "limit_hit", "stdout", "stderr", "digest_after")


def compare(entry: Mapping[str, Any], result: Result) -> dict[str, Any]:
    """{field: {"recorded": …, "replayed": …}} for each compared field that differs (empty: reproduced)."""
    now = record([], {}, b"", Limits(), result, None, None, {})
    return {k: {"recorded": entry[k], "replayed": now[k]} for k in COMPARED if entry[k] != now[k]}
