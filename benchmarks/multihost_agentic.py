"""Agentic RL (multi-turn calculator episodes) on 2 JAX processes against the same job on one process.

    .venv/bin/python benchmarks/multihost_agentic.py [--sft_steps 60] [--steps 3] \
        [--out benchmarks/results/multihost_agentic.json]

Too slow for the test suite on a 2-core CPU (two full agentic runs, minutes), so it is a check run on
demand: `configs/agentic_tools.py:smoke` with rl.deterministic_rollout=True (episodes advance in rounds:
rlvr.envs.rollout.TurnRounds) runs once as 2 processes x 4 CPU devices on loopback (rlvr.launch.local_cluster,
each process starting from the same SFT warm start, run first here) and once in this process with 8
devices. Prints one JSON line: per-step rewards, losses and mean episode turns of both runs, whether
every logged completion (train and held-out: tokens, rewards, versions; the per-token log-probs left out)
is the same, the largest relative loss difference and the largest weight difference (the processes sum
gradients in another order: rounding-level). Before rounds, the 2-process run stopped in JAX's
device_put check (its processes built different batches).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

SPEC = "configs/agentic_tools.py:smoke"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sft_steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import numpy as np
    from rlvr.launch.local_cluster import LocalCluster

    from rlvr import api, config_lib, observe
    from rlvr.main import run

    root = tempfile.mkdtemp(prefix="multihost_agentic_")
    overrides = {"train.tensorboard": False, "train.num_steps": args.steps, "checkpoint.every_steps": args.steps,
                 "rl.eval_examples": 4, "rl.deterministic_rollout": True}
    warm = os.path.join(root, "warm")  # the SFT warm start both runs begin from
    run(config_lib.load_config(SPEC, {**overrides, "train.num_steps": 1, "rl.sft_steps": args.sft_steps,
                                      "rl.sft_demos": 8 * args.sft_steps}), warm)
    overrides.update({"rl.sft_steps": 0, "init.workdir": os.path.join(warm, "sft")})
    two, one = os.path.join(root, "two"), os.path.join(root, "one")
    command = [sys.executable, "-m", "rlvr.main", f"--config={SPEC}", f"--workdir={two}",
               *[f"--config.{k}={v}" for k, v in overrides.items()]]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.perf_counter()
    cluster = LocalCluster(command, 2, 4, os.path.join(root, "logs"), cwd=repo, env=dict(os.environ))
    codes = cluster.wait(3000)
    two_s = time.perf_counter() - t0
    if tuple(codes) != (0, 0):
        raise SystemExit(f"2-process run failed {codes}:\n" + "\n".join(cluster.output(i)[-3000:] for i in range(2)))
    t0 = time.perf_counter()
    run(config_lib.load_config(SPEC, overrides), one)
    one_s = time.perf_counter() - t0

    def steps(workdir):
        return [(m["step"], m["reward"], m["loss"], m.get("episode_turns")) for m in observe.read_metrics(workdir)
                if "reward" in m]

    def samples(workdir):
        return [{k: v for k, v in s.items() if k != "logprobs"} for s in observe.read_metrics(workdir, "samples.jsonl")]

    leaves = [jax.tree.leaves(jax.device_get(api.load_trained(w).params)) for w in (two, one)]
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(*leaves, strict=True))
    emit({"benchmark": "multihost_agentic", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
          "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)", "command": " ".join(sys.argv),
          "config": SPEC, "overrides": overrides, "sft_steps": args.sft_steps,
          "two_processes": {"steps": steps(two), "wall_s": round(two_s, 1)},
          "one_process": {"steps": steps(one), "wall_s": round(one_s, 1)},
          "same_rewards_and_turns": [s[::3] + s[1:2] for s in steps(two)] == [s[::3] + s[1:2] for s in steps(one)],
          "max_loss_rel_diff": max(abs(a[2] - b[2]) / max(abs(b[2]), 1e-12)
                                   for a, b in zip(steps(two), steps(one), strict=True)),
          "same_samples": samples(two) == samples(one), "samples_compared": len(samples(one)),
          "max_weight_diff": diff}, args.out)


if __name__ == "__main__":
    main()
