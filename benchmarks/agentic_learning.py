"""The agentic learning check over seeds: configs/agentic_tools.py, before vs after multi-turn GRPO.

    .venv/bin/python benchmarks/agentic_learning.py --seeds 0,1 --workdir /tmp/agentic_learning

Each seed is a full run (SFT warm start on scripted calculator episodes, half of them answering
without the tool, then multi-turn GRPO) in its own subprocess (on 2 CPU cores, about 15 minutes a
seed). Prints one JSON line: per seed, held-out success (pass@1, greedy episodes) and tool-use
rate before and after RL, the episodes/s and the share of episode time spent in tools; and the
minimum gains over seeds, compared with the margins the config's docstring states.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MARGIN_POINTS = 20.0  # configs/agentic_tools.py: success and tool use each rise by at least this


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
    return {"seed": seed,
            "success_before": summary["heldout_accuracy_before"], "success_after": summary["heldout_accuracy_after"],
            "tool_use_before": summary.get("heldout_tool_use_before"),
            "tool_use_after": summary.get("heldout_tool_use_after"),
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
    gain = min(100 * (r["success_after"] - r["success_before"]) for r in rows)
    tool_gain = min(100 * ((r["tool_use_after"] or 0) - (r["tool_use_before"] or 0)) for r in rows)
    print(json.dumps({"benchmark": "agentic_learning", "config": "configs/agentic_tools.py", "seeds": rows,
                      "min_success_gain_points": round(gain, 1), "min_tool_use_gain_points": round(tool_gain, 1),
                      "margin_points": MARGIN_POINTS,
                      "meets_margin": gain >= MARGIN_POINTS and tool_gain >= MARGIN_POINTS}))


if __name__ == "__main__":
    main()
