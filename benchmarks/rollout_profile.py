"""Where a fixed-config rollout's device time goes: per-op profile of one decode call and one prefill call.

    .venv/bin/python benchmarks/rollout_profile.py [--calls 5] [--shape fixed|realistic] [--out FILE]
        [--dtype float32|bfloat16] [--attention native,ragged] [--matmul auto|native,xla]

The fixed workload of `rollout.py` (32 prompts x 64 -> 64 tokens, bench preset, decode_steps 64:
four 8-row prefill calls, then one decode call of 63 steps). One generate call runs with the
engine's device functions wrapped to keep a copy of the first prefill's and the decode call's
arguments; each is then re-run `--calls` times under `jax.profiler` (fresh copies: the pool and
state are donated) and XLA:CPU's per-op events (thunks; a `ynn_fusion` is a YNNPACK matmul or
reduction) are summed by what the compiled HLO's op names say they are: each projection's matmul,
attention, sampling, norms, the decode window's gather (a while loop's or conditional's own event spans its
body's ops and is not counted again). Ops run one after another on this 2-core
box (their sum is about the wall time), so the shares are the call's time.

Also, interleaved in the same process: the decode call with its window cut to the pages its rows
reach (8 of 12, what the engine passes: `Dispatch.window_buckets`) against the full 12-page window
(the engine before the cut), wall and process-CPU medians. Beside it, the roofline of the same
call (`common.decode_roofline`'s formulas, machine peaks measured here).

`--shape realistic`: `rollout.py`'s realistic shape (bench_32k, 8 chat prompts x groups of 8 on 64
slots, decode_steps 16, 96 new tokens each so that every slot is decoding): the first decode call
with all 64 rows active, profiled under each decode attention ("native", the engine's choice
there on CPU, "ragged", its plain-XLA form, and "window", which it would take below WINDOW_AUTO_BYTES),
and with `--matmul native,xla` under each decode matmul too (the packed native kernel, the
engine's "auto" for float32 on CPU, against XLA's products; its custom calls count as their
projection's matmul, the packed SwiGLU's as gate_up_proj's).
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import decode_roofline, emit, machine_peaks  # noqa: E402
from rollout import _fresh, _params, _requests  # noqa: E402

from rlvr.models.config import PRESETS, ModelConfig  # noqa: E402
from rlvr.rollout import device_fns  # noqa: E402
from rlvr.rollout.engine import Engine  # noqa: E402

# the engine's fused projections first (`transformer.fuse_projections`: "qkv_proj" holds "v_proj")
PROJECTIONS = ("qkv_proj", "gate_up_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "lm_head")
CONTAINERS = ("while", "cond", "conditional", "call")  # thunks whose time is their body's ops, counted already


def _category(op_name: str) -> str:
    name = op_name.lower()
    if "/mlp/ffi_call" in name:  # the packed SwiGLU (`packed_swiglu`): gate_up's products and silu(gate) * up
        return "matmul_gate_up_proj"
    for proj in PROJECTIONS:
        if proj in name or (proj == "lm_head" and "...e,ev->...v" in name):
            matmul = "dot_general" in name or "ffi_call" in name  # XLA's, or the packed native kernel's
            return f"matmul_{proj}" if matmul else "elementwise"
    if "self_attn" in name or "contiguous_attention" in name:
        return "attention"
    if "layernorm" in name or "/norm/" in name or "q_norm" in name or "k_norm" in name:
        return "norm"
    if any(k in name for k in ("uniform", "threefry", "inverse_cdf", "log_softmax", "sample", "first_argmax")):
        return "sampling"
    if "jit(decode)/transpose" in name or "jit(_take)" in name:
        return "window_gather"
    return "other"


def _copy(args):
    """Fresh device copies of a call's arguments (the pool and state are donated)."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a, args)


def _capture(call) -> dict:
    """The first prefill's and the decode call's arguments (copies) from one generate call."""
    captured, originals = {}, (device_fns.decode, device_fns.prefill)

    def wrap(name, fn):
        def wrapped(*args):
            captured.setdefault(name, _copy(args))
            return fn(*args)
        return wrapped

    device_fns.decode, device_fns.prefill = wrap("decode", originals[0]), wrap("prefill", originals[1])
    try:
        call()
    finally:
        device_fns.decode, device_fns.prefill = originals
    return captured


def _timed(fn, args) -> tuple[float, float]:
    fresh = _copy(args)
    jax.block_until_ready(fresh)
    start, start_cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*fresh))
    return time.perf_counter() - start, time.process_time() - start_cpu


def _profile(fn, args, calls: int) -> dict:
    """Per-category op milliseconds per call, from a profiler trace of `calls` calls."""
    ops = {}
    for line in fn.lower(*args).compile().as_text().splitlines():
        match = re.match(r"\s*%?(\S+) = \S+ .*?op_name=\"([^\"]+)\"", line)
        if match:
            ops[match.group(1)] = match.group(2)
    _timed(fn, args)
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        walls = [_timed(fn, args)[0] for _ in range(calls)]
        jax.profiler.stop_trace()
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    per_category = collections.defaultdict(float)
    for plane in data.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            for event in line.events:
                if "Execute" in event.name or "Await" in event.name or event.name.startswith("end:") \
                        or event.name.split(".")[0] in CONTAINERS:
                    continue
                per_category[_category(ops.get(event.name, event.name))] += event.duration_ns / 1e6 / calls
    total = sum(per_category.values())
    return {"wall_ms_median": round(statistics.median(walls) * 1e3, 1), "op_ms_total": round(total, 1),
            "op_ms": {k: round(v, 1) for k, v in sorted(per_category.items(), key=lambda kv: -kv[1])},
            "share": {k: round(v / total, 3) for k, v in sorted(per_category.items(), key=lambda kv: -kv[1])}}


