"""The gVisor backend: one fresh `runsc run` sandbox per call, from a generated OCI bundle.

Layout inside (see ../shared/specs/sandbox-gvisor.md §1): a tiny read-only root (no host /etc, /root or
/home), `/usr` bound read-only (Debian's python3 and stdlib), a size-capped tmpfs `/tmp`, `/workspace` bound
to the per-call host tmpfs, optional read-only binds (the verdict harness), `--network=none`, uid 1000, no
capabilities, noNewPrivileges, rlimits (NPROC caps processes and threads per sandbox; AS, NOFILE, FSIZE,
CPU, CORE=0) and cgroup memory/CPU limits (pids only as a high backstop: a low one crashes the sentry).

A seccomp filter (OCI `linux.seccomp`, loaded by gVisor with `--oci-seccomp`) makes mknod/mknodat of
character and block devices fail with EPERM for every process in the sandbox: gVisor's own tmpfs (`/tmp`,
the pool's workspace) would otherwise let uid 1000 create device nodes (FIFOs and sockets stay allowed).

Every runsc invocation has a timeout (the kvm platform hangs on machines without VT-x; so can a wedged
sentry). Teardown (`runsc delete --force`, ~1.7 s, and the empty cgroup directories runsc leaves after
kills) runs in a background reaper thread, off the request path; `drain()` waits for it (atexit too).
Everything of this process (runsc state, bundles, workspaces) lives under one directory named after its
pid and start time (`home()`), so sandboxes left by a killed process are found and removed by the next
one's first sandbox, or by `python -m rlvr.sandbox.cleanup` (cleanup.py).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .capture import Captured, capture
from .types import CPU, MEMORY, Limits, SandboxUnavailable
from .workspace import SANDBOX_UID, Workspace

PLATFORM = os.environ.get("RLVR_RUNSC_PLATFORM", "ptrace")  # "kvm" hangs without VT-x; systrap on newer runsc
PYTHON = "/usr/bin/python3"  # Debian's interpreter under the read-only /usr bind
PATH_ENV = "/usr/local/bin:/usr/bin:/bin"
_CALL_TIMEOUT_S = 30.0
CPU_BOOT_S = 0.5  # CPU the sandbox's own boot and Python start use; granted on top of Limits.cpu_s
_CGROUP_ROOT = "/sys/fs/cgroup"
_INSTALL_HINT = "install gVisor as root: apt-get install -y runsc"

# Called once, before this process's first sandbox (`probe`): the package puts cleanup.py's reaping of the
# sandboxes that killed processes left here (cleanup drives runsc, so runsc does not import it).
BEFORE_FIRST_SANDBOX: list[Callable[[], None]] = []

_counter = itertools.count()
_lock = threading.Lock()
_home: str | None = None
_probed: bool = False


def start_ticks(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22); None if no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])  # fields after the command name, which may hold spaces


def owner_tag(pid: int | None = None) -> str:
    """`<pid>-<start ticks>` of this process (or `pid`): the owner part of a sandbox directory's name."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{start_ticks(pid)}"


def processes_naming(directory: str) -> list[int]:
    """Host pids (not this one) whose command line names a path inside `directory`."""
    mine, pids = directory.rstrip("/").encode() + b"/", []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if mine in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def mounts_under(directory: str) -> list[str]:
    """Mount points at or below `directory`, deepest first."""
    prefix = directory.rstrip("/") + "/"
    try:
        with open("/proc/mounts") as f:
            points = [line.split()[1].replace("\\040", " ") for line in f]
    except OSError:
        return []
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)


def home() -> str:
    """This process's private directory, `<tmp>/rlvr-sandbox-<pid>-<start time>-<random>` (its owner, for
    cleanup.py): runsc state (`--root`), the shared read-only rootfs, bundles, workspaces."""
    global _home
    with _lock:
        if _home is None:
            _home = tempfile.mkdtemp(prefix=f"rlvr-sandbox-{owner_tag()}-")
            os.chmod(_home, 0o711)
            os.mkdir(os.path.join(_home, "state"), 0o700)
            os.mkdir(os.path.join(_home, "workspaces"), 0o711)
            _make_rootfs(os.path.join(_home, "rootfs"))
        return _home


