"""Launch a config as one job or as a sweep, locally or on a cluster; print an experiment's results.

    python -m rlvr.launch configs/X.py[:arg] [--sweep] [--target=local] [--exp=NAME] [--root=experiments]
           [--parallel=N] [--config.a.b=v ...] [--dry_run] [target options --key=value ...]
    python -m rlvr.launch results EXP_OR_DIR [--root=experiments] [--csv=F] [--plot=F] [--metric=NAME,...]
    python -m rlvr.launch plan WORKDIR [--set.FIELD=V ...] [--grid.FIELD=a,b ...] [--cost.trainer=X ...]

Without --sweep the config runs as one job; with it, the config module's `get_sweep()` gives one job
per entry, each on top of the common `--config.a.b=v` overrides (parsed with the field's type). Every
job's config is validated before any job starts. The launch writes ROOT/EXP/experiment.json and
ROOT/EXP/jobs/NAME/job.json (EXP defaults to `<config name>-<YYYYmmdd-HHMMSS>`); each job's workdir is
its folder. --target=local runs the jobs here, --parallel at a time, and prints the results table;
running the same command with the same --exp again skips succeeded jobs and re-runs the others.
--target=xm|k8s|slurm hands the experiment and the other `--key=value` flags to
`rlvr.launch.targets.TARGETS[target]`, which writes the cluster's files. --dry_run writes the
experiment directory and prints the commands; nothing runs. `plan` simulates a larger RL run
calibrated on a measured one (rlvr.launch.plan).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from rlvr.launch import local, records, results, sweep
from rlvr.launch.sweep import LaunchError

from rlvr import config_lib

LAUNCH_FLAGS = {"target": "local", "exp": None, "root": "experiments", "parallel": "1"}
LAUNCH_SWITCHES = ("sweep", "dry_run")
RESULTS_FLAGS = {"root": "experiments", "csv": None, "plot": None, "metric": None}


def parse_flags(argv: list[str], valued: dict[str, str | None], switches: tuple[str, ...] = ()
                ) -> tuple[list[str], dict[str, Any], dict[str, str]]:
    """(positionals, known flags with defaults, other `--key=value` flags). Values need `=`."""
    positionals: list[str] = []
    known: dict[str, Any] = {**valued, **{name: False for name in switches}}
    other: dict[str, str] = {}
    for arg in argv:
        if not arg.startswith("--"):
            positionals.append(arg)
            continue
        key, has_value, value = arg[2:].partition("=")
        if key in switches:
            if has_value:
                raise LaunchError(f"{arg}: --{key} is a switch; give it without a value.")
            known[key] = True
        elif key in valued:
            if not has_value or not value:
                raise LaunchError(f"{arg}: give a value, --{key}=VALUE.")
            known[key] = value
        elif has_value:
            other[key] = value
        else:
            raise LaunchError(f"unknown flag {arg}; flags are --key=value (switches: "
                              f"{', '.join('--' + s for s in switches) or 'none'}).")
    return positionals, known, other


def launch(argv: list[str]) -> int:
    """The launch command; returns the process exit status."""
    positionals, flags, other = parse_flags(argv, LAUNCH_FLAGS, LAUNCH_SWITCHES)
    if len(positionals) != 1:
        raise LaunchError(f"give exactly one config, e.g. configs/X.py[:arg] (got {positionals}).")
    spec, target = positionals[0], flags["target"]
    options = {k: v for k, v in other.items() if not k.startswith("config.")}
    writer = _target_writer(target) if target != "local" else None
    if writer is None and options:
        raise LaunchError(f"unknown flag --{next(iter(options))}: --target=local takes no target options.")
    parallel = _positive_int(flags["parallel"], "--parallel")
    probe = _start_probe() if writer is None else None  # runs while the configs load
    try:
        base = sweep.load_base_config(spec)
        overrides = {k[len("config."):]: sweep.parse_value(base, k[len("config."):], v)
                     for k, v in other.items() if k.startswith("config.")}
        sweep.trainer_names()  # imports the trainers (no backend) while the probe runs
        devices = _device_count(probe) if probe else None
    finally:
        if probe and probe.poll() is None:
            probe.kill()
            probe.wait()
    experiment = sweep.expand(spec, overrides, flags["sweep"], flags["root"], flags["exp"], num_devices=devices,
                              python=sys.executable if writer is None else "python")
    with records.locked(experiment.directory):
        records.write_experiment(experiment, target, [sys.executable, "-m", "rlvr.launch", *argv])
        print(f"experiment {experiment.directory}: {len(experiment.jobs)} job(s), target {target}", flush=True)
        if flags["dry_run"]:
            for job in experiment.jobs:
                print(shlex.join(job.command))
            return 0
        if writer is not None:
            return _write_target(writer, target, experiment, options)
        code = local.run(experiment, parallel)
    print(results.report(experiment.directory))
    return code


def show_results(argv: list[str]) -> int:
    """The results command: prints the table, writes the CSV and PNG if asked."""
    positionals, flags, other = parse_flags(argv, RESULTS_FLAGS)
    if other:
        raise LaunchError(f"unknown flag --{next(iter(other))} for results; flags: "
                          f"{', '.join('--' + f for f in RESULTS_FLAGS)}.")
    if len(positionals) != 1:
        raise LaunchError(f"results: give one experiment name or directory (got {positionals}).")
    exp_dir = results.experiment_dir(positionals[0], flags["root"])
    metrics = [m for m in flags["metric"].split(",") if m] if flags["metric"] else None
    print(results.report(exp_dir, metrics, flags["csv"], flags["plot"]))
    for path in filter(None, (flags["csv"], flags["plot"])):
        print(f"wrote {path}")
    return 0


def _start_probe() -> subprocess.Popen:
    """Counts the JAX devices local jobs will see in a child process: the launcher itself never
    starts a backend (it would hold accelerator memory the jobs need)."""
    return subprocess.Popen([sys.executable, "-c", "import jax; print(jax.device_count())"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _device_count(probe: subprocess.Popen) -> int:
    out, err = probe.communicate(timeout=600)
    if probe.returncode:
        raise LaunchError(f"could not count this machine's JAX devices:\n{err[-2000:]}")
    return int(out.split()[-1])


def _target_writer(target: str) -> Callable[..., list[str]]:
    try:
        from rlvr.launch.targets import TARGETS
    except ImportError as e:
        raise LaunchError(f"--target={target}: cluster targets are not available ({e}); use --target=local.") from None
    if target not in TARGETS:
        raise LaunchError(f"--target={target} is unknown; choose local or one of {sorted(TARGETS)}.")
    return TARGETS[target]


def _write_target(writer: Callable[..., list[str]], target: str, experiment: sweep.Experiment,
                  options: dict[str, str]) -> int:
    try:
        paths = writer(experiment, options)
    except ValueError as e:
        message = str(e) if str(e).startswith(f"--target={target}") else f"--target={target}: {e}"
        raise LaunchError(message) from None
    for path in paths:
        print(f"wrote {path}")
    return 0


def show_plan(argv: list[str]) -> int:
    """The plan command: simulate a larger run calibrated on a measured one (rlvr.launch.plan)."""
    from rlvr.launch import plan

    positionals, _, other = parse_flags(argv, {})
    if len(positionals) != 1:
        raise LaunchError(f"plan: give one workdir of a measured rl run (got {positionals}).")
    print(plan.report(plan.run(positionals[0], other)))
    return 0


def _positive_int(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise LaunchError(f"{flag}={text}: must be a positive integer.")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        if argv[0] == "results":
            return show_results(argv[1:])
        if argv[0] == "plan":
            return show_plan(argv[1:])
        return launch(argv)
    except (LaunchError, config_lib.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
