"""The worker that lives inside a warm gVisor sandbox (pid 1) and runs each task in a fresh forked child.

Runs under Debian's python3 inside the sandbox (stdlib only; never imported by the host package). It is
uid 0 *inside gVisor* with only CAP_SETUID, SETGID, KILL, CHOWN, DAC_OVERRIDE and FOWNER (needed to wipe
and refill the workspace and to drop each child to uid 1000); the child has no capabilities, so it
cannot signal, ptrace or read the memory of this worker, nor write to its channel. gVisor, not this
worker, is the boundary to the host.

Per task: wipe /workspace and /tmp, write the task's files, hand the task to a child forked ahead of it
(`Spare`), which drops to uid 1000 with rlimits and either execs argv or runs Python source in-process
(no interpreter start: a fork, ~10 ms under ptrace, is the per-task cost); collect its output up to a
cap, enforce the wall clock, then SIGKILL every other process in the sandbox (kill(-1) from pid 1) and
reap them; any survivor marks the task "leftover".

Protocol on stdin/stdout: frames of an 8-byte big-endian length and a body. Host -> worker: a marshal
header {argv | python, env, limits, files: [[name, size]], stdin_size} (marshal: builtin, and the host is
trusted) then one raw frame with the file bytes and stdin concatenated. Worker -> host: a JSON header
(status, limit hit, sizes, digests, timings; parsed safely by the host) then one raw frame with stdout +
stderr. The channel is read and written unbuffered (os.readv/os.write), and every buffer that held task data
(frames, output chunks, the file-read buffer of the digest) is zeroed after use: each later task is a fork of
this process and could read its memory.
"""

import gc
import io
import marshal
import os
import resource
import select
import signal
import stat
import struct
import sys
import time
import types

try:  # the builtin module: hashlib would map OpenSSL into the worker, and every fork copies its mappings
    from _sha256 import sha256
except ImportError:
    from hashlib import sha256

UID = 1000
WORKSPACE = "/workspace"
CHANNEL_IN, CHANNEL_OUT = 0, 1  # read and written unbuffered: no stdio buffer keeps a copy of task data
WAKE = os.pipe()  # written by the SIGCHLD handler (signal.set_wakeup_fd)


def to_json(value):
    """JSON for the reply (dicts, lists, str, int, float, bool, None): the json module imports re, and every
    module the worker imports makes each fork dearer."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else f"\\u{ord(c):04x}" for c in value) + '"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{to_json(str(k))}: {to_json(v)}" for k, v in value.items()) + "}"
    return "[" + ", ".join(to_json(v) for v in value) + "]"


def read_exact(n):
    buf = bytearray(n)
    with memoryview(buf) as view:
        got = 0
        while got < n:
            k = os.readv(CHANNEL_IN, [view[got:]])
            if not k:
                raise EOFError
            got += k
    return buf


def read_frame():
    return read_exact(struct.unpack(">Q", read_exact(8))[0])


def write_all(data):
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            done += os.write(CHANNEL_OUT, view[done:])


def send(header, chunks=()):
    """The reply: a JSON header frame, then one frame of the concatenated `chunks` (written as they are)."""
    body = to_json(header).encode()
    write_all(struct.pack(">Q", len(body)) + body + struct.pack(">Q", sum(len(c) for c in chunks)))
    for chunk in chunks:
        write_all(chunk)


def scrub(buffers):
    """Zero buffers that held task data: a later task's fork inherits this worker's memory (see pool.py)."""
    for buf in buffers:
        buf[:] = bytes(len(buf))


def wipe(top):
    for name in os.listdir(top):
        path = os.path.join(top, name)
        if os.path.isdir(path) and not os.path.islink(path):
            wipe(path)
            try:
                os.rmdir(path)
            except OSError:
                pass
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def write_files(files, payload):
    view, at = memoryview(payload), 0
    for name, size in files:
        path = os.path.join(WORKSPACE, name)
        make_dirs(os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        done = 0
        while done < size:
            done += os.write(fd, view[at + done:at + size])
        os.fchown(fd, UID, UID)
        os.close(fd)
        at += size
    return at


def make_dirs(directory):
    """Create missing parent directories inside the workspace, owned by the task's uid."""
    if directory == WORKSPACE or os.path.isdir(directory):
        return
    make_dirs(os.path.dirname(directory))
    os.mkdir(directory, 0o755)
    os.chown(directory, UID, UID)


