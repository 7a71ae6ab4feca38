"""Several task families as one task source, built from the `rl.task` string.

`rl.task` names families from `rlvr.tasks.registry.FAMILIES` (plus the raw arithmetic families
add/sub/mul), comma-separated, each with an optional mixture weight and glob patterns allowed:

    "add"                          the quickstart's single family
    "list_sort:2,string_reverse"   two families, drawn 2:1
    "rg/*"                         every reasoning-gym family, equal weights
    "data/rl.jsonl,add"            a task file (a path ending in .jsonl: rlvr.tasks.datasets.TaskFileFamily,
                                   e.g. the flywheel's tasks) beside a family; a path takes no weight

Without a curriculum, task `i` of a stream draws its family from the weights with a generator
seeded by `(seed, stream, i)`, so the data position is still one integer. With a curriculum the
producer chooses (family, level) itself and asks `task(i, family=, level=)`. Held-out
evaluation sets are stratified: task `i` belongs to family `i mod F`, so every family is
measured on the same number of tasks (the capability-balance report compares domains).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import numpy as np

from rlvr.tasks.arithmetic import OPS, ArithmeticFamily
from rlvr.tasks.base import TRAIN, Family, RewardWeights, Task


class TaskMixture:
    """Families with mixture weights, behaving like one family (see module doc)."""

    def __init__(self, families: Mapping[str, Family], weights: Mapping[str, float] | None = None, seed: int = 0):
        if not families:
            raise ValueError("rl.task: no task families selected")
        self.families = dict(families)
        self.names = list(self.families)
        self.weights = {n: float((weights or {}).get(n, 1.0)) for n in self.names}
        self.seed = seed
        total = sum(self.weights.values())
        if total <= 0 or min(self.weights.values()) < 0:
            raise ValueError(f"rl.task weights {self.weights}: need non-negative weights with a positive sum")
        self._p = np.array([self.weights[n] / total for n in self.names])

    def levels(self) -> dict[str, list[int]]:
        return {n: f.levels() for n, f in self.families.items()}

    def domains(self) -> dict[str, str]:
        return {n: f.domain or n for n, f in self.families.items()}

    def _pick(self, index: int, stream: int) -> str:
        if len(self.names) == 1:
            return self.names[0]
        rng = np.random.default_rng([self.seed, stream, index, 0x6D6978])
        return self.names[int(rng.choice(len(self.names), p=self._p))]

    def task(self, index: int, stream: int = TRAIN, level: int | None = None, family: str | None = None) -> Task:
        name = family or self._pick(index, stream)
        if name not in self.families:
            raise ValueError(f"task family {name!r} is not in this run's mixture {self.names}")
        return self.families[name].task(index, stream, level)

    def tasks(self, start: int, count: int, stream: int = TRAIN) -> list[Task]:
        return [self.task(i, stream) for i in range(start, start + count)]

    def held_out(self, count: int, stream: int = 1) -> list[Task]:
        """`count` held-out tasks, stratified over families (one family: its first `count`)."""
        if len(self.names) == 1:
            return self.families[self.names[0]].tasks(0, count, stream)
        return [self.families[self.names[i % len(self.names)]].task(i // len(self.names), stream)
                for i in range(count)]

    def family_of(self, task: Task) -> Family:
        return self.families[task.family]

    def score(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        return self.family_of(task).score(task, completion, truncated)

    def demonstration(self, task: Task, off_format: bool = False) -> dict[str, str]:
        return self.family_of(task).demonstration(task, off_format)


def parse_task_spec(spec: str) -> dict[str, float]:
    """"a:2,b" -> {"a": 2.0, "b": 1.0}; patterns stay unexpanded."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, colon, weight = part.rpartition(":")
        if part.endswith(".jsonl"):  # a task file's path (TaskFileFamily), which may hold ':' (s3://...)
            out[part] = 1.0
            continue
        try:
            out[name.strip() if colon else part] = float(weight) if colon else 1.0
        except ValueError:
            raise ValueError(f"rl.task={spec!r}: weight {weight!r} of {name!r} is not a number") from None
    if not out:
        raise ValueError(f"rl.task={spec!r}: name at least one task family")
    return out


def available_families() -> list[str]:
    from rlvr.tasks.registry import FAMILIES

    return sorted(FAMILIES)


def expand(spec: str) -> dict[str, float]:
    """Task spec -> {family name: weight}, patterns expanded against the registry. Unknown names
    raise with the list of known ones (and the install hint for missing optional data)."""
    known = available_families()
    out: dict[str, float] = {}
    for pattern, weight in parse_task_spec(spec).items():
        if pattern.endswith(".jsonl"):
            out.setdefault(pattern, weight)
            continue
        names = fnmatch.filter(known, pattern) if any(c in pattern for c in "*?[") else \
            [pattern] if pattern in known else []
        if not names:
            raise ValueError(f"rl.task: {pattern!r} matches no task family. {_hint(pattern)}Known families: "
                             f"{', '.join(known[:40])}{' …' if len(known) > 40 else ''} ({len(known)} in all; "
                             "`python -m rlvr.tasks.audit --list` prints them)")
        for name in names:
            out.setdefault(name, weight)
    return out


def _hint(pattern: str) -> str:
    if pattern.startswith("rg/"):
        from rlvr.tasks import reasoning_gym

        if not reasoning_gym.FAMILIES:
            return "reasoning-gym is not installed: pip install -e '.[data]'. "
    return ""


def build_family(name: str, seed: int = 0, weights: RewardWeights | None = None, min_digits: int = 1,
                 max_digits: int = 3, format_weight: float = 0.0) -> Family:
    """One family by registry name (add/sub/mul take the digit range)."""
    if name in OPS:
        return ArithmeticFamily(op=name, min_digits=min_digits, max_digits=max_digits, seed=seed,
                                format_weight=format_weight)
    if name.endswith(".jsonl"):
        from rlvr.tasks.datasets import TaskFileFamily

        return TaskFileFamily(name, seed=seed, weights=weights)
    from rlvr.tasks.registry import FAMILIES

    return FAMILIES[name](seed=seed, weights=weights)


def build_tasks(rl, seed: int) -> TaskMixture:
    """The TaskMixture named by `rl.task` with `rl`'s reward weights and digit range."""
    weights = RewardWeights(format=rl.format_weight, process=rl.process_weight, safety=rl.safety_weight)
    mixture = expand(rl.task)
    families = {name: build_family(name, seed, weights, rl.min_digits, rl.max_digits, rl.format_weight)
                for name in mixture}
    return TaskMixture(families, mixture, seed)
