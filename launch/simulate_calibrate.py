"""Fit `rlvr.launch.simulate` to measured runs: `calibrate(workdir) -> SimulationConfig`.

    bench = Microbench("workdirs/quickstart")
    config = calibrate("workdirs/quickstart", engine=bench.engine_timing(), train=bench.train())
    simulate(dataclasses.replace(config, mode="async")).step_s   # a prediction for another setting

What comes from where:
  structure     config.json: mode, staleness bound, prompts_per_step x group_size, engine slots,
                decode_steps, prefill rows/chunk, verifier/sandbox/episode workers, padded rows
  lengths       prompt tokens: 64 prompts of the run's task family through its tokenizer; output
                tokens: metrics `response_length` and `truncated_fraction` (the truncated share at
                max_new_tokens, the rest uniform around the remaining mean); episodes: turns,
                tokens and tool seconds per turn from episodes.jsonl
  service times train: median `train_s` over the padded tokens (optionally shaped fixed +
                per-token by `Microbench.train`); weight sync: median `sync_s`; verification:
                busy verifier seconds (`util/sandbox` x workers x round) per scored sample;
                engine: the shape of `Microbench.engine_timing` (decode and prefill calls timed on the
                run's own model), scaled so the simulated `generate_s` matches the measured one
                (one factor: the machine's speed and the host overheads of that run)

`measured(workdir)` gives the figures a prediction is compared with, with their definitions.
The first `skip_steps` steps (compiles) are left out everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from rlvr.launch.simulate import Dist, EngineTiming, SimulationConfig, TaskClass, simulate

from rlvr import observe


def load_run(workdir: str) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """(config.json, the metrics.jsonl records) of a run directory."""
    paths = [os.path.join(workdir, name) for name in ("config.json", "metrics.jsonl")]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"calibrate: {missing} not found; pass the workdir of a finished RL run")
    with open(paths[0]) as f:
        config = json.load(f)
    records = observe.read_metrics(workdir)
    if config.get("job") != "rl":
        raise ValueError(f"calibrate: {workdir} is a {config.get('job')!r} run; it needs an RL run (job='rl')")
    return config, records


def _steps(records: list[dict[str, float]], skip_steps: int) -> list[dict[str, float]]:
    steps = [r for r in records if "step_s" in r]
    if len(steps) <= skip_steps:
        raise ValueError(f"calibrate: {len(steps)} steps recorded, skip_steps={skip_steps}; run more steps")
    return steps[skip_steps:]


def measured(workdir: str, skip_steps: int = 2, outlier: float = 2.5) -> dict[str, float]:
    """The run's figures after `skip_steps`: mean per-step times; `util/trainer` = sum(train_s +
    sync_s) / sum(step_s); `util/producer` = sum(generate_s) / sum(step_s) (share of the loop's
    time a batch is being made); the scheduler's `util/*` and `queue/*` (per-round definitions)
    as plain means over steps when the run wrote them; `step_s_cv`: step-time noise. Steps longer
    than `outlier` x the median step (a late compile, a stall of the shared machine) are left
    out and counted in `outlier_steps`."""
    _, records = load_run(workdir)
    steps = _steps(records, skip_steps)
    median = statistics.median(r["step_s"] for r in steps)
    kept = [r for r in steps if r["step_s"] <= outlier * median]
    dropped, steps = len(steps) - len(kept), kept
    wall = sum(r["step_s"] for r in steps)
    mean = lambda key: float(np.mean([r[key] for r in steps]))  # noqa: E731
    out = {"steps": len(steps), "outlier_steps": dropped, "step_s": wall / len(steps),
           "step_s_median": statistics.median(r["step_s"] for r in steps),
           "step_s_cv": float(np.std([r["step_s"] for r in steps]) / max(wall / len(steps), 1e-12)),
           "train_s": mean("train_s"), "sync_s": mean("sync_s"), "generate_s": mean("generate_s"),
           "wait_for_rollout_s": mean("wait_for_rollout_s"),
           "util/trainer": sum(r["train_s"] + r["sync_s"] for r in steps) / wall,
           "util/producer": sum(r["generate_s"] for r in steps) / wall,
           "staleness_mean": mean("staleness_mean"), "staleness_max": max(r["staleness_max"] for r in steps)}
    for key in ("verify_s", "util/inference", "util/inference_slots", "util/sandbox", "queue/inference",
                "queue/sandbox", "episodes_per_s", "episode_env_share"):
        if all(key in r for r in steps):
            out[f"round/{key}" if key.startswith(("util/", "queue/")) else key] = mean(key)
    return out


# --- lengths -------------------------------------------------------------------------------------

def output_dist(mean: float, truncated: float, max_new: int, points: int = 64) -> Dist:
    """Output lengths with the measured mean: a `truncated` share at max_new, the rest spread
    uniformly (as `points` quantiles) around the mean they must have."""
    if truncated >= 0.999 or mean >= max_new - 0.5:
        return Dist.const(max_new)
    rest = min(max((mean - truncated * max_new) / (1 - truncated), 1.0), max_new)
    half = min(rest - 1, max_new - rest)
    n_max = int(round(truncated * points))
    rest_values = np.linspace(rest - half, rest + half, points - n_max)
    return Dist.empirical([float(max_new)] * n_max + [float(v) for v in rest_values])


def prompt_lengths(config: dict[str, Any], count: int = 64) -> Dist:
    """Token counts of `count` prompts of the run's task family (its tokenizer, its prompt format)."""
    import ml_collections

    from rlvr import api
    from rlvr.rl.producer import prompt_ids
    from rlvr.tasks import build_tasks

    c = ml_collections.ConfigDict(config)
    tokenizer = api.build_tokenizer(c)
    tasks = build_tasks(c.rl, c.seed)
    lengths = [len(prompt_ids(tokenizer, t, c.rl.prompt_format)) for t in tasks.tasks(0, count)]
    return Dist.empirical(lengths)


