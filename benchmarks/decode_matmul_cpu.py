"""The native packed decode matmul against XLA's on this CPU, on the sampler workload, in one JSON line.

    .venv/bin/python benchmarks/decode_matmul_cpu.py [--rounds 2] [--out benchmarks/results/decode_matmul_cpu.json]

The workload of `benchmarks/rollout.py --only sampler` (the `bench` preset; 32 prompts x 64 tokens ->
64 new tokens, temperature 1) on two engines that differ only in `decode_matmul` ("native": the C++
kernel of kernels/packed_matmul, whose 16-float vectors are one AVX-512 register; "xla"), timed in
ABBA order (wall and process CPU seconds per call). The CPU's AVX flags are recorded beside: the engine's
"auto" takes the native kernel only on a CPU with avx512f (rlvr/rollout/engine.py, `_native_matmul`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402
from rlvr.kernels import native_build  # noqa: E402
from rollout import _engine, _fresh, _params, _requests  # noqa: E402

from rlvr.models.config import PRESETS, ModelConfig  # noqa: E402


def _timed(call) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each: native and xla, order flipped)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    cfg = ModelConfig(**PRESETS["bench"])
    params = _params(cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1024, 64).tolist() for _ in range(32)]
    calls = {}
    for kind in ("native", "xla"):
        engine = _engine(cfg, params, max_slots=32, max_len=192, page_size=16, decode_steps=16, prefill_rows=8,
                         prefill_chunk=64, decode_matmul=kind)
        calls[kind] = _fresh(engine, lambda engine=engine: engine.generate(_requests(prompts, [64] * 32)))
        calls[kind]()  # compile
    load = [os.getloadavg()[0]]
    runs: dict[str, list] = {"native": [], "xla": []}
    for r in range(args.rounds):
        for kind in ("native", "xla") if r % 2 == 0 else ("xla", "native"):
            wall, cpu = _timed(calls[kind])
            runs[kind].append({"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)})
        load.append(os.getloadavg()[0])
    median = {k: statistics.median(x["wall_s"] for x in v) for k, v in runs.items()}
    flags = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl") if native_build.cpu_has(f)]
    emit({"benchmark": "decode_matmul_cpu", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="minutes"), "command": "python benchmarks/decode_matmul_cpu.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.uname().machine}, {os.cpu_count()} CPUs", "cpu_flags": flags, "load": load,
        "workload": "bench preset, 32 prompts x 64 -> 64 new tokens", "runs": runs,
        "tokens_per_s": {k: round(32 * 64 / v, 1) for k, v in median.items()},
        "native_over_xla_wall": round(median["native"] / median["xla"], 2)}, args.out)


if __name__ == "__main__":
    main()
