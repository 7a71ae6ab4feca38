"""RL and eval sequence budgets from one place: the response budget.

The user sets `rl.max_new_tokens` (tokens per completion; per model turn for multi-turn tasks).
The rest is derived from the prompts of `rl.task`, measured with the job's tokenizer, chat template
and prompt format (`rlvr.tasks.preview.measure`: every item of dataset families, a sample per level
of procedural ones):

  rl.max_prompt_len    0 = the longest measured prompt
  rl.seq_len           0 = max_prompt_len + max_new_tokens, rounded up to a multiple of 8 (train rows)
  rl.engine.max_len    0 = seq_len rounded up to rl.engine.page_size (the engine's cache per sequence)

Set explicitly, `max_prompt_len` or `seq_len` caps the prompts: longer tasks are skipped, and said
so here, in each step's metrics (`prompts_too_long`) and in evaluations. Prompts that cannot fit at
all (the model's context, or the cap) are a ConfigError naming the longest. Multi-turn tasks need
`rl.seq_len` (the whole episode's budget). An eval job, or RL continuing an RL run, with
`rl.max_new_tokens=0` and `rl.prompt_format=""` inherits both from the run in init.workdir.
"""

from __future__ import annotations

import math

import ml_collections

from rlvr.config_lib import ConfigError

ROW_MULTIPLE = 8  # derived train rows are a multiple of this many tokens


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
    from rlvr.models.config import VisionConfig
    from rlvr.tasks import build_tasks, preview

    rl = config.rl
    inherit(rl, recorded)
    if config.tokenizer.system_prompt and rl.prompt_format == "raw":
        raise ConfigError("tokenizer.system_prompt is only used with chat prompts: set rl.prompt_format='chat' "
                          "(or clear the system prompt).")
    try:
        tasks = build_tasks(rl, config.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sampled = preview.sample_tasks(tasks)
    vision = VisionConfig.of(config.model.get("vision"))
    measured = preview.measure(sampled, tokenizer, rl.prompt_format, vision)
    episodic = preview.episodic_families(sampled)
    if episodic and not rl.seq_len:
        raise ConfigError(f"rl.seq_len is not set: the multi-turn tasks {episodic} need an episode budget (prompt, "
                          "every turn and observation), e.g. --config.rl.seq_len=4096.")
    context = config.model.max_position_embeddings
    longest = max((m.tokens for m in measured), default=0)
    cap = rl.max_prompt_len or (rl.seq_len - rl.max_new_tokens if rl.seq_len else longest)
    if cap <= 0:
        raise ConfigError(f"rl.max_new_tokens={rl.max_new_tokens} leaves no room for the prompt in rl.seq_len="
                          f"{rl.seq_len}; raise rl.seq_len or set it to 0 (derived).")
    seq_len = rl.seq_len or min(derive(cap, rl.max_new_tokens, rl.engine.page_size)[0], context)
    max_len = rl.engine.max_len or math.ceil(seq_len / rl.engine.page_size) * rl.engine.page_size
    if not rl.seq_len and cap + rl.max_new_tokens > context:
        raise ConfigError(f"prompts of up to {cap} tokens plus rl.max_new_tokens={rl.max_new_tokens} exceed the "
                          f"model's context (model.max_position_embeddings={context}); longest prompts: "
                          f"{preview.longest(measured)}. Lower rl.max_new_tokens, set rl.max_prompt_len to skip "
                          "longer prompts, or choose other tasks (rl.task).")
    too_long = [m for m in measured if m.tokens > seq_len - rl.max_new_tokens]
    if measured and len(too_long) == len(measured):
        raise ConfigError(f"no prompt of rl.task={rl.task!r} fits: all {len(measured)} measured are longer than "
                          f"rl.seq_len={seq_len} - rl.max_new_tokens={rl.max_new_tokens}; longest: "
                          f"{preview.longest(measured)}. Set rl.seq_len=0 and rl.max_prompt_len=0 (derived), or "
                          "lower rl.max_new_tokens.")
    rl.max_prompt_len, rl.seq_len, rl.engine.max_len = seq_len - rl.max_new_tokens, seq_len, max_len
    print(f"budgets: prompts <= {rl.max_prompt_len} tokens (longest of {len(measured)} measured: {longest}), "
          f"responses <= {rl.max_new_tokens} -> rows of rl.seq_len={seq_len} tokens, engine cache "
          f"rl.engine.max_len={max_len} per sequence")
    if too_long:
        print(f"WARNING: {len(too_long)} of {len(measured)} measured prompts of rl.task are longer than "
              f"{rl.max_prompt_len} tokens and will be skipped (longest: {preview.longest(too_long)}); "
              "set rl.max_prompt_len=0 and rl.seq_len=0 to fit them all.")
    return episodic
