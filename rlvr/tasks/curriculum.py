"""Curriculum: keep every task family at a difficulty "slightly beyond grasp", and no domain starved.

Per (family, difficulty level) the curriculum tracks an exponential moving average of the pass
rate of the groups it has seen. Sampling a task is two draws:

1. the family, from the configured mixture ratios, with a floor so that no family drops below
   `floor` of the draws, whatever the ratios say (the others keep their ratios among themselves);
2. its level, near the family's current level: the current level with weight 1, one level up and
   one level down with weight `explore` each. A level's weight is multiplied by `outside` when its
   tracked pass rate is known and outside the band [low, high].

After each update the family's current level moves up when its pass rate there is above `high`
(promotion: the tasks got too easy) and down when it is below `low` (demotion: too hard), once the
level has at least `min_samples` results. `state()`/`from_state()` round-trip through JSON and
include the RNG, so a resumed run draws exactly what the uninterrupted one would have.

Task graph: with `prerequisites` ({composite: [families]}, see `rlvr.tasks.graph`), a composite
family is locked — never drawn, and outside the floor — until each prerequisite's mastery
(its best tracked pass rate over levels with at least `min_samples` results) reaches
`threshold`. Unlocking is sticky: a composite once drawn stays in the mixture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class LevelStats:
    pass_rate: float = 0.0  # EMA over groups
    samples: int = 0  # results seen at this level
    zero_variance_groups: int = 0  # groups where every sample passed or every sample failed


class Curriculum:
    """Band-seeking difficulty per family plus floored mixture sampling; see the module doc."""

    def __init__(self, levels: Mapping[str, Sequence[int]], mixture: Mapping[str, float] | None = None,
                 band: tuple[float, float] = (0.2, 0.8), floor: float = 0.05, ema: float = 0.2,
                 min_samples: int = 16, explore: float = 0.25, outside: float = 0.1, seed: int = 0,
                 prerequisites: Mapping[str, Sequence[str]] | None = None, threshold: float = 0.5):
        if not levels:
            raise ValueError("curriculum: no task families given")
        low, high = band
        if not 0 <= low < high <= 1:
            raise ValueError(f"curriculum.band={band}: need 0 <= low < high <= 1")
        if not 0 <= floor <= 1:
            raise ValueError(f"curriculum.floor={floor}: must be in [0, 1] (capped at 1/families when drawing)")
        self.levels = {f: sorted(int(x) for x in ls) for f, ls in levels.items()}
        mixture = dict(mixture or {f: 1.0 for f in self.levels})
        unknown = sorted(set(mixture) - set(self.levels))
        if unknown:
            raise ValueError(f"curriculum.mixture names unknown families {unknown}")
        self.mixture = {f: float(mixture.get(f, 0.0)) for f in self.levels}
        self.band, self.floor, self.ema, self.min_samples = (low, high), floor, ema, min_samples
        self.explore, self.outside = explore, outside
        self.current = {f: ls[0] for f, ls in self.levels.items()}
        self.stats: dict[tuple[str, int], LevelStats] = {}
        self.rng = np.random.default_rng(seed)
        from rlvr.tasks.graph import check_acyclic

        self.prerequisites = {c: [p for p in ps if p in self.levels] for c, ps in (prerequisites or {}).items()
                              if c in self.levels}
        check_acyclic(self.prerequisites)
        self.threshold = threshold
        self.unlocked: set[str] = set()  # (acyclic: some family has no prerequisite, so one is always available)

    # --- sampling ---------------------------------------------------------------------------------

    def mastery(self, family: str) -> float:
        """The family's best tracked pass rate over levels with enough results (0 if none)."""
        rates = [s.pass_rate for (f, _), s in self.stats.items() if f == family and s.samples >= self.min_samples]
        return max(rates, default=0.0)

    def available(self) -> list[str]:
        """Families that may be drawn now: atomic ones, and composites whose prerequisites are mastered."""
        for c, ps in self.prerequisites.items():
            if c not in self.unlocked and all(self.mastery(p) >= self.threshold for p in ps):
                self.unlocked.add(c)
        return [f for f in self.levels if f not in self.prerequisites or f in self.unlocked]

    def family_weights(self) -> dict[str, float]:
        """Mixture ratios over the available families, normalised; families below the floor are
        lifted to it and the others share the rest in their configured ratios (repeated until no
        family is below the floor). Locked composites get 0."""
        names = self.available()
        floor = min(self.floor, 1.0 / len(names))
        raw = np.array([self.mixture[f] for f in names], np.float64)
        raw = raw if raw.sum() > 0 else np.ones(len(names))
        floored = np.zeros(len(names), bool)
        while True:
            free = ~floored
            weights = np.where(floored, floor, 0.0)
            rest = 1.0 - floor * floored.sum()
            weights[free] = rest * raw[free] / raw[free].sum() if raw[free].sum() > 0 else rest / free.sum()
            below = free & (weights < floor - 1e-12)
            if not below.any():
                return {f: float(w) for f, w in zip(names, weights, strict=True)}
            floored |= below

    def level_weights(self, family: str) -> dict[int, float]:
        ls, current = self.levels[family], self.current[family]
        i = ls.index(current)
        weights = {current: 1.0}
        for j in (i - 1, i + 1):
            if 0 <= j < len(ls):
                weights[ls[j]] = self.explore
        low, high = self.band
        for level in weights:
            stats = self.stats.get((family, level))
            if stats is not None and stats.samples >= self.min_samples and not low <= stats.pass_rate <= high:
                weights[level] *= self.outside
        return weights

    def sample(self, count: int = 1) -> list[tuple[str, int]]:
        """`count` (family, level) draws."""
        fw = self.family_weights()
        names = list(fw)
        out = []
        for f in self.rng.choice(len(names), size=count, p=np.array([fw[n] for n in names])):
            family = names[int(f)]
            lw = self.level_weights(family)
            levels = list(lw)
            p = np.array([lw[x] for x in levels])
            out.append((family, levels[int(self.rng.choice(len(levels), p=p / p.sum()))]))
        return out

    # --- learning from results ------------------------------------------------------------------

    def update(self, family: str, level: int, passes: Sequence[float]) -> None:
        """Records one group's pass/fail results (0..1 each) for a task of (family, level), then
        promotes or demotes the family's current level."""
        if not passes:
            return
        rate = float(np.mean(passes))
        stats = self.stats.setdefault((family, level), LevelStats())
        stats.pass_rate = rate if stats.samples == 0 else (1 - self.ema) * stats.pass_rate + self.ema * rate
        stats.samples += len(passes)
        stats.zero_variance_groups += int(len(set(passes)) == 1)
        self._move(family)

    def _move(self, family: str) -> None:
        ls, current = self.levels[family], self.current[family]
        stats = self.stats.get((family, current))
        if stats is None or stats.samples < self.min_samples:
            return
        i = ls.index(current)
        if stats.pass_rate > self.band[1] and i + 1 < len(ls):
            self.current[family] = ls[i + 1]
        elif stats.pass_rate < self.band[0] and i > 0:
            self.current[family] = ls[i - 1]

    # --- reporting and checkpointing --------------------------------------------------------------

    def report(self) -> list[dict[str, Any]]:
        """One row per (family, level) seen: pass rate, samples, zero-variance groups, current."""
        return [{"family": f, "level": lv, "pass_rate": round(s.pass_rate, 4), "samples": s.samples,
                 "zero_variance_groups": s.zero_variance_groups, "current": self.current[f] == lv,
                 "locked": f in self.prerequisites and f not in self.unlocked}
                for (f, lv), s in sorted(self.stats.items())]

    def state(self) -> dict[str, Any]:
        return {"current": dict(self.current), "unlocked": sorted(self.unlocked),
                "stats": [[f, lv, dataclasses.asdict(s)] for (f, lv), s in sorted(self.stats.items())],
                "rng": self.rng.bit_generator.state}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.current = {f: int(v) for f, v in state["current"].items()}
        self.stats = {(f, int(lv)): LevelStats(**s) for f, lv, s in state["stats"]}
        self.rng.bit_generator.state = state["rng"]
        self.unlocked = set(state.get("unlocked", []))
