"""The explicit table of task families: name -> constructor `(seed=, weights=) -> Family`.

Each family module exports its own `FAMILIES` table; this module merges them. No decorator
registry: what exists is what these tables list.
"""

from __future__ import annotations

import functools

from rlvr.tasks import datasets, procedural, reasoning_gym
from rlvr.tasks.arithmetic import OPS, ArithmeticFamily

# the quickstart's raw-format arithmetic (rl.min_digits/rl.max_digits apply when built by rl.task)
ARITHMETIC = {op: functools.partial(ArithmeticFamily, op) for op in OPS}

FAMILIES = {**ARITHMETIC, **procedural.FAMILIES, **datasets.FAMILIES, **reasoning_gym.FAMILIES}

# the multi-turn environments' families (rlvr.envs: tools, code repair, stateful tools); their tasks are
# episodes (task.metadata["env"]), and a single completion is scored in their answer-only form
from rlvr.envs import families as env_families  # noqa: E402

FAMILIES.update(env_families.FAMILIES)

# the domain kits (rlvr.domains): each exports its FAMILIES table
from rlvr.domains.finance import families as finance_families  # noqa: E402

FAMILIES.update(finance_families.FAMILIES)

from rlvr.domains.cad import families as cad_families  # noqa: E402

FAMILIES.update(cad_families.FAMILIES)
# multimodal families (their prompts show images: a VLM policy, rl.prompt_format="chat")
from rlvr.tasks.charts import CHART_FAMILIES  # noqa: E402

FAMILIES.update(CHART_FAMILIES)
from rlvr.tasks.geometry_drawings import GEOMETRY_FAMILIES  # noqa: E402
from rlvr.tasks.ui_screens import UI_FAMILIES  # noqa: E402

FAMILIES.update(UI_FAMILIES)
FAMILIES.update(GEOMETRY_FAMILIES)
