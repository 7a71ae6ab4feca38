"""Discrete-event simulation of rlvr's RL loop: plan a large run's resources on a laptop.

    from rlvr.launch import simulate
    result = simulate.simulate(simulate.SimulationConfig(servers=64, sandbox_workers=256, ...))
    result.summary()   # step time, utilisation per resource class, queues, staleness

It models the loop as `rlvr/trainers/rl.py`, `rlvr/rl/producer.py`, `rlvr/rl/scheduler.py` and
`rlvr/rollout/engine.py` run it, with a heap of timestamped events (no simulation library):

  trainer    one step = wait for the batch, train (fixed + per-token seconds), weight sync to every
             server (each finishes its current engine iteration first); sync mode makes the batch
             in the step, async mode on a producer that may start batch b once version >= b - k
  producer   a batch = rounds of `prompts_per_step - kept` groups of `group_size` samples until
             enough groups are kept (dynamic sampling drops groups whose samples all pass or all
             fail; at most `max_refill_rounds` refills); a round runs its single-turn groups through
             the scheduler and, at the same time, its multi-turn groups as episodes on
             `episode_workers`, as rlvr.rl.producer does (`overlap_phases=False`: episodes after the
             single-turn groups, the producer before the scheduler)
  scheduler  groups dispatched by the policy (highest priority first) while the requests in flight
             fit `capacity`; every finished sample is scored at once on `verifier_workers` threads
             (code verifiers also hold a sandbox worker); optional preemption of the newest
             lower-priority group when a higher-priority one does not fit (as rlvr.rl.scheduler)
  servers    continuous batching, one iteration = admit into free slots (a group's samples share
             their prompt: a twin waits until the leader's prompt is cached), prefill calls of
             `prefill_rows` rows x a chunk, one decode call emitting `decode_steps` tokens for every
             running sequence; times: decode_a + decode_b * running (+ decode_slot_s * max_slots for an
             engine that computes every slot), prefill_a + prefill_b * tokens;
             requests go to the server with the fewest in flight (as rlvr.rollout.client)
  episodes   each turn = a generation request (its whole history as prompt) then a tool call on
             `sandbox_workers`; the history grows by the output and the observation tokens
  colocation `colocated` = c > 0: the engine shares the trainer's devices; while both compute, the
             trainer progresses at 1/(1+c) speed and engine iterations take (1+c) times longer

Statistics are kept over a window that skips `warmup_steps` (as the measured runs skip compiles).
The choice policy is a small function (`POLICIES`: a waiting job with .priority and .arrival ->
sort key, lower served first); it orders the scheduler's groups, each server's admissions and the
worker queues. `engine_preempt` adds SGLang-style eviction: a waiting request takes the slot of a
lower-priority running one, which later prefills its prompt and output again. Within one round
the scheduler dispatches highest priority first, so its group preemption (`preempt`) only acts
when a higher-priority group joins a round already running (rlvr.rl.scheduler does the same).
Modules: this one (inputs, results, `simulate`, `plan`), `simulate_resources` (event loop,
servers, worker pools), `simulate_loop` (scheduler, episodes, producer, trainer) and
`simulate_calibrate` (`calibrate(workdir)`: a config fit to a measured run).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from rlvr.launch import simulate_loop

# --- the model's inputs --------------------------------------------------------------------------

DIST_KINDS = ("const", "uniform", "exp", "lognormal", "empirical")


@dataclasses.dataclass(frozen=True)
class Dist:
    """A length or duration distribution: const(a), uniform(a, b), exp(mean a), lognormal(mean a,
    coefficient of variation b), empirical(values). Build with the class methods."""

    kind: str = "const"
    a: float = 0.0
    b: float = 0.0
    values: tuple[float, ...] = ()

    def __post_init__(self):
        if self.kind not in DIST_KINDS:
            raise ValueError(f"Dist.kind={self.kind!r}: use one of {DIST_KINDS}")
        if self.kind == "empirical" and not self.values:
            raise ValueError("Dist.values: an empirical distribution needs at least one value")
        if self.kind != "empirical" and (self.a < 0 or self.b < 0):
            raise ValueError(f"Dist({self.kind}, a={self.a}, b={self.b}): parameters must be >= 0")

    @classmethod
    def const(cls, value: float) -> Dist:
        return cls("const", float(value))

    @classmethod
    def uniform(cls, low: float, high: float) -> Dist:
        if high < low:
            raise ValueError(f"Dist.uniform({low}, {high}): high must be >= low")
        return cls("uniform", float(low), float(high))

    @classmethod
    def exp(cls, mean: float) -> Dist:
        return cls("exp", float(mean))

    @classmethod
    def lognormal(cls, mean: float, cv: float) -> Dist:
        return cls("lognormal", float(mean), float(cv))

    @classmethod
    def empirical(cls, values: Sequence[float]) -> Dist:
        return cls("empirical", values=tuple(float(v) for v in values))

    def sample(self, rng: np.random.Generator) -> float:
        if self.kind == "const":
            return self.a
        if self.kind == "uniform":
            return float(rng.uniform(self.a, self.b))
        if self.kind == "exp":
            return float(rng.exponential(self.a)) if self.a > 0 else 0.0
        if self.kind == "lognormal":
            if self.a <= 0:
                return 0.0
            sigma2 = math.log1p(self.b ** 2)
            return float(rng.lognormal(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2)))
        return self.values[int(rng.integers(len(self.values)))]

    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "empirical":
            return float(np.mean(self.values))
        return self.a


@dataclasses.dataclass(frozen=True)
class TaskClass:
    """One kind of task in the mix. Single-turn: a prompt, an output, a verification. Episodic
    (`episodic=True`): `turns` turns, each an output of `output_tokens` then a tool call of `tool_s`
    on a sandbox worker, `observation_tokens` appended to the history between turns."""

    name: str = "task"
    weight: float = 1.0
    priority: float = 1.0
    prompt_tokens: Dist = Dist.const(16)
    output_tokens: Dist = Dist.const(64)
    max_new_tokens: int = 0  # > 0: outputs (per turn for episodes) are cut there (rl.max_new_tokens)
    verify_s: Dist = Dist.const(0.0)
    verify_sandbox: bool = False  # the verifier runs the answer in a sandbox (holds a sandbox worker)
    pass_rate: float = 0.5  # per sample; dynamic sampling drops groups that all pass or all fail
    episodic: bool = False
    turns: Dist = Dist.const(1)
    tool_s: Dist = Dist.const(0.0)
    observation_tokens: Dist = Dist.const(0)

    def __post_init__(self):
        if self.weight < 0 or not 0 <= self.pass_rate <= 1 or self.max_new_tokens < 0:
            raise ValueError(f"TaskClass {self.name!r}: weight and max_new_tokens must be >= 0, pass_rate in [0, 1] "
                             f"(got weight={self.weight}, pass_rate={self.pass_rate}, "
                             f"max_new_tokens={self.max_new_tokens})")


@dataclasses.dataclass(frozen=True)
class EngineTiming:
    """Service times of one inference server (fit by rlvr.launch.simulate_calibrate)."""

    decode_a: float = 0.01  # one decode call: decode_a + decode_b * running + decode_slot_s * max_slots
    decode_b: float = 0.0
    decode_slot_s: float = 0.0  # engines whose decode computes every slot (rlvr's: fixed shapes); SGLang: 0
    prefill_a: float = 0.005  # one prefill call: prefill_a + prefill_b * rows * chunk tokens
    prefill_b: float = 0.0
    step_overhead_s: float = 0.0  # host work per engine iteration (admission, bookkeeping)
    decode_steps: int = 8  # tokens per sequence per decode call
    prefill_rows: int = 4
    prefill_chunk: int = 64
    share_prefix: bool = True  # a group's samples share their prompt's cache (twins wait for the leader)
    cache_history: bool = False  # multi-turn: later turns prefill only the new tokens (radix cache)

    def scaled(self, factor: float) -> EngineTiming:
        """Every time multiplied by `factor` (machine speed, load)."""
        times = ("decode_a", "decode_b", "decode_slot_s", "prefill_a", "prefill_b", "step_overhead_s")
        return dataclasses.replace(self, **{name: getattr(self, name) * factor for name in times})


@dataclasses.dataclass(frozen=True)
class SimulationConfig:
    """One RL configuration to simulate. Times in seconds, lengths in tokens."""

    mode: str = "sync"  # sync | async
    max_staleness: int = 1  # async: batch b may start once the policy version >= b - max_staleness
    num_steps: int = 12
    warmup_steps: int = 2  # left out of the statistics
    prompts_per_step: int = 16
    group_size: int = 8
    dynamic_sampling: bool = False
    max_refill_rounds: int = 4
    tasks: tuple[TaskClass, ...] = (TaskClass(),)
    servers: int = 1
    max_slots: int = 64
    engine: EngineTiming = EngineTiming()
    capacity: int | None = None  # scheduler's in-flight bound; None = servers * max_slots; 0 = unbounded
    verifier_workers: int = 8
    verify_overlap: bool = True  # score each sample as it finishes (rlvr.rl.scheduler); False: after the round
    sandbox_workers: int = 4
    episode_workers: int = 64
    train_fixed_s: float = 0.0
    train_per_token_s: float = 1e-5
    train_padded_len: int = 0  # > 0: train tokens = rows * this (padded rows); 0: the samples' tokens
    weight_sync_s: float = 0.01
    colocated: float = 0.0  # contention between trainer and engine sharing devices (see module doc)
    overlap_phases: bool = True  # a round's episodes run alongside its single-turn groups (False: after them)
    policy: str = "priority"  # a key of POLICIES: order of groups, engine admission and worker queues
    preempt: bool = False  # group preemption by the round scheduler (rlvr.rl.scheduler)
    max_preemptions: int = 2
    engine_preempt: bool = False  # servers evict lower-priority running sequences for waiting ones
    seed: int = 0

    def __post_init__(self):
        _validate(self)


def _validate(c: SimulationConfig) -> None:
    if c.mode not in ("sync", "async"):
        raise ValueError(f"SimulationConfig.mode={c.mode!r}: use 'sync' or 'async'")
    if c.policy not in POLICIES:
        raise ValueError(f"SimulationConfig.policy={c.policy!r}: use one of {sorted(POLICIES)}")
    positive = ("num_steps", "prompts_per_step", "group_size", "servers", "max_slots", "verifier_workers",
                "sandbox_workers", "episode_workers")
    for name in positive:
        if getattr(c, name) < 1:
            raise ValueError(f"SimulationConfig.{name}={getattr(c, name)}: must be >= 1")
    if not 0 <= c.warmup_steps < c.num_steps:
        raise ValueError(f"SimulationConfig.warmup_steps={c.warmup_steps}: must be in [0, num_steps={c.num_steps})")
    for name in ("max_staleness", "max_refill_rounds", "train_fixed_s", "train_per_token_s", "weight_sync_s",
                 "colocated", "max_preemptions", "train_padded_len"):
        if getattr(c, name) < 0:
            raise ValueError(f"SimulationConfig.{name}={getattr(c, name)}: must be >= 0")
    if c.capacity is not None and c.capacity < 0:
        raise ValueError(f"SimulationConfig.capacity={c.capacity}: None (servers*max_slots), 0 (unbounded) or > 0")
    if not c.tasks or sum(t.weight for t in c.tasks) <= 0:
        raise ValueError("SimulationConfig.tasks: give at least one TaskClass with weight > 0")
    e = c.engine
    if e.decode_steps < 1 or e.prefill_rows < 1 or e.prefill_chunk < 1:
        raise ValueError("SimulationConfig.engine: decode_steps, prefill_rows and prefill_chunk must be >= 1")


# The choice policy: a waiting job (anything with .priority and .arrival) -> sort key, lower first.
POLICIES: dict[str, Callable[[Any], tuple]] = {
    "fifo": lambda job: (job.arrival,),
    "priority": lambda job: (-job.priority, job.arrival),
}


@dataclasses.dataclass
class SimulationResult:
    """What a simulated run predicts (window: the steps after `warmup_steps`).

    Utilisation: `trainer` = (train + sync time) / wall; `inference_busy` = share of time a server has
    >= 1 sequence in a slot; `inference_slots` = mean occupied slots / max_slots; `sandbox`,
    `verifier`, `episode_workers` = mean busy workers / workers, `producer` = share of time a batch
    is being made. `round` holds rlvr.rl.scheduler's metrics by its own definitions (`util/*`,
    `queue/*`: time inside its rounds only; `util/sandbox` is its verifier threads), averaged over
    the window's steps, to compare with the `util/*` and `queue/*` a run writes to metrics.jsonl."""

    step_s: float
    wait_for_rollout_s: float
    train_s: float
    sync_s: float
    generate_s: float
    verify_s: float
    utilisation: dict[str, float]
    queues: dict[str, float]
    round: dict[str, float]
    staleness: dict[str, Any]
    waits: dict[str, float]
    counts: dict[str, float]
    steps: list[dict[str, float]]

    def summary(self) -> dict[str, Any]:
        """The headline figures, rounded, for printing as JSON."""
        r = lambda x: round(float(x), 4)  # noqa: E731
        return {"step_s": r(self.step_s), "wait_for_rollout_s": r(self.wait_for_rollout_s), "train_s": r(self.train_s),
                "sync_s": r(self.sync_s), "generate_s": r(self.generate_s), "verify_s": r(self.verify_s),
                "utilisation": {k: r(v) for k, v in self.utilisation.items()},
                "queues": {k: r(v) for k, v in self.queues.items()},
                "round": {k: r(v) for k, v in self.round.items()},
                "staleness_mean": r(self.staleness["mean"]), "staleness_max": self.staleness["max"],
                "waits": {k: r(v) for k, v in self.waits.items()}, "counts": self.counts}


