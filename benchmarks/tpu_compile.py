"""The longest sequence flash attention compiles for, per TPU generation, with the real TPU compiler.

    .venv/bin/python benchmarks/tpu_compile.py [--generations v5e,v5p,v6e] [--lengths 8192,...,262144]
        [--out benchmarks/results/tpu_compile.json]

For each generation (its 4- or 8-chip topology, deviceless: libtpu, the `tpu` extra) and each length T,
the forward and backward (dq, dk/dv) of one device's attention at Qwen3-1.7B's heads (16 query heads, 8
KV heads, head dim 128, bf16, causal, batch 1) are lowered and compiled, in both kernel layouts: the
shipped one (`pallas_tpu.py`, the key sequence on the grid) and the whole-keys one (`pallas.py`'s,
Triton's layout, where a program holds its head's whole key sequence in VMEM). A length stops being
tried in a layout after it fails once. Prints one JSON line: per generation and layout the largest T
that compiled, and per attempt the compile seconds, the temp bytes, or the error's first line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GENERATIONS = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def compile_attention(length: int, layout: str) -> dict:
    """Compiles forward + backward at `length` under the current target; {"ok", "compile_s", ...}."""
    import jax
    import jax.numpy as jnp
    from rlvr.kernels.flash_attention import pallas
    from rlvr.kernels.flash_attention.api import _check_spec
    from rlvr.kernels.flash_attention.config import default_block_sizes
    from rlvr.kernels.target import tpu_generation

    spec = _check_spec(True, 0, 0.0, None, HEAD_DIM)
    blocks = default_block_sizes("tpu", tpu_generation())
    make_plan = pallas.make_plan

    def plan_for_layout(*args, **kwargs):
        return dataclasses.replace(make_plan(*args, **kwargs), grid_over_keys=layout == "grid_over_keys")

    def loss(q, k, v):
        ids = jnp.ones((1, length), jnp.int32)
        pos = jnp.arange(length, dtype=jnp.int32)[None]
        out, lse = pallas.flash_attention_pallas(q, k, v, ids, ids, pos, pos, spec=spec, blocks=blocks,
                                                 platform="tpu", interpret=False)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    q = jax.ShapeDtypeStruct((1, length, HEADS, HEAD_DIM), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, length, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    started = time.perf_counter()
    pallas.make_plan = plan_for_layout
    try:
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    except Exception as error:  # the compiler's refusal (VMEM out of memory, ...) is the result
        return {"ok": False, "compile_s": round(time.perf_counter() - started, 1),
                "error": str(error).strip().splitlines()[0][:200]}
    finally:
        pallas.make_plan = make_plan
    return {"ok": True, "compile_s": round(time.perf_counter() - started, 1),
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "mosaic_kernels": compiled.as_text().count('custom_call_target="tpu_custom_call"')}


def main() -> None:
    from rlvr.kernels.target import compile_for

    parser = argparse.ArgumentParser()
    parser.add_argument("--generations", default="v5e,v5p,v6e")
    parser.add_argument("--lengths", default="8192,16384,32768,65536,131072,262144")
    parser.add_argument("--layouts", default="grid_over_keys,whole_keys")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "tpu_compile.json"))
    args = parser.parse_args()
    import libtpu

    record = {"date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "command": "python " + " ".join(sys.argv),
              "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "load_1m": os.getloadavg()[0],
              "libtpu": getattr(libtpu, "__version__", "?"), "shape": {"heads": HEADS, "kv_heads": KV_HEADS,
                                                                      "head_dim": HEAD_DIM, "batch": 1},
              "largest_length": {}, "attempts": []}
    for generation in args.generations.split(","):
        for layout in args.layouts.split(","):
            largest = 0
            for length in (int(n) for n in args.lengths.split(",")):
                with compile_for(GENERATIONS[generation]):
                    result = compile_attention(length, layout)
                record["attempts"].append({"generation": generation, "layout": layout, "length": length, **result})
                print(json.dumps(record["attempts"][-1]), file=sys.stderr, flush=True)
                if not result["ok"]:
                    break
                largest = length
            record["largest_length"][f"{generation}/{layout}"] = largest
    from common import emit

    emit(record, args.out, sort_keys=True)


if __name__ == "__main__":
    main()
