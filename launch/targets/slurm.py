"""Slurm target: one sbatch script per job and a submit.sh that submits them all.

    python -m rlvr.launch configs/X.py --sweep --target=slurm --gpu=h100 --gpus_per_node=8 --nodes=2 \\
        --partition=gpu --time=24:00:00 [--setup='source .venv/bin/activate']
    bash EXPERIMENT/slurm/submit.sh

Each script asks for `--nodes` nodes with `--gpus_per_node` GPUs and one task per node, and runs
`srun python -m rlvr.main ...` there: one JAX process per node that sees all of that node's GPUs.
`rlvr.launch.distributed` reads srun's per-task SLURM_* variables (coordinator = the step's first
node, process id = SLURM_PROCID). XLA_PYTHON_CLIENT_MEM_FRACTION is exported as the --hbm_fraction
the fit check assumed, so the budget checked is the budget the job gets. Logs go to
EXPERIMENT/slurm/logs/<job>-<jobid>.out; workdirs default to the experiment's own job folders
(a shared filesystem is assumed, as usual on Slurm clusters).

`--rollout_workers=N` (RL jobs) adds one node to the allocation, the last, for a rollout fleet:
`python -m rlvr.rollout.fleet` starts N servers there (`--rollout_server=sglang`: SGLang's own, or
`rlvr`; `--rollout_gpus_per_worker` GPUs each) behind SGLang's router on `--rollout_port`; the script
waits for its ready file, runs the trainer with `rl.sglang_router=http://<that node>:PORT` (the
workers are read from the router) and stops the fleet when it exits. The servers start from
`--rollout_model` (default: the job's init.hf_checkpoint); the trainer sends its weights at step 0.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import stat

from rlvr.launch.targets import common
from rlvr.launch.targets.options import OptionError, gpu_accelerator, parse_options, positive


@dataclasses.dataclass
class SlurmOptions:
    """`--key=value` options of --target=slurm."""

    gpu: str = "h100"  # a100 | a100-40gb | h100 | h200 (HBM for the fit check)
    gpus_per_node: int = 8
    nodes: int = 1
    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = "24:00:00"
    constraint: str = ""
    cpus_per_task: int = 0  # 0: the cluster's default
    mem: str = ""  # e.g. 0 (all of the node's memory) or 500G
    exclusive: bool = True
    python: str = "python"  # the interpreter on the nodes (after --setup)
    repo_dir: str = ""  # where the scripts cd (holds configs/); default: this checkout
    workdir_root: str = ""  # default: the experiment directory (its jobs/NAME folders)
    setup: str = ""  # shell lines run before srun, e.g. 'module load cuda; source .venv/bin/activate'
    coordinator_port: int = 0  # 0: derived from the job id (as JAX's own Slurm detection)
    # an RL job's rollout fleet on one extra node: N servers behind SGLang's router (rlvr.rollout.fleet)
    rollout_workers: int = 0
    rollout_model: str = ""  # the servers' initial HF checkpoint (default: the job's init.hf_checkpoint)
    rollout_gpus_per_worker: int = 1
    rollout_server: str = "sglang"  # sglang (python -m sglang.launch_server) | rlvr (python -m rlvr.rollout.server)
    rollout_port: int = 30100  # the router's
    rollout_start_timeout: int = 1800  # seconds the job waits for the fleet before giving up
    aot_check: bool = True
    hbm_fraction: float = 0.9

    def check(self) -> None:
        positive("gpus_per_node", self.gpus_per_node, "slurm")
        positive("nodes", self.nodes, "slurm")
        if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}|\d+", self.time):
            raise OptionError(f"--time={self.time!r}: use Slurm's [D-]HH:MM:SS (or minutes), e.g. --time=24:00:00.")
        if self.cpus_per_task < 0 or not 0 <= self.coordinator_port < 65536:
            raise OptionError("--cpus_per_task must be >= 0 and --coordinator_port in [0, 65536).")
        if self.rollout_workers < 0 or self.rollout_gpus_per_worker < 1:
            raise OptionError("--rollout_workers must be >= 0 and --rollout_gpus_per_worker >= 1.")
        if self.rollout_workers * self.rollout_gpus_per_worker > self.gpus_per_node:
            raise OptionError(f"--rollout_workers={self.rollout_workers} x --rollout_gpus_per_worker="
                              f"{self.rollout_gpus_per_worker} GPUs do not fit the fleet's node "
                              f"(--gpus_per_node={self.gpus_per_node}).")
        if self.rollout_server not in ("sglang", "rlvr"):
            raise OptionError(f"--rollout_server={self.rollout_server!r}: use sglang or rlvr.")


FLEET_ROUTER = "http://rlvr-fleet-router"  # stands for the fleet's router in the validated overrides


def _directives(name: str, logs: str, opts: SlurmOptions) -> list[str]:
    nodes = opts.nodes + (1 if opts.rollout_workers else 0)  # the fleet's node last
    lines = [f"--job-name={name}", f"--nodes={nodes}", "--ntasks-per-node=1",
             f"--gpus-per-node={opts.gpus_per_node}", f"--time={opts.time}",
             f"--output={os.path.join(logs, name)}-%j.out"]
    for key in ("partition", "account", "qos", "constraint", "mem"):
        if getattr(opts, key):
            lines.append(f"--{key}={getattr(opts, key)}")
    if opts.cpus_per_task:
        lines.append(f"--cpus-per-task={opts.cpus_per_task}")
    if opts.exclusive:
        lines.append("--exclusive")
    return [f"#SBATCH {line}" for line in lines]


def script(job, name: str, logs: str, repo_dir: str, opts: SlurmOptions) -> str:
    """The sbatch script of one (already adjusted) job."""
    exports = {"PYTHONUNBUFFERED": "1", "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{opts.hbm_fraction:g}"}
    if opts.coordinator_port:
        exports["RLVR_COORDINATOR_PORT"] = str(opts.coordinator_port)
    command = shlex.join([opts.python, *job.command[1:]])
    lines = ["#!/bin/bash", f"# rlvr job {job.name}: {opts.nodes} node(s) x {opts.gpus_per_node} {opts.gpu}",
             *_directives(name, logs, opts), "", "set -euo pipefail", f"cd {shlex.quote(repo_dir)}"]
    lines += [opts.setup] if opts.setup else []
    lines += [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]
    lines += [f"mkdir -p {shlex.quote(job.workdir)}"]
    if opts.rollout_workers:
        lines += _fleet_lines(job, opts)
        placeholder = shlex.quote(f"--config.rl.sglang_router={FLEET_ROUTER}")
        command = command.replace(placeholder, f'"--config.rl.sglang_router=http://${{FLEET_NODE}}:{opts.rollout_port}"')
    relative = " --relative=0" if opts.rollout_workers else ""  # the trainer's nodes: all but the fleet's
    lines += [f"srun --nodes={opts.nodes}{relative} --ntasks-per-node=1 --kill-on-bad-exit=1 \\", "    " + command, ""]
    return "\n".join(lines)


def _fleet_lines(job, opts: SlurmOptions) -> list[str]:
    """Start the rollout fleet (N servers + the router, `rlvr.rollout.fleet`) on the allocation's last
    node in the background and wait (bounded) for its ready file; it stops when the script exits."""
    model = opts.rollout_model or job.config.get("init", {}).get("hf_checkpoint", "")
    ready = f"{job.workdir}/rollout_fleet.json"
    fleet = [opts.python, "-m", "rlvr.rollout.fleet", f"--hf_dir={model}", f"--workers={opts.rollout_workers}",
             "--router", f"--server={opts.rollout_server}", "--host=0.0.0.0", f"--port={opts.rollout_port}",
             f"--devices_per_worker={opts.rollout_gpus_per_worker}", f"--ready_file={ready}",
             f"--log_dir={job.workdir}/rollout_fleet_logs", f"--start_timeout={opts.rollout_start_timeout}"]
    return [
        'FLEET_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n 1)',
        f"rm -f {shlex.quote(ready)}",
        f"srun --nodes=1 --ntasks=1 --relative={opts.nodes} --kill-on-bad-exit=1 {shlex.join(fleet)} &",
        "FLEET_PID=$!",
        "trap 'kill $FLEET_PID 2>/dev/null || true' EXIT",
        f"for _ in $(seq {opts.rollout_start_timeout}); do [ -s {shlex.quote(ready)} ] && break; "
        "kill -0 $FLEET_PID 2>/dev/null || break; sleep 1; done",
        f'[ -s {shlex.quote(ready)} ] || {{ echo "rollout fleet not ready: see {job.workdir}/rollout_fleet_logs" >&2; '
        "exit 1; }",
    ]


def _fleet_overrides(job, opts: SlurmOptions) -> dict:
    if not opts.rollout_workers:
        return {}
    if job.config.get("job") != "rl":
        raise OptionError(f"--rollout_workers: job {job.name} is a {job.config.get('job')!r} job; the rollout "
                          "fleet serves RL rollouts only (drop the option).")
    if not (opts.rollout_model or job.config.get("init", {}).get("hf_checkpoint")):
        raise OptionError(f"--rollout_workers: give --rollout_model=PATH (an HF checkpoint with job {job.name}'s "
                          "architecture, on the shared filesystem) for the servers to start from.")
    return {"rl.backend": "sglang", "rl.sglang_router": FLEET_ROUTER}


def _write(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP)
    return path


def write(experiment, options: dict[str, str]) -> list[str]:
    """TARGETS["slurm"]: writes EXPERIMENT/slurm/<job>.sbatch and submit.sh; returns the paths."""
    opts = parse_options(SlurmOptions, options, "slurm")
    acc = gpu_accelerator(opts.gpu, opts.gpus_per_node, opts.nodes)
    root = opts.workdir_root.rstrip("/") if opts.workdir_root else os.path.join(experiment.directory, "jobs")
    adjusted = common.adjust_jobs(experiment, lambda job: _fleet_overrides(job, opts),
                                  lambda job: os.path.join(root, job.name))
    common.check(adjusted, acc, opts.aot_check, opts.hbm_fraction)
    out = os.path.join(experiment.directory, "slurm")
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    repo_dir = os.path.abspath(opts.repo_dir or os.getcwd())
    paths = []
    for job in adjusted.jobs:
        name = re.sub(r"[^A-Za-z0-9._-]", "_", f"{experiment.name}-{job.name}")
        paths.append(_write(os.path.join(out, f"{job.name}.sbatch"), script(job, name, logs, repo_dir, opts)))
    submit = ["#!/bin/bash", f"# submits the {len(paths)} job(s) of experiment {experiment.name}",
              "set -euo pipefail", *[f"sbatch {shlex.quote(p)}" for p in paths], ""]
    return paths + [_write(os.path.join(out, "submit.sh"), "\n".join(submit))]
