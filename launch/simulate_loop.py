"""The RL loop of `rlvr.launch.simulate` (read its module docstring first): the round scheduler,
episodes, the producer (a batch of rounds), the trainer and `Sim`, which wires them to the
resources of `rlvr.launch.simulate_resources` and computes the result. Internal.

Random draws come from a generator per (step, round, group), so two configurations see the
same tasks and lengths (common random numbers: a difference between them is the configuration's,
not the dice's).
"""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import numpy as np
from rlvr.launch.simulate_resources import Group, Levels, Loop, Pool, Request, Server, tokens


class Round:
    """One round's single-turn groups through the scheduler (rlvr.rl.scheduler.RoundScheduler):
    dispatch by policy while in-flight requests fit the capacity, score each finished sample,
    preempt the newest lower-priority group for a waiting one that does not fit."""

    def __init__(self, sim: Sim, groups: list[Group], done: Callable[[dict[str, float]], None]):
        self.sim, self.done = sim, done
        self.waiting = sorted(groups, key=sim.policy)
        self.inflight: dict[int, Group] = {}
        self.in_flight = self.scoring = 0
        self.held: list[Callable[[], None]] = []
        self.generated_at: float | None = None
        self.start, self.snap, self.finished = sim.loop.now, sim.levels.snapshot(), False
        capacity = sim.config.capacity
        self.capacity = sim.config.servers * sim.config.max_slots if capacity is None else capacity

    def run(self) -> None:
        self._step()

    def _step(self) -> None:
        self._dispatch()
        self._preempt()
        levels = self.sim.levels
        levels.set("round/inflight", self.in_flight)
        levels.set("round/busy", float(self.in_flight > 0))
        levels.set("round/queue", len(self.waiting))
        self._check()

    def _fits(self, g: Group) -> bool:
        need = len(g.outputs) - len(g.done)
        return not self.capacity or not self.inflight or self.in_flight + need <= self.capacity

    def _dispatch(self) -> None:
        while self.waiting and self._fits(self.waiting[0]):
            g = self.waiting.pop(0)
            if g.dispatched_at < 0:
                self.sim.record_wait("dispatch", g.priority, self.sim.loop.now - self.start)
            g.dispatched_at = self.sim.loop.now
            self.inflight[id(g)] = g
            for i, target in enumerate(g.outputs):
                if i not in g.done:
                    r = Request(g, g.prompt, target, g.priority, lambda r, g=g, i=i: self._completed(g, i, r))
                    g.pending[i] = r
                    self.in_flight += 1
                    self.sim.submit(r)

    def _preempt(self) -> None:
        if not (self.sim.config.preempt and self.waiting and self.capacity) or self._fits(self.waiting[0]):
            return
        top = self.waiting[0].priority
        victims = [g for g in self.inflight.values() if g.priority < top and not g.aborting and g.pending
                   and g.preemptions < self.sim.config.max_preemptions]
        victim = min(victims, key=lambda g: (g.priority, -g.dispatched_at), default=None)
        if victim is not None:
            victim.aborting = "preempt"
            victim.preemptions += 1
            self.sim.counts["preemptions"] += 1
            for r in list(victim.pending.values()):
                r.server.abort(r)

    def _completed(self, g: Group, i: int, r: Request) -> None:
        del g.pending[i]
        self.in_flight -= 1
        if not (r.aborted and g.aborting):
            g.done[i] = r
            g.samples[i] = (g.prompt + r.out, r.first_version, r.last_version)
            self.scoring += 1
            job = lambda: self.sim.verify(g.priority, g.verify[i], g.task.verify_sandbox, self._scored)  # noqa: E731
            job() if self.sim.config.verify_overlap else self.held.append(job)
        if not g.pending:
            del self.inflight[id(g)]
            if g.aborting == "preempt" and len(g.done) < len(g.outputs):
                self.waiting.append(g)
                self.waiting.sort(key=self.sim.policy)
            g.aborting = ""
        self._step()

    def _scored(self) -> None:
        self.scoring -= 1
        self._check()

    def _check(self) -> None:
        if self.waiting or self.inflight or self.finished:
            return
        if self.generated_at is None:
            self.generated_at = self.sim.loop.now
            for job in self.held:
                job()
            self.held = []
        if self.scoring:
            return
        self.finished = True
        self.done(self._metrics())

    def _metrics(self) -> dict[str, float]:
        """rlvr.rl.scheduler's per-round metrics (time inside the round only)."""
        now, end = self.sim.loop.now, self.sim.levels.snapshot()
        duration = max(now - self.start, 1e-12)
        mean = lambda name: (end.get(name, 0.0) - self.snap.get(name, 0.0)) / duration  # noqa: E731
        out = {"duration": now - self.start, "verify_s": now - self.generated_at,
               "util/inference": mean("round/busy"), "queue/inference": mean("round/queue"),
               "util/sandbox": mean("verifier/busy") / self.sim.config.verifier_workers,
               "queue/sandbox": mean("verifier/queue")}
        if self.capacity:
            out["util/inference_slots"] = mean("round/inflight") / self.capacity
        return out


