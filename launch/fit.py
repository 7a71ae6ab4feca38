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
                embedded rollout engine, its copy of the params and its paged KV cache (allocated
                unsharded, so counted whole on one device)
  eval          not checked: reported as such, never as a pass
XLA:CPU's buffer assignment approximates a TPU/GPU compile (fusion and layouts differ), hence the
headroom. A real topology compile needs libtpu (`jax.experimental.topologies`), not required here.
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

GIB = 2**30

# Per-chip HBM in GiB. TPUs: Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v4, /v5e,
# /v5p, /v6e: v4 32 GiB, v5e 16 GB, v5p 95 GiB, v6e 32 GB per chip). GPUs: NVIDIA data sheets (A100
# 40GB / 80GB, H100 SXM 80GB, H200 141GB). The "GB" of both vendors' HBM figures are treated as GiB
# here; the default 0.9 headroom fraction more than covers the difference and runtime reservations.
HBM_GIB: dict[str, float] = {
    "v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0,
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
                 python: str = sys.executable, timeout_s: float = 3600.0) -> list[dict[str, Any]]:
    """Compiles each job (its overrides on `config_spec`) for `devices` fake CPU devices, all in one
    subprocess (one jax start-up for a whole sweep); returns one analysis dict per job."""
    # Values travel as Python literals (tuples and None survive, unlike JSON).
    request = json.dumps({"config_spec": config_spec,
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
                     python: str = sys.executable, echo=print) -> list[FitReport]:
    """Checks every job of `experiment` (a `rlvr.launch.sweep.Experiment`); raises FitError for the
    first job that does not fit, naming it, the needed vs available memory and the fixes."""
    budget = int(hbm_gib_per_chip * fraction * GIB)
    names = [job.name for job in experiment.jobs]
    analyses = analyze_jobs(experiment.config_spec, [job.overrides for job in experiment.jobs], devices, names,
                            python)
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

def analyze_job(config) -> dict[str, Any]:
    """{"needed_bytes", "components", "note"} for one validated config on the visible devices."""
    from rlvr import aot

    if config.job in ("sft", "dpo", "rm"):
        report = aot.analyze(config)
        return {"needed_bytes": report["per_device_total_bytes"],
                "components": {"train_step": report["per_device_total_bytes"]}, "note": ""}
    if config.job == "rl":
        return analyze_rl(config)
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


def _rl_batch(config, cfg) -> dict[str, Any]:
    import numpy as np

    rl = config.rl
    rows, t = rl.prompts_per_step * rl.group_size // rl.updates_per_batch, rl.seq_len
    ints = ("tokens", "positions", "segment_ids", "loss_mask", "seq_index")
    floats = ["advantages", "behaviour_logp", "token_weight"]
    floats += ["old_logp"] if rl.updates_per_batch > 1 else []
    floats += ["returns", "old_values"] if rl.advantage == "gae" else []
    batch = {k: np.zeros((rows, t), np.int32) for k in ints}
    batch.update({k: np.zeros((rows, t), np.float32) for k in floats})
    batch["row_weight"] = np.zeros((rows,), np.float32)
    return batch


def per_device_bytes(tree) -> int:
    """Bytes of the largest shard of each leaf of an abstract, sharded pytree, summed."""
    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def analyze_rl(config) -> dict[str, Any]:
    """The RL train step plus the memory resident beside it (see the module docstring)."""
    import functools

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from rlvr import aot, sharding
    from rlvr.rl.objective import Objective, rl_loss
    from rlvr.train import step as step_lib
    from rlvr.train.optimizer import build_optimizer

    rl = config.rl
    if rl.teacher and rl.distill_estimator == "full":
        raise ValueError("launch.fit: rl.distill_estimator='full' runs the teacher inside the train step, which "
                         "the fit does not model yet; fit with --config.rl.distill_estimator=sampled and add the "
                         "teacher's parameter bytes")
    mesh = sharding.make_mesh(dict(config.mesh))
    cfg = aot.model_config_of(config)
    cfg = dataclasses.replace(cfg, value_head=cfg.value_head or rl.advantage == "gae")
    optimizer = build_optimizer(config.optimizer, config.train.num_steps * rl.updates_per_batch)
    shardings = step_lib.state_shardings(cfg, optimizer, mesh)
    state = step_lib.abstract_state(cfg, optimizer, shardings)
    shapes = _rl_batch(config, cfg)
    batch_sh = step_lib.batch_shardings(shapes, mesh)
    batch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, batch_sh)
    use_ref = rl.reference_model or rl.kl_coef > 0
    in_step = (use_ref and rl.kl_mode == "loss") or rl.reference_model
    base = step_lib.abstract_base(cfg, mesh)  # a LoRA policy's frozen base: also its reference (same buffers)
    reference = base if base is not None else state["params"]
    frozen = {"ref": reference} if in_step else None
    objective = Objective.from_config(config)
    step = step_lib.build_train_step(functools.partial(rl_loss, cfg, objective), optimizer, mesh, shardings,
                                     batch_sh, micro_batches=config.train.micro_batches,
                                     frozen_sharding=jax.tree.map(lambda x: x.sharding, frozen) if in_step else None,
                                     base_sharding=step_lib.base_shardings(cfg, mesh))
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    memory = step.lower(state, batch, rng, frozen, base).compile().memory_analysis()
    sizes = {n: int(getattr(memory, f"{n}_size_in_bytes")) for n in ("argument", "output", "temp", "alias")}
    shared = per_device_bytes(base) if base is not None and in_step else 0  # the base passed twice, held once
    components = {"train_step": sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"] - shared}
    params = per_device_bytes(state["params"]) + (per_device_bytes(base) if base is not None else 0)
    if use_ref and not in_step and base is None:  # (a LoRA policy's reference is its base: no copy)
        components["reference_params"] = params
    notes = []
    if rl.backend == "embedded":
        components.update(engine_bytes(cfg, rl.engine, params))
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

    if jax.device_count() != devices:
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
        print(json.dumps(analyze_job(config), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
