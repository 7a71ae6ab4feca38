"""Multi-host RL: each process reads its share of the task stream and verifies its share of the completions.

On a multi-process job every process drives the same embedded engine over the global mesh (SPMD), so
every process needs every prompt and every reward (they take the same host-side decisions: curriculum,
advantages, the train batch). What is split is the host work: task `cursor + i` of a round is read
(generated, or loaded from its dataset) only by process `i % processes`, and the completions of group
`g` (the round's g-th task) are verified only by process `g % processes`; the others receive them by an
exchange of JSON (rlvr.data.shards.gather_json) at a fixed point of the synchronous loop. With one
process nothing is exchanged and every task is read and verified here.

Multi-turn episodes (tools, sandboxes) run on every process: an environment's answers shape the next
turn's prompt, which the SPMD engine needs everywhere (docs/how-to/launch-on-a-pod.md, "Running across hosts").

Held-out evaluation (rlvr.evaluation) splits its verifying the same way (`split`): task i's completions are
scored only by process i mod N.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax

from rlvr.data import shards
from rlvr.tasks.base import Task


class HostShare:
    """Who reads which task and verifies which group, and the exchanges that give every process all of them."""

    def __init__(self, process: int | None = None, processes: int | None = None):
        self.process = jax.process_index() if process is None else process
        self.processes = jax.process_count() if processes is None else processes
        self.tasks_read = 0  # tasks this process read from the stream
        self.completions_verified = 0  # completions this process's verifiers scored
        self._lock = threading.Lock()

    def owns(self, position: int) -> bool:
        return position % self.processes == self.process

    def read_tasks(self, read: Callable[[int], Task], count: int) -> list[Task]:
        """Tasks 0..count-1 of a round (`read(i)` reads the i-th): this process reads its own, the
        others arrive from their processes."""
        mine = [i for i in range(count) if self.owns(i)]
        self.tasks_read += len(mine)
        if self.processes == 1:
            return [read(i) for i in range(count)]
        tasks: list[Any] = [None] * count
        for shared in shards.gather_json({str(i): read(i).to_json() for i in mine}):
            for i, values in shared.items():
                tasks[int(i)] = Task.from_json(values)
        return tasks

    def verifies(self, group: int) -> bool:
        """Whether this process verifies group `group`'s completions (counted when it does)."""
        if not self.owns(group):
            return False
        with self._lock:
            self.completions_verified += 1
        return True

    def share_verdicts(self, by_group: dict[int, list[tuple[Any, dict | None]]]) -> None:
        """{group: [(sample, failure)]}: the groups this process verified have their rewards (and
        failures); the others get theirs from the processes that verified them (in place)."""
        if self.processes == 1:
            return
        mine = {str(g): [[s.rewards, f] for s, f in results] for g, results in by_group.items() if self.owns(g)}
        for shared in shards.gather_json(mine):
            for g, verdicts in shared.items():
                results = by_group[int(g)]
                for n, ((sample, _), (rewards, failure)) in enumerate(zip(results, verdicts, strict=True)):
                    sample.rewards = rewards
                    results[n] = (sample, failure)

    def split(self, count: int, work: Callable[[int], Any]) -> list[Any]:
        """[work(i) for i in range(count)]: this process computes the i it owns, the others' results (JSON)
        arrive from their processes. Collective on several processes: all call it at the same point."""
        if self.processes == 1:
            return [work(i) for i in range(count)]
        results: list[Any] = [None] * count
        for shared in shards.gather_json({str(i): work(i) for i in range(count) if self.owns(i)}):
            for i, value in shared.items():
                results[int(i)] = value
        return results

    def report(self) -> str:
        return (f"rollout: process {self.process} of {self.processes} read {self.tasks_read} tasks and verified "
                f"{self.completions_verified} completions")
