"""Ahead-of-time check: compile a job's train step for a target mesh on CPU, report memory.

    python -m rlvr.aot --config=configs/sft_tiny.py --devices=64 \\
        --config.mesh.data=8 --config.mesh.fsdp=8 --hbm_gib=16

`--devices` fakes that many CPU devices (set before jax starts), so a pod-sized mesh can be
compiled on a laptop. Nothing is allocated: the state is ShapeDtypeStructs with shardings.
It prints one JSON line (per-device argument/output/temp bytes from XLA's memory analysis)
and exits 1 when the per-device total exceeds `--hbm_gib`. XLA:CPU's buffer assignment
approximates, not reproduces, a TPU/GPU compile (fusion and layouts differ); compiling
against a real TPU topology needs libtpu (`jax.experimental.topologies`), which this does
not require.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any


def _preparse_devices(argv: list[str]) -> None:
    for arg in argv:
        if arg.startswith("--devices="):
            count = int(arg.split("=", 1)[1])
            os.environ["JAX_PLATFORMS"] = "cpu"
            flags = os.environ.get("XLA_FLAGS", "")
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _abstract_batch(config, mesh) -> tuple[Any, Any, Any]:
    """(abstract batch, its shardings, loss_fn factory input) for the job's loss."""
    import jax
    import numpy as np

    from rlvr.train import step as step_lib

    b, t = config.data.batch_size, config.data.seq_len
    fields = ("tokens", "positions", "segment_ids", "loss_mask")
    if config.job == "sft":
        shapes = {k: np.zeros((b, t), np.int32) for k in fields}
    else:
        shapes = {f"{side}_{k}": np.zeros((b, t), np.int32) for side in ("chosen", "rejected") for k in fields}
        shapes.update(ref_chosen=np.zeros((b,), np.float32), ref_rejected=np.zeros((b,), np.float32))
    shardings = step_lib.batch_shardings(shapes, mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    return abstract, shardings


def _loss_fn(config, cfg):
    from rlvr.trainers import preference, sft

    if config.job == "sft":
        return sft.configured_loss(config, cfg)
    if config.job == "rm":
        return functools.partial(preference.reward_model_loss, cfg)
    return functools.partial(preference.preference_loss, cfg, config.preference)


def model_config_of(config):
    """The architecture the job runs: its starting checkpoint's (config.json only: no weights are
    read), with the config's runtime fields, or model.* for random init (rlvr.start)."""
    from rlvr import start

    return start.model_config(config)


def analyze(config) -> dict[str, Any]:
    """Compiles the job's train step for `config.mesh` over the visible devices (no
    allocation) and returns XLA's per-device memory analysis in bytes."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from rlvr import sharding
    from rlvr.train import step as step_lib
    from rlvr.train.optimizer import build_optimizer

    mesh = sharding.make_mesh(dict(config.mesh))
    cfg = model_config_of(config)
    optimizer = build_optimizer(config.optimizer, config.train.num_steps)
    shardings = step_lib.state_shardings(cfg, optimizer, mesh)
    state = step_lib.abstract_state(cfg, optimizer, shardings)
    batch, batch_sh = _abstract_batch(config, mesh)
    base = step_lib.abstract_base(cfg, mesh)
    step = step_lib.build_train_step(_loss_fn(config, cfg), optimizer, mesh, shardings, batch_sh,
                                     micro_batches=config.train.micro_batches,
                                     base_sharding=step_lib.base_shardings(cfg, mesh))
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    compiled = step.lower(state, batch, rng, None, base).compile()
    memory = compiled.memory_analysis()
    per_device = {name: int(getattr(memory, f"{name}_size_in_bytes"))
                  for name in ("argument", "output", "temp", "alias", "generated_code")}
    total = per_device["argument"] + per_device["output"] + per_device["temp"] - per_device["alias"]
    nbytes = lambda tree: int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))
    return {"devices": jax.device_count(), "mesh": dict(mesh.shape), "params": cfg.num_params(),
            "param_bytes_total": nbytes(state["params"]) + nbytes(base), "trained_param_bytes": nbytes(state["params"]),
            "optimizer_state_bytes": nbytes(state["opt_state"]), "per_device_bytes": per_device,
            "per_device_total_bytes": total}


def main(argv: list[str]) -> int:
    from absl import flags
    from ml_collections import config_flags

    config_flag = config_flags.DEFINE_config_file("config", None, "Experiment config file[:arg].", lock_config=True)
    flags.DEFINE_integer("devices", None, "Number of (fake CPU) devices to compile for.")
    hbm = flags.DEFINE_float("hbm_gib", 0.0, "Per-device memory budget in GiB (0 = report only).")
    flags.FLAGS(argv)
    report = analyze(config_flag.value)
    report["per_device_total_gib"] = round(report["per_device_total_bytes"] / 2**30, 4)
    fits = not hbm.value or report["per_device_total_bytes"] <= hbm.value * 2**30
    report["budget_gib"], report["fits"] = hbm.value or None, fits
    print(json.dumps(report, sort_keys=True))
    if not fits:
        print(f"will not fit: {report['per_device_total_gib']} GiB per device > --hbm_gib={hbm.value}; "
              "shard more (mesh.fsdp / mesh.tensor), use remat (model.remat_policy) or micro-batches "
              "(train.micro_batches).", file=sys.stderr)
    return 0 if fits else 1


if __name__ == "__main__":
    _preparse_devices(sys.argv)
    sys.exit(main(sys.argv))
