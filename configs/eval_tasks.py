"""Held-out evaluation with pass@k per task family and difficulty level.

    python -m rlvr.main --config=configs/eval_tasks.py --workdir=workdirs/eval

By default it evaluates the quickstart's trained policy (workdirs/quickstart, after
`make quickstart`) on 1- and 2-digit addition: 64 held-out problems per level, 8 samples each,
pass@1/2/4/8. Point it elsewhere with `--config.init.workdir=DIR` and `--config.rl.task=SPEC`. The
response budget and prompt format are the evaluated run's (rlvr.budgets); prompt and cache lengths
are derived from the tasks. Variant `:smoke` (few tasks, for tests).
"""

import os

import ml_collections

from rlvr import config_lib


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    c = config_lib.load_config(os.path.join(os.path.dirname(__file__), "quickstart.py"))
    c.unlock()
    c.job = "eval"
    c.init.workdir = "workdirs/quickstart"
    c.rl.sft_steps = 0
    # the evaluated run's budget and prompt format; lengths derived from the tasks (rlvr.budgets)
    c.rl.max_new_tokens, c.rl.prompt_format, c.rl.seq_len, c.rl.engine.max_len = 0, "", 0, 0
    c.eval.levels, c.eval.examples_per_level, c.eval.samples, c.eval.temperature = "all", 64, 8, 1.0
    if arg == "smoke":
        c.eval.examples_per_level, c.eval.samples = 4, 4
    elif arg:
        raise ValueError(f"configs/eval_tasks.py: unknown variant {arg!r}; use smoke or nothing")
    return c
