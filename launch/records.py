"""The experiment directory on disk: `ROOT/EXP/experiment.json` and `ROOT/EXP/jobs/NAME/job.json`.

experiment.json: config spec, target, git revision and dirty flag, the launch command line, created
time, the common overrides and the sweep, the job names, and one entry per launch (re-runs append).
job.json: index, name, overrides, resolved config, command, git revision, workdir, status
(pending | running | succeeded | failed | killed), start/end times, return code, log path, attempts.
Files are replaced atomically (write, then rename), so a reader never sees half a record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

from rlvr.launch.sweep import Experiment, Job, LaunchError

STATUSES = ("pending", "running", "succeeded", "failed", "killed")
LOG_NAME = "job.log"


def now() -> str:
    """Local time, ISO 8601 with milliseconds and the UTC offset."""
    return datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")


def seconds_between(start: str | None, end: str | None) -> float | None:
    if not start:
        return None
    stop = datetime.datetime.fromisoformat(end) if end else datetime.datetime.now().astimezone()
    return (stop - datetime.datetime.fromisoformat(start)).total_seconds()


def write_json(path: str, record: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2, default=repr)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def job_path(workdir: str) -> str:
    return os.path.join(workdir, "job.json")


def read_job(workdir: str) -> dict[str, Any]:
    return read_json(job_path(workdir))


def update_job(workdir: str, **fields: Any) -> dict[str, Any]:
    record = {**read_job(workdir), **fields}
    write_json(job_path(workdir), record)
    return record


@contextlib.contextmanager
def locked(directory: str) -> Iterator[None]:
    """Holds `directory/.lock` so that two launchers never run the same experiment at once."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".lock"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LaunchError(f"experiment {directory} is being launched by another process; wait for it "
                              "or choose another --exp.") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_experiment(experiment: Experiment, target: str, command: list[str]) -> None:
    """Creates or updates the experiment directory. An existing one must hold the same jobs (a re-run
    of the same command): its succeeded jobs keep their records, the others are reset to pending."""
    path = os.path.join(experiment.directory, "experiment.json")
    previous = read_json(path) if os.path.exists(path) else None
    if previous is not None:
        _check_same_jobs(experiment, previous)
    launch = {"time": now(), "command": command, "target": target, "git_revision": experiment.git_revision,
              "git_dirty": experiment.git_dirty}
    record = {"name": experiment.name, "config_spec": experiment.config_spec, "target": target,
              "git_revision": experiment.git_revision, "git_dirty": experiment.git_dirty, "command": command,
              "created": previous["created"] if previous else launch["time"], "overrides": experiment.overrides,
              "sweep": experiment.sweep, "jobs": [job.name for job in experiment.jobs],
              "launches": [*(previous or {}).get("launches", []), launch]}
    for job in experiment.jobs:
        _write_job(job, experiment.git_revision)
    write_json(path, record)


def _write_job(job: Job, git_revision: str) -> None:
    os.makedirs(job.workdir, exist_ok=True)
    old = read_job(job.workdir) if os.path.exists(job_path(job.workdir)) else {}
    if old.get("status") == "succeeded":
        return
    record = {**dataclasses.asdict(job), "git_revision": git_revision, "status": "pending",
              "start_time": None, "end_time": None, "return_code": None,
              "log": os.path.join(job.workdir, LOG_NAME), "attempts": old.get("attempts", 0),
              "host": None, "pid": None, "launcher_pid": None}
    if old:
        record["previous"] = {k: old.get(k) for k in ("status", "start_time", "end_time", "return_code")}
    write_json(job_path(job.workdir), record)


def _check_same_jobs(experiment: Experiment, previous: dict[str, Any]) -> None:
    def canonical(value: Any) -> str:
        return json.dumps(value, sort_keys=True, default=repr)

    stored = [read_job(os.path.join(experiment.directory, "jobs", name)) for name in previous.get("jobs", [])]
    same = (previous.get("config_spec") == experiment.config_spec
            and [(j["name"], canonical(j["overrides"])) for j in stored]
            == [(j.name, canonical(j.overrides)) for j in experiment.jobs])
    if not same:
        raise LaunchError(f"experiment {experiment.directory} already exists with other jobs (config "
                          f"{previous.get('config_spec')}, jobs {previous.get('jobs')}); re-run the same "
                          "command to resume it, or choose another --exp.")


def effective_status(record: dict[str, Any]) -> str:
    """The recorded status, except a 'running' job whose launcher is gone on this host is 'killed'."""
    status = record.get("status", "pending")
    if status == "running" and record.get("host") == socket.gethostname() and record.get("launcher_pid"):
        try:
            os.kill(record["launcher_pid"], 0)
        except ProcessLookupError:
            return "killed"
        except PermissionError:
            pass
    return status