def simulate(config: SimulationConfig, max_events: int = 20_000_000) -> SimulationResult:
    """Runs the simulation of `config` to its last step (deterministic for a fixed `config.seed`)."""
    sim = simulate_loop.Sim(config, POLICIES[config.policy])
    sim.run(max_events)
    return _summarize(sim)


def _summarize(sim: simulate_loop.Sim) -> SimulationResult:
    """The window's time averages and per-step means (see SimulationResult)."""
    c = sim.config
    (t0, start), (t1, end) = sim.window_start, sim.window_end
    wall = max(t1 - t0, 1e-12)
    mean = lambda name: (end.get(name, 0.0) - start.get(name, 0.0)) / wall  # noqa: E731
    steps = sim.trainer.steps[c.warmup_steps:]
    utilisation = {"trainer": mean("trainer/busy"), "producer": mean("producer/busy"),
                   "inference_busy": mean("inference/busy") / c.servers,
                   "inference_slots": mean("inference/slots") / (c.servers * c.max_slots),
                   "verifier": mean("verifier/busy") / c.verifier_workers,
                   "sandbox": mean("sandbox/busy") / c.sandbox_workers,
                   "episode_workers": mean("episode/busy") / c.episode_workers}
    rounds = [s["round"] for s in steps if s["round"]]
    keys = sorted({k for r in rounds for k in r})
    per_round = {key: float(np.mean([r.get(key, 0.0) for r in rounds])) for key in keys}
    queues = {"inference_requests": mean("inference/waiting"), "dispatch_groups": mean("round/queue"),
              "verifier": mean("verifier/queue"), "sandbox": mean("sandbox/queue"),
              "episodes": mean("episode/queue")}
    staleness = [x for s in steps for x in s["staleness"]]
    values, counts = np.unique(staleness, return_counts=True)
    per_step = lambda key: float(np.mean([s[key] for s in steps]))  # noqa: E731
    return SimulationResult(
        step_s=wall / len(steps), wait_for_rollout_s=per_step("wait_for_rollout_s"), train_s=per_step("train_s"),
        sync_s=per_step("sync_s"), generate_s=per_step("generate_s"), verify_s=per_step("verify_s"),
        utilisation=utilisation, queues=queues, round=per_round,
        staleness={"mean": float(np.mean(staleness)), "max": int(max(staleness)),
                   "histogram": {int(v): float(n / len(staleness)) for v, n in zip(values, counts, strict=True)},
                   "partial_fraction": float(np.mean([p for s in steps for p in s["partial"]]))},
        waits={k: float(np.mean(v)) for k, v in sorted(sim.waits.items())},
        counts={**dict(sim.counts), "rounds_per_step": per_step("rounds")},
        steps=[{k: v for k, v in s.items() if k not in ("staleness", "partial", "round")} for s in sim.trainer.steps])


