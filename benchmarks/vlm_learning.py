"""The tiny VLM's learning check: held-out chart-reading accuracy after the SFT warm start and after
GRPO, on three seeds (the easiest level, `chart_bars_labelled`: 2 thick bars on a fixed 0-5 axis,
labelled with their values, in a 112x84 chart).

    .venv/bin/python benchmarks/vlm_learning.py [--seeds 0,1,2] [--root DIR] [--set KEY=VALUE ...]

Runs `configs/vlm.py` (a random-init Qwen2.5-VL-layout VLM: SFT on rendered charts, then GRPO with
the rollout engine prefilling each chart) once per seed through `benchmarks/quickstart_seeds.py`
and writes its JSON line (per seed: held-out greedy accuracy before RL = after SFT, after RL, the
gain in points, wall time; the mean and minimum gain; date, machine, command) to
`benchmarks/results/vlm_learning.json`. Each seed's `probe` (benchmarks/vlm_answer_probe.py on its
warm start and RL checkpoint, the same held-out charts): the gain in greedy accuracy and in the mean
probability of the right value (the expected accuracy of a sampled answer), each with its paired
standard error in points. Without --root the workdirs are temporary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart_seeds  # noqa: E402
import vlm_answer_probe  # noqa: E402

CONFIG = "configs/vlm.py"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "vlm_learning.json"))
    parser.add_argument("--root", default="")
    known, rest = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="vlm_learning_") as scratch:
        root = known.root or scratch  # kept workdirs: the probe reads each run's warm start and RL checkpoint
        code = quickstart_seeds.main([f"--config={CONFIG}", f"--out={known.out}", f"--root={root}", *rest])
        with open(known.out) as f:
            record = json.load(f)
        for run in record["runs"]:  # the answer probe: paired gains with their standard errors
            probe = vlm_answer_probe.probe(quickstart_seeds.run_dir(root, run["seed"], record["overrides"], CONFIG))
            run.update(probe={k: v for k, v in probe.items() if k not in ("run", "seed")})
    record.update(benchmark="vlm_learning", command=" ".join([".venv/bin/python benchmarks/vlm_learning.py", *argv]))
    with open(known.out, "w") as f:
        json.dump(record, f, indent=1)
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
