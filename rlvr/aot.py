"""Ahead-of-time check: compile a job's train step for its target and report memory per chip.

    # the real TPU compiler (libtpu, deviceless; `pip install -e '.[tpu]'`), nothing allocated:
    python -m rlvr.aot --config=configs/recipes/chat_sft_dpo.py:MODEL_DIR,sft --topology=v5p:2x2x1
    # no libtpu: XLA:CPU's estimate on fake CPU devices (set before jax starts)
    python -m rlvr.aot --config=configs/sft_tiny.py --devices=64 --config.mesh.fsdp=8 --hbm_gib=16

Every job kind with a train step compiles: sft, dpo, rm, and rl (the RL loss, with the frozen
reference inside the step when the KL is a loss term and the value head under GAE; with the embedded
rollout engine also its prefill and decode programs, whose weights, KV pages and temp stay resident
beside the train step and are added to the total). The state is
ShapeDtypeStructs with shardings on a mesh of the target's devices. It prints one JSON line: per-chip
argument/output/temp/alias bytes (`memory_analysis`), FLOPs and bytes accessed (`cost_analysis`), the
collectives and Pallas (Mosaic) kernels in the compiled HLO, compile seconds, and the verdict against
the chip's HBM (`--hbm_gib`, default the topology's chip); it exits 1 when the job does not fit. A program
the TPU compiler refuses as too large for a chip's HBM is reported as not fitting (`refused`, with the
temporaries' size it gave as a lower bound), not as a crash.

With `--topology` the target platform is the TPU (`rlvr.kernels.target.compile_for`): attention
'flash' builds its Mosaic kernels, and the numbers are the TPU compiler's. Without it, XLA:CPU's buffer
assignment only approximates a TPU/GPU compile (fusion and layouts differ; gigabytes off at 1.7B
parameters), and the report says so (`"compiler": "xla:cpu (estimate)"`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any

# Per-chip HBM in GiB of the TPU generations (Cloud TPU system-architecture pages: v4 32 GiB, v5e 16 GB,
# v5p 95 GiB, v6e 32 GB), by the generation prefix of a topology name.
TPU_HBM_GIB = {"v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0}


def _preparse_devices(argv: list[str]) -> None:
    for arg in argv:
        if arg.startswith("--devices="):
            count = int(arg.split("=", 1)[1])
            os.environ["JAX_PLATFORMS"] = "cpu"
            flags = os.environ.get("XLA_FLAGS", "")
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def model_config_of(config):
    """The architecture the job runs: its starting checkpoint's (config.json only: no weights are
    read), with the config's runtime fields, or model.* for random init (rlvr.start)."""
    from rlvr import start

    return start.model_config(config)


def hbm_gib_of(topology: str) -> float:
    """Per-chip HBM of a TPU topology name ('v5p:2x2x1' -> 95)."""
    generation = topology.split(":", 1)[0]
    if generation not in TPU_HBM_GIB:
        raise ValueError(f"topology {topology!r}: unknown TPU generation {generation!r}; known: {sorted(TPU_HBM_GIB)}")
    return TPU_HBM_GIB[generation]


