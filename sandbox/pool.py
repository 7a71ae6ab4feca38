"""A warm pool of gVisor sandboxes: `Pool(size, limits).run(...)` costs a fork per task, not a sandbox start.

Each warm sandbox is a long-lived `runsc run` whose pid 1 is the worker in zygote.py, talking to the host
over the sandbox's stdin/stdout. The sandbox has the same layout and limits as `api.run` (read-only root,
/usr read-only, size-capped /tmp, no network, cgroup memory/CPU, no device nodes), including /workspace:
a host tmpfs per warm sandbox, capped in size and inodes (`Limits.workspace_bytes`, `workspace_inodes`;
gVisor's own tmpfs ignores `nr_inodes` in this runsc version); the worker keeps a few capabilities inside gVisor
to reset the workspace and to drop each task's child (forked ahead of the task) to uid 1000 with no
capabilities and the task's rlimits. CPU is enforced by the host from the sandbox's cgroup; the wall
clock by the worker, with a host backstop that kills the whole sandbox.

Between tasks the worker wipes /workspace and /tmp and kills every process the task left. A sandbox is
*retired* (killed and deleted in the background, a fresh one started in its place) whenever anything
looks suspicious: a limit was hit, a process outlived its task, the protocol broke, the sandbox died.

A sandbox that dies under a task for no reason of the task's own (no limit explains it: killed from
outside, crashed; or found dead when taken from the idle queue) is retired like any other, and the task is
RE-RUN on another warm sandbox, at most `lost_retries` times; tasks are stateless, so the re-run is the same
task and only its result is returned (the trace records the lost sandboxes). Past that, `run` raises
`WorkerLost` (a `SandboxError`: the machinery failed, not the program) rather than returning a Result
that would be judged as the program's failure. A task that hit a limit is never re-run: its Result says
which limit. `lost` and `reruns` count these events; `busy()` names the sandboxes running a task.

Not protected (compared with a fresh sandbox per call, `api.run`): tasks in one sandbox share its kernel
state across time (e.g. the page cache), and a task's fork inherits the worker's memory. The worker keeps task
data out of it: the channel is read and written unbuffered, and every buffer that held a task's files, stdin,
output or workspace contents (read for the digest) is zeroed after use (tests/test_sandbox_pool.py scans a
task's own memory for the previous task's data). What stays is not the task's data: the parsed task header
(command, environment, limits, file names) and the hash state of the digest (the last < 64 bytes of each
workspace file). Expected outputs of verdicts never enter a sandbox at all; use `api.run` when tasks must
not learn anything of each other.

A Pool is an `executor.Executor` (`run(...) -> Result`, `close()`), the interface a remote worker implements
too (see executor.py). Templates (overlay workspaces) are `api.run`'s and `Episode`'s, not the pool's: its
workspace is wiped and refilled by the worker per task, where a template would be a full copy per task.
"""

from __future__ import annotations

import atexit
import json
import marshal
import os
import queue
import select
import shutil
import struct
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping, Sequence

from . import api, runsc, trace
from .types import CPU, DISK, MEMORY, WALL_TIME, Limits, Result, SandboxError, Timings

ZYGOTE_CAPS = ["CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER"]
STDIN_MAX = 1 << 16  # the worker writes a task's stdin in one go into the pipe buffer
_GRACE_S = 2.0  # host backstop beyond the worker's own wall-clock enforcement
_START_TIMEOUT_S = 30.0
_zygote_lock = threading.Lock()
_open_pools: weakref.WeakSet[Pool] = weakref.WeakSet()


@atexit.register
def _close_open_pools() -> None:
    """Warm sandboxes run in their own session and would outlive this process: close forgotten pools
    (registered after runsc's exit hook, so it runs first and the reaper then deletes them)."""
    for pool in list(_open_pools):
        pool.close()


class WorkerLost(SandboxError):
    """The warm sandbox stopped answering or died; `limit` names the reason when one is known."""

    def __init__(self, message: str, limit: str | None = None):
        super().__init__(message)
        self.limit = limit