def realistic(calls: int, dtype: str = "float32", attentions: tuple[str, ...] = ("ragged", "window"),
              matmuls: tuple[str, ...] = ("auto",)) -> dict:
    """The realistic shape's full-batch decode call, profiled per decode attention and decode
    matmul (`dtype`: the engine's weights and KV pages); keyed "attention" or, with more than one
    matmul, "attention/matmul"."""
    from rollout import SLOTS, _chat_requests, chat_workload

    cfg = ModelConfig(**PRESETS["bench_32k"])
    params, (prompts, _) = _params(cfg), chat_workload(8)
    out = {"workload": f"bench_32k, 8 chat prompts x 8 on 64 slots, 96 new tokens, decode_steps 16, {dtype}"}
    for attention, matmul in ((a, m) for a in attentions for m in matmuls):
        engine = Engine(cfg, params, max_slots=SLOTS, max_len=1536, page_size=16, decode_steps=16, prefill_rows=4,
                        prefill_chunk=256, decode_attention=attention, decode_matmul=matmul, dtype=dtype)
        full, decode = [], device_fns.decode

        def keep_full(*args, decode=decode, full=full):
            if not full and int(np.asarray(args[8]).sum()) == SLOTS:
                full.append(_copy(args))
            return decode(*args)

        device_fns.decode = keep_full
        try:
            engine.generate(_chat_requests(prompts, [96] * SLOTS, range(8), attention))
        finally:
            device_fns.decode = decode
        args = full[0]
        key = attention if len(matmuls) == 1 else f"{attention}/{matmul}"
        out[key] = {"context_mean": round(float(np.asarray(args[7]["position"]).mean()), 1),
                    **_profile(device_fns.decode, args, calls)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--shape", default="fixed", choices=("fixed", "realistic"))
    parser.add_argument("--out", default="")
    parser.add_argument("--dtype", default="float32", help="realistic: the engine's weights and KV pages")
    parser.add_argument("--attention", default="native,ragged", help="realistic: decode attentions to profile")
    parser.add_argument("--matmul", default="auto", help="realistic: decode matmuls to profile (auto, native, xla)")
    args = parser.parse_args()
    if args.shape == "realistic":
        emit({"benchmark": "rollout_profile", "realistic_decode_call": realistic(
            args.calls, args.dtype, tuple(args.attention.split(",")), tuple(args.matmul.split(",")))},
            args.out)
        return
    cfg = ModelConfig(**PRESETS["bench"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1024, 64).tolist() for _ in range(32)]
    engine = Engine(cfg, _params(cfg), max_slots=32, max_len=192, page_size=16, decode_steps=64, prefill_rows=8,
                    prefill_chunk=64)
    call = _fresh(engine, lambda: engine.generate(_requests(prompts, [64] * 32)))
    call()
    captured = _capture(call)
    decode, prefill = captured["decode"], captured["prefill"]
    full = list(decode)
    full[5] = jnp.asarray(engine.page_table)  # the whole 12-page rows: the window before the cut
    variants = {"window_8_pages": tuple(decode), "window_12_pages": tuple(full)}
    for v in variants.values():
        _timed(device_fns.decode, v)
    runs = {name: [] for name in variants}
    for r in range(2 * args.calls):
        for name in variants if r % 2 == 0 else reversed(list(variants)):
            runs[name].append(_timed(device_fns.decode, variants[name]))
    cut = {name: {"median_s": round(statistics.median(w for w, _ in rs), 4),
                  "median_cpu_s": round(statistics.median(c for _, c in rs), 4)} for name, rs in runs.items()}
    peaks = machine_peaks()
    roofline = decode_roofline(cfg, prompts, [64] * 32, 32, peaks)
    emit({"benchmark": "rollout_profile", "workload": "32 x 64 -> 64, bench preset, decode_steps 64",
          "decode_call": {"steps": 63, "rows": 32, "window_pages": int(decode[5].shape[1]),
                          **_profile(device_fns.decode, decode, args.calls),
                          "roofline_ms": round(1e3 * (roofline["seconds"] - roofline["prefill_s"]), 1)},
          "prefill_call": {"rows": 8, "chunk": 64, **_profile(device_fns.prefill, prefill, args.calls),
                           "roofline_ms": round(1e3 * roofline["prefill_s"] / 4, 1)},
          "window_cut": {**cut, "speedup": round(cut["window_12_pages"]["median_s"] / cut["window_8_pages"]["median_s"],
                                                 3),
                         "speedup_cpu": round(cut["window_12_pages"]["median_cpu_s"]
                                              / cut["window_8_pages"]["median_cpu_s"], 3)},
          "machine_peaks": {k: round(v, 1) for k, v in peaks.items()}, "roofline": roofline}, args.out)


if __name__ == "__main__":
    main()
