"""The rollout engine's prefill and decode programs compiled by the TPU compiler at the GRPO recipe's shape.

    .venv/bin/python benchmarks/engine_tpu_compile.py [--topologies v5e:2x2,v5p:2x2x1]
        [--meshes "tensor=4;fsdp=4"] [--out benchmarks/results/engine_tpu_compile.json]

Qwen3-1.7B's architecture (benchmarks/data/qwen3-1.7b/config.json; shapes only, no weights) with
configs/recipes/grpo_math.py's engine (128 slots, 1,536 tokens each: 512 prompt + 1,024 new, pages of
64, 16 decode steps a call, prefill 16 rows x 512) in bfloat16 weights and KV pages, compiled on this
CPU host for each TPU topology (libtpu, deviceless: `rlvr.rollout.compile_check.engine_programs`) on
each mesh: the recipe's fsdp=4 (the trainer's params layout; the pool replicated, rows split) and a
tensor-parallel one. Records per-chip GiB of params, KV pool, temp and the program's total, whether
the Mosaic kernel is in it, and compile seconds. Prints one JSON line (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GIB = 2**30
ENGINE = dict(max_slots=128, max_len=1536, page_size=64, decode_steps=16, prefill_rows=16, prefill_chunk=512,
              dtype="bfloat16", kv_dtype="bfloat16")


def qwen3_1_7b():
    from rlvr.models import hf

    with open(os.path.join(REPO, "benchmarks", "data", "qwen3-1.7b", "config.json")) as f:
        return hf.config_from_hf(json.load(f))


def parse_mesh(text: str) -> dict[str, int]:
    return {axis: int(size) for axis, size in (part.split("=") for part in text.split(","))}


def measure(cfg, topology: str, mesh_shape: dict[str, int], programs: list[str]) -> list[dict]:
    import importlib.metadata

    import jax
    from rlvr.kernels.target import compile_for, compiled_report

    from rlvr import sharding
    from rlvr.models import params as params_lib
    from rlvr.rollout import compile_check

    libtpu = importlib.metadata.version("libtpu")
    shapes = params_lib.abstract_params(cfg)  # outside compile_for: its init trace makes a key on the host
    rows = []
    for name in programs:
        with compile_for(topology) as topo:
            mesh = sharding.make_mesh(mesh_shape, topo.devices)
            params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                                  params_lib.param_shardings(cfg, mesh))
            sizes = compile_check.engine_sizes(cfg, params, mesh, **ENGINE)
            row = {"topology": topology, "mesh": mesh_shape, "program": name, "libtpu": libtpu,
                   "params_gib": round(sizes["params"] / GIB, 2), "pool_gib": round(sizes["pool"] / GIB, 2)}
            start = time.perf_counter()
            try:
                program = compile_check.engine_programs(cfg, params, mesh, programs=(name,), **ENGINE)[name]
            except Exception as error:  # the TPU compiler refusing the program (e.g. out of HBM) is a result
                rows.append({**row, "error": str(error).splitlines()[0][:300],
                             "compile_s": round(time.perf_counter() - start, 1)})
                print(json.dumps(rows[-1]), file=sys.stderr)
                continue
        report = compiled_report(program)
        memory = {**report["per_device_bytes"], "total": report["per_device_total_bytes"]}
        rows.append({**row, "temp_gib": round(memory["temp"] / GIB, 2), "total_gib": round(memory["total"] / GIB, 2),
                     "temp_over_pool": round(memory["temp"] / sizes["pool"], 3),
                     "mosaic": report["mosaic_kernels"] > 0,
                     "tflops": round(report["flops"] / 1e12, 3),
                     "compile_s": round(compile_check.compile_seconds[name], 1), "bytes": memory})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topologies", default="v5e:2x2,v5p:2x2x1")
    parser.add_argument("--meshes", default="tensor=4;fsdp=4")
    parser.add_argument("--programs", default="prefill,decode")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "engine_tpu_compile.json"))
    args = parser.parse_args()
    cfg = qwen3_1_7b()
    record = {"benchmark": "engine_tpu_compile", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()} {os.cpu_count()} CPUs (shared; compile times are this host's)",
              "load": os.getloadavg()[0], "command": "python " + " ".join(sys.argv),
              "model": "Qwen3-1.7B (shapes)", "engine": ENGINE, "results": []}
    for topology in args.topologies.split(","):
        for mesh in args.meshes.split(";"):
            record["results"] += measure(cfg, topology, parse_mesh(mesh), args.programs.split(","))
    from common import emit

    emit(record, args.out, sort_keys=True)


if __name__ == "__main__":
    main()
