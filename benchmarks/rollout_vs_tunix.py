"""Our sampler and Tunix's, side by side in one window, on the fixed config (32 x 64 -> 64 tokens).

    .venv/bin/python benchmarks/rollout_vs_tunix.py [--tunix_python .venv-tunix/bin/python] [--rounds 2]
        [--replicas 1] [--also_replicas 2]

Needs Tunix in its own venv (ignored by git): `python3 -m venv .venv-tunix &&
.venv-tunix/bin/pip install google-tunix` (~12 min). Runs the peer's `bench_tunix.py --only sampler`
(benchmarks/peers/, its own process: 2 warm-up + 7 timed calls, its median) and our
`benchmarks/rollout.py --only sampler` (the same model, prompts and call counts) alternately in
ABBA order, `--rounds` pairs, and prints one JSON line: both medians, each run's figure, and the
speed-up (median of ours over median of theirs, and per adjacent pair), and the roofline of the
same model and workload (`common.decode_roofline`, peaks measured between the pairs). Beside it,
`roofline_at_decode_shapes`: the same with the decode's weight products at the rate XLA reaches on
their own 32-row shapes (`common.decode_matmul_gflops`), the ceiling of an engine whose decode costs
nothing else; `ceiling_speedup_vs_tunix` is that ceiling over Tunix's median, the most any engine on
XLA:CPU's products could be over the peer here. This machine's speed drifts by up to 2x over
minutes: only such same-window ratios mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "peers", "bench_tunix.py")  # a copy of ../shared/peers/tunix/bench_tunix.py
sys.path.insert(0, HERE)
from common import decode_matmul_gflops, decode_roofline, machine_peaks  # noqa: E402

from rlvr.models.config import PRESETS, ModelConfig  # noqa: E402


def _last_json(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def tunix(python: str) -> float:
    return _last_json([python, PEER, "--only", "sampler", "--repeats", "1"])["summary"]["sampler_gen_tokens_per_s"]


def ours(decode_steps: int, replicas: int = 1) -> dict:
    record = _last_json([sys.executable, os.path.join(HERE, "rollout.py"), "--only", "sampler",
                         "--decode_steps", str(decode_steps), "--replicas", str(replicas)])
    return record["sampler"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tunix_python", default=os.path.join(HERE, "..", ".venv-tunix", "bin", "python"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode_steps", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=1,
                        help="ours: the engine's slots split over this many engines stepped at once")
    parser.add_argument("--also_replicas", type=int, default=0,
                        help="also time ours with this many replicas in every round (reported as `ours_also`)")
    args = parser.parse_args()
    cfg = ModelConfig(**PRESETS["bench"])

    def peaks_now():
        return {**machine_peaks(), "decode_matmul_gflops": decode_matmul_gflops(cfg, 32)}

    theirs, mine, also, pairs, also_pairs, order, peaks = [], [], [], [], [], [], [peaks_now()]
    t0 = time.perf_counter()
    runners = ["tunix", "ours"] + (["also"] if args.also_replicas else [])
    for r in range(args.rounds):
        pair = {}
        for who in runners if r % 2 == 0 else runners[::-1]:
            if who == "tunix":
                pair[who] = tunix(args.tunix_python)
                theirs.append(pair[who])
            else:
                result = ours(args.decode_steps, args.replicas if who == "ours" else args.also_replicas)
                pair[who] = result["tokens_per_s"]
                (mine if who == "ours" else also).append(result)
            order.append(who)
        pairs.append(round(pair["ours"] / pair["tunix"], 3))
        if "also" in pair:
            also_pairs.append(round(pair["also"] / pair["tunix"], 3))
        peaks.append(peaks_now())
    best = {k: max(p[k] for p in peaks) for k in peaks[0]}
    # the workload's shape (the roofline does not depend on the token values): 32 distinct 64-token prompts
    shape = ([[i] * 64 for i in range(32)], [64] * 32, 32)
    roofline = decode_roofline(cfg, *shape, {k: v for k, v in best.items() if k != "decode_matmul_gflops"})
    ceiling = decode_roofline(cfg, *shape, best)
    ours_median = statistics.median(m["tokens_per_s"] for m in mine)
    extra = {}
    if also:
        also_median = statistics.median(m["tokens_per_s"] for m in also)
        extra = {"ours_also": {"replicas": args.also_replicas, "runs": also, "median": round(also_median, 1),
                               "speedup_vs_tunix": round(also_median / statistics.median(theirs), 3),
                               "speedup_per_pair": also_pairs,
                               "vs_roofline": round(also_median / roofline["tokens_per_s"], 3)}}
    print(json.dumps({
        "benchmark": "rollout_vs_tunix", "workload": "32 prompts x 64 tokens -> 64 new tokens, temperature 1, "
        "bench preset (4.46M params, fp32); 2 warm-up + 7 timed calls per run, median",
        "order": order, "tunix_tokens_per_s": theirs, "ours_tokens_per_s": [m["tokens_per_s"] for m in mine],
        "ours_runs": mine, "tunix_median": round(statistics.median(theirs), 1), "ours_median": round(ours_median, 1),
        "speedup_vs_tunix": round(ours_median / statistics.median(theirs), 3), "speedup_per_pair": pairs,
        "machine_peaks_best": {k: round(v, 1) for k, v in best.items()}, "roofline": roofline,
        "ours_vs_roofline": round(ours_median / roofline["tokens_per_s"], 3),
        "tunix_vs_roofline": round(statistics.median(theirs) / roofline["tokens_per_s"], 3),
        "roofline_at_decode_shapes": ceiling,
        "ours_vs_roofline_at_decode_shapes": round(ours_median / ceiling["tokens_per_s"], 3),
        "ceiling_speedup_vs_tunix": round(ceiling["tokens_per_s"] / statistics.median(theirs), 3),
        "decode_steps": args.decode_steps, "replicas": args.replicas, "wall_s": round(time.perf_counter() - t0, 1),
        **extra}, sort_keys=True))


if __name__ == "__main__":
    main()
