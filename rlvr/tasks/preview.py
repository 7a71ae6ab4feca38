"""See what the model will see: task prompts rendered with a tokenizer, and their token counts.

    python -m rlvr.tasks.preview --task=asdiv,algebra_linear --tokenizer=path/to/hf_dir --prompt_format=chat
    python -m rlvr.tasks.preview --task=add --count=3                       # byte-level, raw prompts

Prints a few rendered prompts per family (exactly the text the tokens decode to), then per family the
prompt lengths of every measured task (dataset families: all items of both splits; procedural
families: `--per_level` tasks per level and split), and with `--max_new_tokens` the budgets a run
would derive (`rlvr.budgets`). `measure` is what RL and eval jobs use to derive those budgets.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import numpy as np

from rlvr.tasks.base import HELD_OUT, TRAIN, Task

PER_LEVEL = 16  # procedural families: tasks measured per level and split


@dataclasses.dataclass(frozen=True)
class Measured:
    """One task's rendered prompt length."""

    tokens: int
    task: Task

    def describe(self) -> str:
        split = "held-out" if self.task.stream == HELD_OUT else "train"
        return f"{self.task.family} level {self.task.level} #{self.task.index} ({split}): {self.tokens} tokens"


def sample_tasks(mixture, per_level: int = PER_LEVEL) -> list[Task]:
    """Tasks of every family of `mixture` whose prompts bound the run's: a dataset family's items of
    both splits, else `per_level` tasks per level of the train and held-out streams."""
    from rlvr.tasks.datasets import DatasetFamily

    out = []
    for family in mixture.families.values():
        if isinstance(family, DatasetFamily):
            out += family.split_tasks(TRAIN) + family.split_tasks(HELD_OUT)
            continue
        for level in family.levels():
            out += [family.task(i, stream, level) for stream in (TRAIN, HELD_OUT) for i in range(per_level)]
    return out


def measure(tasks: Sequence[Task], tokenizer, prompt_format: str, vision=None) -> list[Measured]:
    """Prompt lengths of the single-turn tasks (multi-turn prompts come from their environment);
    `vision` (a VLM's VisionConfig): image placeholders counted as the model sees them."""
    from rlvr.rl.producer import is_episode_task, prompt_ids

    return [Measured(len(prompt_ids(tokenizer, t, prompt_format, vision)), t) for t in tasks
            if not is_episode_task(t)]


def episodic_families(tasks: Sequence[Task]) -> list[str]:
    from rlvr.rl.producer import is_episode_task

    return sorted({t.family for t in tasks if is_episode_task(t)})


def longest(measured: Sequence[Measured], count: int = 3) -> str:
    """The `count` longest prompts, described (for error messages)."""
    top = sorted(measured, key=lambda m: -m.tokens)[:count]
    return "; ".join(m.describe() for m in top)


def family_table(measured: Sequence[Measured]) -> str:
    """Per family: tasks measured and prompt tokens min / median / max."""
    lines = ["| family | tasks | min | median | max |", "|---|---|---|---|---|"]
    for family in sorted({m.task.family for m in measured}):
        lengths = np.array([m.tokens for m in measured if m.task.family == family])
        lines.append(f"| {family} | {len(lengths)} | {lengths.min()} | {int(np.median(lengths))} | {lengths.max()} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rlvr import config_lib, start
    from rlvr.rl.producer import prompt_ids
    from rlvr.tasks import build_tasks

    parser = argparse.ArgumentParser(prog="python -m rlvr.tasks.preview", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="add", help="rl.task spec: a family, or a weighted mixture with globs.")
    parser.add_argument("--tokenizer", default="", help="A Hugging Face tokenizer directory ('' = byte-level).")
    parser.add_argument("--prompt_format", default="raw", choices=["raw", "chat"], help="Raw text or chat messages.")
    parser.add_argument("--chat_template", default="", help="A template, a .jinja file or 'chatml' ('' = the "
                        "tokenizer's).")
    parser.add_argument("--system_prompt", default="", help="A system prompt put first (chat).")
    parser.add_argument("--count", type=int, default=2, help="Rendered prompts printed per family.")
    parser.add_argument("--per_level", type=int, default=PER_LEVEL, help="Procedural families: tasks measured per "
                        "level and split.")
    parser.add_argument("--max_new_tokens", type=int, default=0, help="With a response budget: the budgets a run "
                        "derives.")
    args = parser.parse_args(argv)
    try:
        tokenizer = start.build_tokenizer({"path": args.tokenizer, "chat_template": args.chat_template,
                                           "system_prompt": args.system_prompt})
        rl = config_lib.rl_config()
        rl.task = args.task
        tasks = build_tasks(rl, 0)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for family in tasks.families.values():
        for t in family.tasks(0, args.count):
            ids = prompt_ids(tokenizer, t, args.prompt_format) if not t.metadata.get("env") else []
            print(f"--- {t.family} level {t.level} #{t.index}: {len(ids)} tokens ---")
            print(tokenizer.decode(ids) if ids else "(multi-turn: the prompt comes from its environment)")
    measured = measure(sample_tasks(tasks, args.per_level), tokenizer, args.prompt_format)
    if measured:
        print(family_table(measured))
        print(f"longest prompts: {longest(measured)}")
    if args.max_new_tokens and measured:
        from rlvr.budgets import derive

        seq_len, max_len = derive(max(m.tokens for m in measured), args.max_new_tokens, page_size=16)
        print(f"with rl.max_new_tokens={args.max_new_tokens}: rl.seq_len={seq_len}, rl.engine.max_len={max_len} "
              "(page size 16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
