"""Ahead-of-time fit check: will each job's train step fit the target's accelerator memory?

The cluster targets call `check_experiment` before writing anything. Each job is compiled for the
target's device count on fake CPU devices (a subprocess: the device count must be set before jax
is imported) and XLA's per-device memory analysis is compared with the accelerator's HBM times a
headroom fraction. A job that does not fit is refused with its name, the needed and available
memory and the usual fixes; `--aot_check=false` on the launch command skips the check.

What is compiled, per job kind:
  sft, dpo, rm  the train step, as `rlvr.aot.analyze` does (params, optimizer state, batch, temps)
  rl            the RL train step (`rlvr.rl.objective.rl_loss` on a batch of the configured rollout
                shape, the frozen reference inside it when the KL is a loss term), plus what stays
                resident beside it: the reference params (KL as a reward penalty) and, for the
                embedded rollout engine, its copy of the params and its paged KV cache (split over
                KV heads on a tensor axis, else whole on every device) and, compiled for a TPU
                topology, the larger temp of its prefill and decode programs
  eval          not checked: reported as such, never as a pass
On a TPU target with the TPU compiler installed (the `tpu` extra: libtpu, deviceless) every job is
compiled by it for the slice's topology; otherwise XLA:CPU's buffer assignment approximates a TPU/GPU
compile (fusion and layouts differ; gigabytes off at 1.7B parameters), labelled as such in each
report's note.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from rlvr.aot import TPU_HBM_GIB

GIB = 2**30

# Per-chip HBM in GiB. TPUs: Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v4, /v5e,
# /v5p, /v6e: v4 32 GiB, v5e 16 GB, v5p 95 GiB, v6e 32 GB per chip). GPUs: NVIDIA data sheets (A100
# 40GB / 80GB, H100 SXM 80GB, H200 141GB). The "GB" of both vendors' HBM figures are treated as GiB
# here; the default 0.9 headroom fraction more than covers the difference and runtime reservations.
HBM_GIB: dict[str, float] = {
    **TPU_HBM_GIB,
    "a100": 80.0, "a100-40gb": 40.0, "h100": 80.0, "h200": 141.0,
}

FIXES = ("more chips or a wider fsdp axis (--tpu/--nodes, --config.mesh.fsdp), a smaller batch "
         "(--config.data.batch_size / rl.prompts_per_step) or more micro-batches (--config.train.micro_batches), "
         "remat (--config.model.remat_policy), chunked log-probs (--config.train.logprob_chunk_size=1024)")


class FitError(ValueError):
    """A job does not fit (or could not be compiled for) the target; the message names the job and fix."""


@dataclasses.dataclass
class FitReport:
    """One job's check. `needed_bytes` is None when the job kind is not checked (see `note`)."""

    job: str
    devices: int
    budget_bytes: int
    needed_bytes: int | None
    components: dict[str, int]
    note: str = ""

    @property
    def checked(self) -> bool:
        return self.needed_bytes is not None

    @property
    def fits(self) -> bool:
        return self.checked and self.needed_bytes <= self.budget_bytes

    def line(self) -> str:
        if not self.checked:
            return f"fit check: job {self.job}: NOT CHECKED ({self.note})"
        verdict = "fits" if self.fits else "DOES NOT FIT"
        note = f"; {self.note}" if self.note else ""
        return (f"fit check: job {self.job}: {self.needed_bytes / GIB:.3f} GiB per device of "
                f"{self.budget_bytes / GIB:.3f} GiB available on {self.devices} devices: {verdict}{note}")


def hbm_gib(accelerator: str) -> float:
    """Per-chip HBM of a known accelerator name (see HBM_GIB); a clear error otherwise."""
    key = accelerator.lower()
    if key not in HBM_GIB:
        raise FitError(f"accelerator {accelerator!r} has no known HBM size; known: {sorted(HBM_GIB)} "
                       "(or skip the check with --aot_check=false).")
    return HBM_GIB[key]


def analyze_jobs(config_spec: str, overrides: list[Mapping[str, Any]], devices: int, labels: list[str],
                 python: str = sys.executable, timeout_s: float = 3600.0,
                 topology: str | None = None) -> list[dict[str, Any]]:
    """Compiles each job (its overrides on `config_spec`) for `devices` fake CPU devices, or with the
    TPU compiler for `topology` ('v5p:2x2x1'), all in one subprocess (one jax start-up for a whole
    sweep); returns one analysis dict per job."""
    # Values travel as Python literals (tuples and None survive, unlike JSON).
    request = json.dumps({"config_spec": config_spec, "topology": topology,
                          "jobs": [{k: repr(v) for k, v in o.items()} for o in overrides]})
    cmd = [python, "-m", "rlvr.launch.fit", f"--devices={devices}"]
    result = subprocess.run(cmd, input=request, capture_output=True, text=True, timeout=timeout_s,
                            env=_cpu_env(devices))
    lines = [json.loads(ln) for ln in result.stdout.splitlines() if ln.startswith("{")]
    if result.returncode or len(lines) != len(overrides):
        failed = labels[len(lines)] if len(lines) < len(labels) else "?"
        raise FitError(f"job {failed}: the fit check could not compile it for {devices} devices:\n"
                       f"{result.stderr.strip()[-3000:]}\n(fix the config, or skip with --aot_check=false)")
    return lines