def workspaces_dir() -> str:
    """Where this process's workspaces are made (traversable by the sandbox uids, not listable)."""
    return os.path.join(home(), "workspaces")


def state_root() -> str:
    return os.path.join(home(), "state")


def _make_rootfs(root: str) -> None:
    """The minimal read-only root: mount points, merged-/usr links, and an /etc with passwd and group only."""
    for d in ("proc", "dev", "usr", "tmp", "workspace", "harness", "etc"):
        os.makedirs(os.path.join(root, d), 0o755)
    for link in ("bin", "lib", "lib64", "sbin"):
        os.symlink(f"usr/{link}", os.path.join(root, link))
    with open(os.path.join(root, "etc", "passwd"), "w") as f:
        f.write(f"root:x:0:0::/:/bin/false\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::/workspace:/bin/false\n")
    with open(os.path.join(root, "etc", "group"), "w") as f:
        f.write(f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n")


def runsc_binary() -> str:
    """The runsc path; SandboxUnavailable (with the install command) when it is missing."""
    path = shutil.which("runsc")
    if path is None:
        raise SandboxUnavailable(f"the runsc backend needs gVisor's `runsc` on PATH; it was not found. {_INSTALL_HINT} "
                                 "(or choose backend='bwrap'/'process' for development only)")
    return path


def runsc_argv(*args: str, root: str | None = None) -> list[str]:
    """`runsc --root <ours> --platform=… --network=none --oci-seccomp <args>`: only ever our own containers
    (`root`: another state root, for cleanup.py's orphans)."""
    return [runsc_binary(), "--root", root or state_root(), f"--platform={PLATFORM}", "--network=none",
            "--oci-seccomp", *args]


def _device_rule(syscall: str, mode_arg: int, kind: int) -> dict[str, Any]:
    return {"names": [syscall], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,  # EPERM
            "args": [{"index": mode_arg, "value": 0o170000, "valueTwo": kind, "op": "SCMP_CMP_MASKED_EQ"}]}


# mknod(path, mode, dev) / mknodat(dirfd, path, mode, dev) of a character or block device: EPERM
SECCOMP = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"],
           "syscalls": [_device_rule(call, arg, kind) for call, arg in (("mknod", 1), ("mknodat", 2))
                        for kind in (0o020000, 0o060000)]}


def new_id(prefix: str = "rlvr") -> str:
    """A container id unique on the host; it names the cgroup directories too."""
    return f"{prefix}-{os.getpid()}-{next(_counter)}-{secrets.token_hex(3)}"


def _mounts(workspace: str | None, limits: Limits, ro_binds: Mapping[str, str]) -> list[dict[str, Any]]:
    """OCI mounts; `workspace` None: /workspace is a size-capped tmpfs inside the sentry (the pool's)."""
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "noexec", "size=65536"]},
        {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro", "nosuid", "nodev"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": [f"size={int(limits.tmp_bytes)}", "mode=1777", "nosuid", "nodev"]},
        {"destination": "/workspace", "type": "bind", "source": workspace,
         "options": ["rbind", "rw", "nosuid", "nodev"]} if workspace else
        {"destination": "/workspace", "type": "tmpfs", "source": "tmpfs",
         "options": [f"size={int(limits.workspace_bytes)}", "mode=0755", "nosuid", "nodev"]},
    ]
    for dest, source in ro_binds.items():
        mounts.append({"destination": dest, "type": "bind", "source": source,
                       "options": ["rbind", "ro", "nosuid", "nodev"]})
    return mounts


