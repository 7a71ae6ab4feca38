"""The agentic learning check over seeds: configs/agentic_tools.py, before vs after multi-turn GRPO.

    .venv/bin/python benchmarks/agentic_learning.py --seeds 0,1 --workdir /tmp/agentic_learning

Each seed is a full run (SFT warm start on scripted calculator episodes, half of them answering
without the tool, then multi-turn GRPO) in its own subprocess (on 2 CPU cores, about 15 minutes a
seed). Prints one JSON line: per seed, held-out greedy success (pass@1) before and after RL, and
the sampled episodes' tool-use rate and success rate at the start of RL (mean of the first 3
steps) and at the end (mean of the last 10): greedy decoding already picks the tool after the
warm start, so the policy's change shows in what it samples. Also episodes/s and the share of
episode time spent in tools; and the minimum gains over seeds against the config's margins.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# configs/agentic_tools.py: the stated gains, in points (the sampled success is reported, not gated:
# seed 1 gained only 2.9 points there, while its held-out greedy success gained 10.9)
MARGINS = {"heldout_success": 5.0, "sampled_tool_use": 30.0}


def run_seed(seed: int, workdir: str, overrides: list[str]) -> dict:
    path = os.path.join(workdir, f"seed{seed}")
    if not os.path.exists(os.path.join(path, "summary.json")):
        command = [sys.executable, "-m", "rlvr.main", "--config=configs/agentic_tools.py", f"--workdir={path}",
                   f"--config.seed={seed}", *overrides]
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(path, "summary.json")) as f:
        summary = json.load(f)
    metrics = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    rl_rows = [m for m in metrics if "episodes" in m]
    start, end = rl_rows[:3], rl_rows[-10:]

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    return {"seed": seed,
            "heldout_success": [summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]],
            "heldout_tool_use": [summary.get("heldout_tool_use_before"), summary.get("heldout_tool_use_after")],
            "sampled_tool_use": [mean(start, "reward/tool_use"), mean(end, "reward/tool_use")],
            "sampled_success": [mean(start, "pass_rate"), mean(end, "pass_rate")],
            "episodes_per_s": sum(m["episodes_per_s"] for m in rl_rows) / len(rl_rows),
            "episode_env_share": sum(m["episode_env_share"] for m in rl_rows) / len(rl_rows),
            "wall_s": summary["wall_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--workdir", default="/tmp/rlvr_agentic_learning")
    parser.add_argument("overrides", nargs="*", help="extra --config.X=Y flags")
    args = parser.parse_args()
    rows = [run_seed(int(s), args.workdir, args.overrides) for s in args.seeds.split(",")]
    gains = {key: round(min(100 * (r[key][1] - r[key][0]) for r in rows), 1)
             for key in (*MARGINS, "sampled_success")}
    print(json.dumps({"benchmark": "agentic_learning", "config": "configs/agentic_tools.py", "seeds": rows,
                      "min_gain_points": gains, "margins_points": MARGINS,
                      "meets_margins": all(gains[k] >= m for k, m in MARGINS.items())}))


if __name__ == "__main__":
    main()