def _abstract(shapes, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def _preference_batch(config):
    import numpy as np

    b, t = config.data.batch_size, config.data.seq_len
    fields = ("tokens", "positions", "segment_ids", "loss_mask")
    if config.job == "sft":
        return {k: np.zeros((b, t), np.int32) for k in fields}
    shapes = {f"{side}_{k}": np.zeros((b, t), np.int32) for side in ("chosen", "rejected") for k in fields}
    shapes.update(ref_chosen=np.zeros((b,), np.float32), ref_rejected=np.zeros((b,), np.float32))
    return shapes


def rl_batch(config) -> dict[str, Any]:
    """Zero arrays of an RL train batch of the configured rollout shape (rows = prompts x group /
    updates per batch, rl.seq_len tokens)."""
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


@dataclasses.dataclass
class StepProgram:
    """A job's jitted train step and its abstract arguments (state, batch, rng, frozen, base)."""

    step: Any
    args: tuple
    cfg: Any
    in_step_reference: bool = False


def train_step_program(config, mesh) -> StepProgram:
    """The job's train step over `mesh`, with ShapeDtypeStruct arguments (nothing allocated)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from rlvr.train import step as step_lib
    from rlvr.train.optimizer import build_optimizer

    cfg = model_config_of(config)
    steps = config.train.num_steps
    rl = config.rl if config.job == "rl" else None
    if rl is not None:
        if rl.teacher and rl.distill_estimator == "full":
            raise ValueError("aot: rl.distill_estimator='full' runs the teacher inside the train step, which is not "
                             "modelled yet; check with --config.rl.distill_estimator=sampled and add the teacher's "
                             "parameter bytes")
        cfg = dataclasses.replace(cfg, value_head=cfg.value_head or rl.advantage == "gae")
        steps *= rl.updates_per_batch
    optimizer = build_optimizer(config.optimizer, steps)
    shardings = step_lib.state_shardings(cfg, optimizer, mesh)
    state = step_lib.abstract_state(cfg, optimizer, shardings)
    shapes = rl_batch(config) if rl is not None else _preference_batch(config)
    batch_sh = step_lib.batch_shardings(shapes, mesh)
    base = step_lib.abstract_base(cfg, mesh)  # a LoRA model's frozen base (also an RL reference)
    frozen, in_step = None, False
    if rl is not None:
        in_step = ((rl.reference_model or rl.kl_coef > 0) and rl.kl_mode == "loss") or bool(rl.reference_model)
        frozen = {"ref": base if base is not None else state["params"]} if in_step else None
    step = step_lib.build_train_step(
        _loss_fn(config, cfg), optimizer, mesh, shardings, batch_sh, micro_batches=config.train.micro_batches,
        frozen_sharding=jax.tree.map(lambda x: x.sharding, frozen) if frozen else None,
        base_sharding=step_lib.base_shardings(cfg, mesh))
    key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
    rng = jax.ShapeDtypeStruct((), key_dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    return StepProgram(step, (state, _abstract(shapes, batch_sh), rng, frozen, base), cfg, in_step)


def _loss_fn(config, cfg):
    from rlvr.trainers import preference, sft

    if config.job == "sft":
        return sft.configured_loss(config, cfg)
    if config.job == "rm":
        return functools.partial(preference.reward_model_loss, cfg)
    if config.job == "rl":
        from rlvr.rl.objective import Objective, rl_loss

        return functools.partial(rl_loss, cfg, Objective.from_config(config))
    return functools.partial(preference.preference_loss, cfg, config.preference)


def target_devices(topology: str | None):
    """(devices, context to lower and compile in, compiler label) for a TPU topology or the host."""
    import jax

    if topology is None:
        return jax.devices(), contextlib.nullcontext(), f"xla:{jax.default_backend()} (estimate)"
    from rlvr.kernels.target import compile_for, tpu_topology

    return tpu_topology(topology).devices, compile_for(topology), f"tpu ({topology}, libtpu deviceless)"


def analyze(config, topology: str | None = None) -> dict[str, Any]:
    """The report of `analyze_program` (the program itself dropped)."""
    return analyze_program(config, topology)[0]


def analyze_program(config, topology: str | None = None) -> tuple[dict[str, Any], StepProgram]:
    """Compiles the job's train step for `config.mesh` over the target's devices (a TPU `topology`, or
    the visible devices) without allocating; returns the report (`compiled_report`, or `hbm_refusal`, plus
    the parameter and optimizer-state bytes in all) and the abstract program (its state's shapes)."""
    import jax

    from rlvr import sharding
    from rlvr.kernels.target import compiled_report, hbm_refusal

    devices, context, compiler = target_devices(topology)
    mesh = sharding.make_mesh(dict(config.mesh), devices)
    started = time.perf_counter()
    program = train_step_program(config, mesh)  # abstract values only: built on the host
    with context:  # traced, lowered and compiled for the target
        try:
            report = compiled_report(program.step.lower(*program.args).compile())
        except Exception as error:  # the TPU compiler refuses a program that cannot fit a chip
            report = hbm_refusal(error)
            if report is None:
                raise
    state, base = program.args[0], program.args[4]
    nbytes = lambda tree: int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))
    return {"job": config.job, "compiler": compiler, "topology": topology, "devices": len(devices),
            "mesh": dict(mesh.shape), "params": program.cfg.num_params(), "attention": program.cfg.attention,
            "param_bytes_total": nbytes(state["params"]) + nbytes(base), "trained_param_bytes": nbytes(state["params"]),
            "optimizer_state_bytes": nbytes(state["opt_state"]), "in_step_reference": program.in_step_reference,
            "compile_s": round(time.perf_counter() - started, 1), **report}, program


