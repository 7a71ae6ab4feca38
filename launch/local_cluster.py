"""A multi-host JAX job on one machine: N processes on loopback, each started as a pod's host would be.

    python -m rlvr.launch.local_cluster --processes=2 --devices=4 -- \\
        python -m rlvr.main --config=configs/sft_tiny.py:smoke --workdir=/tmp/sft2

Each process gets exactly the environment a cluster target gives its host, and nothing else decides
how it joins the job (`rlvr.launch.distributed` reads it):

  style "k8s"    RLVR_COORDINATOR_ADDRESS / RLVR_NUM_PROCESSES / RLVR_PROCESS_ID, as the JobSet
                 manifests set them (rlvr.launch.targets.k8s.trainer_env), the coordinator on 127.0.0.1
  style "slurm"  the SLURM_* variables `srun --ntasks-per-node=1` sets on each node (job id, task
                 count, rank, step node list "localhost"), as in the sbatch scripts (targets.slurm)

plus XLA_FLAGS giving each process `devices` fake CPU devices (CPU collectives across processes go
over gloo, JAX's default on CPU). This is what the multi-process tests run (tests/test_multihost.py):
the trainers, checkpoints and faults across processes, checked against one process with all devices.
What only a real pod shows (ICI/NCCL collectives, shared-storage latency, real preemption notices):
docs/how-to/launch-on-a-pod.md, "Running across hosts".
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rlvr.launch import distributed

STYLES = ("k8s", "slurm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(style: str, num_processes: int, process_id: int, port: int, devices: int,
                job_id: int = 4242) -> dict[str, str]:
    """The variables process `process_id` of `num_processes` gets (see the module docstring)."""
    if style == "k8s":
        env = {distributed.COORDINATOR: f"127.0.0.1:{port}", distributed.NUM_PROCESSES: str(num_processes),
               distributed.PROCESS_ID: str(process_id)}
    elif style == "slurm":
        env = {"SLURM_JOB_ID": str(job_id), "SLURM_NTASKS": str(num_processes), "SLURM_PROCID": str(process_id),
               "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_NUM_NODES": str(num_processes),
               distributed.COORDINATOR_PORT: str(port)}
    else:
        raise ValueError(f"style={style!r}: use one of {STYLES}.")
    return {**env, **device_env(devices)}


def device_env(devices: int) -> dict[str, str]:
    """`devices` fake CPU devices for one process (and unbuffered output for its log)."""
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"
                         " --xla_cpu_collective_timeout_seconds=600"
                         " --xla_cpu_collective_call_terminate_timeout_seconds=600",
            "PYTHONUNBUFFERED": "1"}


def k8s_pod_env(container: Mapping[str, Any], index: int, port: int = 0) -> dict[str, str]:
    """The environment of a JobSet trainer `container` (rlvr.launch.targets.k8s) as the kubelet gives
    pod `index` of the Indexed Job (fieldRefs to the job-completion-index annotation resolved); with
    `port`, the coordinator (pod 0's DNS name) is moved to 127.0.0.1:`port`."""
    annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = annotations[re.fullmatch(r"metadata\.annotations\['(.+)'\]", path).group(1)]
    if port and distributed.COORDINATOR in env:
        env[distributed.COORDINATOR] = f"127.0.0.1:{port}"
    return env


class LocalCluster:
    """N processes of one command; `logs[i]` is process i's combined stdout/stderr file."""

    def __init__(self, command: Sequence[str], num_processes: int, devices: int, log_dir: str, *,
                 style: str = "k8s", cwd: str | None = None, env: Mapping[str, str] | None = None,
                 host_envs: Sequence[Mapping[str, str]] | None = None, port: int = 0):
        """`host_envs`: each process's cluster variables as given (e.g. `k8s_pod_env` of a generated
        manifest, with `port` its coordinator port) instead of those of `style`."""
        os.makedirs(log_dir, exist_ok=True)
        port = port or free_port()
        self.logs = [os.path.join(log_dir, f"process{i}.log") for i in range(num_processes)]
        base = {k: v for k, v in (os.environ if env is None else env).items()
                if not k.startswith(("SLURM_", "RLVR_COORDINATOR", "RLVR_NUM_PROC", "RLVR_PROCESS", "XLA_FLAGS"))}
        self.processes = []
        for i in range(num_processes):
            with open(self.logs[i], "w") as log:
                self.processes.append(subprocess.Popen(
                    list(command), cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**base, **(process_env(style, num_processes, i, port, devices) if host_envs is None
                                    else {**host_envs[i], **device_env(devices)})}))

    def signal(self, process_id: int, sig: int) -> None:
        self.processes[process_id].send_signal(sig)

    def wait(self, timeout_s: float) -> list[int | None]:
        """Every process's exit code; those still running after `timeout_s` are killed (code None)."""
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for p in self.processes:
            try:
                codes.append(p.wait(max(deadline - time.monotonic(), 0.01)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill()
        return codes

    def kill(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def output(self, process_id: int) -> str:
        with open(self.logs[process_id]) as f:
            return f.read()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4, help="fake CPU devices per process")
    parser.add_argument("--style", choices=STYLES, default="k8s")
    parser.add_argument("--log_dir", default="local_cluster_logs")
    parser.add_argument("--timeout_s", type=float, default=3600)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.processes < 1 or args.devices < 1:
        parser.error("give --processes >= 1, --devices >= 1 and a command after --")
    cluster = LocalCluster(command, args.processes, args.devices, args.log_dir, style=args.style)
    codes = cluster.wait(args.timeout_s)
    for i, code in enumerate(codes):
        print(f"process {i}: {'timed out (killed)' if code is None else f'exit {code}'} -- log {cluster.logs[i]}")
    return max((124 if c is None else abs(c)) for c in codes)


if __name__ == "__main__":
    sys.exit(main())
