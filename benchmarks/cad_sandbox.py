"""CAD step latency: an OpenSCAD program -> a mesh in gVisor -> the host's score (IoU, Chamfer, renders).

    .venv/bin/python benchmarks/cad_sandbox.py [--per-level 8] [--out benchmarks/results/cad_sandbox.json]

One step is what scoring a candidate costs (rlvr.domains.cad.scad.score_script): OpenSCAD in a fresh gVisor
sandbox (`rlvr.sandbox.run`, binary STL on stdout), then on the host the strict STL parse, manifold3d's
volumetric IoU, the Chamfer distance and the three depth renders against the target. The candidate is the
task's reference program (a typical successful step; targets are built beforehand and not timed). For the
same tasks, interleaved, the same program runs as a bare `openscad` subprocess on the host (no isolation): the
sandbox's cost is the same-run ratio `sandbox_over_bare` of medians; `pool_*` is the same program in a warm gVisor
pool of one sandbox (rlvr.sandbox.Pool, what RLVR_CAD_POOL=N turns on), `pool_over_fresh` its ratio to the fresh
sandbox. Prints one JSON line: p50 / p99 seconds of the whole step, of its sandbox and host-score parts, of the
pool's step and of the bare run, overall and per level. No model runs here, so there is no roofline to print
beside these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time

import numpy as np
from rlvr.sandbox import Pool

from rlvr.domains.cad import scad
from rlvr.domains.cad import verify as cv
from rlvr.domains.cad.families import CadScript


def bare_openscad(script: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="bench-cad-") as d:
        with open(os.path.join(d, scad.MAIN), "w") as f:
            f.write(script)
        return subprocess.run(scad.ARGV, cwd=d, capture_output=True, timeout=120).stdout


def pct(values: list[float]) -> dict[str, float]:
    return {"p50_s": round(float(np.percentile(values, 50)), 3), "p99_s": round(float(np.percentile(values, 99)), 3),
            "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-level", type=int, default=8)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    family = CadScript(seed=0)
    tasks = [family.task(i, level=level) for level in family.levels() for i in range(args.per_level)]
    targets = {t.answer: cv.target(scad.target_stl(t.answer)) for t in tasks}  # built beforehand, not timed
    rows = []
    pool = Pool(1, scad.limits())
    for task in tasks:
        t0 = time.perf_counter()
        bare = bare_openscad(task.answer)
        t1 = time.perf_counter()
        result, stl = scad.run_candidate(task.answer, backend="runsc")
        t2 = time.perf_counter()
        scores = cv.score(stl, targets[task.answer])
        t3 = time.perf_counter()
        _, pooled = scad.run_candidate(task.answer, executor=pool)
        pooled_scores = cv.score(pooled, targets[task.answer])
        t4 = time.perf_counter()
        assert scores["iou"] >= 0.99 and len(bare) == len(stl or b"") == len(pooled or b""), (task.metadata, scores)
        assert pooled_scores["iou"] >= 0.99
        rows.append({"level": task.level, "bare": t1 - t0, "sandbox": t2 - t1, "score": t3 - t2, "step": t3 - t1,
                     "pool_step": t4 - t3, "triangles": len(stl) // 50})
    pool.close()
    out = {"benchmark": "cad_sandbox", "date": time.strftime("%Y-%m-%d"),
           "machine": f"{os.cpu_count()} CPUs, {platform.platform()}, runsc ptrace, load average "
                      f"{os.getloadavg()[0]:.1f} at the end",
           "command": f".venv/bin/python benchmarks/cad_sandbox.py --per-level {args.per_level}",
           "step": "OpenSCAD in a fresh gVisor sandbox (binary STL on stdout) + host score (parse, manifold3d IoU, "
                   "Chamfer, 3 renders)"}
    parts = ("step", "sandbox", "score", "pool_step", "bare")
    for part in parts:
        out[part + "_all"] = pct([r[part] for r in rows])
    for level in family.levels():
        mine = [r for r in rows if r["level"] == level]
        out[f"level{level}"] = {part: pct([r[part] for r in mine]) for part in parts}
        out[f"level{level}"]["triangles_median"] = int(np.median([r["triangles"] for r in mine]))
    out["sandbox_over_bare"] = round(out["sandbox_all"]["p50_s"] / out["bare_all"]["p50_s"], 2)
    out["pool_over_fresh"] = round(out["pool_step_all"]["p50_s"] / out["step_all"]["p50_s"], 2)
    out["steps_per_s_one_worker"] = round(1 / out["step_all"]["p50_s"], 2)
    line = json.dumps(out, sort_keys=True)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