class Episode:
    """One multi-turn episode: per turn a generation request (its history as the prompt), then a
    tool call on a sandbox worker; the history grows by the output and the observation."""

    def __init__(self, sim: Sim, g: Group, index: int, done: Callable[[], None]):
        self.sim, self.g, self.index, self.done = sim, g, index, done
        self.turns, self.history, self.versions = g.episodes[index], 0, []

    def turn(self, t: int) -> None:
        out, _, _ = self.turns[t]
        need = self.g.prompt + self.history
        if t and self.sim.config.engine.cache_history:
            need = max(1, self.turns[t - 1][2])
        self.sim.submit(Request(None, need, out, self.g.priority, lambda r: self._generated(t, r)))

    def _generated(self, t: int, r: Request) -> None:
        self.history += r.out
        self.versions += [r.first_version, r.last_version]
        tool_s = self.turns[t][1]
        if self.g.task.tool_s.kind == "const" and self.g.task.tool_s.a == 0:
            self._after_tool(t)
            return
        loop = self.sim.loop
        self.sim.sandboxes.submit(self.g.priority, lambda release: loop.at(
            tool_s, lambda: (release(), self._after_tool(t))))

    def _after_tool(self, t: int) -> None:
        if t + 1 < len(self.turns):
            self.history += self.turns[t][2]
            self.turn(t + 1)
            return
        self.g.samples[self.index] = (self.g.prompt + self.history, min(self.versions), max(self.versions))
        self.done()


class EpisodePhase:
    """The round's multi-turn groups: group_size episodes each, on a pool of episode threads
    (highest priority groups first), after its single-turn groups (as rlvr.rl.producer)."""

    def __init__(self, sim: Sim, groups: list[Group], done: Callable[[], None]):
        jobs = [(g, i) for g in sorted(groups, key=sim.policy) for i in range(len(g.episodes))]
        self.left, self.done = len(jobs), done
        self.pool = Pool(sim, "episode", min(sim.config.episode_workers, len(jobs)))
        for g, i in jobs:
            self.pool.submit(g.priority, lambda release, g=g, i=i: Episode(
                sim, g, i, lambda: (release(), self._ended())).turn(0))

    def _ended(self) -> None:
        self.left -= 1
        if not self.left:
            self.done()


class Batch:
    """`Producer.make_batch`: rounds until prompts_per_step groups are kept (dynamic sampling
    drops the groups whose samples all pass or all fail), at most max_refill_rounds refills."""

    def __init__(self, sim: Sim, step: int, done: Callable[[dict[str, Any]], None]):
        self.sim, self.step, self.done = sim, step, done
        self.kept: list[Group] = []
        self.dropped: list[Group] = []
        self.rounds, self.start, self.round_metrics = 0, sim.loop.now, []
        sim.levels.add("producer/busy", 1)

    def round(self) -> None:
        need = self.sim.config.prompts_per_step - len(self.kept)
        groups = [self.sim.new_group(self.step, self.rounds, i) for i in range(need)]
        single = [g for g in groups if g.episodes is None]
        episodic = [g for g in groups if g.episodes is not None]

        overlap = self.sim.config.overlap_phases
        left = [int(bool(single)) + int(bool(episodic))]

        def phase_done(metrics: dict[str, float] | None = None) -> None:
            if metrics:
                self.round_metrics.append(metrics)
            left[0] -= 1
            if episodic and not overlap and left[0] == 1:  # single-turn groups first, then the episodes
                EpisodePhase(self.sim, episodic, phase_done)
            elif not left[0]:
                self._filter(groups)
        if single:
            Round(self.sim, single, phase_done).run()
        if episodic and (overlap or not single):
            EpisodePhase(self.sim, episodic, phase_done)

    def _filter(self, groups: list[Group]) -> None:
        c = self.sim.config
        self.rounds += 1
        for g in groups:
            mixed = 0 < sum(g.passes) < len(g.passes)
            (self.kept if mixed or not c.dynamic_sampling else self.dropped).append(g)
        if len(self.kept) < c.prompts_per_step and self.rounds <= c.max_refill_rounds:
            self.round()
            return
        kept = (self.kept + self.dropped)[: c.prompts_per_step]
        self.sim.levels.add("producer/busy", -1)
        total = sum(m["duration"] for m in self.round_metrics) or 1e-12
        keys = [k for k in (self.round_metrics[0] if self.round_metrics else {}) if k.startswith(("util", "queue"))]
        round_means = {k: sum(m[k] * m["duration"] for m in self.round_metrics) / total for k in keys}
        self.done({"step": self.step, "samples": [g.samples[i] for g in kept for i in sorted(g.samples)],
                   "generate_s": self.sim.loop.now - self.start, "rounds": self.rounds,
                   "verify_s": sum(m["verify_s"] for m in self.round_metrics), "round": round_means})


