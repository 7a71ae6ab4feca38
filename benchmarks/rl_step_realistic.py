"""The GRPO step of the real RL loop at a realistic shape: RL-step seconds, the generate/train split,
generated tokens/s, and the decode roofline of the same model and batch measured in the same run.

    .venv/bin/python benchmarks/rl_step_realistic.py [--warmup 1 --steps 2] [--cache_dir DIR]

Start-up (issue 50): `first_step` is the first step's seconds and split, `start_to_first_step_s` the
job's wall time from `train()` to the end of step 1 (model init, engine, held-out evaluation before
RL, step 1), and `compile` every XLA program the job compiled (workdir/compile.jsonl, rlvr.compile_log)
totalled per program. `--cache_dir` is `compile.cache_dir`: "" (default) = a new empty directory, a
cold start; run twice with the same DIR for a warm one (the second process loads what the first
compiled). `--steps 0` stops after the first step (no steady-state figures or roofline).

Shape (issue 17): the `bench_32k` preset (6 layers, d512, GQA 8:2, tied 32,768-token vocabulary,
34.9M params, fp32, random init) with a byte-level BPE tokenizer of 32,768 ids and a ChatML
template (`common.chat_bpe_tokenizer`, trained on the Python standard library, cached in
--tokenizer_dir); chat prompts from five reasoning-gym families that share its system prompt
(gsm_symbolic, knights_knaves, basic_arithmetic, string_manipulation, zebra_puzzles: 110 to 900
tokens); 4 prompts x groups of 8 per step, 128 new tokens (temperature 1), rows packed into 1,024-token
train rows, each group's prompt once per row with its completions after it (rl.share_prompts), in
micro-batches of 2 rows; logits only at the sampled positions (rl.sampled_logits_only), one
AdamW update per step, no reference model. `rl.mode="sync"`: a step is rollout
(generate + verify + advantages) then the train step then the weight sync.

Roofline (same process): `common.decode_roofline` for the step's generation (its mean prompt and
response lengths, the groups' prompts prefilled once, 32 rows at a time) with the machine's fp32
1024^3 matmul FLOP/s and streaming-read bytes/s, measured before and after the runs (best and
median reported; the ratio uses the median, closest to the load the steps ran under).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import apply_overrides, chat_bpe_tokenizer, decode_roofline, emit, machine_peaks  # noqa: E402

from rlvr import config_lib  # noqa: E402
from rlvr.job import resolve  # noqa: E402
from rlvr.models.config import ModelConfig  # noqa: E402
from rlvr.train import flops  # noqa: E402
from rlvr.trainers import rl as rl_trainer  # noqa: E402

TASKS = "rg/gsm_symbolic,rg/knights_knaves,rg/basic_arithmetic,rg/string_manipulation,rg/zebra_puzzles"
PROMPTS, GROUP, NEW_TOKENS, SEQ_LEN = 4, 8, 128, 1024


def bench_config(tokenizer_dir: str, num_steps: int, model_json: str = "", cache_dir: str = "",
                 overrides: tuple[str, ...] = ()):
    c = config_lib.base_config()
    c.job = "rl"
    c.model = (config_lib.model_config_dict(**json.loads(model_json)) if model_json
               else config_lib.model_config_dict(preset="bench_32k"))
    c.tokenizer.path = tokenizer_dir
    rl = c.rl
    rl.task, rl.prompt_format = TASKS, "chat"
    rl.prompts_per_step, rl.group_size, rl.max_new_tokens = PROMPTS, GROUP, NEW_TOKENS
    rl.temperature, rl.top_p, rl.seq_len, rl.pack = 1.0, 1.0, SEQ_LEN, True
    rl.engine.max_len, rl.engine.page_size, rl.engine.max_slots = SEQ_LEN, 16, PROMPTS * GROUP
    rl.engine.decode_steps, rl.engine.prefill_rows, rl.engine.prefill_chunk = 16, 4, 256
    rl.mode, rl.reference_model, rl.kl_coef = "sync", False, 0.0
    rl.eval_examples, rl.eval_every, rl.sft_steps = 1, 0, 0
    c.train.num_steps, c.train.log_every, c.train.tensorboard = num_steps, 10**6, False
    # each group's prompt once per row, its completions after it (rl.share_prompts: the same loss; 9 rows' worth,
    # not 18), in micro-batches of 2 rows: the fastest per row on this CPU (first step, train seconds per
    # 1,024-token row: 1.7 at 1-2 rows, 1.9 at 3, 2.3 at 5, 2.5 at 10). Rows are a multiple of 5: 9 -> 10
    rl.share_prompts = True
    c.train.micro_batches = 5
    c.checkpoint.every_steps, c.checkpoint.resume = 10**6, False
    c.compile.cache_dir = cache_dir
    apply_overrides(c, overrides)  # --set a.b=value, e.g. rl.sampled_logits_only=False
    config_lib.validate(c, jax.device_count())
    c.lock()
    return c


def compile_breakdown(workdir: str) -> dict:
    """workdir/compile.jsonl totalled: programs, seconds, cache hits, and per program name (count,
    compile and lowering seconds, hits), the costliest first."""
    with open(os.path.join(workdir, "compile.jsonl")) as f:
        records = [json.loads(line) for line in f]
    by: dict[str, dict] = {}
    for r in records:
        entry = by.setdefault(r["program"], {"count": 0, "compile_s": 0.0, "lower_s": 0.0, "cache_hits": 0})
        entry["count"] += 1
        entry["compile_s"] = round(entry["compile_s"] + r["compile_s"], 3)
        entry["lower_s"] = round(entry["lower_s"] + r["lower_s"], 3)
        entry["cache_hits"] += r["cache"] == "hit"
    ranked = sorted(by.items(), key=lambda kv: -(kv[1]["compile_s"] + kv[1]["lower_s"]))
    return {"programs": len(records), "compile_s": round(sum(r["compile_s"] for r in records), 2),
            "lower_s": round(sum(r["lower_s"] for r in records), 2),
            "cache_hits": sum(r["cache"] == "hit" for r in records),
            "by_program": {name: entry for name, entry in ranked if entry["compile_s"] + entry["lower_s"] >= 0.05},
            "small_programs": sum(1 for _, e in ranked if e["compile_s"] + e["lower_s"] < 0.05)}


def first_step_report(first: dict, start_to_first_step_s: float) -> dict:
    """The first step's seconds (its generate/verify/train/sync split and the compile seconds within it)."""
    generate_s = first["generate_s"] - first.get("verify_s", 0.0)
    return {"step_s": round(first["step_s"], 2), "generate_s": round(generate_s, 2),
            "train_s": round(first["train_s"], 2), "sync_s": round(first["sync_s"], 3),
            "compile_s_within": round(first.get("compile_s", 0.0), 2), "rows": first["rows"],
            "rows_used": first.get("rows_used"),
            "start_to_first_step_s": round(start_to_first_step_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=1, help="steps skipped (compiles)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps (0: the first step only)")
    parser.add_argument("--tokenizer_dir", default=os.path.join(tempfile.gettempdir(), "rlvr_bench_bpe32k"))
    parser.add_argument("--model_json", default="", help="the model's fields (for a tree without bench_32k)")
    parser.add_argument("--timing_only", action="store_true",
                        help="no roofline (to time another tree's trainer with PYTHONPATH=that tree)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override (a Python literal), e.g. rl.sampled_logits_only=False; repeatable")
    parser.add_argument("--cache_dir", default="", help="compile.cache_dir ('' = a new empty one: a cold start)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    tokenizer_dir = chat_bpe_tokenizer(args.tokenizer_dir)
    peaks = [] if args.timing_only or not args.steps else [machine_peaks()]
    step_ends: list[float] = []
    one_step = rl_trainer.one_step

    def timed_step(run, step):  # when each step ends, for the start-up figure
        out = one_step(run, step)
        step_ends.append(time.perf_counter())
        return out
    rl_trainer.one_step = timed_step
    cached = len(os.listdir(args.cache_dir)) if args.cache_dir and os.path.isdir(args.cache_dir) else 0
    with tempfile.TemporaryDirectory(prefix="rl_step_realistic_") as workdir:
        config = bench_config(tokenizer_dir, max(args.warmup + args.steps, 1), args.model_json,
                              args.cache_dir or os.path.join(workdir, "jax_cache"), tuple(args.set))
        with contextlib.redirect_stdout(sys.stderr):
            train_start = time.perf_counter()
            rl_trainer.train(resolve(config, workdir))
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if '"step_s"' in line]
        start_up = {"cache": f"warm ({cached} entries at start)" if cached else "cold (an empty cache)",
                    "first_step": first_step_report(records[0], step_ends[0] - train_start),
                    "compile": compile_breakdown(workdir)}
    if not args.steps:
        emit({"benchmark": "rl_step_realistic", "overrides": args.set, **start_up,
              "total_runtime_s": round(time.perf_counter() - t0, 1)})
        return
    timed = records[args.warmup:]
    med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    generate_s = statistics.median(r["generate_s"] - r.get("verify_s", 0.0) for r in timed)
    samples, response_len = med("samples"), med("response_length")
    timing = {
        "step_s": round(med("step_s"), 3),
        "breakdown_median_s": {"generate": round(generate_s, 3), "verify": round(med("verify_s"), 4),
                               "train": round(med("train_s"), 3), "sync": round(med("sync_s"), 4)},
        "warmup_step_s": [round(r["step_s"], 2) for r in records[:args.warmup]],
        "step_s_all": [round(r["step_s"], 3) for r in records], "response_length_mean": round(response_len, 1),
        "generated_tokens_per_step": int(samples * response_len),
        "generated_tokens_per_s": round(samples * response_len / generate_s, 1), **start_up}
    if args.timing_only:
        emit({"benchmark": "rl_step_realistic", **timing, "total_runtime_s": round(time.perf_counter() - t0, 1)})
        return
    peaks.append(machine_peaks())
    prompt_len = med("prompt_length")
    cfg = ModelConfig.from_mapping(config.model)
    prompts = [[g] * int(prompt_len) for g in range(PROMPTS) for _ in range(GROUP)]  # groups share a prompt
    best = {k: max(p[k] for p in peaks) for k in peaks[0]}
    typical = {k: statistics.median(p[k] for p in peaks) for k in peaks[0]}
    roofline = decode_roofline(cfg, prompts, [int(response_len)] * len(prompts), PROMPTS * GROUP, typical)
    # the train step's lower bound: model FLOPs of the step's real tokens, those its rows hold (the output layer
    # on every token, the usual MFU convention, though rl.sampled_logits_only runs it on the sampled ones; with
    # rl.share_prompts a group's prompt once per row, not once per completion) at the matmul peak
    tokens = med("row_tokens")
    train_tflops = flops.train_flops_per_token(cfg, int(prompt_len + response_len)) * tokens / 1e12
    train_roofline_s = train_tflops * 1e12 / (typical["matmul_gflops"] * 1e9)
    emit({
        "benchmark": "rl_step_realistic", "devices": str(jax.devices()[0]), "cpu_count": os.cpu_count(),
        "model": "bench_32k preset (6 layers, d512, GQA 8:2, tied vocab 32768, 34.9M params, fp32, random init)",
        "tokenizer": "byte-level BPE, 32768 ids, ChatML template (common.chat_bpe_tokenizer)",
        "workload": f"{PROMPTS} chat prompts ({TASKS}) x group {GROUP}, {NEW_TOKENS} new tokens, packed "
                    f"{SEQ_LEN}-token train rows, 1 AdamW update/step, sync",
        "warmup_steps": args.warmup, "measured_steps": args.steps, "overrides": args.set, **timing,
        "prompt_length_mean": round(prompt_len, 1),
        "machine_peaks_median": {k: round(v, 1) for k, v in typical.items()},
        "machine_peaks_best": {k: round(v, 1) for k, v in best.items()},
        "generation_roofline": roofline,
        "generation_vs_roofline": round(timing["generated_tokens_per_s"] / roofline["tokens_per_s"], 4),
        "train_roofline": {"tokens": int(tokens), "tokens_unshared": int(samples * (prompt_len + response_len)),
                           "model_tflops": round(train_tflops, 3),
                           "seconds": round(train_roofline_s, 2)},
        "train_vs_roofline": round(train_roofline_s / timing["breakdown_median_s"]["train"], 3),
        "total_runtime_s": round(time.perf_counter() - t0, 1),
    })


if __name__ == "__main__":
    main()
