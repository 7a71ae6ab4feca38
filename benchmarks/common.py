"""Shared helpers for the benchmarks: timing, the matmul yardstick, the peer figures, the decode roofline."""

from __future__ import annotations

import json
import time

from rlvr.models.config import ModelConfig
from rlvr.train import flops

# Our own measurement of Tunix 0.1.7 with the peer script on the same fixed config and a 2-core CPU
# (benchmarks/results/tunix_peer.json; the script is benchmarks/peers/bench_tunix.py). The
# yardstick-scaled ratio is only an estimate (it read ~1.3x optimistic on 2026-11-30); the real
# comparison is side by side in one window (benchmarks/rollout_vs_tunix.py for the sampler):
#   python3 -m venv /tmp/venv-tunix && /tmp/venv-tunix/bin/pip install google-tunix
#   /tmp/venv-tunix/bin/python benchmarks/peers/bench_tunix.py --only sft,sampler
# then this repo's benchmarks immediately after.
TUNIX = {"sft_step_s": 0.7185, "sampler_tokens_per_s": 4047.6, "grpo_step_s": 2.0358,
         "calib_matmul_gflops": 285.15}


def calibrate_matmul_gflops(reps: int = 20) -> float:
    """The peer benchmark's yardstick of machine speed: median fp32 1024³ matmul GFLOP/s
    (`rlvr.train.flops.measure_matmul_peak`, the one the trainer's MFU uses)."""
    return flops.measure_matmul_peak("float32", 1024, reps, median=True) / 1e9


def time_calls(fn, repeats: int) -> tuple[float, list[float]]:
    """(first call incl. compile, per-call times of `repeats` more calls); fn blocks itself."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, times


def emit(record: dict, out: str = "", sort_keys: bool = False) -> None:
    """Prints the record as one JSON line and, with `out`, writes it there (indented)."""
    print(json.dumps(record, sort_keys=True))
    if out:
        with open(out, "w") as f:
            json.dump(record, f, indent=2, sort_keys=sort_keys)
            f.write("\n")


def machine_peaks(dtype: str = "float32") -> dict:
    """The roofline's two ceilings, measured now: best-of matmul FLOP/s (1024³ in `dtype`) and
    streaming-read bytes/s (a sum over a resident 256 MiB array)."""
    return {"matmul_gflops": flops.measure_matmul_peak(dtype) / 1e9,
            "read_gbytes_per_s": flops.measure_memory_bandwidth() / 1e9}


def _unique_prompt_ranges(prompts: list[list[int]]) -> list[tuple[int, int]]:
    """[start, end) of each distinct prompt's tokens not shared with an earlier (sorted) prompt:
    the tokens an ideal engine with prefix sharing prefills (a trie's nodes)."""
    ordered = sorted({tuple(p) for p in prompts})
    ranges, previous = [], ()
    for p in ordered:
        common = 0
        for a, b in zip(p, previous, strict=False):
            if a != b:
                break
            common += 1
        ranges.append((common, len(p)))
        previous = p
    return ranges


def decode_roofline(cfg: ModelConfig, prompts: list[list[int]], output_lengths: list[int], batch: int,
                    peaks: dict, kv_dtype: str = "float32") -> dict:
    """Seconds an ideal engine needs for this workload on this machine, and its tokens/s.

    Prefill: every distinct prompt token once (shared prefixes once), compute-bound at the matmul
    peak. Decode: each generated token after the first (the first comes from the prefill's last
    position) at max(FLOPs / peak FLOP/s, bytes / peak bytes/s), with the formulas of
    `rlvr.train.flops` (weights read once per step, shared by `batch` rows; each row reads its own
    KV context). `peaks["attention_matmul_gflops"]`, if given, is the ceiling of the attention
    products (their own dtype's: bf16 KV pages are multiplied in bf16 beside fp32 weights); the
    weight products use `peaks["matmul_gflops"]`. Returns {"seconds", "tokens_per_s",
    "prefill_tokens", "prefill_s", "decode_compute_s", "decode_memory_s"}."""
    peak_flops, peak_bw = peaks["matmul_gflops"] * 1e9, peaks["read_gbytes_per_s"] * 1e9
    attention_peak = peaks.get("attention_matmul_gflops", peaks["matmul_gflops"]) * 1e9

    def compute_seconds(context: int) -> float:  # one token's products at `context` keys
        attention = flops.decode_flops_per_token(cfg, context) - flops.decode_flops_per_token(cfg, 0)
        return flops.decode_flops_per_token(cfg, 0) / peak_flops + attention / attention_peak

    prefill_s, prefill_tokens = 0.0, 0
    for start, end in _unique_prompt_ranges(prompts):
        prefill_tokens += end - start
        prefill_s += sum(compute_seconds(pos + 1) for pos in range(start, end))
    compute_s = memory_s = decode_s = 0.0
    for prompt, n in zip(prompts, output_lengths, strict=True):
        for context in range(len(prompt) + 1, len(prompt) + n):
            c = compute_seconds(context)
            m = flops.decode_bytes_per_token(cfg, context, batch, kv_dtype) / peak_bw
            compute_s, memory_s, decode_s = compute_s + c, memory_s + m, decode_s + max(c, m)
    seconds = prefill_s + decode_s
    return {"seconds": round(seconds, 4), "tokens_per_s": round(sum(output_lengths) / seconds, 1),
            "prefill_tokens": prefill_tokens, "prefill_s": round(prefill_s, 4),
            "decode_compute_s": round(compute_s, 4), "decode_memory_s": round(memory_s, 4)}


def chat_bpe_tokenizer(directory: str, vocab_size: int = 32768, corpus_mb: int = 12) -> str:
    """A byte-level BPE tokenizer of `vocab_size` ids with ChatML specials and template
    (`rlvr.models.tokenizer.train_bpe`), trained on the Python standard library's sources (offline,
    ~1 min; kept in `directory` and reused). Returns the directory (tokenizer.json + config)."""
    import glob
    import os
    import sysconfig

    from rlvr.models.tokenizer import train_bpe

    if os.path.exists(os.path.join(directory, "tokenizer.json")):
        return directory
    texts, size = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
        if size > corpus_mb * 2**20 or "site-packages" in path:
            continue
        with open(path, encoding="utf-8", errors="ignore") as f:
            texts.append(f.read())
        size += len(texts[-1])
    train_bpe(texts, vocab_size).save(directory)
    return directory