class Producer:
    """Batches for the trainer: made on request (sync), or ahead on a background producer that
    may start batch b once the policy version >= b - max_staleness (async)."""

    def __init__(self, sim: Sim):
        self.sim, self.version, self.next, self.busy = sim, 0, 0, False
        self.queue: deque[dict[str, Any]] = deque()
        self.waiter: Callable[[dict[str, Any]], None] | None = None

    def request(self, step: int, deliver: Callable[[dict[str, Any]], None]) -> None:
        if self.sim.config.mode == "sync":
            Batch(self.sim, step, deliver).round()
        elif self.queue:
            deliver(self.queue.popleft())
        else:
            self.waiter = deliver
            self.produce()

    def set_version(self, version: int) -> None:
        self.version = version
        if self.sim.config.mode == "async":
            self.produce()

    def produce(self) -> None:
        c = self.sim.config
        if self.busy or self.next >= c.num_steps or self.version < self.next - c.max_staleness:
            return
        self.busy, step = True, self.next
        self.next += 1
        Batch(self.sim, step, self._made).round()

    def _made(self, batch: dict[str, Any]) -> None:
        self.busy = False
        if self.waiter is not None:
            deliver, self.waiter = self.waiter, None
            deliver(batch)
        else:
            self.queue.append(batch)
        self.produce()


class Trainer:
    """Steps: wait for the batch, train, sync every server, version += 1. With `colocated` = c,
    training runs at 1/(1+c) speed while any server computes."""

    def __init__(self, sim: Sim):
        self.sim, self.training, self.steps = sim, False, []
        self.remaining = self.rate = self.since = 0.0
        self.token = 0

    def begin(self, step: int) -> None:
        sim = self.sim
        if step == sim.config.num_steps:
            sim.finish()
            return
        if step == sim.config.warmup_steps:
            sim.window_start = (sim.loop.now, sim.levels.snapshot())
        self.record = {"step": step, "start": sim.loop.now}
        sim.producer.request(step, self._got)

    def _got(self, batch: dict[str, Any]) -> None:
        c, now = self.sim.config, self.sim.loop.now
        self.batch = batch
        self.record.update(wait_for_rollout_s=now - self.record["start"], generate_s=batch["generate_s"],
                           verify_s=batch["verify_s"], rounds=batch["rounds"], round=batch["round"])
        train_tokens = len(batch["samples"]) * c.train_padded_len if c.train_padded_len \
            else sum(s[0] for s in batch["samples"])
        self.sim.levels.add("trainer/busy", 1)
        self.training, self.remaining, self.since = True, c.train_fixed_s + c.train_per_token_s * train_tokens, now
        self.trained_at = now
        self._reschedule()
        self.sim.trainer_state_changed()

    def _reschedule(self) -> None:
        c = self.sim.config
        self.rate = 1.0 / (1.0 + c.colocated) if c.colocated and self.sim.active_servers else 1.0
        self.token += 1
        token = self.token
        self.sim.loop.at(self.remaining / self.rate, lambda: self._trained(token))

    def inference_changed(self) -> None:
        """Servers started or stopped computing: the colocated trainer's speed changes."""
        if self.training and self.sim.config.colocated:
            now = self.sim.loop.now
            self.remaining = max(self.remaining - (now - self.since) * self.rate, 0.0)
            self.since = now
            self._reschedule()

    def _trained(self, token: int) -> None:
        if token != self.token:
            return
        sim, step = self.sim, self.record["step"]
        self.training = False
        sim.trainer_state_changed()
        self.record["train_s"] = sim.loop.now - self.trained_at
        self.synced_from, left = sim.loop.now, [len(sim.servers)]

        def one_done() -> None:
            left[0] -= 1
            if not left[0]:
                self._synced()
        for server in sim.servers:
            server.request_sync(step + 1, one_done)

    def _synced(self) -> None:
        sim, step, now = self.sim, self.record["step"], self.sim.loop.now
        sim.levels.add("trainer/busy", -1)
        staleness = [step - first for _, first, _ in self.batch["samples"]]
        partial = [last != first for _, first, last in self.batch["samples"]]
        self.record.update(sync_s=now - self.synced_from, end=now, step_s=now - self.record["start"],
                           staleness=staleness, partial=partial)
        self.steps.append(self.record)
        sim.producer.set_version(step + 1)
        self.begin(step + 1)


