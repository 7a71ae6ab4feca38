"""The GRPO step of the real RL loop at a realistic shape: RL-step seconds, the generate/train split,
generated tokens/s, and the decode roofline of the same model and batch measured in the same run.

    .venv/bin/python benchmarks/rl_step_realistic.py [--warmup 1 --steps 2]

Shape (issue 17): the `bench_32k` preset (6 layers, d512, GQA 8:2, tied 32,768-token vocabulary,
34.9M params, fp32, random init) with a byte-level BPE tokenizer of 32,768 ids and a ChatML
template (`common.chat_bpe_tokenizer`, trained on the Python standard library, cached in
--tokenizer_dir); chat prompts from five reasoning-gym families that share its system prompt
(gsm_symbolic, knights_knaves, basic_arithmetic, string_manipulation, zebra_puzzles: 110 to 900
tokens); 4 prompts x groups of 8 per step, 128 new tokens (temperature 1), rows packed into 1,024-token
train rows (8 micro-batches: the RL loss holds full logits), one AdamW update per step, no reference
model. `rl.mode="sync"`: a step is rollout
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
from common import chat_bpe_tokenizer, decode_roofline, emit, machine_peaks  # noqa: E402

from rlvr import config_lib  # noqa: E402
from rlvr.job import resolve  # noqa: E402
from rlvr.models.config import ModelConfig  # noqa: E402
from rlvr.trainers import rl as rl_trainer  # noqa: E402

TASKS = "rg/gsm_symbolic,rg/knights_knaves,rg/basic_arithmetic,rg/string_manipulation,rg/zebra_puzzles"
PROMPTS, GROUP, NEW_TOKENS, SEQ_LEN = 4, 8, 128, 1024


def bench_config(tokenizer_dir: str, num_steps: int, model_json: str = ""):
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
    c.train.micro_batches = 8  # the RL loss materialises [rows, 1024, 32768] logits: 2 rows at a time
    c.checkpoint.every_steps, c.checkpoint.resume = 10**6, False
    config_lib.validate(c, jax.device_count())
    c.lock()
    return c


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=1, help="steps skipped (compiles)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps")
    parser.add_argument("--tokenizer_dir", default=os.path.join(tempfile.gettempdir(), "rlvr_bench_bpe32k"))
    parser.add_argument("--model_json", default="", help="the model's fields (for a tree without bench_32k)")
    parser.add_argument("--timing_only", action="store_true",
                        help="no roofline (to time another tree's trainer with PYTHONPATH=that tree)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    tokenizer_dir = chat_bpe_tokenizer(args.tokenizer_dir)
    peaks = [] if args.timing_only else [machine_peaks()]
    config = bench_config(tokenizer_dir, args.warmup + args.steps, args.model_json)
    with tempfile.TemporaryDirectory(prefix="rl_step_realistic_") as workdir:
        with contextlib.redirect_stdout(sys.stderr):
            rl_trainer.train(resolve(config, workdir))
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if '"step_s"' in line]
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
        "generated_tokens_per_s": round(samples * response_len / generate_s, 1)}
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
    emit({
        "benchmark": "rl_step_realistic", "devices": str(jax.devices()[0]), "cpu_count": os.cpu_count(),
        "model": "bench_32k preset (6 layers, d512, GQA 8:2, tied vocab 32768, 34.9M params, fp32, random init)",
        "tokenizer": "byte-level BPE, 32768 ids, ChatML template (common.chat_bpe_tokenizer)",
        "workload": f"{PROMPTS} chat prompts ({TASKS}) x group {GROUP}, {NEW_TOKENS} new tokens, packed "
                    f"{SEQ_LEN}-token train rows, 1 AdamW update/step, sync",
        "warmup_steps": args.warmup, "measured_steps": args.steps, **timing,
        "prompt_length_mean": round(prompt_len, 1),
        "machine_peaks_median": {k: round(v, 1) for k, v in typical.items()},
        "machine_peaks_best": {k: round(v, 1) for k, v in best.items()},
        "generation_roofline": roofline,
        "generation_vs_roofline": round(timing["generated_tokens_per_s"] / roofline["tokens_per_s"], 4),
        "total_runtime_s": round(time.perf_counter() - t0, 1),
    })


if __name__ == "__main__":
    main()