def digest(top=WORKSPACE):
    """The same tree digest as the host's workspace.tree_digest (path, type, mode, size, content sha256)."""
    h = sha256()
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            rel = os.path.relpath(full, top)
            h.update(f"{rel}\0{stat.S_IFMT(st.st_mode)}\0{st.st_mode & 0o7777}\0{st.st_size}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(full).encode(errors="replace"))
            elif stat.S_ISREG(st.st_mode):
                h.update(file_sha256(full))
    return h.hexdigest()


READ_BUF = bytearray(1 << 16)  # file contents pass through here only, zeroed after each file


def file_sha256(path):
    content = sha256()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return content.digest()
    try:
        with memoryview(READ_BUF) as view:
            while n := os.readv(fd, [view]):
                content.update(view[:n])
    except OSError:
        pass
    finally:
        os.close(fd)
        scrub([READ_BUF])
    return content.digest()


def child(task, fds):
    """In the forked child: become uid 1000 with rlimits, wire stdio, then exec argv or run the source."""
    stdin_r, out_w, err_w = fds
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    os.setgroups([])
    os.setresgid(UID, UID, UID)
    os.setresuid(UID, UID, UID)
    for name, soft, hard in task["limits"]["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.dup2(stdin_r, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.closerange(3, 1 << 16)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL if sig == signal.SIGPIPE else signal.SIG_IGN)
    os.chdir(WORKSPACE)
    env = task["env"]
    if task.get("python"):
        run_python(env)
    os.execvpe(task["argv"][0], task["argv"], env)


def run_python(env):
    """`python3 -I -B main.py` without starting an interpreter: a fresh __main__, fresh stdio objects."""
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=False)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)
    sys.argv = ["main.py"]
    main = types.ModuleType("__main__")
    main.__file__ = WORKSPACE + "/main.py"
    sys.modules["__main__"] = main
    code = 0
    try:
        with open("main.py", "rb") as f:
            source = f.read()
        exec(compile(source, main.__file__, "exec"), main.__dict__)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.__excepthook__(*sys.exc_info())  # CPython's C traceback printer: no traceback module
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        code = code or 120
    os._exit(code & 0xFF)


def drain(fd):
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def kill_others():
    """SIGKILL every process but this one (pid 1) and reap them; True if any was left. Every orphan is
    re-parented to pid 1, so "we still have children" is "something outlived its task" (one syscall)."""
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return False
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.002)
    return True


def collect(pid, fds, limits, started):
    """Read the child's output (capped) until it exits or a limit hits: (status, stdout chunks, stderr chunks,
    limit hit). Output passes through READ_BUF into exact-size bytearrays (no intermediate copies), which
    run_task zeroes once they are sent."""
    cap, deadline = limits["output_bytes"], started + limits["wall_s"]
    poller = select.poll()
    chunks = {fds[0]: [], fds[1]: []}
    sizes = dict.fromkeys(chunks, 0)
    open_fds = set(chunks)
    for fd in (*chunks, WAKE[0]):  # SIGCHLD writes to WAKE: the poll wakes at the child's exit, no polling delay
        poller.register(fd, select.POLLIN)
    status, hit, exited_at = None, None, None
    with memoryview(READ_BUF) as view:
        while hit is None:
            timeout_ms = int(1000 * min(max(deadline - time.monotonic(), 0.0), 0.5))
            for fd, _ in poller.poll(timeout_ms):
                if fd == WAKE[0]:
                    drain(WAKE[0])
                    continue
                n = os.readv(fd, [view])
                if not n:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                    continue
                keep = min(n, max(cap - sizes[fd], 0))
                if keep:
                    chunks[fd].append(bytearray(view[:keep]))
                    sizes[fd] += keep
                if n > keep:
                    hit = "output"
            if status is None:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status, exited_at = st, time.monotonic()
            now = time.monotonic()
            if status is not None and (not open_fds or now - exited_at > 0.05):
                break
            if hit is None and now > deadline:
                hit = "wall_time"
    scrub([READ_BUF])
    return status, chunks[fds[0]], chunks[fds[1]], hit


