"""Model FLOPs per step (a stated formula) and a measured matmul peak, for MFU.

Formula (per token, forward + backward = 3 × forward):
    6 · N_matmul  +  12 · L · H · Dh · T
N_matmul counts the weights used in matrix products (all parameters except the input
embedding lookup; a tied embedding counts once, as the output projection). The second term
is attention scores and values over the full T×T square (the causal half is not discounted,
as in PaLM's appendix B convention). Padding positions are counted: they are computed.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from rlvr.models.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    n = cfg.num_params()
    return n if cfg.tie_word_embeddings else n - cfg.vocab_size * cfg.hidden_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return 6 * matmul_params(cfg) + attention


def measure_matmul_peak(dtype: str = "float32", size: int = 1024, repeats: int = 10, median: bool = False) -> float:
    """FLOP/s of a square matmul on the default device: the 'peak' MFU is quoted against (the
    best of `repeats` timed calls), or with `median=True` the benchmarks' yardstick of machine
    speed (the peer benchmark's: the median fp32 1024³ matmul, robust to a noisy shared machine).

    On CPU one matmul uses all cores, so this is the whole machine's figure; on
    accelerators it is per device. 16-bit operands are multiplied with float32 accumulation, as
    the model's projections are (`layers._matmul`; a bf16-output product runs XLA:CPU's
    upcast path at a third of that)."""
    def product(x):
        return x @ x if jnp.dtype(x.dtype).itemsize >= 4 else jnp.matmul(x, x, preferred_element_type=jnp.float32)

    return 2 * size**3 / _call_time(jax.jit(product), jnp.ones((size, size), dtype), repeats, median)


def _call_time(fn, arg, repeats: int, median: bool = False) -> float:
    """Seconds of one call of jitted `fn(arg)` after a warm-up call: the fastest of `repeats`, or
    their median."""
    fn(arg).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(arg).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) if median else min(times)


def machine_peak(dtype: str = "float32") -> float:
    """Peak FLOP/s of all devices this process drives (CPU devices share the cores)."""
    per_device = measure_matmul_peak(dtype)
    return per_device if jax.devices()[0].platform == "cpu" else per_device * jax.local_device_count()


# --- decoding (the rollout engine's roofline) -----------------------------------------------
#
# One generated token at context length c (tokens already cached, itself included) costs
#     FLOPs  = 2 · N_matmul + 4 · L · H · Dh · c         (projections; attention scores + values)
#     bytes  = c · kv_bytes_per_token  +  weight_bytes / B
# where B rows share one read of the weights per decode step, and kv_bytes_per_token =
# L · 2 · KVH · Dh · sizeof(kv dtype). A prompt token costs the FLOPs only (prefill is
# compute-bound). The roofline time of a token is max(FLOPs / peak FLOP/s, bytes / peak bytes/s).


def decode_flops_per_token(cfg: ModelConfig, context: int) -> float:
    return 2 * matmul_params(cfg) + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "float32") -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(kv_dtype).itemsize


def decode_bytes_per_token(cfg: ModelConfig, context: int, batch: int, kv_dtype: str = "float32") -> float:
    weights = matmul_params(cfg) * jnp.dtype(cfg.param_dtype).itemsize
    return context * kv_bytes_per_token(cfg, kv_dtype) + weights / max(batch, 1)


def measure_memory_bandwidth(megabytes: int = 256, repeats: int = 10, median: bool = False) -> float:
    """Bytes/s of a streaming read (a sum over a resident float32 array): best of `repeats`, or
    their median."""
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    return x.nbytes / _call_time(jax.jit(jnp.sum), x, repeats, median)