def oci_config(argv: Sequence[str], workspace: str | None, limits: Limits, env: Mapping[str, str] | None = None,
               ro_binds: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The OCI runtime spec of one sandbox running `argv` in /workspace as uid 1000 with no privileges."""
    caps: dict[str, list[str]] = {k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")}
    environment = {"PATH": PATH_ENV, "LANG": "C.UTF-8", "HOME": "/workspace", "PYTHONIOENCODING": "utf-8",
                   **(env or {})}
    memory = int(limits.memory_bytes + limits.sandbox_overhead_bytes)
    rlimits = [{"type": name, "soft": soft, "hard": hard} for name, soft, hard in limits.rlimits()]
    return {
        "ociVersion": "1.0.2",
        "root": {"path": os.path.join(home(), "rootfs"), "readonly": True},
        "hostname": "sandbox",
        "process": {"user": {"uid": SANDBOX_UID, "gid": SANDBOX_UID}, "args": list(argv), "cwd": "/workspace",
                    "env": [f"{k}={v}" for k, v in environment.items()], "capabilities": caps,
                    "noNewPrivileges": True, "rlimits": rlimits},
        "mounts": _mounts(workspace, limits, ro_binds or {}),
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                  "seccomp": SECCOMP,
                  "resources": {"memory": {"limit": memory, "swap": memory},
                                "cpu": {"quota": int(limits.cpus * 100_000), "period": 100_000},
                                "pids": {"limit": 4096}}},
    }


def write_bundle(cid: str, config: dict[str, Any]) -> str:
    """A bundle directory (config.json only; the rootfs is shared) outside anything the sandbox can see."""
    bundle = os.path.join(home(), "bundles", cid)
    os.makedirs(bundle, 0o700)
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(config, f)
    return bundle


def kill(cid: str) -> None:
    """`runsc kill <id> KILL` (all processes of the sandbox), bounded by a timeout; errors ignored."""
    _quiet([*runsc_argv("kill", "--all", cid, "KILL")], timeout_s=10.0)


def _quiet(argv: list[str], timeout_s: float = _CALL_TIMEOUT_S) -> subprocess.CompletedProcess | None:
    """Run a runsc management command with /dev/null stdio and a timeout (killed, group and all, on expiry)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(argv, proc.returncode, b"", err)


def probe() -> None:
    """Start one sandbox running /bin/true (once per process); SandboxUnavailable with what was tried."""
    global _probed
    if _probed:
        return
    for hook in BEFORE_FIRST_SANDBOX:
        hook()
    ws = Workspace(1 << 20, 64, parent=workspaces_dir())
    cid = new_id("rlvr-probe")
    try:
        bundle = write_bundle(cid, oci_config(["/usr/bin/true"], ws.path, Limits()))
        argv = runsc_argv("run", "--bundle", bundle, cid)
        got = capture(argv, lambda proc: kill(cid), wall_s=_CALL_TIMEOUT_S, output_cap=1 << 16)
    finally:
        REAPER.submit(cid, ws)
    if got.returncode != 0 or got.killed_for:
        raise SandboxUnavailable(
            f"runsc is installed but could not start a sandbox (tried: {' '.join(argv)} -> rc {got.returncode}"
            f"{', timed out' if got.killed_for else ''}): {got.stderr.decode(errors='replace')[-2000:]}\n"
            f"Needs root (or --rootless), cgroups, and a working platform ({PLATFORM}; set RLVR_RUNSC_PLATFORM). "
            f"{_INSTALL_HINT}")
    _probed = True


def execute(argv: Sequence[str], ws: Workspace, limits: Limits, stdin: bytes = b"",
            env: Mapping[str, str] | None = None, ro_binds: Mapping[str, str] | None = None) -> tuple[Captured, str]:
    """Run argv in a fresh sandbox over the workspace; (what it did, the container id). Teardown is queued."""
    probe()
    cid = new_id()
    bundle = write_bundle(cid, oci_config(argv, ws.path, limits, env, ro_binds))
    try:
        watch = CgroupWatch(cid, limits)
        got = capture(runsc_argv("run", "--bundle", bundle, cid), lambda proc: kill(cid),
                      wall_s=limits.wall_s + limits.start_grace_s, output_cap=limits.output_bytes, stdin=stdin,
                      poll=watch.poll)
        # the sandbox's cgroup (the launcher's rusage does not hold the sandbox); once gone, the last sample
        got.cpu_s = max(watch.cpu_s, cpu_seconds(cid))
    finally:
        REAPER.submit(cid, None)
    if got.killed_for is None and got.returncode == 128 + signal.SIGKILL and watch.near_memory_limit():
        got.killed_for = MEMORY  # the cgroup OOM-killed the sandbox (it vanishes with it: the last sample tells)
    return got, cid


class CgroupWatch:
    """Samples a sandbox's cgroups while it runs: kills for CPU (gVisor ignores RLIMIT_CPU) and remembers
    the memory high-water mark and failure count, the evidence of a cgroup OOM kill."""

    def __init__(self, cid: str, limits: Limits):
        self.cid, self.limits = cid, limits
        self.memory_limit = limits.memory_bytes + limits.sandbox_overhead_bytes
        self.mem_peak, self.mem_failcnt = 0, 0
        self.cpu_s = 0.0  # at the last sample (every 50 ms while it runs)

    def poll(self) -> str | None:
        memory = os.path.join(_CGROUP_ROOT, "memory", self.cid)
        self.mem_peak = max(self.mem_peak, _read_int(os.path.join(memory, "memory.max_usage_in_bytes")))
        self.mem_failcnt = max(self.mem_failcnt, _read_int(os.path.join(memory, "memory.failcnt")))
        self.cpu_s = max(self.cpu_s, cpu_seconds(self.cid))
        return CPU if self.cpu_s > self.limits.cpu_s + CPU_BOOT_S else None

    def near_memory_limit(self) -> bool:
        return self.mem_failcnt > 0 or self.mem_peak > 0.8 * self.memory_limit


def _read_int(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def cpu_seconds(cid: str) -> float:
    """CPU seconds the sandbox (sentry, gofer and stubs included) has used: its cpuacct cgroup; 0 if gone."""
    return _read_int(os.path.join(_CGROUP_ROOT, "cpuacct", cid, "cpuacct.usage")) / 1e9


def cgroup_dirs(cid: str) -> list[str]:
    """The cgroup directories (v1 controllers) named after a container that exist right now."""
    try:
        controllers = os.listdir(_CGROUP_ROOT)
    except OSError:
        return []
    return [p for c in controllers if os.path.isdir(p := os.path.join(_CGROUP_ROOT, c, cid))]


def leftover_cgroups(prefix: str = "rlvr-") -> list[str]:
    """Cgroup directories (any v1 controller) whose name starts with `prefix`: should be none when idle."""
    found = []
    for controller in os.listdir(_CGROUP_ROOT) if os.path.isdir(_CGROUP_ROOT) else []:
        try:
            found += [os.path.join(_CGROUP_ROOT, controller, d)
                      for d in os.listdir(os.path.join(_CGROUP_ROOT, controller)) if d.startswith(prefix)]
        except OSError:
            continue
    return found


def leftover_processes() -> list[int]:
    """Host pids whose command line names this process's runsc directory (sentry, gofer, stubs, runsc)."""
    return [] if _home is None else processes_naming(_home)


def list_containers() -> list[str]:
    """Ids of the containers in this process's runsc state directory (should be empty when idle)."""
    done = subprocess.run(runsc_argv("list", "-quiet"), capture_output=True, timeout=_CALL_TIMEOUT_S)
    return done.stdout.decode().split()


class Reaper:
    """A background thread that deletes finished sandboxes (~1.7 s each), their cgroups and bundles."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, Workspace | None]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, cid: str, ws: Workspace | None) -> None:
        """Queue a container (and optionally its workspace) for teardown."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="rlvr-sandbox-reaper", daemon=True)
                self._thread.start()
        self._queue.put((cid, ws))

    def _loop(self) -> None:
        while True:
            cid, ws = self._queue.get()
            try:
                teardown(cid)
                if ws is not None:
                    ws.close()
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Block until every queued teardown is done."""
        self._queue.join()


def teardown(cid: str) -> None:
    """Delete a container whatever its state, then the empty cgroup directories and its bundle."""
    if cid in _existing():
        _quiet(runsc_argv("delete", "--force", cid))
    for path in cgroup_dirs(cid):
        try:
            os.rmdir(path)
        except OSError:
            pass
    shutil.rmtree(os.path.join(home(), "bundles", cid), ignore_errors=True)


def _existing() -> set[str]:
    """Container ids with state in our --root (a finished `runsc run` removes its own). The state files are
    named `<id>_sandbox:<sandbox id>.state` in this runsc version."""
    try:
        return {name.split("_sandbox:")[0] for name in os.listdir(state_root())}
    except OSError:
        return set()


def _at_exit() -> None:
    """Finish queued teardowns (and a reaping of orphans in flight), then remove this process's directory
    when no container and no mount is left in it."""
    REAPER.drain()
    if _home is not None and not _existing() and not mounts_under(_home):
        shutil.rmtree(_home, ignore_errors=True)


REAPER = Reaper()
atexit.register(_at_exit)
