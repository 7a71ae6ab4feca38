"""Run one launcher process with harness-enforced limits: wall clock and output size.

The program inside may flood its output or never exit; the harness reads each stream up to a cap (the
rest is drained into nothing after the kill), and a timer calls the backend's `kill` when the wall clock
runs out. Reading happens in threads, so a flood on stderr cannot block stdout.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from .types import OUTPUT, WALL_TIME


@dataclasses.dataclass
class Captured:
    returncode: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    killed_for: str | None  # WALL_TIME or OUTPUT when the harness killed the run
    run_s: float
    cpu_s: float | None = None  # user + system CPU seconds of the launcher and its reaped children


class _Stream(threading.Thread):
    """Reads a pipe, keeping the first `cap` bytes; calls `on_overflow` once when more arrives."""

    def __init__(self, pipe, cap: int, on_overflow: Callable[[], None]):
        super().__init__(daemon=True)
        self.pipe, self.cap, self.on_overflow = pipe, cap, on_overflow
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False

    def run(self) -> None:
        while chunk := self.pipe.read1(1 << 16):
            keep = chunk[: max(self.cap - self.size, 0)]
            if keep:
                self.chunks.append(keep)
                self.size += len(keep)
            if len(keep) < len(chunk) and not self.truncated:
                self.truncated = True
                self.on_overflow()
        self.pipe.close()

    def data(self) -> bytes:
        return b"".join(self.chunks)


class _Killer:
    """Calls `kill` at most once, recording why."""

    def __init__(self, kill: Callable[[], None]):
        self._kill, self._lock, self.reason = kill, threading.Lock(), None

    def __call__(self, reason: str) -> None:
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
        self._kill()


def capture(argv: Sequence[str], kill: Callable[[subprocess.Popen], None], wall_s: float, output_cap: int,
            stdin: bytes = b"", cwd: str | None = None, env: dict[str, str] | None = None,
            poll: Callable[[], str | None] | None = None) -> Captured:
    """Run argv to completion under the wall-clock and output caps; `kill(proc)` stops the whole sandbox.

    `poll`, called every 50 ms while the process runs, may name a limit to kill for (the runsc backend
    reads the sandbox's cgroup: gVisor does not enforce RLIMIT_CPU, so the harness does)."""
    start = time.perf_counter()
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cwd, env=env, start_new_session=True)
    killer = _Killer(lambda: kill(proc))
    streams = [_Stream(proc.stdout, output_cap, lambda: killer(OUTPUT)),
               _Stream(proc.stderr, output_cap, lambda: killer(OUTPUT))]
    for s in streams:
        s.start()
    threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
    reason, cpu_s = _watch(proc, start + wall_s, poll)
    if reason:
        killer(reason)
        cpu_s = _reap(proc)
    run_s = time.perf_counter() - start
    for s in streams:
        s.join(timeout=5.0)  # EOF follows the kill; a stuck reader is a daemon thread and is abandoned
    out, err = streams
    return Captured(proc.returncode, out.data(), err.data(), out.truncated, err.truncated, killer.reason, run_s,
                    cpu_s)


def _watch(proc: subprocess.Popen, deadline: float,
           poll: Callable[[], str | None] | None) -> tuple[str | None, float | None]:
    """Wait for the process: (the limit it ran into (WALL_TIME, or one `poll` named), None) while it runs
    on, or (None, the CPU seconds it used) once it exited."""
    step = 0.05 if poll else None
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return WALL_TIME, None
        cpu_s = _wait(proc, min(left, step) if step else left)
        if cpu_s is not None:
            return None, cpu_s
        if poll and (reason := poll()):
            return reason, None


def _reap(proc: subprocess.Popen, grace_s: float = 10.0) -> float:
    """Wait for the launcher; if the backend's kill did not stop it within the grace, SIGKILL its group.
    The CPU seconds it used."""
    cpu_s = _wait(proc, grace_s)
    if cpu_s is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        cpu_s = _wait(proc, None)
    return cpu_s


def _wait(proc: subprocess.Popen, timeout: float | None) -> float | None:
    """Reap the process with os.wait4 (Popen.wait drops its rusage) within `timeout` seconds (None: for as
    long as it takes): the user + system CPU seconds it and its reaped children used, or None if still running."""
    deadline = None if timeout is None else time.perf_counter() + timeout
    delay = 0.0005
    while True:
        pid, status, usage = os.wait4(proc.pid, 0 if deadline is None else os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        left = deadline - time.perf_counter()
        if left <= 0:
            return None
        time.sleep(min(delay, left))
        delay = min(2 * delay, 0.05)


def _feed(pipe, data: bytes) -> None:
    """Write stdin and close it; a program that exits without reading it is not an error."""
    try:
        if data:
            pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):
        pass
