"""Append-only, partitioned JSONL logs that survive a crash with nothing lost or duplicated.

Layout: `ROOT/<stream>/date=YYYY-MM-DD/part-<host>-<pid>-<start ns>.jsonl`. Every writing process opens
its own part files (a new one per day), so a record torn by a crash is always the last line of a file
no one appends to again. Each line frames one record with its CRC-32:

    {"crc32": 1234567, "rec": {...}}

written with one `os.write` on an O_APPEND file and then `fsync`ed before `append` returns: a caller
that answers only after `append` (the server answers a request after recording it) never acknowledges
a record that a kill could lose. `read` yields each intact record once (by its `id`, so a record
appended twice, e.g. by a retried client, is read once), drops a torn last line, and reports (never
silently skips) a corrupt line in the middle of a file. Writers need a local filesystem (append and
fsync); readers also read part files shipped to object storage.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

from rlvr import storage

logger = logging.getLogger(__name__)

_PREFIX = b'{"crc32": '
_MIDDLE = b', "rec": '


def frame(record: dict[str, Any]) -> bytes:
    """One framed line: the record's JSON and its CRC-32."""
    raw = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
    return _PREFIX + str(zlib.crc32(raw)).encode() + _MIDDLE + raw + b"}\n"


def unframe(line: bytes) -> dict[str, Any] | None:
    """The record of an intact framed line (with its newline), else None."""
    if not line.startswith(_PREFIX) or not line.endswith(b"}\n"):
        return None
    crc, sep, raw = line[len(_PREFIX):-2].partition(_MIDDLE)
    if not sep or not crc.isdigit() or zlib.crc32(raw) != int(crc):
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _day(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d")


class AppendLog:
    """Writes records of one stream (e.g. "traffic", "feedback") under `root`; thread-safe."""

    def __init__(self, root: str, stream: str, fsync: bool = True):
        self.root, self.stream, self.fsync = root, stream, fsync
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._day = ""
        self._tag = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"

    def _open(self, day: str) -> int:
        if self._fd is not None:
            os.close(self._fd)
        folder = os.path.join(self.root, self.stream, f"date={day}")
        os.makedirs(folder, exist_ok=True)
        self._fd = os.open(os.path.join(folder, f"part-{self._tag}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                           0o644)
        self._day = day
        if self.fsync:  # the new file's directory entry is durable too
            dir_fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return self._fd

    def append(self, record: dict[str, Any]) -> dict[str, Any]:
        """Writes `record` (an `id` and `time` are added when missing) durably; returns it."""
        record = {"id": uuid.uuid4().hex, "time": time.time(), **record}
        line = frame(record)
        with self._lock:
            day = _day(record["time"])
            fd = self._fd if day == self._day and self._fd is not None else self._open(day)
            written = os.write(fd, line)
            while written < len(line):  # a short write (rare; signals): finish the line
                written += os.write(fd, line[written:])
            if self.fsync:
                os.fsync(fd)
        return record

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def part_files(root: str, stream: str) -> list[str]:
    """The stream's part files, partitions in date order (`root` local or on object storage, where
    finished part files can be shipped with `rlvr.storage.upload_dir`)."""
    base = storage.join(root, stream)
    return [storage.join(base, day, name) for day in storage.listdir(base) if day.startswith("date=")
            for name in storage.listdir(storage.join(base, day)) if name.endswith(".jsonl")]


def read_file(path: str, stats: dict[str, int] | None = None) -> Iterator[dict[str, Any]]:
    """Intact records of one part file; a torn last line is dropped, a corrupt middle line logged."""
    stats = stats if stats is not None else {}
    lines = storage.read_bytes(path).splitlines(keepends=True)
    for i, line in enumerate(lines):
        record = unframe(line)
        if record is not None:
            yield record
        elif i == len(lines) - 1:
            stats["torn"] = stats.get("torn", 0) + 1
        else:
            stats["corrupt"] = stats.get("corrupt", 0) + 1
            logger.warning("%s line %d: corrupt record skipped", path, i + 1)


def read(root: str, stream: str, stats: dict[str, int] | None = None) -> Iterator[dict[str, Any]]:
    """Every intact record of `stream` once (deduplicated by `id`); `stats` counts torn, corrupt and
    duplicate lines."""
    stats = stats if stats is not None else {}
    seen: set[str] = set()
    for path in part_files(root, stream):
        for record in read_file(path, stats):
            if record.get("id") in seen:
                stats["duplicate"] = stats.get("duplicate", 0) + 1
                continue
            seen.add(record.get("id"))
            yield record