def _episode_task(workdir: str, name: str, response_length: float, pass_rate: float) -> TaskClass | None:
    """Turns, output tokens and tool seconds per turn from the run's episodes.jsonl."""
    path = os.path.join(workdir, "episodes.jsonl")
    if not os.path.exists(path):
        return None
    turns, outputs, tools = [], [], []
    with open(path) as f:
        for line in f:
            trace = json.loads(line).get("trace", {})
            if trace.get("turns"):
                turns.append(len(trace["turns"]))
                outputs += [t["tokens"] for t in trace["turns"]]
                tools += [t.get("env_s", 0.0) for t in trace["turns"]]
    if not turns:
        return None
    mean_turns = float(np.mean(turns))
    observation = max(response_length - float(np.mean(outputs)) * mean_turns, 0.0) / max(mean_turns - 1, 1.0)
    return TaskClass(name=name, episodic=True, turns=Dist.empirical(turns), output_tokens=Dist.empirical(outputs),
                     tool_s=Dist.empirical(tools), observation_tokens=Dist.const(observation), pass_rate=pass_rate)


# --- calibration ---------------------------------------------------------------------------------

def structure(config: dict[str, Any]) -> dict[str, Any]:
    """The SimulationConfig fields that config.json fixes (no timing)."""
    rl = config["rl"]
    e = rl["engine"]
    urls = [u for u in rl.get("sglang_urls", "").split(",") if u.strip()] if rl["backend"] == "sglang" else []
    capacity = rl.get("schedule", {}).get("capacity", 0) or (0 if urls else None)
    return {"mode": rl["mode"], "max_staleness": rl["max_staleness"], "prompts_per_step": rl["prompts_per_step"],
            "group_size": rl["group_size"], "dynamic_sampling": rl["dynamic_sampling"],
            "max_refill_rounds": rl["max_refill_rounds"], "servers": max(len(urls), 1), "max_slots": e["max_slots"],
            "capacity": capacity, "verifier_workers": rl["verifier_workers"],
            "sandbox_workers": rl.get("env", {}).get("sandbox_workers", 4) or 1,
            "episode_workers": rl.get("episode_workers", 64), "train_padded_len": 0 if rl["pack"] else rl["seq_len"],
            "preempt": rl.get("schedule", {}).get("preempt", False),
            "max_preemptions": rl.get("schedule", {}).get("max_preemptions", 2)}


