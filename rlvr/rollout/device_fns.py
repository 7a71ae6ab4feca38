"""The engine's jitted device functions: chunked prefill, multi-step decode, page copies.

Shapes are fixed per engine (prefill [rows, chunk], decode [slots] × `steps`), so serving
never recompiles per request. Params are an argument (not a closure): a weight update swaps
arrays without recompiling. The page pool is donated and updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rlvr.models.config import ModelConfig
from rlvr.models.transformer import forward
from rlvr.rollout.sampling import sample_tokens


def _cache(pool, page_table):
    return {"k": pool["k"], "v": pool["v"], "page_table": page_table}


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def prefill(cfg: ModelConfig, params, pool, page_table, tokens, positions, segment_ids, sampling):
    """Writes a chunk of prompt tokens [R, C] into the pages and samples a token after each
    row's last valid position (used only when the chunk completes the prompt)."""
    logits, cache = forward(cfg, params, tokens, positions, segment_ids, _cache(pool, page_table))
    last = jnp.maximum(jnp.sum(segment_ids != 0, axis=1) - 1, 0)
    last_logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    next_pos = jnp.take_along_axis(positions, last[:, None], axis=1)[:, 0] + 1
    tok, logprob = _sample(last_logits, sampling, jnp.zeros_like(next_pos), next_pos)
    return {"k": cache["k"], "v": cache["v"]}, tok, logprob


def _mask_stops(logits, sampling, generated):
    """Forbid stop tokens (eos and stop_token_ids) while fewer than min_new_tokens exist."""
    early = generated < sampling["min_new"]
    stop_ids = sampling["stop_ids"]  # [S, M], -1 = unused
    hit = jnp.zeros(logits.shape, bool)
    rows = jnp.arange(logits.shape[0])[:, None]
    hit = hit.at[rows, jnp.where(stop_ids >= 0, stop_ids, logits.shape[1])].set(True, mode="drop")
    return jnp.where(early[:, None] & hit, -jnp.inf, logits)


def _is_stop(tokens, sampling):
    return jnp.any(tokens[:, None] == sampling["stop_ids"], axis=1)


def _sample(logits, sampling, generated, positions):
    """(tokens, their log-probs under the distribution sampled from: temperature, top-k, top-p,
    min-p; see rlvr.rollout.sampling). Stop tokens forbidden by min_new_tokens are outside that
    distribution too (the trainer does not model min_new_tokens: RL requests leave it at 0)."""
    masked = _mask_stops(logits, sampling, generated)
    return sample_tokens(masked, sampling["temperature"], sampling["top_k"], sampling["top_p"], sampling["min_p"],
                         sampling["seed"], positions)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def decode(cfg: ModelConfig, steps: int, params, pool, page_table, tokens, positions, active, generated, sampling):
    """Up to `steps` decode steps for every slot [S]. A row stops (and writes nothing more)
    after a stop token (past min_new_tokens) or at max_new_tokens. Returns the pool, the
    sampled tokens and their log-probs [S, steps], and how many tokens each row emitted."""

    def one(carry, _):
        pool, token, pos, done, count = carry
        seg = (~done).astype(jnp.int32)[:, None]
        logits, cache = forward(cfg, params, token[:, None], pos[:, None], seg, _cache(pool, page_table))
        nxt, logprob = _sample(logits[:, 0], sampling, count, pos + 1)
        emitted = ~done
        count = count + emitted.astype(jnp.int32)
        finished = (_is_stop(nxt, sampling) & (count >= sampling["min_new"])) | (count >= sampling["max_new"])
        pool = {"k": cache["k"], "v": cache["v"]}
        return (pool, jnp.where(done, token, nxt), pos + emitted, done | finished, count), (nxt, logprob, emitted)

    # Unrolled in Python (not lax.scan): the per-layer parameter slices are then computed
    # once per call and shared by all steps instead of being re-sliced every step.
    carry, outs = (pool, tokens, positions, ~active, generated), []
    for _ in range(steps):
        carry, out = one(carry, None)
        outs.append(out)
    toks, logprobs, emitted = (jnp.stack(x, axis=1) for x in zip(*outs, strict=True))
    return carry[0], toks, logprobs, emitted.sum(axis=1)


@functools.partial(jax.jit, donate_argnums=0)
def copy_pages(pool, src, dst):
    """pool[:, dst[i]] = pool[:, src[i]] (copy-on-write of a shared partial prompt page);
    entries with dst out of range are ignored."""
    return {name: arr.at[:, dst].set(arr[:, jnp.clip(src, 0, arr.shape[1] - 1)], mode="drop")
            for name, arr in pool.items()}
