"""Shared helpers for the benchmarks: timing, the matmul yardstick, the decode roofline.

Comparisons with a peer (Tunix) are made side by side in one run (benchmarks/rollout_vs_tunix.py,
benchmarks/lora_train.py --tunix_python): a figure measured on another day is never printed beside ours."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import time

import jax
import jax.numpy as jnp

from rlvr.models.config import ModelConfig
from rlvr.models.layers import _matmul  # the model's own product (bf16: fp32 accumulation)
from rlvr.train import flops


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


def decode_matmul_gflops(cfg: ModelConfig, rows: int, dtype: str = "float32", steps: int = 16,
                         repeats: int = 5) -> float:
    """FLOP/s XLA reaches on a decode step's own weight products at `rows` rows, measured now: every
    layer's fused q/k/v, output, fused gate-up and down projections and the output projection
    (random weights of the model's shapes in `dtype`), chained in a `fori_loop` of `steps` steps as
    the engine's decode call runs them; the best of `repeats` calls. Nothing else (no attention,
    norms, sampling, host work) is in the loop, so an engine whose decode cost only these products
    runs at this rate; beside the 1024³ peak it says how much of the roofline the decode's shapes
    leave reachable (small-row products run below the square matmul's rate on CPU)."""
    h, e, f = cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    shapes = [(e, h + 2 * cfg.num_kv_heads * cfg.head_dim), (h, e), (e, 2 * f), (f, e)] * cfg.num_layers
    shapes.append((e, cfg.vocab_size))
    keys = jax.random.split(jax.random.key(0), len(shapes))
    weights = [jax.random.normal(k, s, dtype) * s[0] ** -0.5 for k, s in zip(keys, shapes, strict=True)]

    def step(_, x):
        for i in range(cfg.num_layers):
            qkv, o, gate_up, down = weights[4 * i: 4 * i + 4]
            x = x + _matmul(_matmul(x, qkv)[:, :h], o)
            g, u = jnp.split(_matmul(x, gate_up), 2, axis=-1)
            x = x + _matmul(jax.nn.silu(g) * u, down)
        logits = _matmul(x, weights[-1])
        return x + logits[:, :e] * 1e-3

    x = jnp.ones((rows, e), dtype)
    seconds = flops._call_time(jax.jit(lambda x: jax.lax.fori_loop(0, steps, step, x)), x, repeats)
    return 2 * rows * steps * sum(a * b for a, b in shapes) / seconds / 1e9


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
    weight products use `peaks["matmul_gflops"]`, or in decode `peaks["decode_matmul_gflops"]` if
    given (`decode_matmul_gflops`: the rate XLA reaches at the decode step's own shapes, which makes
    this the ceiling of an engine whose only decode cost is those products). Returns {"seconds",
    "tokens_per_s", "prefill_tokens", "prefill_s", "decode_compute_s", "decode_memory_s"}."""
    peak_flops, peak_bw = peaks["matmul_gflops"] * 1e9, peaks["read_gbytes_per_s"] * 1e9
    attention_peak = peaks.get("attention_matmul_gflops", peaks["matmul_gflops"]) * 1e9
    decode_peak = peaks.get("decode_matmul_gflops", peaks["matmul_gflops"]) * 1e9

    def compute_seconds(context: int, weight_peak: float = peak_flops) -> float:  # one token at `context` keys
        attention = flops.decode_flops_per_token(cfg, context) - flops.decode_flops_per_token(cfg, 0)
        return flops.decode_flops_per_token(cfg, 0) / weight_peak + attention / attention_peak

    prefill_s, prefill_tokens = 0.0, 0
    for start, end in _unique_prompt_ranges(prompts):
        prefill_tokens += end - start
        prefill_s += sum(compute_seconds(pos + 1) for pos in range(start, end))
    compute_s = memory_s = decode_s = 0.0
    for prompt, n in zip(prompts, output_lengths, strict=True):
        for context in range(len(prompt) + 1, len(prompt) + n):
            c = compute_seconds(context, decode_peak)
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


PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "bench_tunix.py")


def default_tunix_python() -> str:
    """`<repo>/.venv-tunix/bin/python`: where the peer's venv lives (ignored by git)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-tunix", "bin", "python")


def tunix_part(python: str, part: str, quick: bool = False, env: dict[str, str] | None = None) -> dict:
    """One part ("sft", "grpo", "sampler") of the peer script `benchmarks/peers/bench_tunix.py` in a
    fresh process of the peer's venv (environment `env`, default this one's): that part's result dict
    (its median and every timed call)."""
    if not os.path.exists(python):
        raise FileNotFoundError(f"--tunix_python {python} does not exist: make the peer's venv "
                                "(python3 -m venv .venv-tunix && .venv-tunix/bin/pip install google-tunix) or pass "
                                "its python")
    cmd = [python, PEER, "--child", "--only", part] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the Tunix peer ({' '.join(cmd)}) failed, rc {proc.returncode}: {proc.stderr[-2000:]}")
    result = json.loads(lines[-1])[part]
    if "error" in result:
        raise RuntimeError(f"the Tunix peer's {part} part failed: {result['error']}")
    return result


def load_average() -> list[float]:
    """The machine's 1/5/15-minute load averages now (the machine is shared: say how loaded it was)."""
    return [round(x, 2) for x in os.getloadavg()]


def publish(record: dict, out: str = "") -> None:
    """Prints the record as one JSON line and, with `out`, records it there (`record_with_history`)."""
    emit(record)
    if out:
        record_with_history(out, record)


def record_with_history(path: str, record: dict) -> None:
    """Writes `record` to `path` as the file's current record; what the file held before (one
    record, with its own `earlier` list) moves into `record["earlier"]`, newest first."""
    earlier = []
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
        earlier = previous.pop("earlier", [])
        earlier.insert(0, previous)
    with open(path, "w") as f:
        json.dump({**record, "earlier": earlier}, f, indent=2)
        f.write("\n")


def apply_overrides(config, overrides) -> None:
    """`--set a.b=value` options (a Python literal each) written into an ml_collections config."""
    for override in overrides:
        key, _, value = override.partition("=")
        *path, leaf = key.split(".")
        section = config
        for name in path:
            section = section[name]
        section[leaf] = ast.literal_eval(value)