def calibrate(workdir: str, engine: EngineTiming | None = None, train: tuple[float, float] | None = None,
              skip_steps: int = 2, colocated: float = 0.0, prompt_tokens: Dist | None = None,
              num_steps: int = 12) -> SimulationConfig:
    """A SimulationConfig of the run in `workdir` whose simulated step matches the measured one
    (see the module docstring). `engine`: the engine's timing shape (`Microbench.engine_timing`;
    default: every call costs the same); `train`: (fixed s, s per token) shape (`Microbench.train`;
    default: all per token); `colocated`: the contention of an engine sharing the trainer's devices
    (`Microbench.colocation`). Calibrate on a sync run: in async mode the measured train and sync
    times include the contention with generation, which the simulation adds itself."""
    config, records = load_run(workdir)
    steps = _steps(records, skip_steps)
    med = lambda key: float(statistics.median(r.get(key, 0.0) for r in steps))  # noqa: E731
    fields = structure(config)
    rl = config["rl"]
    fields["engine"] = dataclasses.replace(engine or EngineTiming(decode_a=1.0, prefill_a=1.0),
                                           decode_steps=rl["engine"]["decode_steps"],
                                           prefill_rows=rl["engine"]["prefill_rows"],
                                           prefill_chunk=rl["engine"]["prefill_chunk"])
    samples = med("groups_generated") * rl["group_size"] or rl["prompts_per_step"] * rl["group_size"]
    verify_busy = med("util/sandbox") * rl["verifier_workers"] * med("generate_s") if "util/sandbox" in steps[0] \
        else med("verify_s") * min(rl["verifier_workers"], samples)  # before the scheduler: verify after the round
    pass_rate = min(max(med("pass_rate"), 0.0), 1.0)
    task = _episode_task(workdir, rl["task"], med("response_length"), pass_rate) if "episodes" in steps[0] else None
    if task is None:
        task = TaskClass(name=rl["task"], prompt_tokens=prompt_tokens or prompt_lengths(config),
                         output_tokens=output_dist(med("response_length"), med("truncated_fraction"),
                                                   rl["max_new_tokens"]),
                         verify_s=Dist.const(verify_busy / samples), pass_rate=pass_rate)
    rows = med("rows") or rl["prompts_per_step"] * rl["group_size"]
    train_tokens = rows * (fields["train_padded_len"] or rl["seq_len"])
    fixed, per_token = train or (0.0, 1.0)
    train_scale = med("train_s") / (fixed + per_token * train_tokens)
    base = SimulationConfig(**fields, tasks=(task,), num_steps=num_steps, warmup_steps=2, colocated=colocated,
                            train_fixed_s=fixed * train_scale, train_per_token_s=per_token * train_scale,
                            weight_sync_s=med("sync_s"), verify_overlap="util/sandbox" in steps[0],
                            seed=config.get("seed", 0))
    return fit_engine_scale(base, med("generate_s"))


def transfer(base: SimulationConfig, workdir: str, **changes: Any) -> SimulationConfig:
    """`base`'s fitted timings and task mix with the structure of the run in `workdir` (its
    config.json: batch shape, mode, engine settings, workers): a prediction for that run."""
    config, _ = load_run(workdir)
    rl = config["rl"]["engine"]
    engine = dataclasses.replace(base.engine, decode_steps=rl["decode_steps"], prefill_rows=rl["prefill_rows"],
                                 prefill_chunk=rl["prefill_chunk"])
    return dataclasses.replace(base, **structure(config), engine=engine, **changes)


def fit_engine_scale(base: SimulationConfig, generate_s: float, iterations: int = 6) -> SimulationConfig:
    """`base` with its engine times scaled so the simulated generate_s matches `generate_s`
    (fixed-point iterations; generation time is close to linear in the engine's times)."""
    config = base
    for _ in range(iterations):
        simulated = simulate(config).generate_s
        if simulated <= 0 or abs(simulated / generate_s - 1) < 0.005:
            break
        config = dataclasses.replace(config, engine=config.engine.scaled(generate_s / simulated))
    return config


