"""Sandboxes left behind by a killed process: found by their owner and removed.

    python -m rlvr.sandbox.cleanup [--dry-run] [--tmp DIR]

A process that runs sandboxes keeps all of their host state under one directory,
`<tmp>/rlvr-sandbox-<pid>-<start>-<random>` (runsc.home()): runsc's state root (its containers), the OCI
bundles, the workspaces (tmpfs and overlay mounts). The owner is the pid *and* its start time (clock ticks
since boot, field 22 of /proc/<pid>/stat), so a recycled pid is never taken for the owner. A normal exit
removes the directory; a SIGKILL leaves it, and possibly live sandboxes: a warm pool worker waits on a pipe
that a forked child of the dead process may still hold open, a fresh sandbox runs its program with no
harness left to enforce the wall clock.

`orphans()` lists the directories whose owner is gone; `remove(directory)` kills and deletes their
containers (`runsc --root <theirs> kill`/`delete`), SIGKILLs the host processes whose command line names
the directory (runsc, its sentry and gofer), removes the containers' cgroups, unmounts what is mounted
under it and deletes it. A directory whose owner is alive is never touched, nor anything outside the
orphan's directory and its containers' cgroups. Two processes cleaning at once do not collide: the first
claims a directory (a `reaping` file naming it, taken over only from a dead claimer).

The first sandbox a process starts (`runsc.probe`, through `runsc.BEFORE_FIRST_SANDBOX`, where the package
puts `start_reaping`) reaps orphans in a background thread, joined at exit; the command line does it at
once and prints one JSON line per orphan.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from . import runsc
from .runsc import mounts_under, owner_tag, processes_naming, start_ticks

PREFIX = "rlvr-sandbox-"
_NAME = re.compile(r"rlvr-sandbox-(\d+)-(?:(\d+)-)?[A-Za-z0-9_]+")  # pid, start (absent in older names)
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()


def _alive(tag: str) -> bool:
    """Whether the process named by an owner tag (`pid-start`, or a bare `pid` of an older name) is running."""
    pid, _, start = tag.partition("-")
    ticks = start_ticks(int(pid))
    return ticks is not None and (not start or str(ticks) == start)


def _owner(name: str) -> str | None:
    found = _NAME.fullmatch(name)
    if found is None:
        return None
    return found.group(1) + (f"-{found.group(2)}" if found.group(2) else "")


def orphans(top: str | None = None) -> list[str]:
    """Sandbox directories under `top` (default: the temp directory) whose owner process is gone."""
    top = top or tempfile.gettempdir()
    try:
        names = os.listdir(top)
    except OSError:
        return []
    found = []
    for name in sorted(names):
        tag = _owner(name)
        path = os.path.join(top, name)
        if tag is not None and not _alive(tag) and os.path.isdir(path) and not os.path.islink(path):
            found.append(path)
    return found


def _claim(directory: str) -> bool:
    """Take the directory for this process (False when a live process is already cleaning it)."""
    claim = os.path.join(directory, "reaping")
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            with open(claim) as f:
                if _alive(f.read().strip()):
                    return False
        except (OSError, ValueError):
            pass
        fd = os.open(claim, os.O_WRONLY | os.O_TRUNC)
    except OSError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(owner_tag())
    return True


def containers(directory: str) -> list[str]:
    """Container ids with runsc state or a bundle in an owner's directory."""
    ids: set[str] = set()
    for sub, split in (("state", "_sandbox:"), ("bundles", None)):
        try:
            names = os.listdir(os.path.join(directory, sub))
        except OSError:
            continue
        ids |= {n.split(split)[0] if split else n for n in names if not split or split in n}
    return sorted(ids)


def remove(directory: str) -> dict[str, Any]:
    """Remove an orphan's sandboxes and directory (see the module doc); what was found."""
    if not _claim(directory):
        return {"directory": directory, "skipped": "another process is cleaning it"}
    ids = containers(directory)
    state = os.path.join(directory, "state")
    for cid in ids:
        runsc._quiet(runsc.runsc_argv("kill", "--all", cid, "KILL", root=state), timeout_s=10.0)
        runsc._quiet(runsc.runsc_argv("delete", "--force", cid, root=state))
    pids = processes_naming(directory)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for cid in ids:
        for path in runsc.cgroup_dirs(cid):
            try:
                os.rmdir(path)
            except OSError:
                pass
    mounts = mounts_under(directory)
    for point in mounts:
        if subprocess.run(["umount", point], capture_output=True, timeout=10).returncode != 0:
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=10)
    if not mounts_under(directory):  # never delete through a mount that would not go
        shutil.rmtree(directory, ignore_errors=True)
    return {"directory": directory, "containers": ids, "processes": pids, "mounts": mounts,
            "removed": not os.path.exists(directory)}


def reap_orphans(top: str | None = None) -> list[dict[str, Any]]:
    """`remove` every orphan under `top`; one summary per orphan."""
    return [remove(directory) for directory in orphans(top)]


def start_reaping() -> None:
    """Reap orphans in a daemon thread, once per process (`finish_reaping` joins it at exit)."""
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap_quietly, name="rlvr-sandbox-orphans", daemon=True)
            _reaper.start()
            atexit.register(finish_reaping)


def _reap_quietly() -> None:
    try:
        reap_orphans()
    except Exception as e:  # noqa: BLE001 - best effort: the command line reports errors
        print(f"rlvr.sandbox: cleaning up after killed processes failed: {e!r}", file=sys.stderr)


def finish_reaping(timeout_s: float = 60.0) -> None:
    if _reaper is not None:
        _reaper.join(timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlvr.sandbox.cleanup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list the orphans and what they hold; remove nothing")
    parser.add_argument("--tmp", default=None, help="the directory holding rlvr-sandbox-* (default: the temp dir)")
    args = parser.parse_args(argv)
    for directory in orphans(args.tmp):
        if args.dry_run:
            report = {"directory": directory, "containers": containers(directory),
                      "processes": processes_naming(directory), "mounts": mounts_under(directory)}
        else:
            report = remove(directory)
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