def analyze_engine(config, topology: str | None = None, programs=("prefill", "decode")) -> dict[str, Any]:
    """An RL job's embedded rollout engine compiled as the job runs it: its prefill and decode programs
    (`rlvr.rollout.compile_check`) at `rl.engine`'s slots, pages and dtypes, on the train mesh its
    params live on (a tensor axis splits the KV pool over heads; without one each chip holds it all).
    Per chip: the engine's weights, KV pool, and each program's report (`compiled_report`);
    `temp_bytes` is the larger program's temp (they never run at once)."""
    from rlvr import sharding
    from rlvr.kernels.target import compiled_report, hbm_refusal
    from rlvr.models import params as params_lib
    from rlvr.rollout import compile_check

    cfg, engine = model_config_of(config), config.rl.engine
    devices, _, compiler = target_devices(topology)
    mesh = sharding.make_mesh(dict(config.mesh), devices)
    params = _abstract(params_lib.abstract_params(cfg), params_lib.param_shardings(cfg, mesh))
    kwargs = dict(max_slots=engine.max_slots, max_len=engine.max_len, page_size=engine.page_size,
                  dtype=engine.dtype, kv_dtype=engine.kv_dtype or engine.dtype, decode_steps=engine.decode_steps,
                  prefill_rows=engine.prefill_rows, prefill_chunk=engine.prefill_chunk)
    sizes = compile_check.engine_sizes(cfg, params, mesh, **kwargs)
    reports, temp = {}, 0
    for name in programs:
        started = time.perf_counter()
        _, context, _ = target_devices(topology)  # a fresh context each time: one cannot be entered twice
        with context:
            try:
                [compiled] = compile_check.engine_programs(cfg, params, mesh, programs=(name,), **kwargs).values()
                reports[name] = compiled_report(compiled)
                temp = max(temp, reports[name]["per_device_bytes"]["temp"])
            except Exception as error:  # refused as too large for a chip: its temporaries are the lower bound
                reports[name] = hbm_refusal(error)
                if reports[name] is None:
                    raise
                temp = max(temp, reports[name]["per_device_total_bytes"] - sizes["params"] - sizes["pool"])
        reports[name]["compile_s"] = round(time.perf_counter() - started, 1)
    return {"compiler": compiler, "engine_params_bytes": sizes["params"], "engine_pool_bytes": sizes["pool"],
            "temp_bytes": temp, "programs": reports}


def main(argv: list[str]) -> int:
    from absl import flags
    from ml_collections import config_flags

    from rlvr import start

    config_flag = config_flags.DEFINE_config_file("config", None, "Experiment config file[:arg].", lock_config=True)
    flags.DEFINE_integer("devices", None, "Number of (fake CPU) devices to compile for (XLA:CPU estimate).")
    topology = flags.DEFINE_string("topology", None, "A TPU topology to compile for with the real TPU compiler "
                                   "(libtpu), e.g. v5e:2x4, v5p:2x2x1, v6e:2x4.")
    hbm = flags.DEFINE_float("hbm_gib", None, "Per-device memory budget in GiB (default: the topology's chip HBM; "
                             "0 = report only).")
    flags.FLAGS(argv)
    config = start.resolve(config_flag.value)
    report = analyze(config, topology.value)
    if config.job == "rl" and config.rl.backend == "embedded":
        engine = analyze_engine(config, topology.value)
        report["engine"] = engine
        report["per_device_total_bytes"] += engine["engine_params_bytes"] + engine["engine_pool_bytes"] + \
            engine["temp_bytes"]
    budget = hbm.value if hbm.value is not None else (hbm_gib_of(topology.value) if topology.value else 0.0)
    report["per_device_total_gib"] = round(report["per_device_total_bytes"] / 2**30, 4)
    fits = not budget or report["per_device_total_bytes"] <= budget * 2**30
    report["budget_gib"], report["fits"] = budget or None, fits
    print(json.dumps(report, sort_keys=True))
    if not fits:
        print(f"will not fit: {report['per_device_total_gib']} GiB per device > {budget} GiB; "
              "shard more (mesh.fsdp / mesh.tensor), use remat (model.remat_policy) or micro-batches "
              "(train.micro_batches).", file=sys.stderr)
    return 0 if fits else 1


if __name__ == "__main__":
    _preparse_devices(sys.argv)
    sys.exit(main(sys.argv))
