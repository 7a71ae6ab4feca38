"""The weaker backends, for development only: "bwrap" (bubblewrap) and "process" (a plain subprocess).

Both share the host kernel; a kernel bug is one syscall away. Both run the program through a tiny launcher
that sets hard rlimits (AS, CPU, FSIZE, NOFILE, NPROC, CORE=0) and then execs it; as root they run it as
the dedicated host uid `LOCAL_UID` (RLIMIT_NPROC is ignored for root and counts every process of a uid).

"process" does NOT protect against: reading any host file that uid can read (world-readable secrets,
/etc, other users' world-readable homes); writing anywhere that uid can write (/tmp, /dev/shm); network
access (loopback and off-host); signalling or ptracing other processes of the same uid (other concurrent
runs, and, when not run as root, the host-side test harness of a check-style verdict); daemons that leave
the process group with setsid (only the group is killed); memory limits beyond RLIMIT_AS (no cgroup);
total disk use outside the workspace; any kernel exploit.

"bwrap" adds a private mount view (`/usr` read-only, the workspace, a size-capped /tmp), new
pid/net/ipc/uts/user namespaces, no capabilities and --die-with-parent (the pid namespace dies with its
init, so daemons do not outlive the run). It does NOT protect against: kernel exploits (no seccomp filter
is installed here), memory use beyond RLIMIT_AS (no cgroup), CPU share (no quota), or NPROC across
concurrent runs (one shared uid: a fork bomb in one run can starve another's forks).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence

from .capture import Captured, capture
from .runsc import PATH_ENV, home
from .types import Limits, SandboxUnavailable
from .workspace import Workspace

LOCAL_UID = 61001  # a uid no account uses: its NPROC budget belongs to the sandboxed runs alone
PYTHON = "/usr/bin/python3"

# `python3 -I -S -c LAUNCHER '<json>'`: set hard rlimits, drop to the uid (when root), exec the program.
LAUNCHER = """\
import json, os, resource, sys
spec = json.loads(sys.argv[1])
for name, soft, hard in spec["rlimits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
os.umask(0o022)
os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
"""


def owner_uid() -> int:
    """The host uid local runs use: LOCAL_UID as root, else the caller's own."""
    return LOCAL_UID if os.geteuid() == 0 else os.geteuid()


def _launch(argv: Sequence[str], limits: Limits, env: Mapping[str, str]) -> list[str]:
    spec = {"rlimits": limits.rlimits(), "argv": list(argv), "env": dict(env)}
    return [PYTHON, "-I", "-S", "-c", LAUNCHER, json.dumps(spec)]


def _env(workspace: str, env: Mapping[str, str] | None) -> dict[str, str]:
    return {"PATH": PATH_ENV, "LANG": "C.UTF-8", "HOME": workspace, "PYTHONIOENCODING": "utf-8", **(env or {})}


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _as_owner(argv: list[str]) -> list[str]:
    """Prefix that switches to LOCAL_UID when root (setpriv drops groups and capabilities too)."""
    if os.geteuid() != 0:
        return argv
    uid = str(LOCAL_UID)
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", *argv]


def execute_process(argv: Sequence[str], ws: Workspace, limits: Limits, stdin: bytes = b"",
                    env: Mapping[str, str] | None = None) -> Captured:
    """Run argv as a plain subprocess in the workspace directory (cwd) under rlimits. Not isolation."""
    launch = _as_owner(_launch(argv, limits, _env(ws.path, env)))
    return capture(launch, _killpg, wall_s=limits.wall_s, output_cap=limits.output_bytes, stdin=stdin,
                   cwd=ws.path, env={"PATH": PATH_ENV})


def bwrap_binary() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable("the bwrap backend needs bubblewrap: apt-get install -y bubblewrap")
    return path


def _bwrap_argv(ws: Workspace, limits: Limits, ro_binds: Mapping[str, str]) -> list[str]:
    etc = os.path.join(home(), "rootfs", "etc")
    argv = [bwrap_binary(), "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--uid", "1000", "--gid", "1000", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", "--ro-bind", etc, "/etc", "--proc", "/proc", "--dev", "/dev",
            "--size", str(int(limits.tmp_bytes)), "--tmpfs", "/tmp", "--bind", ws.path, "/workspace"]
    for link in ("bin", "lib", "lib64", "sbin"):
        argv += ["--symlink", f"usr/{link}", f"/{link}"]
    for dest, source in ro_binds.items():
        argv += ["--ro-bind", source, dest]
    return [*argv, "--remount-ro", "/", "--chdir", "/workspace", "--"]


def execute_bwrap(argv: Sequence[str], ws: Workspace, limits: Limits, stdin: bytes = b"",
                  env: Mapping[str, str] | None = None, ro_binds: Mapping[str, str] | None = None) -> Captured:
    """Run argv under bubblewrap with the same layout as the runsc backend (host kernel, no cgroups)."""
    launch = _launch(argv, limits, _env("/workspace", env))
    command = _as_owner([*_bwrap_argv(ws, limits, ro_binds or {}), *launch])
    got = capture(command, _killpg, wall_s=limits.wall_s, output_cap=limits.output_bytes, stdin=stdin,
                  env={"PATH": PATH_ENV})
    got.cpu_s = None  # bwrap's rusage misses a killed program (never reaped by bwrap): not measured
    return got
