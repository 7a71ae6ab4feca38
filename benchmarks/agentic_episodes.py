"""Episode throughput of the agentic RL producer on code repair, with the sandbox pool.

    .venv/bin/python benchmarks/agentic_episodes.py [--episodes 32] [--workers 16] [--sandbox-workers 2]

A scripted policy (each task's reference turns: read the faulty file, str_replace the bug, run the
tests, answer) stands in for the model, so the figures isolate the environment side: tool calls,
gVisor sandbox runs (warm pool), the host-judged verdict, and the producer's episode threads.
Prints one JSON line: episodes/s, turns per episode, the share of episode time spent in tools
(`episode_env_share`) and the solved fraction (must be 1.0: the script is correct), for episodes
run one at a time and concurrently (the ratio is the concurrency speed-up on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rlvr import config_lib  # noqa: E402
from rlvr.models.tokenizer import byte_level_tokenizer  # noqa: E402
from rlvr.rl.producer import Producer, ProducerSettings  # noqa: E402
from rlvr.rollout.types import Completion  # noqa: E402
from rlvr.tasks import build_tasks  # noqa: E402


class ScriptedRepairPolicy:
    """A backend whose turn n of a task's episode is the task's n-th reference turn."""

    def __init__(self, tokenizer, tasks, family):
        self.tokenizer, self.tasks, self.family = tokenizer, tasks, family
        self.scripts: dict[str, list[str]] = {}

    def add(self, task) -> None:
        self.scripts[task.chat()[-1]["content"]] = self.family.reference_turns(task)

    def _turns(self, text: str) -> list[str]:
        for opening, turns in self.scripts.items():
            if opening in text:
                return turns
        raise KeyError("unknown task")

    def generate(self, requests):
        out = []
        for r in requests:
            text = self.tokenizer.decode(r.input_ids)
            turns = self._turns(text)
            n = text.count("<|im_start|>assistant") - 1
            ids = self.tokenizer.encode(turns[min(n, len(turns) - 1)]) + [self.tokenizer.eos_id]
            out.append(Completion(r.rid, list(r.input_ids), ids, [0.0] * len(ids), [0] * len(ids),
                                  {"type": "stop", "matched": self.tokenizer.eos_id}))
        return out


def measure(episodes: int, workers: int, sandbox_workers: int) -> dict:
    config = config_lib.load_config("configs/agentic_code.py", {})
    rl = config.rl
    rl.group_size, rl.prompts_per_step, rl.episode_workers = 4, episodes // 4, workers
    rl.env.sandbox_workers = sandbox_workers
    rl.max_new_tokens, rl.seq_len = 4096, 16384
    tokenizer = byte_level_tokenizer()
    tasks = build_tasks(rl, seed=0)
    policy = ScriptedRepairPolicy(tokenizer, tasks, tasks.families["code_repair"])
    for i in range(rl.prompts_per_step):
        policy.add(tasks.task(i))
    producer = Producer(policy, tasks, tokenizer, ProducerSettings.from_config(rl), seed=0)
    start = time.perf_counter()
    batch = producer.make_batch(0)
    wall = time.perf_counter() - start
    producer.stop()
    stats = batch.stats
    solved = sum(s.rewards["correct"] for s in batch.samples) / len(batch.samples)
    return {"episodes": len(batch.samples), "episode_workers": workers, "wall_s": round(wall, 2),
            "episodes_per_s": round(len(batch.samples) / wall, 3), "episode_turns": stats["episode_turns"],
            "episode_env_share": round(stats["episode_env_share"], 3), "solved": solved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--sandbox-workers", type=int, default=2)
    args = parser.parse_args()
    serial = measure(args.episodes // 2, 1, args.sandbox_workers)
    concurrent = measure(args.episodes, args.workers, args.sandbox_workers)
    print(json.dumps({"benchmark": "agentic_episodes", "env": "code_repair (scripted policy, gVisor pool)",
                      "sandbox_workers": args.sandbox_workers, "serial": serial, "concurrent": concurrent,
                      "concurrency_speedup": round(concurrent["episodes_per_s"] / serial["episodes_per_s"], 2)}))


if __name__ == "__main__":
    main()
