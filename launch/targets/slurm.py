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
    aot_check: bool = True
    hbm_fraction: float = 0.9

    def check(self) -> None:
        positive("gpus_per_node", self.gpus_per_node, "slurm")
        positive("nodes", self.nodes, "slurm")
        if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}|\d+", self.time):
            raise OptionError(f"--time={self.time!r}: use Slurm's [D-]HH:MM:SS (or minutes), e.g. --time=24:00:00.")
        if self.cpus_per_task < 0 or not 0 <= self.coordinator_port < 65536:
            raise OptionError("--cpus_per_task must be >= 0 and --coordinator_port in [0, 65536).")


def _directives(name: str, logs: str, opts: SlurmOptions) -> list[str]:
    lines = [f"--job-name={name}", f"--nodes={opts.nodes}", "--ntasks-per-node=1",
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
    command = [opts.python, *job.command[1:]]
    lines = ["#!/bin/bash", f"# rlvr job {job.name}: {opts.nodes} node(s) x {opts.gpus_per_node} {opts.gpu}",
             *_directives(name, logs, opts), "", "set -euo pipefail", f"cd {shlex.quote(repo_dir)}"]
    lines += [opts.setup] if opts.setup else []
    lines += [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]
    lines += [f"mkdir -p {shlex.quote(job.workdir)}",
              f"srun --nodes={opts.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
              "    " + shlex.join(command), ""]
    return "\n".join(lines)


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
    adjusted = common.adjust_jobs(experiment, lambda job: {}, lambda job: os.path.join(root, job.name))
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
