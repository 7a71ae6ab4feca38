"""A lazily indexed JSONL file: byte offsets of its lines, found once, so any page opens by seeking.

`JsonlIndex.refresh` scans only the bytes appended since the last call (a run still writing keeps
growing its index; a rewritten, shorter file, as `observe.drop_metrics_after` leaves on resume, is
re-indexed from the start). A half-written last line is not indexed until its newline arrives.
`summaries` parses each line once, on the first filter, into the few fields filters need.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

CHUNK = 1 << 24  # bytes read per step of the newline scan and of the summary pass


class JsonlIndex:
    """Line `i` of `path` spans bytes `starts[i]:ends[i]` (blank lines are not lines)."""

    def __init__(self, path: str, summarize: Callable[[dict[str, Any]], dict[str, Any]]):
        self.path, self.summarize = path, summarize
        self.starts = np.zeros(0, np.int64)
        self.ends = np.zeros(0, np.int64)
        self.scanned = 0  # bytes of the file indexed (up to the last newline)
        self.summary_rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # the offsets (held briefly: a page never waits for a summary pass)
        self._summary_lock = threading.Lock()  # one summary pass at a time

    def __len__(self) -> int:
        return len(self.starts)

    def refresh(self) -> int:
        """Indexes the lines appended since the last call; returns the line count."""
        with self._lock:
            size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
            if size < self.scanned:  # rewritten: start again
                self.starts, self.ends = np.zeros(0, np.int64), np.zeros(0, np.int64)
                self.scanned, self.summary_rows = 0, []
            if size > self.scanned:
                self._scan(size)
            return len(self.starts)

    def _scan(self, size: int) -> None:
        starts, ends = [self.starts], [self.ends]
        line_start = self.scanned
        with open(self.path, "rb") as f:
            f.seek(self.scanned)
            position = self.scanned
            while position < size:
                chunk = f.read(min(CHUNK, size - position))
                if not chunk:
                    break
                newlines = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10).astype(np.int64) + position
                if len(newlines):
                    begin = np.concatenate([[line_start], newlines[:-1] + 1])
                    keep = newlines > begin  # not blank
                    starts.append(begin[keep])
                    ends.append(newlines[keep])
                    line_start = int(newlines[-1]) + 1
                position += len(chunk)
        self.starts, self.ends = np.concatenate(starts), np.concatenate(ends)
        self.scanned = line_start

    def read(self, i: int) -> dict[str, Any]:
        """Record `i` (a line that is not JSON reads as {"unreadable": its first 200 characters})."""
        with open(self.path, "rb") as f:
            f.seek(int(self.starts[i]))
            raw = f.read(int(self.ends[i] - self.starts[i]))
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return {"unreadable": raw[:200].decode("utf-8", "replace")}

    def read_many(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self.read(i) for i in indices]

    def summaries(self) -> list[dict[str, Any]]:
        """One summary per indexed line (parsed on first use, then only the new lines)."""
        self.refresh()
        with self._summary_lock:
            with self._lock:
                starts, ends, rows = self.starts, self.ends, self.summary_rows
            if len(rows) < len(starts):
                rows.extend(self._summarize_range(starts, ends, len(rows), len(starts)))
            return rows

    def _summarize_range(self, starts: np.ndarray, ends: np.ndarray, first: int, stop: int) -> list[dict[str, Any]]:
        out = []
        with open(self.path, "rb") as f:
            i = first
            while i < stop:
                j = int(np.searchsorted(ends, starts[i] + CHUNK, side="right"))
                j = min(max(j, i + 1), stop)
                base = int(starts[i])
                f.seek(base)
                block = f.read(int(ends[j - 1]) - base)
                for k in range(i, j):
                    raw = block[int(starts[k]) - base:int(ends[k]) - base]
                    try:
                        out.append(self.summarize(json.loads(raw)))
                    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                        out.append({"unreadable": True})
                i = j
        return out