def _zygote_dir() -> str:
    """A directory holding only zygote.py, bound read-only at /harness inside every pool sandbox."""
    directory = os.path.join(runsc.home(), "zygote")
    with _zygote_lock:
        if not os.path.isdir(directory):
            os.makedirs(directory, 0o755)
            shutil.copy(os.path.join(os.path.dirname(__file__), "zygote.py"), directory)
    return directory


def _worker_config(limits: Limits, workspace: str) -> dict:
    """The OCI spec of a warm sandbox: like api.run's (the same capped host workspace, which the worker wipes
    between tasks), but pid 1 is the worker, uid 0 with ZYGOTE_CAPS."""
    config = runsc.oci_config([api.PYTHON, "-I", "-S", "-B", "/harness/zygote.py"], workspace, limits,
                              ro_binds={"/harness": _zygote_dir()})
    process = config["process"]
    process["user"] = {"uid": 0, "gid": 0}
    process["cwd"] = "/"
    process["capabilities"] = {k: list(ZYGOTE_CAPS) for k in ("bounding", "effective", "permitted")}
    process["rlimits"] = [r for r in process["rlimits"] if r["type"] != "RLIMIT_CPU"]  # the worker lives long
    return config


class Worker:
    """One warm sandbox and its channel."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.cid = runsc.new_id("rlvr-pool")
        self.ws = api.new_workspace(limits, "runsc")
        try:
            bundle = runsc.write_bundle(self.cid, _worker_config(limits, self.ws.path))
            self.proc = subprocess.Popen(runsc.runsc_argv("run", "--bundle", bundle, self.cid),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
        except BaseException:
            self.ws.close()
            raise
        self.watch = runsc.CgroupWatch(self.cid, limits)
        self.tasks = 0
        self.task_cpu_s = 0.0  # CPU seconds of the sandbox (its cgroup) during the last task
        try:
            deadline = time.monotonic() + _START_TIMEOUT_S
            greeting, _ = self._read_frame(deadline), self._read_frame(deadline)
            if greeting != b'{"ready": true}':
                raise WorkerLost(f"the pool worker sent an unexpected greeting: {greeting[:200]!r}")
        except BaseException:
            self.retire()
            raise

    def task(self, header: dict, payload: bytes, wall_s: float, cpu_s: float) -> tuple[dict, bytes]:
        """Send one task, wait for its reply (host backstops: wall clock + grace, CPU from the cgroup)."""
        body = marshal.dumps(header, 4)  # the worker avoids importing json (see zygote.py)
        try:
            self.proc.stdin.write(struct.pack(">Q", len(body)) + body + struct.pack(">Q", len(payload)) + payload)
            self.proc.stdin.flush()
        except OSError as e:
            raise WorkerLost(f"cannot write to the pool worker: {e}") from None
        deadline = time.monotonic() + wall_s + _GRACE_S
        cpu_start = runsc.cpu_seconds(self.cid)
        cpu_limit = cpu_start + cpu_s + runsc.CPU_BOOT_S
        try:
            reply = json.loads(self._read_frame(deadline, cpu_limit))
            data = self._read_frame(deadline, cpu_limit)
        except ValueError:
            raise WorkerLost("the pool worker sent a malformed reply") from None
        finally:
            self.task_cpu_s = max(runsc.cpu_seconds(self.cid) - cpu_start, 0.0)
        self.tasks += 1
        return reply, data

    def _read_frame(self, deadline: float, cpu_limit: float | None = None) -> bytes:
        size = struct.unpack(">Q", self._read_exact(8, deadline, cpu_limit))[0]
        return self._read_exact(size, deadline, cpu_limit)

    def _read_exact(self, n: int, deadline: float, cpu_limit: float | None) -> bytes:
        fd, chunks, got = self.proc.stdout.fileno(), [], 0
        while got < n:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready:
                chunk = os.read(fd, n - got)
                if not chunk:
                    self.watch.poll()
                    raise WorkerLost("the pool sandbox died", MEMORY if self.watch.near_memory_limit() else None)
                chunks.append(chunk)
                got += len(chunk)
                continue
            self.watch.poll()
            if time.monotonic() > deadline:
                raise WorkerLost("the pool worker did not answer in time", WALL_TIME)
            if cpu_limit is not None and runsc.cpu_seconds(self.cid) > cpu_limit:
                raise WorkerLost("the task used more CPU than allowed", CPU)
        return b"".join(chunks)

    def retire(self) -> None:
        """Kill the sandbox now; its deletion, cgroups and workspace go to the background reaper."""
        runsc.kill(self.cid)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        runsc.REAPER.submit(self.cid, self.ws)


def _clamp(task: Limits, pool: Limits) -> Limits:
    """A task's limits, never above the pool sandbox's (the worker cannot raise its own hard rlimits)."""
    fields = ("memory_bytes", "nproc", "nofile", "file_bytes", "output_bytes")
    return Limits(**{**task.to_json(), **{f: min(getattr(task, f), getattr(pool, f)) for f in fields}})


class Pool:
    """`size` warm gVisor sandboxes; `run(...)` like `api.run`, one task per sandbox at a time, thread-safe."""

    def __init__(self, size: int, limits: Limits | None = None, trace_path: str | None | bool = None,
                 lost_retries: int = 2):
        if lost_retries < 0:
            raise ValueError(f"lost_retries must be >= 0 (re-runs of a task whose sandbox died), got {lost_retries}")
        runsc.probe()
        self.limits = limits or Limits()
        self.trace_path = trace_path
        self.lost_retries = lost_retries
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._closed = False
        self._live: set[Worker] = set()
        self._busy: set[Worker] = set()
        self._lock = threading.Lock()
        self.retired = 0
        self.lost = 0  # task attempts whose sandbox died under them (no limit hit)
        self.reruns = 0  # of which re-run on another sandbox
        self.start_error: Exception | None = None
        self._threads: list[threading.Thread] = []
        _open_pools.add(self)
        starters = [threading.Thread(target=self._start_one, daemon=True) for _ in range(size)]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if self._idle.qsize() < size:
            self.close()
            raise SandboxError(f"only {self._idle.qsize()} of {size} pool sandboxes started: {self.start_error!r}")

    def _start_one(self) -> None:
        try:
            worker = Worker(self.limits)
        except Exception as e:  # noqa: BLE001 - a failed start shows as a short pool, checked by the caller
            self.start_error = e
            return
        with self._lock:
            if self._closed:
                worker.retire()
                return
            self._live.add(worker)
        self._idle.put(worker)

    def _retire(self, worker: Worker) -> None:
        """Retire in the background and start a replacement."""
        with self._lock:
            self._live.discard(worker)
            self.retired += 1

        def replace() -> None:
            worker.retire()
            if not self._closed:
                self._start_one()

        thread = threading.Thread(target=replace, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def idle(self) -> int:
        """How many sandboxes are warm and free now (replacements still starting are not)."""
        return self._idle.qsize()

    def busy(self) -> list[str]:
        """Container ids of the sandboxes running a task now (monitoring; tests kill one)."""
        with self._lock:
            return sorted(w.cid for w in self._busy)

    def run(self, command: Sequence[str] | None = None, *, python: str | None = None,
            files: Mapping[str, bytes | str] | None = None, stdin: bytes = b"", env: Mapping[str, str] | None = None,
            limits: Limits | None = None, tag: str | None = None, timeout_s: float = 60.0) -> Result:
        """Run one task in a warm sandbox (see `api.run`); waits up to `timeout_s` for a free one. A task
        whose sandbox died under it is re-run elsewhere (see the module doc); `WorkerLost` past
        `lost_retries` re-runs."""
        if self._closed:
            raise SandboxError("the pool is closed")
        if len(stdin) > STDIN_MAX:
            raise ValueError(f"pool tasks take at most {STDIN_MAX} bytes of stdin (one pipe buffer); pass a file")
        argv, inputs = api.build_command(command, python, files)
        task_limits = _clamp(limits or self.limits, self.limits)
        lost: list[str] = []
        while True:
            queued = time.perf_counter()
            worker = self._take(timeout_s)
            try:
                result, died = self._on(worker, argv, python is not None, inputs, stdin, env, task_limits,
                                        time.perf_counter() - queued)
            finally:
                with self._lock:
                    self._busy.discard(worker)
            if not died:
                break
            lost.append(worker.cid)
            with self._lock:
                self.lost += 1
                if len(lost) > self.lost_retries:
                    break
                self.reruns += 1
        if self.trace_path is not False:
            entry = trace.record(argv, inputs, stdin, task_limits, result, env, tag, {})
            if lost:
                entry["lost_sandboxes"] = lost
            trace.append(self.trace_path or trace.default_path(), entry)
        if died:
            raise WorkerLost(f"the pool sandbox died under the task {len(lost)} time(s) (no limit hit; sandboxes "
                             f"{', '.join(lost)}): {result.text('stderr')}")
        return result

    def _take(self, timeout_s: float) -> Worker:
        """An idle live worker, marked busy (one found dead while idle is retired and replaced)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._closed:
                raise SandboxError("the pool is closed")
            try:
                worker = self._idle.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SandboxError(f"no pool sandbox became free within {timeout_s} s") from None
            if worker.proc.poll() is None:
                with self._lock:
                    self._busy.add(worker)
                return worker
            self._retire(worker)

    def _on(self, worker: Worker, argv: list[str], is_python: bool, inputs: dict[str, bytes], stdin: bytes,
            env: Mapping[str, str] | None, limits: Limits, queue_s: float) -> tuple[Result, bool]:
        """One task on one worker: (its Result, whether the sandbox died under it with no limit to blame).
        The worker goes back to the idle queue, or is retired when suspicious. Timings: queue (waiting for
        a free sandbox), start (host-side framing), run (the round trip: reset, fork, the task, the reply)."""
        dequeued = time.perf_counter()
        names = sorted(inputs)
        environment = {"PATH": runsc.PATH_ENV, "LANG": "C.UTF-8", "HOME": "/workspace",
                       "PYTHONIOENCODING": "utf-8", **(env or {})}
        header = {"argv": argv, "python": is_python, "env": environment, "stdin_size": len(stdin),
                  "files": [[n, len(inputs[n])] for n in names],
                  "limits": {"wall_s": limits.wall_s, "output_bytes": limits.output_bytes,
                             "rlimits": [list(r) for r in limits.rlimits(cpu=False)]}}
        sent = time.perf_counter()
        try:
            reply, data = worker.task(header, b"".join(inputs[n] for n in names) + stdin, limits.wall_s,
                                      limits.cpu_s)
        except WorkerLost as e:
            self._retire(worker)
            return Result("runsc-pool", None, 9, b"", str(e).encode(), limit_hit=e.limit,
                          timings=Timings(queue_s, 0.0, time.perf_counter() - sent), sandbox_id=worker.cid,
                          cpu_s=worker.task_cpu_s), e.limit is None
        out, err = data[: reply["stdout_size"]], data[reply["stdout_size"]:]
        hit = reply["limit_hit"] or _evidence(err, worker)  # before the worker is reused (it wipes the workspace)
        if reply["limit_hit"] or reply["leftover"]:
            self._retire(worker)
        else:
            self._idle.put(worker)
        return Result("runsc-pool", reply["exit_code"], reply["signal"], out, err,
                      reply["limit_hit"] == "output" and len(out) >= limits.output_bytes,
                      reply["limit_hit"] == "output" and len(err) >= limits.output_bytes, hit,
                      Timings(queue_s, sent - dequeued, time.perf_counter() - sent),
                      reply["digest_before"], reply["digest_after"], worker.cid, worker.task_cpu_s), False

    def close(self) -> None:
        """Kill every sandbox; their deletion is queued on the reaper (`runsc.REAPER.drain()` waits)."""
        with self._lock:
            self._closed = True
            live, self._live = list(self._live), set()
            threads = list(self._threads)
        for worker in live:
            worker.retire()
        for thread in threads:  # retirements and replacements in flight (a late replacement retires itself)
            thread.join(timeout=_START_TIMEOUT_S + 15)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _evidence(stderr: bytes, worker: Worker) -> str | None:
    """A limit the task ran into without the worker stopping it: memory (a MemoryError), or the workspace
    (under 1 % of its bytes or inodes left)."""
    if b"MemoryError" in stderr[-4096:]:
        return MEMORY
    return DISK if min(worker.ws.free_fraction()) < 0.01 else None