# --- microbenchmarks -----------------------------------------------------------------------------

def _nonnegative_fit(rows: Sequence[tuple[float, ...]], y: Sequence[float]) -> tuple[float, ...]:
    """Least-squares coefficients of y ~ rows . coef on per-row medians, all >= 0 (scipy's NNLS)."""
    from scipy.optimize import nnls

    groups: dict[tuple[float, ...], list[float]] = {}
    for row, yi in zip(rows, y, strict=True):
        groups.setdefault(tuple(row), []).append(float(yi))
    keys = sorted(groups)
    coef, _ = nnls(np.array(keys, float), np.array([statistics.median(groups[k]) for k in keys]))
    return tuple(float(v) for v in coef)


class Microbench:
    """The run's own engine and RL train step (its model config, random weights, its engine and
    row settings) built once in this process, timed three ways:

      engine()      every prefill call (rows x chunk tokens) and decode call (running sequences)
                    of `counts` concurrent requests, and the rest of each iteration -> EngineTiming
      train()       the update on half and all of a batch's rows -> (fixed s, s per token)
      colocation()  a batch's generation and a train update alone, then at once on two threads
                    -> c, the mean slowdown - 1 of each while the other runs (SimulationConfig.colocated)
    """

    def __init__(self, workdir: str):
        import ml_collections

        from rlvr import api

        config, _ = load_run(workdir)
        self.c = c = ml_collections.ConfigDict(config)
        self.rl = c.rl
        self._model, self._tokenizer = api.build_model(c), api.build_tokenizer(c)
        self.engine = self._engine(c.rl.engine.max_slots)
        self.prompt = max(1, int(round(prompt_lengths(config, 16).mean())))
        self.rng = np.random.default_rng(0)
        self._updates: dict[int, Any] = {}

    def _engine(self, max_slots: int):
        from rlvr.rollout.engine import Engine

        e = self.rl.engine
        return Engine(self._model.cfg, self._model.params, self._tokenizer, max_slots=max_slots, max_len=e.max_len,
                      page_size=e.page_size, decode_steps=e.decode_steps, prefill_rows=e.prefill_rows,
                      prefill_chunk=e.prefill_chunk)

    def generate(self, n: int, engine=None) -> float:
        """Seconds to generate n requests of the run's prompt length and max_new_tokens (no eos)."""
        from rlvr.rollout.types import Request, SamplingParams

        params = SamplingParams(max_new_tokens=self.rl.max_new_tokens, ignore_eos=True)
        requests = [Request(f"m{self.rng.integers(1 << 60)}", self.rng.integers(3, 200, self.prompt).tolist(), params)
                    for _ in range(n)]
        t0 = time.perf_counter()
        (engine or self.engine).generate(requests)
        return time.perf_counter() - t0

    def engine_timing(self, counts: Sequence[int] = (1, 16, 64), repeats: int = 2) -> EngineTiming:
        """Decode calls on the run's engine and on one with a quarter of its slots (the call's
        cost per slot), prefill calls, and the rest of each iteration, fit by least squares."""
        e = self.rl.engine
        calls: list[tuple[str, float, float]] = []
        for engine in (self.engine, self._engine(max(1, e.max_slots // 4))):
            restore = _timed_engine(engine, calls)
            try:
                for n in [k for k in counts if k <= engine.max_slots]:
                    for repeat in range(repeats + 2):  # the first two passes compile (and recompile); dropped
                        start = len(calls)
                        self.generate(n, engine)
                        if repeat < 2:
                            del calls[start:]
            finally:
                restore()
        decode = [(x, t) for kind, x, t in calls if kind == "decode"]
        prefill = [(x, t) for kind, x, t in calls if kind == "prefill"]
        da, db, ds = _nonnegative_fit([(1.0, running, slots) for (running, slots, *_), _ in decode],
                                      [t for _, t in decode])
        pa, pb = _nonnegative_fit([(1.0, x) for x, _ in prefill], [t for _, t in prefill])
        return EngineTiming(decode_a=da, decode_b=db, decode_slot_s=ds, prefill_a=pa, prefill_b=pb,
                            step_overhead_s=float(statistics.median(t for kind, _, t in calls if kind == "step")),
                            decode_steps=e.decode_steps, prefill_rows=e.prefill_rows, prefill_chunk=e.prefill_chunk)

    def update(self, rows: int) -> float:
        """Seconds of one RL update on `rows` rows (the first call per shape compiles)."""
        if rows not in self._updates:
            self._updates[rows] = self._build_update(rows)
        run = self._updates[rows]
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0

    def _build_update(self, rows: int):
        from rlvr.rl.batching import Sample, build_batch
        from rlvr.rl.update import PolicyUpdate
        from rlvr.train import step as step_lib
        from rlvr.train.optimizer import build_optimizer, learning_rate_schedule

        c, rl, model = self.c, self.rl, self._model
        optimizer = build_optimizer(c.optimizer, 1000)
        shardings = step_lib.state_shardings(model.cfg, optimizer, model.mesh)
        state = [step_lib.init_state(jax_copy(model.params), optimizer, shardings)]
        update = PolicyUpdate(c, model, optimizer, shardings, None, learning_rate_schedule(c.optimizer, 1000))
        n, prompt = rl.max_new_tokens, max(1, rl.seq_len - rl.max_new_tokens)
        samples = [Sample(i // rl.group_size, i, self.rng.integers(3, 200, prompt).tolist(),
                          self.rng.integers(3, 200, n).tolist(), [0.0] * n, [0] * n, False,
                          {"reward": float(i % 2)}, advantage=float(i % 2) - 0.5) for i in range(rows)]
        arrays = build_batch(samples, rl.seq_len, 0, rl.aggregation, rl.max_new_tokens, rl.pack, self.row_multiple)

        def run() -> None:
            state[0], _ = update(state[0], dict(arrays), samples, 0)
        return run

    @property
    def row_multiple(self) -> int:
        mesh = dict(self._model.mesh.shape)
        return mesh.get("data", 1) * mesh.get("fsdp", 1) * self.c.train.micro_batches * self.rl.updates_per_batch

    @property
    def rows(self) -> int:
        full = self.rl.prompts_per_step * self.rl.group_size
        return -(-full // self.row_multiple) * self.row_multiple

    def train(self, fractions: Sequence[float] = (0.5, 1.0), repeats: int = 3) -> tuple[float, float]:
        x, y = [], []
        for fraction in fractions:
            rows = max(self.row_multiple, int(self.rows * fraction) // self.row_multiple * self.row_multiple)
            self.update(rows)  # compiles
            for _ in range(repeats):
                x.append(rows * self.rl.seq_len)
                y.append(self.update(rows))
        return _nonnegative_fit([(1.0, xi) for xi in x], y)

    def colocation(self, repeats: int = 3) -> float:
        import threading

        n = self.rl.prompts_per_step * self.rl.group_size
        self.generate(n)  # compiles
        self.update(self.rows)
        gen_alone = statistics.median(self.generate(n) for _ in range(repeats))
        train_alone = statistics.median(self.update(self.rows) for _ in range(repeats))
        train_times: list[float] = []
        thread = threading.Thread(target=lambda: train_times.extend(self.update(self.rows) for _ in range(repeats)))
        gen_times = []
        thread.start()
        while thread.is_alive():
            gen_times.append(self.generate(n))
        thread.join()
        slowdown = (statistics.median(gen_times[:-1] or gen_times) / gen_alone
                    + statistics.median(train_times) / train_alone) / 2
        return max(slowdown - 1.0, 0.0)


def jax_copy(params):
    """A copy of a params pytree (train states donate theirs)."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.copy, params)


def _timed_engine(engine, calls: list[tuple[str, float, float]]):
    """Times one engine's device calls (`Engine.call_times`: synchronous, no overlap) into `calls`:
    ("prefill", rows x chunk, s), ("decode", (running, max_slots, loop steps, used row-steps), s) and
    ("step", 0, s of the rest);
    returns a function that stops timing."""
    engine.call_times = calls

    def restore() -> None:
        engine.call_times = None
    return restore
