"""Verifiable task families for RL: each yields prompts with a reference answer and scores
completions with a deterministic verifier.

A family is a class with `task(index) -> Task` (a pure function of `(seed, index)`, so the
data position of a run is one integer) and `score(task, completion_text, truncated) ->
dict[str, float]`, whose "reward" entry is what RL optimises; the other entries are reward
components reported as metrics. `build_family(config.rl)` picks one by name.
"""

from __future__ import annotations

from rlvr.tasks.arithmetic import ArithmeticFamily, Task

FAMILIES = {"add": ArithmeticFamily, "sub": ArithmeticFamily, "mul": ArithmeticFamily}


def build_family(rl_config, seed: int):
    """The task family named by `rl.task` (see FAMILIES)."""
    if rl_config.task not in FAMILIES:
        raise ValueError(f"rl.task={rl_config.task!r}: unknown; choose one of {sorted(FAMILIES)}")
    return FAMILIES[rl_config.task](op=rl_config.task, min_digits=rl_config.min_digits,
                                    max_digits=rl_config.max_digits, seed=seed,
                                    format_weight=rl_config.format_weight)


__all__ = ["FAMILIES", "ArithmeticFamily", "Task", "build_family"]
