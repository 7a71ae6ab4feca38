"""The tiny VLM's learning check: held-out chart-reading accuracy after the SFT warm start and after
GRPO, on three seeds (the easiest level, `chart_bars_labelled`: 2 thick bars on a fixed 0-5 axis,
labelled with their values, in a 112x84 chart).

    .venv/bin/python benchmarks/vlm_learning.py [--seeds 0,1,2] [--root DIR] [--set KEY=VALUE ...]

Runs `configs/vlm.py` (a random-init Qwen2.5-VL-layout VLM: SFT on rendered charts, then GRPO with
the rollout engine prefilling each chart) once per seed through `benchmarks/quickstart_seeds.py`
and writes its JSON line (per seed: held-out greedy accuracy before RL = after SFT, after RL, the
gain in points, wall time; the mean and minimum gain; date, machine, command) to
`benchmarks/results/vlm_learning.json`.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart_seeds  # noqa: E402


def main(argv: list[str]) -> int:
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vlm_learning.json")
    flags = list(argv)
    if not any(f.startswith("--out") for f in flags):
        flags.append(f"--out={out}")
    code = quickstart_seeds.main(["--config=configs/vlm.py", *flags])
    path = next(f.split("=", 1)[1] for f in flags if f.startswith("--out="))
    with open(path) as f:
        record = json.load(f)
    record.update(benchmark="vlm_learning", command=" ".join([".venv/bin/python benchmarks/vlm_learning.py", *argv]))
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
