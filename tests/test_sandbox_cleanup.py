"""Sandboxes left by a SIGKILLed process (rlvr.sandbox.cleanup): found by their owner (pid + start time) and
removed by the next process's first sandbox, or listed by `python -m rlvr.sandbox.cleanup --dry-run`; a live
process's sandboxes are never touched."""

import json
import os
import signal
import subprocess
import sys

import pytest
from rlvr.sandbox import Limits, Pool, cleanup, runsc

pytestmark = pytest.mark.sandbox

# A pool owner that forks a child holding the pool's pipes open (as any forked helper of a trainer would): when
# the owner is SIGKILLed, its warm sandbox gets no EOF and lives on.
OWNER = r"""
import os, time
from rlvr.sandbox import Limits, Pool, runsc
pool = Pool(1, Limits(wall_s=5), trace_path=False)
keeper = os.fork()
if keeper == 0:
    time.sleep(300)
    os._exit(0)
print(runsc.home(), keeper, flush=True)
time.sleep(300)
"""


def test_sandboxes_of_a_killed_owner_are_removed_by_the_next_start():
    with Pool(1, Limits(wall_s=5), trace_path=False) as mine:
        owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, start_new_session=True)
        home, keeper = owner.stdout.readline().decode().split()
        keeper = int(keeper)
        try:
            os.kill(owner.pid, signal.SIGKILL)
            owner.wait()
            owner.stdout.close()
            (cid,) = cleanup.containers(home)
            assert cleanup.processes_naming(home) and runsc.cgroup_dirs(cid)  # the sandbox outlived its owner
            assert home in cleanup.orphans() and runsc.home() not in cleanup.orphans()
            listed = subprocess.run([sys.executable, "-m", "rlvr.sandbox.cleanup", "--dry-run"], capture_output=True,
                                    text=True, check=True).stdout
            found = [json.loads(line) for line in listed.splitlines()]
            assert {"directory": home, "containers": [cid]}.items() <= next(f for f in found
                                                                            if f["directory"] == home).items()
            assert os.path.isdir(home)  # a dry run removes nothing
            # the next process's first sandbox reaps it (and waits for that before it exits)
            subprocess.run([sys.executable, "-c", "from rlvr.sandbox import run; run(python='pass')"], check=True)
            assert not os.path.exists(home)
            assert cleanup.processes_naming(home) == [] and runsc.cgroup_dirs(cid) == []
            assert os.path.isdir(runsc.home()) and mine.run(python="print(1)").stdout == b"1\n"  # ours: untouched
        finally:
            os.kill(keeper, signal.SIGKILL)


def test_owner_tags_tell_a_recycled_pid_from_its_owner(tmp_path):
    me = cleanup.owner_tag()
    assert cleanup._alive(me) and not cleanup._alive(f"{os.getpid()}-{cleanup.start_ticks(os.getpid()) + 1}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name in (f"rlvr-sandbox-{me}-abcd1234", f"rlvr-sandbox-{os.getpid()}-12345678",  # alive, both name styles
                 f"rlvr-sandbox-{os.getpid()}-1-abcd1234", f"rlvr-sandbox-{dead.pid}-x1y2z3w4",  # dead
                 "rlvr-sandbox-traces", "unrelated"):
        (tmp_path / name).mkdir()
    assert {os.path.basename(p) for p in cleanup.orphans(str(tmp_path))} == {
        f"rlvr-sandbox-{dead.pid}-x1y2z3w4", f"rlvr-sandbox-{os.getpid()}-1-abcd1234"}