# --- planning ------------------------------------------------------------------------------------

def plan(base: SimulationConfig, grid: Mapping[str, Sequence[Any]],
         costs: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Simulates every combination of `grid` (SimulationConfig field -> values) and recommends the
    one with the lowest cost per step: step_s x (trainer + servers x server + sandbox_workers x
    sandbox) in `costs`' units per second (default 1, 1, 0.01: a sandbox core is cheap next to an
    accelerator). Returns {"rows": [...], "recommended": row, "fastest": row}."""
    costs = {"trainer": 1.0, "server": 1.0, "sandbox": 0.01, **(costs or {})}
    unknown = set(grid) - {f.name for f in dataclasses.fields(SimulationConfig)}
    if unknown:
        raise ValueError(f"plan grid: {sorted(unknown)} are not SimulationConfig fields")
    rows = []
    for values in itertools.product(*grid.values()):
        changes = dict(zip(grid, values, strict=True))
        config = dataclasses.replace(base, **changes)
        result = simulate(config)
        rate = costs["trainer"] + config.servers * costs["server"] + config.sandbox_workers * costs["sandbox"]
        shown = ("trainer", "inference_busy", "inference_slots", "sandbox", "verifier")
        rows.append({**changes, "step_s": round(result.step_s, 3), "cost_per_step": round(result.step_s * rate, 1),
                     "bottleneck": bottleneck(result), "staleness_mean": round(result.staleness["mean"], 2),
                     **{f"util/{k}": round(result.utilisation[k], 3) for k in shown}})
    return {"rows": rows, "recommended": min(rows, key=lambda row: row["cost_per_step"]),
            "fastest": min(rows, key=lambda row: row["step_s"])}


def bottleneck(result: SimulationResult) -> str:
    """What the step waits on: "trainer" when it is busy >= 90% of the time; else the busiest of
    inference slots, sandbox workers and verifier threads when one is >= 50% busy; else "latency"
    (the rollout's critical path: the longest outputs, chains of turns, the round's phases)."""
    u = result.utilisation
    if u["trainer"] >= 0.9:
        return "trainer"
    candidates = {"inference": u["inference_slots"], "sandbox": u["sandbox"], "verifier": u["verifier"]}
    busiest = max(candidates, key=candidates.get)
    return busiest if candidates[busiest] >= 0.5 else "latency"