def check_experiment(experiment, devices: int, hbm_gib_per_chip: float, fraction: float, where: str,
                     python: str = sys.executable, echo=print, topology: str | None = None) -> list[FitReport]:
    """Checks every job of `experiment` (a `rlvr.launch.sweep.Experiment`), compiled for a TPU
    `topology` when given; raises FitError for the first job that does not fit, naming it, the needed
    vs available memory and the fixes."""
    budget = int(hbm_gib_per_chip * fraction * GIB)
    names = [job.name for job in experiment.jobs]
    analyses = analyze_jobs(experiment.config_spec, [job.overrides for job in experiment.jobs], devices, names,
                            python, topology=topology)
    reports = []
    for name, analysis in zip(names, analyses, strict=True):
        needed = analysis["needed_bytes"]
        report = FitReport(name, devices, budget, None if needed is None else int(needed),
                           analysis["components"], analysis["note"])
        echo(report.line())
        reports.append(report)
    for report in reports:
        if report.checked and not report.fits:
            parts = ", ".join(f"{k} {v / GIB:.3f}" for k, v in report.components.items())
            raise FitError(
                f"job {report.job} does not fit {where}: it needs {report.needed_bytes / GIB:.3f} GiB per device "
                f"({parts}) but {budget / GIB:.3f} GiB is available ({hbm_gib_per_chip:g} GiB HBM x {fraction:g} "
                f"headroom). Fix: {FIXES}; or skip the check with --aot_check=false.")
    return reports


def _cpu_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


# --- the subprocess ------------------------------------------------------------------------------

def analyze_job(config, topology: str | None = None) -> dict[str, Any]:
    """{"needed_bytes", "components", "note"} for one validated config on the visible devices, or
    compiled for a TPU `topology` by the TPU compiler."""
    from rlvr import aot

    if config.job in ("sft", "dpo", "rm"):
        report = aot.analyze(config, topology)
        note = report["compiler"] + (f"; refused: {report['refused']}" if report.get("refused") else "")
        return {"needed_bytes": report["per_device_total_bytes"],
                "components": {"train_step": report["per_device_total_bytes"]}, "note": note}
    if config.job == "rl":
        return analyze_rl(config, topology)
    return {"needed_bytes": None, "components": {},
            "note": f"job kind {config.job!r} has no train step; its memory is not checked"}


def engine_bytes(cfg, engine, param_bytes: int) -> dict[str, int]:
    """The embedded engine's memory per device: its own copy of the weights (`param_bytes` in the
    model's param_dtype) in rl.engine.dtype, and its KV pages in rl.engine.kv_dtype."""
    import jax.numpy as jnp

    pages = engine.max_slots * (engine.max_len // engine.page_size) + 1
    kv = 2 * cfg.num_layers * pages * engine.page_size * cfg.num_kv_heads * cfg.head_dim
    return {"engine_params": param_bytes * jnp.dtype(engine.dtype).itemsize // jnp.dtype(cfg.param_dtype).itemsize,
            "engine_kv_cache": kv * jnp.dtype(engine.kv_dtype or engine.dtype).itemsize}


def per_device_bytes(tree) -> int:
    """Bytes of the largest shard of each leaf of an abstract, sharded pytree, summed."""
    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def analyze_rl(config, topology: str | None = None) -> dict[str, Any]:
    """The RL train step (`rlvr.aot.analyze`) plus the memory resident beside it (module docstring)."""
    from rlvr import aot

    rl = config.rl
    report, program = aot.analyze_program(config, topology)
    state, base = program.args[0], program.args[4]
    shared = per_device_bytes(base) if base is not None and program.in_step_reference else 0  # passed twice, held once
    components = {"train_step": report["per_device_total_bytes"] - shared}
    params = per_device_bytes(state["params"]) + (per_device_bytes(base) if base is not None else 0)
    use_ref = rl.reference_model or rl.kl_coef > 0
    if use_ref and not program.in_step_reference and base is None:  # (a LoRA policy's reference is its base)
        components["reference_params"] = params
    notes = [report["compiler"]] + (["train step refused: " + report["refused"]] if report.get("refused") else [])
    if rl.backend == "embedded" and topology is not None:  # the engine's programs, compiled too
        engine = aot.analyze_engine(config, topology)
        notes += [f"engine {name} refused: {r['refused']}"
                  for name, r in engine["programs"].items() if r.get("refused")]
        components.update(engine_params=engine["engine_params_bytes"], engine_kv_cache=engine["engine_pool_bytes"],
                          engine_temp=engine["temp_bytes"])
    elif rl.backend == "embedded":
        components.update(engine_bytes(program.cfg, rl.engine, params))
        notes.append("engine: weights + KV pages counted, its programs' temp not")
    else:
        notes.append("rollout runs on the SGLang servers: their memory is not checked here")
    return {"needed_bytes": sum(components.values()), "components": components, "note": "; ".join(notes)}


def main(argv: list[str]) -> int:
    """Subprocess entry: `python -m rlvr.launch.fit --devices=N` with {"config_spec", "jobs": [overrides]}
    on stdin; prints one JSON line per job. XLA_FLAGS/JAX_PLATFORMS come from the parent (`_cpu_env`)."""
    devices = int(next(a for a in argv if a.startswith("--devices=")).split("=", 1)[1])
    request = json.loads(sys.stdin.read())
    import jax

    from rlvr import config_lib, start
    from rlvr.main import TRAINERS

    topology = request.get("topology")
    if topology is None and jax.device_count() != devices:
        print(f"expected {devices} fake devices, jax sees {jax.device_count()}", file=sys.stderr)
        return 1
    for job in request["jobs"]:
        overrides = {k: ast.literal_eval(v) for k, v in job.items()}
        config = config_lib.load_config(request["config_spec"], overrides)
        try:
            start.validate(config, devices, TRAINERS)
            config = start.resolve(config)  # the checkpoint's architecture, the derived RL budgets
        except config_lib.ConfigError as e:
            print(f"config error on {devices} devices: {e}", file=sys.stderr)
            return 2
        print(json.dumps(analyze_job(config, topology), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
