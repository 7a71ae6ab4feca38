"""xmanager target: one work unit per job, through xmanager's open-source `xm_local` launcher.

    python -m rlvr.launch configs/X.py --sweep --target=xm --gpu=h100 --gpus_per_node=8 [--executor=vertex]
    pip install 'rlvr[xm]' && xmanager launch EXPERIMENT/xm/launch.py

The target writes the launch plan as data, `EXPERIMENT/xm/launch_plan.json` (executor, executable,
accelerator requirements, each work unit's args and env), readable without xmanager, and
`launch.py`, which feeds that plan to `apply_plan` with the real `xmanager.xm` / `xm_local`
modules. xmanager is an optional extra and is imported only there: it is heavy (about 90 packages
with google-cloud-aiplatform and SQLAlchemy, and it pins protobuf below 7).

The executable is `xm.python_container` over this checkout with entrypoint `rlvr.main` (xmanager
builds the image), or with --image a prebuilt image (`xm.container`) whose ENTRYPOINT is
`python -m rlvr.main`. One host per job: xm_local's executors do not start a multi-host JAX job,
so a multi-host accelerator is refused here (use --target=k8s or --target=slurm for those).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from rlvr.launch.targets import common
from rlvr.launch.targets.options import Accelerator, OptionError, accelerator_from, parse_options

EXECUTORS = ("local", "vertex", "kubernetes")
# xm.ResourceType names (xmanager/xm/resources.py) for the accelerators rlvr knows.
RESOURCE_NAMES = {"v4": "tpu_v4", "v5e": "tpu_v5e", "v5p": "tpu_v5p", "v6e": "tpu_v6e",
                  "a100": "a100_80gib", "a100-40gb": "a100", "h100": "h100", "h200": "h200"}

LAUNCHER = '''"""Launches rlvr experiment {name!r} with xmanager: `xmanager launch {path}`
(needs `pip install 'rlvr[xm]'`). The plan is launch_plan.json beside this file."""

import json
import os

from absl import app
from xmanager import xm, xm_local

from rlvr.launch.targets.xm import apply_plan

PLAN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_plan.json")


def main(_):
    with open(PLAN) as f:
        print("experiment id:", apply_plan(json.load(f), xm, xm_local))


if __name__ == "__main__":
    app.run(main)
'''


@dataclasses.dataclass
class XmOptions:
    """`--key=value` options of --target=xm."""

    executor: str = "vertex"  # local | vertex | kubernetes (xm_local executors)
    image: str = ""  # prebuilt image (ENTRYPOINT python -m rlvr.main); default: build from --repo_dir
    repo_dir: str = ""  # the project xmanager packages (default: this checkout)
    base_image: str = ""  # python_container's FROM (default: xmanager's)
    tpu: str = ""
    tpu_topology: str = ""
    gpu: str = ""
    gpus_per_node: int = 8
    nodes: int = 1
    workdir_root: str = ""  # default: the experiment's jobs/ folder (use gs://... for Vertex)
    aot_check: bool = True
    hbm_fraction: float = 0.9

    def check(self) -> None:
        if self.executor not in EXECUTORS:
            raise OptionError(f"--executor={self.executor!r}: choose one of {list(EXECUTORS)}.")


def requirements(acc: Accelerator, executor: str) -> dict[str, Any]:
    """`xm.JobRequirements(**this)`: the accelerator as an xm resource (TPU: its slice topology)."""
    if acc.kind == "tpu" and executor == "vertex":
        raise OptionError(f"--target=xm --executor=vertex cannot run {acc.spec}: xm_local's Vertex executor maps "
                          "only TPU v2/v3 (xmanager 0.8.5). Use --target=k8s for TPU slices.")
    if acc.hosts != 1:
        raise OptionError(f"--target=xm runs one host per job, but {acc.spec} has {acc.hosts} hosts: xm_local does "
                          "not start multi-host JAX. Use --target=k8s or --target=slurm, or a single-host size.")
    quantity: Any = acc.topology if acc.kind == "tpu" else acc.chips_per_host
    return {RESOURCE_NAMES[acc.name]: quantity}


def build_plan(experiment, acc: Accelerator, opts: XmOptions) -> dict[str, Any]:
    """The launch plan (JSON-able): what `apply_plan` turns into xm calls."""
    if opts.image:
        executable = {"kind": "container", "image_path": opts.image}
    else:
        executable = {"kind": "python_container", "path": os.path.abspath(opts.repo_dir or os.getcwd()),
                      "entrypoint_module": "rlvr.main", "base_image": opts.base_image or None}
    env = {"PYTHONUNBUFFERED": "1"}
    if acc.kind == "gpu":
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{opts.hbm_fraction:g}"
    units = [{"job": job.name, "args": common.job_args(job.command), "env_vars": env} for job in experiment.jobs]
    return {"experiment_title": experiment.name, "executor": opts.executor, "executable": executable,
            "requirements": requirements(acc, opts.executor), "accelerator": acc.spec, "work_units": units}


def apply_plan(plan: dict[str, Any], xm, xm_local) -> int:
    """Creates the xm_local experiment: one packaged executable, one work unit per job. `xm` and
    `xm_local` are the xmanager modules (passed in, so rlvr never imports xmanager itself)."""
    executor_cls = {"local": xm_local.Local, "vertex": xm_local.Vertex, "kubernetes": xm_local.Kubernetes}[
        plan["executor"]]
    exe = plan["executable"]
    with xm_local.create_experiment(experiment_title=plan["experiment_title"]) as experiment:
        spec = executor_cls.Spec()
        if exe["kind"] == "container":
            packageable = xm.container(executor_spec=spec, image_path=exe["image_path"])
        else:
            packageable = xm.python_container(executor_spec=spec, path=exe["path"],
                                              entrypoint=xm.ModuleName(exe["entrypoint_module"]),
                                              base_image=exe["base_image"])
        [executable] = experiment.package([packageable])
        for unit in plan["work_units"]:
            executor = executor_cls(requirements=xm.JobRequirements(**plan["requirements"]))
            experiment.add(xm.Job(executable=executable, executor=executor, name=unit["job"],
                                  args=list(unit["args"]), env_vars=dict(unit["env_vars"])))
        return experiment.experiment_id


def write(experiment, options: dict[str, str]) -> list[str]:
    """TARGETS["xm"]: writes EXPERIMENT/xm/launch_plan.json and launch.py; returns the paths."""
    opts = parse_options(XmOptions, options, "xm")
    acc = accelerator_from(opts.tpu, opts.tpu_topology, opts.gpu, opts.gpus_per_node, opts.nodes, "xm")
    requirements(acc, opts.executor)  # refuses what xm_local cannot run before anything is compiled
    root = opts.workdir_root.rstrip("/") if opts.workdir_root else os.path.join(experiment.directory, "jobs")
    adjusted = common.adjust_jobs(experiment, lambda job: {}, lambda job: f"{root}/{job.name}")
    common.check(adjusted, acc, opts.aot_check, opts.hbm_fraction)
    out = os.path.join(experiment.directory, "xm")
    os.makedirs(out, exist_ok=True)
    plan_path, launcher_path = os.path.join(out, "launch_plan.json"), os.path.join(out, "launch.py")
    with open(plan_path, "w") as f:
        json.dump(build_plan(adjusted, acc, opts), f, indent=2)
    with open(launcher_path, "w") as f:
        f.write(LAUNCHER.format(name=experiment.name, path=launcher_path))
    return [plan_path, launcher_path]