class Spare:
    """A child forked ahead of its task (the fork, ~10-15 ms here, leaves the request path). It waits,
    still privileged but running nothing of the task, until its task header arrives on `ctl`."""

    def __init__(self):
        ctl_r, self.ctl = os.pipe()
        stdin_r, self.stdin = os.pipe()
        self.out, out_w = os.pipe()
        self.err, err_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (self.ctl, self.stdin, self.out, self.err, CHANNEL_IN, CHANNEL_OUT):
                    os.close(fd)
                header = marshal.loads(os.fdopen(ctl_r, "rb").read() or marshal.dumps(None))
                if header is not None:
                    child(header, (stdin_r, out_w, err_w))
            finally:
                os._exit(127)
        for fd in (ctl_r, stdin_r, out_w, err_w):
            os.close(fd)

    def start(self, header):
        os.write(self.ctl, marshal.dumps(header, 4))  # a small header: fits the pipe buffer
        os.close(self.ctl)


def run_task(spare, header, payload):
    t0 = time.monotonic()
    wipe(WORKSPACE)
    wipe("/tmp")
    stdin_at = write_files(header["files"], payload)
    feed(spare.stdin, payload, stdin_at)  # into the pipe buffer before the task starts
    scrub([payload])
    before = digest()
    started = time.monotonic()
    spare.start({"argv": header["argv"], "python": header["python"], "env": header["env"],
                 "limits": header["limits"]})
    status, out, err, hit = collect(spare.pid, (spare.out, spare.err), header["limits"], started)
    run_s = time.monotonic() - started
    t1 = time.monotonic()
    leftover = kill_others()
    for fd in (spare.out, spare.err):
        os.close(fd)
    code = os.waitstatus_to_exitcode(status if status is not None else signal.SIGKILL)  # None: killed above
    t2 = time.monotonic()
    after = digest()
    phases = {"reset_ms": (started - t0) * 1e3, "task_ms": run_s * 1e3, "sweep_ms": (t2 - t1) * 1e3,
              "digest_ms": (time.monotonic() - t2) * 1e3}
    reply = {"exit_code": code if code >= 0 else None, "signal": -code if code < 0 else None, "limit_hit": hit,
             "leftover": leftover and hit is None, "stdout_size": sum(map(len, out)),
             "stderr_size": sum(map(len, err)), "digest_before": before, "digest_after": after, "run_s": run_s,
             "phases": {k: round(v, 2) for k, v in phases.items()}}
    send(reply, out + err)
    scrub(out + err)


def feed(fd, payload, start):
    """Write stdin, `payload[start:]` (small: the pipe buffer holds 64 KiB; more is written best-effort), and close
    the pipe."""
    try:
        os.set_blocking(fd, False)
        with memoryview(payload) as view:
            if len(view) > start:
                os.write(fd, view[start:])
    except OSError:
        pass
    os.close(fd)


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for fd in WAKE:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(WAKE[1])
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    os.chown(WORKSPACE, UID, UID)
    gc.freeze()  # the worker's objects join a permanent generation: a child's GC never touches (copies) them
    spare = Spare()
    send({"ready": True})
    while True:
        try:
            frame = read_frame()
            header = marshal.loads(frame)
            scrub([frame])
            payload = read_frame()
        except EOFError:
            os._exit(0)
        run_task(spare, header, payload)
        spare = Spare()  # forked while the host reads the reply and sends the next task


if __name__ == "__main__":
    main()
