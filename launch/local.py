"""The local target: an experiment's jobs as subprocesses on this machine, at most `parallel` at once.

Each job runs its `command` with stdout and stderr appended to `WORKDIR/job.log`; `job.json` follows
its status (pending -> running -> succeeded | failed | killed). Jobs already marked succeeded are
skipped, so re-running the same launch resumes an experiment (a job restarted in its workdir resumes
from its own checkpoint; rlvr.main does that).

Ctrl-C or SIGTERM stops starting jobs and sends SIGTERM to the running ones, which save a checkpoint
and exit (rlvr.train.preemption); after `grace_s`, or at a second Ctrl-C, they are killed. Children run
in their own session, so a terminal's Ctrl-C reaches them only through the launcher.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rlvr.launch import records
from rlvr.launch.sweep import Experiment, Job


class _Stop:
    """Set by SIGINT/SIGTERM: `requested` after the first, `force` after the second."""

    def __init__(self):
        self.requested = threading.Event()
        self.force = threading.Event()
        self.signum = 0

    def __call__(self, signum, _frame) -> None:
        if self.requested.is_set():
            self.force.set()
        self.signum = self.signum or signum
        self.requested.set()


@contextmanager
def _signals() -> Iterator[_Stop]:
    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(experiment: Experiment, parallel: int = 1, *, poll_s: float = 0.2, grace_s: float = 60.0) -> int:
    """Runs the experiment's unfinished jobs. Returns 0 if every job succeeded, 1 if any failed,
    128 + signal number if interrupted (the running jobs are then marked killed)."""
    if parallel < 1:
        raise ValueError(f"--parallel={parallel}: must be >= 1.")
    todo = []
    for job in experiment.jobs:
        if records.read_job(job.workdir)["status"] == "succeeded":
            print(f"skip {job.name}: succeeded in an earlier launch", flush=True)
        else:
            todo.append(job)
    running: dict[str, tuple[Job, subprocess.Popen]] = {}
    failed = 0
    with _signals() as stop:
        try:
            while (todo or running) and not stop.requested.is_set():
                while todo and len(running) < parallel:
                    job = todo.pop(0)
                    running[job.name] = (job, _start(job))
                failed += _reap(running)
                time.sleep(poll_s)
        except BaseException:  # a launcher error must not leave jobs running on their own
            _terminate(running, stop, grace_s)
            raise
        if stop.requested.is_set():
            _reap(running)
            _terminate(running, stop, grace_s)
            return 128 + stop.signum
    return 1 if failed else 0


def _start(job: Job) -> subprocess.Popen:
    record = records.read_job(job.workdir)
    attempt = record.get("attempts", 0) + 1
    log_path = os.path.join(job.workdir, records.LOG_NAME)
    with open(log_path, "a") as log:
        log.write(f"=== attempt {attempt}, {records.now()}: {' '.join(job.command)}\n")
        log.flush()
        process = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    records.update_job(job.workdir, status="running", start_time=records.now(), end_time=None, return_code=None,
                       attempts=attempt, pid=process.pid, host=socket.gethostname(), launcher_pid=os.getpid(),
                       log=log_path)
    print(f"start {job.name} (pid {process.pid}); log: {log_path}", flush=True)
    return process


def _reap(running: dict[str, tuple[Job, subprocess.Popen]]) -> int:
    """Records the jobs that exited; returns how many of them failed."""
    failed = 0
    for name, (job, process) in list(running.items()):
        code = process.poll()
        if code is None:
            continue
        del running[name]
        status = "succeeded" if code == 0 else "failed"
        failed += code != 0
        record = records.update_job(job.workdir, status=status, end_time=records.now(), return_code=code)
        took = records.seconds_between(record["start_time"], record["end_time"])
        tail = "" if code == 0 else f" (exit status {code}); log: {record['log']}"
        print(f"{status} {name} in {took:.1f} s{tail}", flush=True)
    return failed


def _terminate(running: dict[str, tuple[Job, subprocess.Popen]], stop: _Stop, grace_s: float) -> None:
    """SIGTERM to each running job's process group, wait up to `grace_s` (or a second signal), then
    SIGKILL; each is marked killed."""
    if running:
        print(f"stopping {len(running)} running job(s): SIGTERM, then SIGKILL after {grace_s:.0f} s "
              "(Ctrl-C again to kill now)", flush=True)
    for _, process in running.values():
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for _, p in running.values()):
        if stop.force.is_set() or time.monotonic() > deadline:
            for _, process in running.values():
                _signal_group(process, signal.SIGKILL)
        time.sleep(0.1)
    for name, (job, process) in running.items():
        records.update_job(job.workdir, status="killed", end_time=records.now(), return_code=process.returncode)
        print(f"killed {name} (exit status {process.returncode})", flush=True)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass
