"""Experience replay of rare successes on hard tasks.

When a group's pass rate is above 0 but at most `max_pass_rate` (the policy solved a hard task
once in a while), the task and one passing sample are kept in a bounded FIFO buffer. Later
rounds re-pose a fraction of their prompts from the buffer (fresh samples from the current
policy, new sampling seeds). If such a re-posed group fails entirely, the stored success takes
the place of one of its samples, so the group still carries a learning signal instead of being
a zero-variance group; the stored tokens keep their behaviour log-probs and versions, so the
importance ratio and clipping of the policy loss treat it as the off-policy sample it is.
An entry is dropped after `max_uses` re-posings. The buffer (and its RNG) is JSON state,
checkpointed with the producer.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from rlvr.rl.batching import Sample
from rlvr.tasks.base import Task


@dataclasses.dataclass
class ReplayEntry:
    task: Task
    success: Sample
    uses: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task.to_json(), "success": self.success.to_json(), "uses": self.uses}

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> ReplayEntry:
        return cls(Task.from_json(values["task"]), Sample.from_json(values["success"]), values["uses"])


class ReplayBuffer:
    """Bounded FIFO of (hard task, one of its rare successes); see the module doc."""

    def __init__(self, capacity: int, max_pass_rate: float = 0.25, max_uses: int = 2, seed: int = 0):
        self.capacity, self.max_pass_rate, self.max_uses = capacity, max_pass_rate, max_uses
        self.entries: collections.deque[ReplayEntry] = collections.deque(maxlen=capacity)
        self.rng = np.random.default_rng([seed, 0x7265])
        self.added = self.replayed = self.injected = 0

    def offer(self, task: Task, group: list[Sample], passes: list[float]) -> None:
        """Keeps one success of a group whose pass rate is in (0, max_pass_rate]."""
        rate = float(np.mean(passes))
        if self.capacity and 0 < rate <= self.max_pass_rate:
            best = max(range(len(group)), key=lambda i: (passes[i], group[i].rewards["reward"]))
            self.entries.append(ReplayEntry(task, dataclasses.replace(group[best])))
            self.added += 1

    def draw(self, count: int) -> list[ReplayEntry]:
        """Up to `count` distinct entries to re-pose (each use counted; spent ones removed)."""
        count = min(count, len(self.entries))
        if not count:
            return []
        picks = sorted(self.rng.choice(len(self.entries), size=count, replace=False).tolist())
        drawn = [self.entries[i] for i in picks]
        for entry in drawn:
            entry.uses += 1
        self.entries = collections.deque([e for e in self.entries if e.uses < self.max_uses], maxlen=self.capacity)
        self.replayed += len(drawn)
        return drawn

    def inject(self, entry: ReplayEntry, group: list[Sample], passes: list[float]) -> list[Sample]:
        """The group, with its last sample replaced by the stored success if nothing passed."""
        if any(passes):
            return group
        self.injected += 1
        return [*group[:-1], dataclasses.replace(entry.success, group=group[-1].group)]

    def stats(self) -> dict[str, float]:
        return {"replay_size": float(len(self.entries)), "replay_added": float(self.added),
                "replay_reposed": float(self.replayed), "replay_injected": float(self.injected)}

    def state(self) -> dict[str, Any]:
        return {"entries": [e.to_json() for e in self.entries], "rng": self.rng.bit_generator.state,
                "counts": [self.added, self.replayed, self.injected]}

    def load_state(self, state: dict[str, Any]) -> None:
        self.entries = collections.deque((ReplayEntry.from_json(e) for e in state["entries"]), maxlen=self.capacity)
        self.rng.bit_generator.state = state["rng"]
        self.added, self.replayed, self.injected = state["counts"]
