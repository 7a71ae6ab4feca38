"""RL and eval sequence budgets from one place: the response budget.

The user sets `rl.max_new_tokens` (tokens per completion; per model turn for multi-turn tasks).
The rest is derived from the prompts of `rl.task`, measured with the job's tokenizer, chat template
and prompt format (`measure`, which `python -m rlvr.tasks.preview` also prints: every item of dataset
families, a sample per level of procedural ones):

  rl.max_prompt_len    0 = the longest measured prompt
  rl.seq_len           0 = max_prompt_len + max_new_tokens, rounded up to a multiple of 8 (train rows)
  rl.engine.max_len    0 = seq_len rounded up to rl.engine.page_size (the engine's cache per sequence)

Set explicitly, `max_prompt_len` or `seq_len` caps the prompts: longer tasks are skipped, and said
so here, in each step's metrics (`prompts_too_long`) and in evaluations. The measurement then only
serves that warning, so a procedural family is sampled for at most `EXPLICIT_SECONDS` (after one task
per level and split): a slow generator (reasoning-gym's zebra puzzles, ~0.5 s a puzzle) would
otherwise hold the job's start for minutes. Prompts that cannot fit at
all (the model's context, or the cap) are a ConfigError naming the longest. Multi-turn tasks need
`rl.seq_len` (the whole episode's budget). An eval job, or RL continuing an RL run, with
`rl.max_new_tokens=0` and `rl.prompt_format=""` inherits both from the run in init.workdir.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import ml_collections

from rlvr.config_lib import ConfigError
from rlvr.models.config import VisionConfig
from rlvr.rl.producer import is_episode_task, prompt_ids
from rlvr.tasks import build_tasks
from rlvr.tasks.base import HELD_OUT, TRAIN, Task
from rlvr.tasks.datasets import DatasetFamily

ROW_MULTIPLE = 8  # derived train rows are a multiple of this many tokens
PER_LEVEL = 16  # procedural families: tasks measured per level and split
EXPLICIT_SECONDS = 2.0  # explicit budgets: seconds of task generation per procedural family, at most


@dataclasses.dataclass(frozen=True)
class Measured:
    """One task's rendered prompt length."""

    tokens: int
    task: Task

    def describe(self) -> str:
        split = "held-out" if self.task.stream == HELD_OUT else "train"
        return f"{self.task.family} level {self.task.level} #{self.task.index} ({split}): {self.tokens} tokens"


def sample_tasks(mixture, per_level: int = PER_LEVEL, seconds: float | None = None) -> list[Task]:
    """Tasks of every family of `mixture` whose prompts bound the run's: a dataset family's items of
    both splits, else `per_level` tasks per level of the train and held-out streams. `seconds`: a
    procedural family stops drawing once that long has passed, having drawn one task of every level
    and split first (tasks are drawn index by index across levels and splits); None draws them all."""
    out = []
    for family in mixture.families.values():
        if isinstance(family, DatasetFamily):
            out += family.split_tasks(TRAIN) + family.split_tasks(HELD_OUT)
            continue
        levels = list(family.levels())
        start, first_round = time.perf_counter(), 2 * len(levels)
        order = [(i, stream, level) for i in range(per_level) for stream in (TRAIN, HELD_OUT) for level in levels]
        for drawn, (i, stream, level) in enumerate(order):
            if seconds is not None and drawn >= first_round and time.perf_counter() - start > seconds:
                break
            out.append(family.task(i, stream, level))
    return out


def measure(tasks: Sequence[Task], tokenizer, prompt_format: str, vision=None) -> list[Measured]:
    """Prompt lengths of the single-turn tasks (multi-turn prompts come from their environment);
    `vision` (a VLM's VisionConfig): image placeholders counted as the model sees them."""
    return [Measured(len(prompt_ids(tokenizer, t, prompt_format, vision)), t) for t in tasks
            if not is_episode_task(t)]


def episodic_families(tasks: Sequence[Task]) -> list[str]:
    """The multi-turn families among `tasks` (their prompts come from an environment, not measured)."""
    return sorted({t.family for t in tasks if is_episode_task(t)})


def longest(measured: Sequence[Measured], count: int = 3) -> str:
    """The `count` longest prompts, described (for error messages)."""
    top = sorted(measured, key=lambda m: -m.tokens)[:count]
    return "; ".join(m.describe() for m in top)


def derive(prompt_len: int, max_new_tokens: int, page_size: int) -> tuple[int, int]:
    """(seq_len, engine max_len) for prompts of up to `prompt_len` tokens."""
    seq_len = math.ceil((prompt_len + max_new_tokens) / ROW_MULTIPLE) * ROW_MULTIPLE
    return seq_len, math.ceil(seq_len / page_size) * page_size


