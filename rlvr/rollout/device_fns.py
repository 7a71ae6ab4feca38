"""The engine's jitted device functions: chunked prefill, the on-device decode loop, page copies.

Decode state stays on the device between calls (`init_state`: per slot the last token, its
position, the tokens generated so far and a done flag). A prefill that completes a prompt
samples the first output token and writes the slot's state (a prompt with one token left, such
as a group sample whose prompt is cached, skips the prefill: `arm`); `decode` runs up to `steps` steps
in a `lax.while_loop` (sampling, stop-token and length checks on device; the loop exits early
once every row is done) and returns the state for the next call. The host therefore dispatches
call N+1 before it reads call N's tokens, and never syncs inside a call. Compile time does not
grow with `steps` (one loop body).

Shapes per engine are few and fixed: prefill [rows, chunk] (two row counts x two chunk sizes),
decode [slots] x `steps` with the ragged page list padded to a power-of-two bucket. Params are
an argument (not a closure): a weight update swaps arrays without recompiling. The page pool
and the decode state are donated and updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rlvr.models.config import ModelConfig
from rlvr.models.transformer import forward, forward_last
from rlvr.rollout.sampling import sample


def init_state(slots: int) -> dict[str, jax.Array]:
    """Every slot idle (done)."""
    return {"token": jnp.zeros((slots,), jnp.int32), "position": jnp.zeros((slots,), jnp.int32),
            "count": jnp.zeros((slots,), jnp.int32), "done": jnp.ones((slots,), bool)}


def _cache(pool, page_table, ragged=None):
    cache = {"k": pool["k"], "v": pool["v"], "page_table": page_table}
    if ragged is not None:
        cache["ragged"] = ragged
    return cache


def _mask_stops(logits, sampling, count):
    """Forbid stop tokens (eos and stop_token_ids) while fewer than min_new_tokens exist."""
    early = count < sampling["min_new"]
    stop_ids = sampling["stop_ids"]  # [S, M], -1 = unused
    ids = jnp.where(early[:, None] & (stop_ids >= 0), stop_ids, logits.shape[1])
    return logits.at[jnp.arange(logits.shape[0])[:, None], ids].set(-jnp.inf, mode="drop")


def _sample(logits, sampling, count, positions, filters):
    """(token, raw policy log-prob) with the row's sampling parameters; stop tokens masked
    before min_new_tokens. The raw log-prob (temperature 1, unfiltered) is the trainer's."""
    token, _ = sample(_mask_stops(logits, sampling, count), sampling["temperature"], sampling["top_k"],
                      sampling["top_p"], sampling["min_p"], sampling["seed"], positions, filters)
    logits = logits.astype(jnp.float32)
    raw = jnp.take_along_axis(logits, token[:, None], -1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
    return token, raw


def _finished(token, count, sampling):
    stop = jnp.any(token[:, None] == sampling["stop_ids"], axis=1)
    return (stop & (count >= sampling["min_new"])) | (count >= sampling["max_new"])


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 8))
def prefill(cfg: ModelConfig, filters: bool, params, pool, page_table, tokens, positions, segment_ids, state, slots,
            completes, sampling):
    """Writes a chunk of prompt tokens [R, C] (valid tokens first in each row) into the pages.
    For rows with `completes` the chunk ends the prompt: the first output token is sampled from
    its last position and the row's slot (`slots`) gets its decode state. Returns the pool, the
    state, and the sampled tokens and raw log-probs [R]. `filters`: see `sampling.sample`."""
    last = jnp.maximum(jnp.sum(segment_ids != 0, axis=1) - 1, 0)
    logits, cache = forward_last(cfg, params, tokens, positions, segment_ids, _cache(pool, page_table), last)
    next_pos = jnp.take_along_axis(positions, last[:, None], axis=1)[:, 0] + 1
    one = jnp.ones_like(next_pos)
    token, raw = _sample(logits, sampling, one - 1, next_pos, filters)
    target = jnp.where(completes, slots, state["token"].shape[0])  # out of range: dropped
    updates = {"token": token, "position": next_pos, "count": one, "done": _finished(token, one, sampling)}
    state = {name: state[name].at[target].set(value, mode="drop") for name, value in updates.items()}
    return {"k": cache["k"], "v": cache["v"]}, state, token, raw


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4, 7))
def decode(cfg: ModelConfig, steps: int, filters: bool, params, pool, page_table, ragged, state, active, sampling):
    """Up to `steps` decode steps for every slot [S]; rows not `active` are treated as done. A
    row stops (and writes nothing more) after a stop token (past min_new_tokens) or at
    max_new_tokens; the loop ends when all rows have. Returns the pool, the new state, the
    sampled tokens and raw log-probs [S, steps], and how many tokens each row emitted.
    `filters`: see `sampling.sample`."""
    slots = state["token"].shape[0]
    start = jnp.where(active, state["count"], 0)

    def cond(carry):
        i, *_, done, _, _ = carry
        return (i < steps) & ~jnp.all(done)

    def body(carry):
        i, pool, token, pos, count, done, toks, logprobs = carry
        segment = (~done).astype(jnp.int32)[:, None]
        logits, cache = forward(cfg, params, token[:, None], pos[:, None], segment,
                                _cache(pool, page_table, ragged))
        nxt, raw = _sample(logits[:, 0], sampling, count, pos + 1, filters)
        count = count + (~done).astype(jnp.int32)
        toks = jax.lax.dynamic_update_slice(toks, nxt[:, None], (0, i))
        logprobs = jax.lax.dynamic_update_slice(logprobs, raw[:, None], (0, i))
        pool = {"k": cache["k"], "v": cache["v"]}
        return (i + 1, pool, jnp.where(done, token, nxt), pos + (~done).astype(jnp.int32), count,
                done | _finished(nxt, count, sampling), toks, logprobs)

    carry = (jnp.int32(0), pool, state["token"], state["position"], state["count"], state["done"] | ~active,
             jnp.zeros((slots, steps), jnp.int32), jnp.zeros((slots, steps), jnp.float32))
    _, pool, token, pos, count, done, toks, logprobs = jax.lax.while_loop(cond, body, carry)
    new_state = {"token": token, "position": pos, "count": count, "done": jnp.where(active, done, state["done"])}
    return pool, new_state, toks, logprobs, jnp.where(active, count, 0) - start


@functools.partial(jax.jit, donate_argnums=0)
def arm(state, slots, tokens, positions):
    """Slots whose prompt has one token left start decoding from it: the decode step that reads
    it writes its KV and samples the first output token, exactly as a prefill of that token
    would (same RNG position, same count). Entries with slot out of range are ignored."""
    updates = {"token": tokens, "position": positions, "count": jnp.zeros_like(tokens),
               "done": jnp.zeros(tokens.shape, bool)}
    return {name: state[name].at[slots].set(value, mode="drop") for name, value in updates.items()}


@functools.partial(jax.jit, donate_argnums=0)
def copy_pages(pool, src, dst):
    """pool[:, dst[i]] = pool[:, src[i]] (copy-on-write of a shared partial prompt page);
    entries with dst out of range are ignored."""
    return {name: arr.at[:, dst].set(arr[:, jnp.clip(src, 0, arr.shape[1] - 1)], mode="drop")
            for name, arr in pool.items()}
