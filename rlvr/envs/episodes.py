"""Stored episodes (`episodes.jsonl` in an RL workdir): export as training data, and replay.

Every multi-turn episode an RL run plays is appended to `WORKDIR/episodes.jsonl`, failed ones
included: its task, rewards, and trace (opening messages, tools, each turn's text, observation,
per-step rewards, timings, and the environment's own trace of tool calls and sandbox commands).

    python -m rlvr.envs.episodes export WORKDIR/episodes.jsonl --out=repaired.jsonl --only=correct
    python -m rlvr.envs.episodes replay WORKDIR/episodes.jsonl --line=17

`export` writes chat records `{"messages", "tools", "rewards"}` that `data.source="jsonl"` SFT
reads (learning from successful or repaired runs; `--only=failed` keeps the mistakes, e.g. as
negative examples). `replay` re-creates the episode's environment from its task, feeds it the
recorded model turns, and reports whether every observation and reward comes out the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any


def read(path: str) -> Iterator[dict[str, Any]]:
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def conversation(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The episode as chat messages: opening messages, then each assistant turn and its observation."""
    trace = record["trace"]
    messages = [dict(m) for m in trace.get("messages", [])]
    for turn in trace.get("turns", []):
        if "text" not in turn:
            continue
        messages.append({"role": "assistant", "content": turn["text"]})
        messages += [dict(m) for m in turn.get("observation", [])]
    return messages


def _selected(record: Mapping[str, Any], only: str) -> bool:
    correct = bool(record.get("rewards", {}).get("correct", 0.0))
    return {"all": True, "correct": correct, "failed": not correct}[only]


def export(path: str, out: str, only: str = "correct") -> int:
    """Writes the selected episodes of `path` as SFT chat records to `out`; returns the count."""
    count = 0
    with open(out, "w") as f:
        for record in read(path):
            if "error" in record["trace"] or not _selected(record, only):
                continue
            messages = conversation(record)
            if not any(m["role"] == "assistant" for m in messages):
                continue
            f.write(json.dumps({"messages": messages, "tools": record["trace"].get("tools"),
                                "rewards": record["rewards"]}) + "\n")
            count += 1
    return count


def replay(record: Mapping[str, Any], make_env: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Re-plays a stored episode's model turns in a fresh environment; returns {"identical",
    "turns", "differences"} comparing observations, done flags, per-step and final rewards."""
    from rlvr.tasks.base import Task

    if make_env is None:
        from rlvr.envs import make_env
    env = make_env(Task.from_json(record["task"]))
    differences = []
    try:
        opening = env.reset()
        if opening != record["trace"].get("messages", opening):
            differences.append({"turn": -1, "field": "messages"})
        turns = [t for t in record["trace"].get("turns", []) if "text" in t]
        for turn in turns:
            step = env.step(turn["text"])
            for field, value in (("observation", step.observation), ("rewards", step.rewards)):
                if json.loads(json.dumps(value)) != turn.get(field):
                    differences.append({"turn": turn["turn"], "field": field, "recorded": turn.get(field),
                                        "replayed": value})
            if step.done:
                break
        final = {k: v for k, v in env.final_rewards().items()}
        recorded = {k: v for k, v in record["rewards"].items() if k != "turns"}
        if final != recorded:
            differences.append({"turn": None, "field": "final_rewards", "recorded": recorded, "replayed": final})
    finally:
        env.close()
    return {"identical": not differences, "turns": len(turns), "differences": differences}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlvr.envs.episodes", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="episodes -> SFT chat records")
    e.add_argument("episodes")
    e.add_argument("--out", required=True)
    e.add_argument("--only", choices=("correct", "failed", "all"), default="correct")
    r = sub.add_parser("replay", help="re-run a stored episode's turns and compare")
    r.add_argument("episodes")
    r.add_argument("--line", type=int, default=0, help="0-based line of the episodes file")
    args = parser.parse_args(argv)
    if args.command == "export":
        print(json.dumps({"exported": export(args.episodes, args.out, args.only), "out": args.out}))
        return 0
    for i, record in enumerate(read(args.episodes)):
        if i == args.line:
            result = replay(record)
            print(json.dumps(result, indent=1))
            return 0 if result["identical"] else 1
    print(f"{args.episodes} has no line {args.line}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
