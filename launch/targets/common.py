"""Steps every cluster target shares: rewrite jobs for the cluster, validate them, fit-check them."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from rlvr.launch import fit
from rlvr.launch.targets.options import Accelerator, OptionError


def adjust_jobs(experiment, extra: Callable[[Any], dict[str, Any]], workdir: Callable[[Any], str]):
    """A copy of `experiment` whose jobs carry `extra(job)` overrides and run in `workdir(job)` (shared
    storage as the cluster sees it); each job's argv is rebuilt with `rlvr.launch.sweep.job_argv` and
    its resolved config re-read, so everything downstream sees what will actually run."""
    from rlvr.launch import sweep

    jobs = []
    for job in experiment.jobs:
        overrides = {**job.overrides, **extra(job)}
        path = workdir(job)
        config = sweep.resolve(experiment.config_spec, overrides, job.name, sweep.smallest_mesh(job.config["mesh"]))
        jobs.append(dataclasses.replace(job, overrides=overrides, config=config.to_dict(), workdir=path,
                                        command=sweep.job_argv(experiment.config_spec, overrides, path)))
    return dataclasses.replace(experiment, jobs=jobs)


def check(experiment, accelerator: Accelerator, aot_check: bool, hbm_fraction: float,
          python: str = sys.executable, echo=print) -> list[fit.FitReport]:
    """Each job's config validated for the accelerator's device count, then (unless `aot_check` is
    off) the fit check. Raises OptionError / fit.FitError (both ValueError) naming the job."""
    from rlvr.launch import sweep

    from rlvr import config_lib, start

    if not 0 < hbm_fraction <= 1:
        raise OptionError(f"--hbm_fraction={hbm_fraction}: must be in (0, 1].")
    for job in experiment.jobs:
        config = config_lib.load_config(experiment.config_spec, job.overrides)
        try:
            start.validate(config, accelerator.devices, sweep.trainer_names())
        except config_lib.ConfigError as e:
            raise OptionError(f"job {job.name} on {accelerator.spec} ({accelerator.devices} devices): {e}") from None
    if not aot_check:
        echo("fit check: skipped (--aot_check=false)")
        return []
    return fit.check_experiment(experiment, accelerator.devices, accelerator.hbm_gib, hbm_fraction,
                                f"{accelerator.spec} ({accelerator.devices} devices)", python, echo,
                                topology=compile_topology(accelerator))


def compile_topology(accelerator: Accelerator) -> str | None:
    """The TPU topology the fit check compiles for with the TPU compiler ('v5p:2x2x4'), or None (a GPU
    target, or libtpu not installed: then XLA:CPU's estimate, labelled as such)."""
    from rlvr.kernels.target import tpu_compiler_unavailable_reason

    if accelerator.kind != "tpu" or not accelerator.topology or tpu_compiler_unavailable_reason():
        return None
    return f"{accelerator.name}:{accelerator.topology}"


def k8s_validator(echo=print) -> Callable[[list[dict]], None] | None:
    """`rlvr.launch.targets.k8s_validate.validate_objects` when the `kubernetes` client (the `k8s`
    extra) is installed; otherwise None, and says that the manifests go unvalidated."""
    try:
        from rlvr.launch.targets import k8s_validate
    except ImportError:
        echo("k8s: manifests not schema-validated (pip install 'rlvr[k8s]' for the kubernetes client models)")
        return None
    return k8s_validate.validate_objects


def job_args(command: list[str]) -> list[str]:
    """The `rlvr.main` flags of a job's argv (what follows `-m rlvr.main`)."""
    return command[command.index("rlvr.main") + 1:]