class Sim:
    """One simulated run: the resources, the loop and the bookkeeping of the result."""

    def __init__(self, config, policy: Callable[[Any], tuple]):
        self.config, self.policy = config, policy
        self.loop = Loop()
        self.levels = Levels(self.loop)
        self.counts: dict[str, float] = defaultdict(float)
        self.waits: dict[str, list[float]] = defaultdict(list)
        self._arrivals = itertools.count()
        self.active_servers, self.finished, self.window_start = 0, False, None
        self.trainer = Trainer(self)
        self.servers = [Server(self) for _ in range(config.servers)]
        self.verifiers = Pool(self, "verifier", config.verifier_workers)
        self.sandboxes = Pool(self, "sandbox", config.sandbox_workers)
        self.producer = Producer(self)
        weights = np.array([t.weight for t in config.tasks], float)
        self.task_p = weights / weights.sum()

    def run(self, max_events: int) -> None:
        self.trainer.begin(0)
        if self.config.mode == "async":
            self.producer.produce()
        self.loop.run(max_events)
        if not self.finished:
            raise RuntimeError("simulation stalled before its last step (no event left to run)")

    def finish(self) -> None:
        self.finished, self.loop.stopped = True, True
        self.window_end = (self.loop.now, self.levels.snapshot())

    def next_arrival(self) -> int:
        return next(self._arrivals)

    def record_wait(self, resource: str, priority: float, seconds: float) -> None:
        if self.window_start is not None:
            self.waits[f"{resource}@{priority:g}"].append(seconds)

    def submit(self, r: Request) -> None:
        """To the server with the fewest requests in flight (rlvr.rollout.client's choice)."""
        server = min(self.servers, key=lambda s: (s.inflight, s.assigned))
        server.inflight += 1
        server.assigned += 1
        r.server, r.submitted_at = server, self.loop.now
        if r.arrival < 0:
            r.arrival = self.next_arrival()
        server.submit(r)

    def verify(self, priority: float, seconds: float, sandbox: bool, done: Callable[[], None]) -> None:
        """A verifier thread for `seconds` (and a sandbox worker with it when `sandbox`)."""
        def start(release: Callable[[], None]) -> None:
            if sandbox:
                self.sandboxes.submit(priority, lambda box: self.loop.at(seconds, lambda: (box(), release(), done())))
            else:
                self.loop.at(seconds, lambda: (release(), done()))
        self.verifiers.submit(priority, start)

    def server_activity(self, delta: int) -> None:
        before = self.active_servers
        self.active_servers += delta
        if bool(before) != bool(self.active_servers):
            self.trainer.inference_changed()

    def trainer_state_changed(self) -> None:
        if self.config.colocated:  # iterations in progress keep their cost; the next ones change speed
            for server in self.servers:
                server.cut()

    def new_group(self, step: int, round_: int, index: int) -> Group:
        c = self.config
        rng = np.random.default_rng([c.seed, step, round_, index])
        task = c.tasks[int(rng.choice(len(c.tasks), p=self.task_p))] if len(c.tasks) > 1 else c.tasks[0]
        prompt, size = tokens(task.prompt_tokens, rng), c.group_size
        cap = task.max_new_tokens or float("inf")
        output = lambda: int(min(tokens(task.output_tokens, rng), cap))  # noqa: E731
        episodes = None
        if task.episodic:
            episodes = [[(output(), task.tool_s.sample(rng), tokens(task.observation_tokens, rng, 0))
                         for _ in range(tokens(task.turns, rng))] for _ in range(size)]
        return Group(task, task.priority, self.next_arrival(), prompt, [output() for _ in range(size)],
                     [task.verify_s.sample(rng) for _ in range(size)], list(rng.random(size) < task.pass_rate),
                     episodes)
