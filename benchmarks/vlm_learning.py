"""The tiny VLM's learning check: held-out chart-reading accuracy after the SFT warm start and after
GRPO, on three seeds (the easiest level, `chart_bars_labelled`: 3 bars labelled with their values).

    .venv/bin/python benchmarks/vlm_learning.py [--seeds 0,1,2] [--root DIR] [--set KEY=VALUE ...]

Runs `configs/vlm.py` (a random-init Qwen2.5-VL-layout VLM: SFT on rendered charts, then GRPO with
the rollout engine prefilling each chart) once per seed through `benchmarks/quickstart_seeds.py`
and writes its JSON line (per seed: held-out greedy accuracy before RL = after SFT, after RL, the
gain in points, wall time; the mean and minimum gain; date, machine, command) to
`benchmarks/results/vlm_learning.json`.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart_seeds  # noqa: E402

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vlm_learning.json")
    flags = sys.argv[1:]
    if not any(f.startswith("--out") for f in flags):
        flags.append(f"--out={out}")
    raise SystemExit(quickstart_seeds.main(["--config=configs/vlm.py", *flags]))
