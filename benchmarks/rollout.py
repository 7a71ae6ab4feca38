"""Rollout throughput of the embedded engine beside the roofline of the same model and batch.

    .venv/bin/python benchmarks/rollout.py [--only fixed,realistic,sampler,decode_variants,first_calls,extras]
        [--repeats 3]

fixed (the `bench` preset shared with the Tunix peer: 4 layers, d256, vocab 1024, 4.46M params, fp32):
  batch:   32 prompts x 64 prompt tokens -> 64 new tokens (temperature 1, eos ignored)
  groups:  8 prompts x n=4 samples (prompt pages shared by the group)
  varied:  64 requests with max_new_tokens uniform in [8, 128] on 16 slots, continuous
           batching (the default batch_lof admission, which for one batch is lof, and fcfs) vs
           static batching (batches of 16, each waits for its longest); also alone: --only varied.
           Each mode's counts (decode and prefill calls, decode loop steps, row-steps
           computed/used, window pages x steps) and the step bounds (static's steps over those
           of a slot refilled every step) are reported beside the ratios, and a cost model fit
           to one synchronous run of each mode (`cost_model`: per decode call, loop step and used
           row-step, prefill and host seconds) with the ratio an ideal engine would reach at
           those costs (no call or host overhead, every freed slot refilled at once).
  varied_many: the same with 256 requests on the 16 slots (--only varied_many)
  naive:   `rlvr.models.generate` (one jitted scan, contiguous cache, static batch, greedy)
realistic (the `bench_32k` preset: 6 layers, d512, GQA 8:2, tied 32,768-token vocabulary, 34.9M
params, fp32): an RL step's rollout, 16 chat prompts x groups of 8 = 128 requests on 64 slots.
  Prompts are token ids laid out as a ChatML conversation ("<|im_start|>system ... <|im_end|>
  <|im_start|>user ... <|im_end|><|im_start|>assistant"), all sharing one 64-token system prompt,
  100 to 1,000 tokens long (log-uniform). Each sample draws max_new_tokens uniform in [128, 512]
  (the varied stopping of real RL; eos is a stop token too, rarely drawn by a random model);
  temperature 1, top_p 1. Continuous batching runs all 128 at once; static batching runs the
  groups in two batches of 64, each waiting for its longest. Timed calls run in ABBA order.
  `--slots N` runs it on N slots (the roofline for a batch of N); `--dtype bfloat16` runs the
  engine in bf16 (weights and KV pages) against the bf16 roofline, the fp32 one reported beside;
  `--kv_dtype bfloat16` keeps fp32 weights and stores the KV pages in bf16 (the roofline of that pair:
  bf16 KV bytes, attention products at the bf16 matmul peak).

decode_variants: the sampler workload under each decode attention x decode_steps, interleaved.

first_calls: issue 17's probe of compile cost on its 13M-parameter, 8k-vocabulary Qwen3 (see
`first_calls`).

Every timed call starts with an empty prefix cache (`engine.flush_cache()`): prompts are
prefilled each time, as the peer's sampler does; sharing inside a call (a group's prompt, the
system prompt) still counts. `sampler` is the 32 x 64 -> 64 workload alone, for
benchmarks/rollout_vs_tunix.py.

Roofline (same model, batch and run): `common.decode_roofline` with the machine's best fp32
1024^3 matmul FLOP/s and streaming-read bytes/s measured in this process; `vs_roofline` is the
measured tokens/s over the roofline's. The realistic section also reports
`roofline_at_decode_shapes` (the decode's weight products at the rate XLA reaches on their own
shapes, `common.decode_matmul_gflops`): the ceiling of an engine whose decode costs only those.
Compile counts are the jit cache sizes of the engine's device functions after the section ran;
`first_call_incl_compile_s` is the first call's wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import (  # noqa: E402
    calibrate_matmul_gflops,
    decode_matmul_gflops,
    decode_roofline,
    emit,
    machine_peaks,
    time_calls,
)

from rlvr import sharding  # noqa: E402
from rlvr.models import params as params_lib  # noqa: E402
from rlvr.models.config import PRESETS, ModelConfig  # noqa: E402
from rlvr.models.generate import _greedy  # noqa: E402
from rlvr.rollout import device_fns  # noqa: E402
from rlvr.rollout.engine import Engine  # noqa: E402
from rlvr.rollout.types import Request, SamplingParams  # noqa: E402


def _requests(prompts, max_new, n=1, prefix="r", stop_ids=(), ignore_eos=True):
    return [Request(f"{prefix}{i}_{j}", p, SamplingParams(max_new_tokens=m, temperature=1.0, ignore_eos=ignore_eos,
                                                          stop_token_ids=list(stop_ids), sampling_seed=i * 100 + j))
            for i, (p, m) in enumerate(zip(prompts, max_new, strict=True)) for j in range(n)]


def tokens_per_s(fn, tokens: int, repeats: int, engine=None) -> dict:
    """Timed calls of fn; with `engine`, its prefix cache is emptied before each call (every call
    prefills its prompts, as the peer's sampler does)."""
    if engine is not None:
        fn = _fresh(engine, fn)
    first, times = time_calls(fn, repeats)
    median = statistics.median(times)
    return {"tokens_per_s": round(tokens / median, 1), "median_s": round(median, 4),
            "first_call_incl_compile_s": round(first, 2)}


def _engine(cfg, params, replicas: int = 1, **options):
    """An Engine, or with `--replicas N` N of them stepped at once (rlvr.rollout.replicas; imported
    only then, so that realistic_timing still runs on trees from before it)."""
    if replicas == 1:
        return Engine(cfg, params, **options)
    from rlvr.rollout.replicas import ReplicatedEngine

    return ReplicatedEngine(cfg, params, replicas=replicas, **options)


def _fresh(engine, fn):
    def call():
        engine.flush_cache()
        return fn()
    return call


def _seconds(fn) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call."""
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - start_cpu


def _compile_counts() -> dict:
    return {"prefill": device_fns.prefill._cache_size(), "decode": device_fns.decode._cache_size()}


def _engine_metrics(engine) -> dict | None:
    metrics = getattr(engine, "metrics", None)
    return metrics() if callable(metrics) else None


def _params(cfg: ModelConfig):
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    return params_lib.init_params(cfg, jax.random.key(0), mesh)


def fixed(args) -> dict:
    cfg = ModelConfig(**PRESETS["bench"])
    params = _params(cfg)
    rng = np.random.default_rng(0)
    calib = calibrate_matmul_gflops()
    peaks = machine_peaks()
    prompts = [rng.integers(0, 1024, 64).tolist() for _ in range(32)]
    opts = dict(max_len=192, page_size=16, decode_steps=args.decode_steps, prefill_rows=8, prefill_chunk=64)
    engine = Engine(cfg, params, max_slots=32, **opts)
    batch = tokens_per_s(lambda: engine.generate(_requests(prompts, [64] * 32)), 32 * 64, args.repeats, engine)
    groups = tokens_per_s(lambda: engine.generate(_requests(prompts[:8], [64] * 8, n=4)), 32 * 64, args.repeats,
                          engine)
    compiles = _compile_counts()
    metrics = _engine_metrics(engine)

    tokens = jnp.asarray(np.array(prompts, np.int32))
    lengths = jnp.full((32,), 64, jnp.int32)
    naive = tokens_per_s(lambda: jax.block_until_ready(_greedy(cfg, params, tokens, lengths, 64, -1)), 32 * 64,
                         args.repeats)

    varied_lengths = varied(args, cfg, params, rng)
    roofline = decode_roofline(cfg, prompts, [64] * 32, 32, peaks)
    return {
        "model": "bench preset (4 layers, d256, 4.46M params, fp32)",
        "decode_steps_per_call": args.decode_steps, "calib_matmul_gflops": round(calib, 1),
        "machine_peaks": {k: round(v, 1) for k, v in peaks.items()},
        "engine_32x64_to_64": batch, "engine_8_prompts_n4": groups, "naive_cached_loop_32x64_to_64": naive,
        "engine_vs_naive": round(batch["tokens_per_s"] / naive["tokens_per_s"], 3),
        "roofline_32x64_to_64": roofline,
        "vs_roofline": round(batch["tokens_per_s"] / roofline["tokens_per_s"], 3),
        **varied_lengths,
        "compile_counts": compiles, "engine_metrics": metrics,
    }


def varied(args, cfg: ModelConfig | None = None, params=None, rng=None) -> dict:
    """64 requests (32-token prompts) with max_new_tokens uniform in [8, 128] on 16 slots:
    continuous batching (all submitted at once; admitted longest max_new_tokens first, the default
    schedule_policy "batch_lof" (for one batch the same as "lof"), and in submission order: "fcfs")
    vs static batching (batches of 16 in submission
    order, each waiting for its longest), calls interleaved (ABBA), medians of wall and of process
    CPU seconds (the latter steadier on a shared machine). See `_varied_run` for the counts and
    step bounds reported beside the ratios."""
    if cfg is None:
        cfg = ModelConfig(**PRESETS["bench"])
        params, rng = _params(cfg), np.random.default_rng(0)
        rng.integers(0, 1024, (32, 64))  # the fixed section's prompts, drawn first there
    varied_new = rng.integers(8, 129, 64).tolist()
    varied_prompts = [rng.integers(0, 1024, 32).tolist() for _ in range(64)]
    return _varied_run(args, cfg, params, varied_prompts, varied_new)


def varied_many(args) -> dict:
    """`varied` with 256 requests on the same 16 slots (16 rollouts per slot, as an RL step of
    32 prompts x 8 samples on a small engine; distinct prompts, so prefill work equals `varied`'s
    per request): the step bound of continuous batching over static grows with requests per slot
    (a slot's lost steps are only at the end), see `_varied_run`."""
    cfg = ModelConfig(**PRESETS["bench"])
    params, rng = _params(cfg), np.random.default_rng(1)
    new = rng.integers(8, 129, 256).tolist()
    return _varied_run(args, cfg, params, [rng.integers(0, 1024, 32).tolist() for _ in range(256)], new)


def static_steps(max_new: list[int], slots: int) -> int:
    """Decode steps of static batching: each batch of `slots` runs until its longest request ends
    (a request of m tokens takes m - 1 decode steps: the prefill samples its first)."""
    return sum(max(max_new[i:i + slots]) - 1 for i in range(0, len(max_new), slots))


def refill_steps(max_new: list[int], slots: int, order: str) -> int:
    """Decode steps of continuous batching if a freed slot were refilled before the very next
    step (the best any admission at call boundaries can do), requests taken in submission order
    ("fcfs") or largest max_new first ("lof"): a lower bound of the engine's steps, so
    static_steps / refill_steps bounds the continuous-over-static ratio at equal cost per step."""
    order_new = sorted(max_new, reverse=True) if order == "lof" else max_new
    free = [0] * slots
    for m in order_new:
        heapq.heapreplace(free, free[0] + m - 1)
    return max(free)


def _timed_calls(engine, call) -> list[tuple[str, object, float]]:
    """Every device call of one run of `call`, timed synchronously (`Engine.call_times`)."""
    engine.call_times = []
    try:
        call()
        return engine.call_times
    finally:
        engine.call_times = None


def cost_model(timed: dict[str, list], steps: dict[str, int], used_row_steps: int) -> dict:
    """Where continuous and static batching's time goes, and the ratio an ideal engine reaches.

    `timed`: each mode's synchronous device calls (`_timed_calls`). Decode calls of both modes are
    fit (non-negative least squares on per-shape medians, `simulate_calibrate._nonnegative_fit`) as
    seconds = per call + per loop step x steps + per used row-step x tokens emitted: a step's
    products over all slots cost the same whether a slot decodes or idles; attention and the rest
    of a row's work are paid only for a decoding row.
    Prefill calls and the host's own time (the engine's "step" entries) are summed per mode.
    `ideal_ceiling`: static over continuous for an engine with no per-call or host cost, both
    modes' prefill at the cheaper one's, and a freed slot refilled before the very next step
    (`steps["lof"]`, `refill_steps`), at the fitted per-step and per-row costs: the modes then
    differ only in loop steps, and the prefill and the used rows' work they share cap the ratio
    below the step bound. `ideal_ceiling_rows_free` also drops the per-row cost (an upper bound
    for any engine whose step costs what this one's does)."""
    from rlvr.launch.simulate_calibrate import _nonnegative_fit

    decode = [(size, t) for name in timed for kind, size, t in timed[name] if kind == "decode"]
    per_call, per_step, per_row = _nonnegative_fit([(1.0, size[2], size[3]) for size, _ in decode],
                                                   [t for _, t in decode])

    def seconds(calls: list, kind: str) -> float:
        return sum(t for k, _, t in calls if k == kind)

    prefill = {name: seconds(calls, "prefill") for name, calls in timed.items()}

    def ideal(row_cost: float) -> float:
        shared = min(prefill.values()) + row_cost * used_row_steps
        return (shared + per_step * steps["static"]) / (shared + per_step * steps["lof"])

    return {"decode_fit": {"per_call_ms": round(per_call * 1e3, 3), "per_loop_step_ms": round(per_step * 1e3, 4),
                           "per_used_row_step_us": round(per_row * 1e6, 2), "calls_fit": len(decode)},
            **{name: {"decode_s": round(seconds(calls, "decode"), 4),
                      "decode_calls": sum(kind == "decode" for kind, _, _ in calls),
                      "loop_steps": sum(size[2] for kind, size, _ in calls if kind == "decode"),
                      "prefill_s": round(prefill[name], 4),
                      "prefill_calls": sum(kind == "prefill" for kind, _, _ in calls),
                      "host_s": round(seconds(calls, "step"), 4),
                      "synchronous_s": round(sum(t for _, _, t in calls), 4)}
               for name, calls in timed.items()},
            "ideal_ceiling": round(ideal(per_row), 3), "ideal_ceiling_rows_free": round(ideal(0.0), 3)}


def _counts(engine, call) -> dict:
    """What one call of `call` does on `engine` (deltas of `Engine.metrics`)."""
    keys = ("decode_calls", "prefill_calls", "decode_loop_steps", "decode_row_steps_paid", "decode_row_steps_used",
            "decode_window_page_steps")
    before = engine.metrics()
    call()
    after = engine.metrics()
    return {k: after[k] - before[k] for k in keys}


def _varied_run(args, cfg: ModelConfig, params, prompts: list[list[int]], max_new: list[int]) -> dict:
    """Continuous (default batch_lof, fcfs) vs static batching of `prompts` on 16 slots (see `varied`), timed
    interleaved, with each mode's counts from one untimed call (decode and prefill calls, decode
    loop steps, row-steps computed and used, window pages x steps) and the step bounds
    (`static_steps`, `refill_steps`) beside the ratios."""
    opts = dict(max_slots=16, max_len=192, page_size=16, decode_steps=args.decode_steps, prefill_rows=8,
                prefill_chunk=64)
    small, fcfs = Engine(cfg, params, **opts), Engine(cfg, params, schedule_policy="fcfs", **opts)
    total, count = sum(max_new), len(max_new)

    def continuous():
        small.generate(_requests(prompts, max_new))

    def continuous_fcfs():
        fcfs.generate(_requests(prompts, max_new))

    def static():
        for start in range(0, count, 16):
            small.generate(_requests(prompts[start:start + 16], max_new[start:start + 16], prefix="s"))

    calls = {"continuous": _fresh(small, continuous), "continuous_fcfs": _fresh(fcfs, continuous_fcfs),
             "static": _fresh(small, static)}
    first = {name: _seconds(call) for name, call in calls.items()}
    counts = {name: _counts(small if name != "continuous_fcfs" else fcfs, call) for name, call in calls.items()}
    runs = {name: [] for name in calls}
    for r in range(args.repeats):
        for name in calls if r % 2 == 0 else reversed(list(calls)):
            runs[name].append(_seconds(calls[name]))
    wall = {name: statistics.median(w for w, _ in runs[name]) for name in calls}
    cpu = {name: statistics.median(c for _, c in runs[name]) for name in calls}
    out = {"workload": f"{count} requests, 32-token prompts, max_new_tokens uniform in [8, 128] on 16 slots, "
                       f"decode_steps {args.decode_steps}",
           **{f"varied_lengths_{name}": {"tokens_per_s": round(total / wall[name], 1), "median_s": round(wall[name], 4),
                                         "all_s": [round(w, 4) for w, _ in runs[name]],
                                         "median_cpu_s": round(cpu[name], 4),
                                         "first_call_incl_compile_s": round(first[name][0], 2),
                                         "counts": counts[name]} for name in calls}}
    out["continuous_vs_static"] = round(wall["static"] / wall["continuous"], 3)
    out["continuous_vs_static_cpu"] = round(cpu["static"] / cpu["continuous"], 3)
    # Static's loop steps over continuous's (counts): the ratio where a step costs the same whatever its
    # rows do and prefill is small beside decode (an accelerator's memory-bound decode, not this CPU's).
    out["continuous_vs_static_loop_steps"] = round(
        counts["static"]["decode_loop_steps"] / counts["continuous"]["decode_loop_steps"], 3)
    out["continuous_fcfs_vs_static"] = round(wall["static"] / wall["continuous_fcfs"], 3)
    out["continuous_fcfs_vs_static_cpu"] = round(cpu["static"] / cpu["continuous_fcfs"], 3)
    steps = {"static": static_steps(max_new, 16), "fcfs": refill_steps(max_new, 16, "fcfs"),
             "lof": refill_steps(max_new, 16, "lof")}
    out["step_bounds"] = {"static_steps": steps["static"], "fcfs_refill_every_step_steps": steps["fcfs"],
                          "lof_refill_every_step_steps": steps["lof"],
                          "fcfs_max_vs_static": round(steps["static"] / steps["fcfs"], 3),
                          "lof_max_vs_static": round(steps["static"] / steps["lof"], 3)}
    timed = {name: _timed_calls(small, calls[name]) for name in ("continuous", "static")}
    out["cost_model"] = cost_model(timed, {"static": steps["static"], "lof": steps["lof"]}, total - count)
    ceiling = out["cost_model"]["ideal_ceiling"]
    out["cost_model"]["measured_vs_ideal_ceiling"] = round(out["continuous_vs_static"] / ceiling, 3)
    out["varied_engine_metrics"] = _engine_metrics(small)
    return out


def sampler(args) -> dict:
    """The peer's sampler workload alone (32 prompts x 64 -> 64, 2 warm-up + 7 timed calls as
    bench_tunix.py), for the side-by-side run (benchmarks/rollout_vs_tunix.py)."""
    cfg = ModelConfig(**PRESETS["bench"])
    params = _params(cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1024, 64).tolist() for _ in range(32)]
    engine = _engine(cfg, params, args.replicas, max_slots=32, max_len=192, page_size=16,
                     decode_steps=args.decode_steps, prefill_rows=8, prefill_chunk=64,
                     **({"decode_matmul": args.decode_matmul} if args.decode_matmul != "auto" else {}))
    call = _fresh(engine, lambda: engine.generate(_requests(prompts, [64] * 32)))
    first, _ = time_calls(call, 1)
    _, times = time_calls(call, 7)
    median = statistics.median(times)
    return {"tokens_per_s": round(32 * 64 / median, 1), "median_s": round(median, 4),
            "all_call_s": [round(t, 4) for t in times], "first_call_incl_compile_s": round(first, 2),
            "compile_counts": _compile_counts(), "replicas": args.replicas}


def decode_variants(args) -> dict:
    """The sampler workload under each decode attention ("window", "ragged", "native") x decode_steps (16,
    64), and the 64-step window and native ones with XLA's products (`decode_matmul="xla"`, suffix
    `_xla_matmul`; the others take "auto": the packed native matmul), interleaved round by round in
    one process (same window): per variant the median wall seconds and the median CPU seconds of
    the process (steadier than wall time on a shared box)."""
    cfg = ModelConfig(**PRESETS["bench"])
    params = _params(cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1024, 64).tolist() for _ in range(32)]
    calls = {}
    variants = [(attention, steps, "auto") for attention in ("window", "ragged", "native") for steps in (16, 64)]
    for attention, steps, matmul in variants + [("window", 64, "xla"), ("native", 64, "xla")]:
        engine = Engine(cfg, params, max_slots=32, max_len=192, page_size=16, decode_steps=steps,
                        prefill_rows=8, prefill_chunk=64, decode_attention=attention, decode_matmul=matmul)
        name = f"{attention}_{steps}" + ("_xla_matmul" if matmul == "xla" else "")
        calls[name] = _fresh(engine, lambda e=engine: e.generate(_requests(prompts, [64] * 32)))
        time_calls(calls[name], 2)
    wall, cpu = {name: [] for name in calls}, {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return {name: {"tokens_per_s": round(32 * 64 / statistics.median(wall[name]), 1),
                   "median_s": round(statistics.median(wall[name]), 4),
                   "median_cpu_s": round(statistics.median(cpu[name]), 4)} for name in calls}


# Issue 17's user model: a random Qwen3 of 13M parameters with an 8k BPE vocabulary (d384, 4 layers,
# 6 heads / 2 KV heads, MLP 1024, untied), engine options as an RL run sized for its prompts.
QWEN3_13M = dict(family="qwen3", vocab_size=8000, hidden_size=384, intermediate_size=1024, num_layers=4,
                 num_heads=6, num_kv_heads=2, head_dim=64, rope_theta=10_000.0, scan_unroll=4)


def first_calls(args) -> dict:
    """Issue 17's probe: 16 requests x 32 new tokens on the 13M model, the first call (prompts of
    52-100 tokens), a second with longer prompts (100-192 tokens: another length bucket), a third
    like the second (warm). Each call's seconds, and the compiles they caused."""
    cfg = ModelConfig(**QWEN3_13M)
    params = _params(cfg)
    engine = Engine(cfg, params, max_slots=16, max_len=256, page_size=16, decode_steps=args.decode_steps,
                    prefill_rows=16, prefill_chunk=32)
    rng = np.random.default_rng(0)
    calls = {}
    for name, (low, high) in (("first", (52, 100)), ("longer_prompts", (100, 192)), ("warm", (100, 192))):
        prompts = [rng.integers(3, 8000, int(rng.integers(low, high + 1))).tolist() for _ in range(16)]
        before = _compile_counts()
        t0 = time.perf_counter()
        engine.generate(_requests(prompts, [32] * 16, prefix=name))
        seconds = time.perf_counter() - t0
        after = _compile_counts()
        calls[name] = {"s": round(seconds, 2), "tokens_per_s": round(16 * 32 / seconds, 1),
                       "new_compiles": {k: after[k] - before[k] for k in after}}
    return {"model": "random Qwen3, 13M params, vocab 8000 (issue 17's)", "workload": "16 requests x 32 new tokens",
            "calls": calls, "engine_metrics": _engine_metrics(engine)}


SYSTEM_LEN, GROUP, SLOTS = 64, 8, 64
IM_START, IM_END, EOS, ASSISTANT = 32000, 32001, 32002, 32003  # ids standing in for ChatML specials


def chat_workload(chat_prompts: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompts, max_new_tokens) of one RL step: `chat_prompts` prompts x GROUP samples."""
    rng = np.random.default_rng(seed)
    system = [IM_START, 9125, *rng.integers(100, 32000, SYSTEM_LEN - 4).tolist(), IM_END, 198]
    prompts = []
    for _ in range(chat_prompts):
        total = int(math.exp(rng.uniform(math.log(100), math.log(1000))))
        user = rng.integers(100, 32000, total - len(system) - 6).tolist()
        prompts.append(system + [IM_START, 882, *user, IM_END, IM_START, ASSISTANT])
    max_new = rng.integers(128, 513, chat_prompts * GROUP).tolist()
    return prompts, max_new


def _chat_requests(prompts, max_new, groups: range, prefix: str) -> list[Request]:
    return [Request(f"{prefix}{i}_{j}", prompts[i],
                    SamplingParams(max_new_tokens=max_new[i * GROUP + j], temperature=1.0, top_p=1.0,
                                   stop_token_ids=[EOS], sampling_seed=i * 100 + j))
            for i in groups for j in range(GROUP)]


def realistic_timing(args) -> dict:
    """The realistic rollout timed, nothing else (no roofline): it runs on older versions of the
    engine too (PYTHONPATH=another tree), with `--model_json` giving the model's fields (a preset
    older trees lack); `--modes` picks the timed calls (continuous, static: ABBA order over
    `--realistic_rounds` rounds)."""
    cfg = ModelConfig(**(json.loads(args.model_json) if args.model_json else PRESETS["bench_32k"]))
    params = _params(cfg)
    prompts, max_new = chat_workload(args.chat_prompts)
    engine = _engine(cfg, params, args.replicas, max_slots=args.slots, max_len=1536, page_size=16,
                     decode_steps=args.decode_steps, prefill_rows=4, prefill_chunk=256, dtype=args.dtype,
                     **({"kv_dtype": args.kv_dtype} if args.kv_dtype else {}),
                     **({"decode_attention": args.decode_attention} if args.decode_attention != "auto" else {}),
                     **({"decode_matmul": args.decode_matmul} if args.decode_matmul != "auto" else {}))
    groups, outputs = range(args.chat_prompts), {}

    def continuous():
        outputs["continuous"] = engine.generate(_chat_requests(prompts, max_new, groups, "c"))
        return sum(len(c.output_ids) for c in outputs["continuous"])

    def static():  # batches of `--slots` requests, each waiting for its longest
        per_batch, outs = args.slots // GROUP, []
        for start in range(0, args.chat_prompts, per_batch):
            chunk = range(start, min(start + per_batch, args.chat_prompts))
            outs += engine.generate(_chat_requests(prompts, max_new, chunk, "s"))
        return sum(len(c.output_ids) for c in outs)

    def timed(fn):
        engine.flush_cache()  # each RL step brings new prompts: nothing cached from the last call
        t0 = time.perf_counter()
        tokens = fn()
        return tokens, time.perf_counter() - t0

    modes = {"continuous": continuous, "static": static}
    names = args.modes.split(",")
    first_tokens, first_s = timed(modes[names[0]])
    runs = {name: [] for name in names}
    for r in range(args.realistic_rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(timed(modes[name]))
    outs = outputs.get("continuous", [])
    finish = [c.finish_reason["type"] for c in outs]
    return {
        "workload": f"{args.chat_prompts} chat prompts (shared {SYSTEM_LEN}-token system prompt, 100-1000 tokens) "
                    f"x group {GROUP} on {args.slots} slots, max_new_tokens uniform [128, 512], temperature 1, "
                    f"{args.dtype} weights, {args.kv_dtype or args.dtype} KV pages",
        "prompt_tokens_mean": round(statistics.mean(len(p) for p in prompts), 1),
        "output_lengths": [len(c.output_ids) for c in outs],
        "finish_reasons": {k: finish.count(k) for k in sorted(set(finish))},
        "decode_steps_per_call": args.decode_steps, "replicas": args.replicas,
        "first_call_incl_compile_s": round(first_s, 2),
        **{name: {"tokens_per_s": round(statistics.median(t / s for t, s in rs), 1),
                  "median_s": round(statistics.median(s for _, s in rs), 3),
                  "all_s": [round(s, 2) for _, s in rs], "tokens": rs[-1][0]} for name, rs in runs.items()},
        "compile_counts": _compile_counts(), "engine_metrics": _engine_metrics(engine),
    }


def realistic(args) -> dict:
    """`realistic_timing` with the roofline of the same model, workload and batch (`--slots` rows),
    measured before and after the timed calls (best of the two). With `--dtype bfloat16` the
    roofline is the bf16 one (bf16 1024^3 matmul peak, bf16 weight and KV bytes) and the fp32
    roofline of the same batch is reported beside it (`roofline_fp32`, `vs_roofline_fp32`). With
    `--kv_dtype bfloat16` beside fp32 weights the roofline reads bf16 KV bytes and puts the attention
    products (bf16 there) at the bf16 matmul peak, the weight products at the fp32 one.
    `roofline_at_decode_shapes`: the same roofline with the decode's weight products at the rate XLA
    reaches on their own `--slots`-row shapes (`common.decode_matmul_gflops`), the ceiling of an
    engine whose decode costs nothing else; `ceiling_vs_roofline` is the most of the roofline such
    an engine reaches."""
    cfg = ModelConfig(**PRESETS["bench_32k"])
    kv_dtype = args.kv_dtype or args.dtype
    dtypes = sorted({"float32", args.dtype, kv_dtype})

    def peaks_now():  # + the decode's own products at `--slots` rows in the weights' dtype
        return {**{dtype: machine_peaks(dtype) for dtype in dtypes}, "decode_matmul_gflops": decode_matmul_gflops(
            dataclasses.replace(cfg, param_dtype=args.dtype), args.slots, args.dtype)}

    peaks = [peaks_now()]
    result = realistic_timing(args)
    peaks.append(peaks_now())
    best = {dtype: {k: max(p[dtype][k] for p in peaks) for k in peaks[0][dtype]} for dtype in dtypes}
    decode_gflops = max(p["decode_matmul_gflops"] for p in peaks)
    prompts, _ = chat_workload(args.chat_prompts)
    lengths = result.pop("output_lengths")
    rows = [p for p in prompts for _ in range(GROUP)]
    rooflines = {dtype: decode_roofline(dataclasses.replace(cfg, param_dtype=dtype), rows, lengths, args.slots,
                                        best[dtype], kv_dtype=dtype) for dtype in dtypes}
    own_peaks, model = dict(best[args.dtype]), dataclasses.replace(cfg, param_dtype=args.dtype)
    if kv_dtype != args.dtype:  # e.g. fp32 weights, bf16 KV: the roofline of that pair
        own_peaks["attention_matmul_gflops"] = best[kv_dtype]["matmul_gflops"]
        rooflines[args.dtype] = decode_roofline(model, rows, lengths, args.slots, own_peaks, kv_dtype=kv_dtype)
    measured = result["continuous" if "continuous" in result else "static"]["tokens_per_s"]
    ceiling = decode_roofline(model, rows, lengths, args.slots, {**own_peaks, "decode_matmul_gflops": decode_gflops},
                              kv_dtype=kv_dtype)
    result.update({
        "model": f"bench_32k preset (6 layers, d512, GQA 8:2, tied vocab 32768, 34.9M params, {args.dtype}"
                 + (f", {kv_dtype} KV)" if kv_dtype != args.dtype else ")"),
        "output_tokens_mean": round(statistics.mean(lengths), 1),
        "machine_peaks_best": {k: round(v, 1) for k, v in best[args.dtype].items()},
        "roofline": rooflines[args.dtype], "vs_roofline": round(measured / rooflines[args.dtype]["tokens_per_s"], 3),
        "decode_matmul_gflops": round(decode_gflops, 1), "roofline_at_decode_shapes": ceiling,
        "vs_roofline_at_decode_shapes": round(measured / ceiling["tokens_per_s"], 3),
        "ceiling_vs_roofline": round(ceiling["tokens_per_s"] / rooflines[args.dtype]["tokens_per_s"], 3)})
    if args.dtype != "float32":
        result.update({"machine_peaks_best_fp32": {k: round(v, 1) for k, v in best["float32"].items()},
                       "roofline_fp32": rooflines["float32"],
                       "vs_roofline_fp32": round(measured / rooflines["float32"]["tokens_per_s"], 3)})
    if "static" in result and "continuous" in result:
        result["continuous_vs_static"] = round(result["continuous"]["tokens_per_s"] / result["static"]["tokens_per_s"],
                                               3)
    return result


EXTRA_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "city", "age", "tags", "ok"],
                "properties": {"name": {"type": "string", "maxLength": 24}, "city": {"type": "string", "maxLength": 24},
                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                        "maxItems": 4},
                               "ok": {"type": "boolean"}}}


def bpe_tokenizer(vocab_size: int = 32000, seed: int = 0):
    """A byte-level BPE tokenizer (`rlvr.models.tokenizer.train_bpe`) trained here on generated
    words, JSON and numbers (no download): realistic token pieces for the grammar's per-state
    token sets."""
    from rlvr.models.tokenizer import train_bpe

    rng = np.random.default_rng(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiouy"] + list("aeiou")
    words = np.array(["".join(rng.choice(syllables, int(rng.integers(1, 5)))) for _ in range(60000)])
    corpus = [" ".join(rng.choice(words, 12)) for _ in range(20000)]
    corpus += [json.dumps({"name": str(rng.choice(words)), "age": int(rng.integers(0, 99)),
                           "tags": [str(w) for w in rng.choice(words, 3)], "ok": bool(rng.integers(2))})
               for _ in range(4000)]
    return train_bpe(corpus, vocab_size)


def extras(args) -> dict:
    """Per-token cost of constrained decoding and of penalties, against plain sampling on the same
    engine and prompts (bench_32k model, a 32k-piece BPE tokenizer trained here). `regex` (a
    free-text grammar that never ends early) generates the same 128 tokens per request as `plain`:
    its per-token cost is the mask's. Constrained batches decode one token per device call (each
    mask follows from the token before), so `plain_one_step` (decode_steps=1) separates the mask's
    own cost from the lost multi-step loop. `json_schema` (a 5-field object; outputs end when the
    object is complete) reports how many outputs validate. Calls interleaved (ABBA), medians;
    per-token = seconds / output tokens (prefill included)."""
    cfg = ModelConfig(**PRESETS["bench_32k"])
    params = _params(cfg)
    t0 = time.perf_counter()
    tokenizer = bpe_tokenizer()
    tokenizer_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, tokenizer.vocab_size, 64).tolist() for _ in range(32)]
    opts = dict(max_slots=32, max_len=256, page_size=16, prefill_rows=8, prefill_chunk=64)
    engines = {"multi": Engine(cfg, params, tokenizer, decode_steps=args.decode_steps, **opts),
               "single": Engine(cfg, params, tokenizer, decode_steps=1, **opts)}
    schema = json.dumps(EXTRA_SCHEMA)
    variants = {"plain": ("multi", {}), "plain_one_step": ("single", {}),
                "regex": ("multi", {"regex": "[a-z ,.]+"}),  # never finishes early: 128 tokens, as plain
                "penalties": ("multi", {"frequency_penalty": 0.3, "presence_penalty": 0.3, "repetition_penalty": 1.1}),
                "json_schema": ("multi", {"json_schema": schema})}

    def call(name):
        engine_name, extra = variants[name]
        engine = engines[engine_name]
        free = "json_schema" not in extra  # eos ends a JSON output once the object is complete
        requests = [Request(f"{name}{i}", p, SamplingParams(max_new_tokens=128, temperature=1.0, ignore_eos=free,
                                                            sampling_seed=i, **extra))
                    for i, p in enumerate(prompts)]
        engine.flush_cache()
        start = time.perf_counter()
        outs = engine.generate(requests)
        return time.perf_counter() - start, sum(len(c.output_ids) for c in outs), outs

    first = {name: call(name)[0] for name in variants}  # compiles (and the grammar's first states)
    runs = {name: [] for name in variants}
    outputs = {}
    for r in range(args.repeats):
        for name in variants if r % 2 == 0 else reversed(list(variants)):
            seconds, tokens, outs = call(name)
            runs[name].append(seconds / tokens)
            outputs[name] = (tokens, outs)
    per_token = {name: statistics.median(v) for name, v in runs.items()}
    parsed = sum(1 for c in outputs["json_schema"][1] if _valid_json(tokenizer, c, EXTRA_SCHEMA))
    roofline = decode_roofline(cfg, prompts, [128] * len(prompts), 32, machine_peaks())
    return {
        "model": "bench_32k preset (34.9M params, fp32); tokenizer: byte-level BPE trained here, "
                 f"{tokenizer.vocab_size} pieces ({round(tokenizer_s, 1)} s)",
        "workload": "32 prompts x 64 tokens on 32 slots, max_new_tokens 128, temperature 1; json_schema: a 5-field "
                    "object (strings <= 24 chars, an integer, a list of up to 4 strings, a boolean)",
        "decode_steps_per_call": args.decode_steps,
        "ms_per_token": {name: round(v * 1e3, 3) for name, v in per_token.items()},
        "tokens_per_s": {name: round(1 / v, 1) for name, v in per_token.items()},
        "output_tokens": {name: tokens for name, (tokens, _) in outputs.items()},
        "regex_vs_plain": round(per_token["regex"] / per_token["plain"], 3),
        "regex_vs_plain_one_step": round(per_token["regex"] / per_token["plain_one_step"], 3),
        "penalties_vs_plain": round(per_token["penalties"] / per_token["plain"], 3),
        "roofline_plain": roofline, "plain_vs_roofline": round(1 / per_token["plain"] / roofline["tokens_per_s"], 3),
        "json_schema_outputs_valid": f"{parsed}/{len(outputs['json_schema'][1])}",
        "first_call_incl_compile_s": {name: round(v, 2) for name, v in first.items()},
    }


def _valid_json(tokenizer, completion, schema) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(tokenizer.decode(completion.output_ids, skip_special_tokens=True)), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="fixed,realistic,first_calls")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--realistic_rounds", type=int, default=2, help="ABBA rounds of static/continuous")
    parser.add_argument("--decode_steps", type=int, default=16)
    parser.add_argument("--chat_prompts", type=int, default=16, help="realistic: prompts (x groups of 8)")
    parser.add_argument("--modes", default="continuous,static", help="realistic: timed calls")
    parser.add_argument("--slots", type=int, default=SLOTS, help="realistic: engine slots (rows decoded at once)")
    parser.add_argument("--dtype", default="float32", help="realistic: rollout weights and KV pages (or bfloat16)")
    parser.add_argument("--kv_dtype", default="", help="realistic: KV pages only (default: --dtype), e.g. bfloat16")
    parser.add_argument("--decode_attention", default="auto",
                        help="realistic: the engine's decode attention (auto: native on CPU where it builds)")
    parser.add_argument("--decode_matmul", default="auto", choices=("auto", "native", "xla"),
                        help="realistic, sampler: the engine's decode products (auto: native for float32 on CPU)")
    parser.add_argument("--model_json", default="", help="realistic_timing: the model's ModelConfig fields")
    parser.add_argument("--replicas", type=int, default=1,
                        help="sampler, realistic: the slots split over this many engines stepped at once")
    args = parser.parse_args()
    record = {"benchmark": "rollout", "devices": str(jax.devices()[0]), "jax": jax.__version__}
    sections = {"fixed": fixed, "realistic": realistic, "sampler": sampler, "first_calls": first_calls,
                "realistic_timing": realistic_timing, "varied": varied, "varied_many": varied_many, "extras": extras,
                "decode_variants": decode_variants}
    for name in args.only.split(","):
        record[name] = sections[name](args)
    emit(record)


if __name__ == "__main__":
    main()
