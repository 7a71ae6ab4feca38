"""Multi-host JAX start-up from the environment a cluster target gives each process.

`rlvr.main` calls `initialize_from_env()` first thing, before any JAX computation. It decides from
the process environment alone whether to call `jax.distributed.initialize(...)` and with what;
`plan_from_env(env)` is that decision as a pure function (env dict in, kwargs out), so tests check it
against the environment the generated manifests and scripts actually set.

Sources, first match wins:

  RLVR_DISTRIBUTED=off          never initialize (a single-host debug run inside a cluster job)
  RLVR_COORDINATOR_ADDRESS,     explicit (the k8s JobSet manifests set these: pod 0's stable hostname
  RLVR_NUM_PROCESSES,           from the JobSet's headless service, the slice's host count, and the
  RLVR_PROCESS_ID               Indexed Job's completion index); all three or none
  SLURM_JOB_ID + SLURM_NTASKS   Slurm (`srun`, one task per node): the coordinator is the step's first
  + SLURM_PROCID                node at a port derived from the job id, as JAX's own Slurm detection
                                does. We pass everything ourselves because JAX's auto-detection also
                                sets local_device_ids=[SLURM_LOCALID], which with one process per node
                                would hide all GPUs but one; with several tasks per node each task
                                keeps that one-GPU view
  TPU_WORKER_HOSTNAMES (>1 host) a multi-host Cloud TPU slice (GKE/TPU VM): JAX auto-detects, so
  or RLVR_DISTRIBUTED=auto      initialize() is called without arguments
  otherwise                     a single host: nothing is called
A count of 1 process is a single host too.

RLVR_HEARTBEAT_TIMEOUT_S (optional, any multi-host source): how long the coordination service waits
for a silent process before it fails the whole job (JAX's default: 100 s). A host that dies (SIGKILL,
machine lost) makes every other process exit with "tasks ... stopped sending heartbeats" after it,
rather than hang; the job's rerun resumes from the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

COORDINATOR = "RLVR_COORDINATOR_ADDRESS"
NUM_PROCESSES = "RLVR_NUM_PROCESSES"
PROCESS_ID = "RLVR_PROCESS_ID"
MODE = "RLVR_DISTRIBUTED"  # "" (decide from the environment) | "auto" | "off"
COORDINATOR_PORT = "RLVR_COORDINATOR_PORT"  # Slurm: overrides the port derived from the job id
HEARTBEAT_TIMEOUT = "RLVR_HEARTBEAT_TIMEOUT_S"
EXPLICIT = (COORDINATOR, NUM_PROCESSES, PROCESS_ID)


class DistributedEnvError(ValueError):
    """The environment asks for multi-host start-up but is incomplete or inconsistent."""


@dataclasses.dataclass(frozen=True)
class DistributedPlan:
    """What `initialize_from_env` does: `kwargs` for jax.distributed.initialize, or None (single host)."""

    source: str  # "explicit" | "slurm" | "tpu" | "auto" | "off" | "single-host"
    kwargs: dict[str, Any] | None

    @property
    def multi_host(self) -> bool:
        return self.kwargs is not None


def plan_from_env(env: Mapping[str, str]) -> DistributedPlan:
    """The multi-host start-up `env` asks for (see the module docstring). Raises DistributedEnvError
    naming the variable when the environment is half set or inconsistent."""
    mode = env.get(MODE, "").strip().lower()
    if mode not in ("", "auto", "off"):
        raise DistributedEnvError(f"{MODE}={env[MODE]!r}: use 'auto', 'off' or leave it unset.")
    if mode == "off":
        return DistributedPlan("off", None)
    plan = _plan(env, mode)
    if plan.kwargs is not None and env.get(HEARTBEAT_TIMEOUT, "").strip():
        seconds = _int(env, HEARTBEAT_TIMEOUT)
        if seconds < 1:
            raise DistributedEnvError(f"{HEARTBEAT_TIMEOUT}={seconds}: must be >= 1 (seconds).")
        plan.kwargs["heartbeat_timeout_seconds"] = seconds
    return plan


def _plan(env: Mapping[str, str], mode: str) -> DistributedPlan:
    given = [name for name in EXPLICIT if env.get(name, "").strip()]
    if given:
        return _explicit(env, given)
    if all(env.get(name) for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")):
        return _slurm(env)
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return DistributedPlan("tpu", {})
    if mode == "auto":
        return DistributedPlan("auto", {})
    return DistributedPlan("single-host", None)


def initialize_from_env(env: Mapping[str, str] | None = None) -> DistributedPlan:
    """Calls jax.distributed.initialize as `plan_from_env` decides (once per process); returns the plan."""
    plan = plan_from_env(os.environ if env is None else env)
    if plan.kwargs is not None:
        import jax

        from rlvr.train import preemption

        jax.distributed.initialize(**plan.kwargs)
        preemption.join_jax_preemption_service()
    return plan


def _int(env: Mapping[str, str], name: str) -> int:
    text = env.get(name, "").strip()
    try:
        return int(text)
    except ValueError:
        raise DistributedEnvError(f"{name}={text!r}: must be an integer.") from None


def _check_rank(count: int, rank: int, count_name: str, rank_name: str) -> None:
    if count < 1:
        raise DistributedEnvError(f"{count_name}={count}: must be >= 1.")
    if not 0 <= rank < count:
        raise DistributedEnvError(f"{rank_name}={rank}: must be in [0, {count_name}={count}).")


def _explicit(env: Mapping[str, str], given: list[str]) -> DistributedPlan:
    missing = [name for name in EXPLICIT if name not in given]
    if missing:
        raise DistributedEnvError(f"{', '.join(given)} set but {', '.join(missing)} missing: set all of "
                                  f"{', '.join(EXPLICIT)} (or none).")
    address = env[COORDINATOR].strip()
    if not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+:\d+", address):
        raise DistributedEnvError(f"{COORDINATOR}={address!r}: must be HOST:PORT (process 0's address).")
    count, rank = _int(env, NUM_PROCESSES), _int(env, PROCESS_ID)
    _check_rank(count, rank, NUM_PROCESSES, PROCESS_ID)
    if count == 1:
        return DistributedPlan("single-host", None)
    # "deactivate": JAX must not override these from a cluster it detects (e.g. the k8s API).
    return DistributedPlan("explicit", {"coordinator_address": address, "num_processes": count,
                                        "process_id": rank, "cluster_detection_method": "deactivate"})


def _slurm(env: Mapping[str, str]) -> DistributedPlan:
    count, rank = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID")
    _check_rank(count, rank, "SLURM_NTASKS", "SLURM_PROCID")
    if count == 1:
        return DistributedPlan("single-host", None)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    if not nodelist:
        raise DistributedEnvError("SLURM_NTASKS > 1 but no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: run the job "
                                  "with srun inside an allocation.")
    port_text = env.get(COORDINATOR_PORT) or env.get("JAX_COORDINATOR_PORT")
    port = int(port_text) if port_text else _int(env, "SLURM_JOB_ID") % 2**12 + (65535 - 2**12 + 1)
    kwargs: dict[str, Any] = {"coordinator_address": f"{first_host(nodelist)}:{port}", "num_processes": count,
                              "process_id": rank, "cluster_detection_method": "deactivate"}
    nodes = _int(env, "SLURM_STEP_NUM_NODES") if env.get("SLURM_STEP_NUM_NODES") else \
        _int(env, "SLURM_NNODES") if env.get("SLURM_NNODES") else count
    if count > nodes:  # several tasks per node: one GPU each, as JAX's own Slurm detection does
        kwargs["local_device_ids"] = [_int(env, "SLURM_LOCALID")]
    return DistributedPlan("slurm", kwargs)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'node[003-005,9],gpu1' -> 'node003', 'a,b' -> 'a'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]*)\])?", nodelist.strip())
    if not match:
        raise DistributedEnvError(f"cannot read the Slurm node list {nodelist!r}.")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + re.split(r"[,-]", ranges, maxsplit=1)[0]
