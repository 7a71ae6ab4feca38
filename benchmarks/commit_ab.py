"""A job's steady training step at two commits, run alternately (ABBA) in one window.

    .venv/bin/python benchmarks/commit_ab.py --config configs/sft_tiny.py [--before HEAD~1] [--rounds 2]
        [--from_step 50] [--out benchmarks/results/sft_tiny_commit_ab.json]

Why: a change to a kernel or a train step shows up first as a micro-benchmark; what a user sees is
the job's own step time. This runs `python -m rlvr.main --config=CONFIG` in a checkout of `--before`
(a git worktree under /tmp, removed at the end, built from that commit's sources: its native kernels too) and in this
one, alternating, each in a fresh workdir with the same venv, and reads each run's `step_time_s`
from its metrics.jsonl: the median over the logged steps from `--from_step` on (compile and warm-up
excluded). Prints one JSON line: per run the medians and final loss, per round the ratio before/after,
and the median ratio. Only same-window ratios mean anything on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_average, publish  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _revision(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[str]:
    """A worktree of `rev` in a fresh temp directory, removed (and unregistered) when the block ends."""
    path = tempfile.mkdtemp(prefix=f"rlvr_commit_ab_{rev}_")
    subprocess.run(["git", "worktree", "add", "--detach", path, rev], cwd=REPO, capture_output=True, check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", path], cwd=REPO, capture_output=True, check=False)


def run_job(tree: str, config: str, from_step: int) -> dict:
    """The job run in `tree`: median step_time_s from `from_step` on, the steps it covers, the final loss."""
    with tempfile.TemporaryDirectory(prefix="commit_ab_") as workdir:
        subprocess.run([sys.executable, "-m", "rlvr.main", f"--config={os.path.join(tree, config)}",
                        f"--workdir={workdir}"], cwd=tree, env={**os.environ, "PYTHONPATH": tree},
                       capture_output=True, check=True)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    steady = [r for r in rows if "step_time_s" in r and r["step"] >= from_step]
    if not steady:
        raise SystemExit(f"no logged step at or after --from_step {from_step} in {config}'s metrics")
    return {"step_time_s": round(statistics.median(r["step_time_s"] for r in steady), 4),
            "steps": [r["step"] for r in steady], "final_loss": rows[-1].get("loss")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="a config file, relative to the repository root")
    parser.add_argument("--before", default="HEAD~1", help="the commit to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=2, help="before/after pairs, in ABBA order")
    parser.add_argument("--from_step", type=int, default=50, help="steady steps: logged steps from this one on")
    parser.add_argument("--out", default="", help="also record the result here (earlier records kept)")
    args = parser.parse_args()
    before_rev, after_rev = _revision(args.before), _revision("HEAD")
    load_before, pairs = load_average(), []
    with checkout(before_rev) as before_tree:
        trees = {"before": before_tree, "after": REPO}
        for r in range(args.rounds):
            pair = {}
            for who in ("before", "after") if r % 2 == 0 else ("after", "before"):
                pair[who] = run_job(trees[who], args.config, args.from_step)
            pair["ratio_before_over_after"] = round(pair["before"]["step_time_s"] / pair["after"]["step_time_s"], 3)
            pairs.append(pair)
    record = {
        "benchmark": "commit_ab", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%MZ"),
        "command": "benchmarks/commit_ab.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (the load averages say how busy)",
        "config": args.config, "before": before_rev,
        "after": f"{after_rev} (this checkout, uncommitted changes included)", "rounds": pairs,
        "median_ratio_before_over_after": round(statistics.median(p["ratio_before_over_after"] for p in pairs), 3),
        "load_average_before": load_before, "load_average_after": load_average(),
    }
    publish(record, args.out)


if __name__ == "__main__":
    main()
