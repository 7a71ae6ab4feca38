"""Verifiable task families for RL and evaluation.

- `base`: the interface — `Family.sample(rng, level) -> Task`, `Family.score(task, text,
  truncated) -> reward components`, layered `RewardWeights`.
- `registry.FAMILIES`: the explicit table of families (procedural, dataset-backed,
  reasoning-gym); `arithmetic`: the raw-format add/sub/mul families of the quickstart.
- `mixture`: several families as one source (`rl.task = "a:2,b,rg/*"`).
- `curriculum`: band-seeking difficulty, floored mixtures, prerequisite gating (task graph).
- `verifiers`: exact/numeric/math/regex/JSON-schema/code/tool-state verifiers.
- `audit`: `python -m rlvr.tasks.audit` probes every verifier with junk and reference answers.
"""

from __future__ import annotations

from rlvr.tasks.arithmetic import ArithmeticFamily
from rlvr.tasks.base import Family, RewardWeights, Task
from rlvr.tasks.mixture import TaskMixture, build_tasks

__all__ = ["ArithmeticFamily", "Family", "RewardWeights", "Task", "TaskMixture", "build_tasks"]