def inherit(rl: ml_collections.ConfigDict, recorded: ml_collections.ConfigDict | None) -> None:
    """rl.max_new_tokens and rl.prompt_format from the RL or eval run a job starts from, when unset."""
    if recorded is not None and recorded.get("job") in ("rl", "eval"):
        if not rl.max_new_tokens:
            rl.max_new_tokens = recorded.rl.max_new_tokens
        if not rl.prompt_format:
            rl.prompt_format = recorded.rl.prompt_format
    if not rl.max_new_tokens:
        raise ConfigError("rl.max_new_tokens is not set: give the response budget (tokens per completion), e.g. "
                          "--config.rl.max_new_tokens=256; prompt and cache lengths are derived from it.")
    rl.prompt_format = rl.prompt_format or "raw"


def resolve(config: ml_collections.ConfigDict, tokenizer, recorded: ml_collections.ConfigDict | None) -> list[str]:
    """Fills rl.max_new_tokens, prompt_format, max_prompt_len, seq_len and engine.max_len of an
    unlocked, otherwise resolved config (see the module docstring) and prints them. Returns the
    multi-turn (tool-using) families of rl.task."""
    rl = config.rl
    explicit = bool(rl.seq_len or rl.max_prompt_len)  # the measurement only warns about longer prompts
    inherit(rl, recorded)
    if config.tokenizer.system_prompt and rl.prompt_format == "raw":
        raise ConfigError("tokenizer.system_prompt is only used with chat prompts: set rl.prompt_format='chat' "
                          "(or clear the system prompt).")
    try:
        tasks = build_tasks(rl, config.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sampled = sample_tasks(tasks, seconds=EXPLICIT_SECONDS if explicit else None)
    vision = VisionConfig.of(config.model.get("vision"))
    measured = measure(sampled, tokenizer, rl.prompt_format, vision)
    episodic = episodic_families(sampled)
    if episodic and not rl.seq_len:
        raise ConfigError(f"rl.seq_len is not set: the multi-turn tasks {episodic} need an episode budget (prompt, "
                          "every turn and observation), e.g. --config.rl.seq_len=4096.")
    context = config.model.max_position_embeddings
    most = max((m.tokens for m in measured), default=0)
    cap = rl.max_prompt_len or (rl.seq_len - rl.max_new_tokens if rl.seq_len else most)
    if cap <= 0:
        raise ConfigError(f"rl.max_new_tokens={rl.max_new_tokens} leaves no room for the prompt in rl.seq_len="
                          f"{rl.seq_len}; raise rl.seq_len or set it to 0 (derived).")
    seq_len = rl.seq_len or min(derive(cap, rl.max_new_tokens, rl.engine.page_size)[0], context)
    max_len = rl.engine.max_len or math.ceil(seq_len / rl.engine.page_size) * rl.engine.page_size
    if not rl.seq_len and cap + rl.max_new_tokens > context:
        raise ConfigError(f"prompts of up to {cap} tokens plus rl.max_new_tokens={rl.max_new_tokens} exceed the "
                          f"model's context (model.max_position_embeddings={context}); longest prompts: "
                          f"{longest(measured)}. Lower rl.max_new_tokens, set rl.max_prompt_len to skip "
                          "longer prompts, or choose other tasks (rl.task).")
    too_long = [m for m in measured if m.tokens > seq_len - rl.max_new_tokens]
    if measured and len(too_long) == len(measured):
        raise ConfigError(f"no prompt of rl.task={rl.task!r} fits: all {len(measured)} measured are longer than "
                          f"rl.seq_len={seq_len} - rl.max_new_tokens={rl.max_new_tokens}; longest: "
                          f"{longest(measured)}. Set rl.seq_len=0 and rl.max_prompt_len=0 (derived), or "
                          "lower rl.max_new_tokens.")
    rl.max_prompt_len, rl.seq_len, rl.engine.max_len = seq_len - rl.max_new_tokens, seq_len, max_len
    print(f"budgets: prompts <= {rl.max_prompt_len} tokens (longest of {len(measured)} measured: {most}), "
          f"responses <= {rl.max_new_tokens} -> rows of rl.seq_len={seq_len} tokens, engine cache "
          f"rl.engine.max_len={max_len} per sequence")
    if too_long:
        print(f"WARNING: {len(too_long)} of {len(measured)} measured prompts of rl.task are longer than "
              f"{rl.max_prompt_len} tokens and will be skipped (longest: {longest(too_long)}); "
              "set rl.max_prompt_len=0 and rl.seq_len=0 to fit them all.")
    return episodic
