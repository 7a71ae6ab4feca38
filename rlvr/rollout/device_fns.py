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
decode [slots] x `steps` (a grammar's one-step call passes a traced `limit`, not a new shape) with
the ragged page list padded to a power-of-two bucket, or a window of one of three lengths
(`Dispatch.window_buckets`). Each call draws its steps' random numbers before its loop. Params are
an argument (not a closure): a weight update swaps arrays without recompiling. The page pool
and the decode state are donated and updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rlvr.kernels.bits import from_bits
from rlvr.models.config import ModelConfig
from rlvr.models.transformer import Transformer, forward, forward_last, rope_tables
from rlvr.rollout.logit_process import count_tokens, extra_logprobs, process, reset_counts
from rlvr.rollout.sampling import policy_logprob, sample_tokens, uniforms


def init_state(slots: int, vocab: int | None = None) -> dict[str, jax.Array]:
    """Every slot idle (done). With `vocab`, also per-slot counts of generated tokens [S, V]
    (the state of penalties; see `logit_process`)."""
    state = {"token": jnp.zeros((slots,), jnp.int32), "position": jnp.zeros((slots,), jnp.int32),
             "count": jnp.zeros((slots,), jnp.int32), "done": jnp.ones((slots,), bool)}
    if vocab is not None:
        state["counts"] = jnp.zeros((slots, vocab), jnp.int32)
    return state


def _cache(pool, page_table, ragged=None):
    cache = {**pool, "page_table": page_table}
    if ragged is not None:
        cache["ragged"] = ragged
    return cache


def _window(pages, page_table, keys_last=False):
    """Each slot's pages in position order, head-major, one array per layer: [L, N, P, KVH, D] ->
    L x [S, KVH, R·P, D] (`keys_last`: L x [S, KVH, D, R·P], the keys' layout, see
    `transformer._window_decode`). One gather of whole pages (rows of a [N, P·KVH·D] view) per
    layer and decode call, so the steps attend without gathering (see `decode`)."""
    layers, num_pages, _, kvh, dim = pages.shape
    slots = page_table.shape[0]
    order = (0, 2, 3, 1) if keys_last else (0, 2, 1, 3)
    return tuple(from_bits(jnp.take(pages[i].reshape(num_pages, -1), page_table.reshape(-1), axis=0), pages.dtype)
                 .reshape(slots, -1, kvh, dim).transpose(order) for i in range(layers))


def _mask_stops(logits, sampling, count):
    """Forbid stop tokens (eos and stop_token_ids) while fewer than min_new_tokens exist."""
    early = count < sampling["min_new"]
    stop_ids = sampling["stop_ids"]  # [S, M], -1 = unused
    ids = jnp.where(early[:, None] & (stop_ids >= 0), stop_ids, logits.shape[1])
    return logits.at[jnp.arange(logits.shape[0])[:, None], ids].set(-jnp.inf, mode="drop")


def _sample(logits, sampling, count, positions, filters, counts=None, mask=None, u=None):
    """(tokens, their log-probs under the distribution sampled from: temperature, top-k, top-p,
    min-p; see rlvr.rollout.sampling). Stop tokens forbidden by min_new_tokens are outside that
    distribution too (the trainer does not model min_new_tokens: RL requests leave it at 0).
    Penalties (`counts`), a grammar `mask` and logit_bias (`logit_process`) change the logits drawn
    from, not the log-probs reported: those stay the policy's (`sampling.policy_logprob`), which is
    what the trainer scores. Greedy rows (temperature 0, which RL never samples with) report the
    policy's log-prob at temperature 1, as SGLang and OpenAI do. `u`: the rows' uniforms, if drawn
    already (`sample_tokens`). `filters` (static) also compiles the stop-token mask: the engine sets
    it when a row has min_new_tokens (`Dispatch._filters`), so plain rows skip the mask's copy of
    the [B, V] logits (about a fifth of the output projection's time at a 152k vocabulary)."""
    processed = process(logits, sampling, counts, mask)
    args = (sampling["temperature"], sampling["top_k"], sampling["top_p"], sampling["min_p"])
    drawn_from = _mask_stops(processed, sampling, count) if filters else processed  # min_new > 0 sets filters
    token, logprob = sample_tokens(drawn_from, *args, sampling["seed"], positions, filters, u)
    if processed is not logits:
        logprob = policy_logprob(logits, token, *args, filters)
    greedy = args[0] <= 0.0
    return token, jax.lax.cond(jnp.any(greedy), lambda: jnp.where(greedy, _raw_logprob(logits, token), logprob),
                               lambda: logprob)


def _raw_logprob(logits, token):
    logits = logits.astype(jnp.float32)
    return jnp.take_along_axis(logits, token[:, None], -1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)


def _finished(token, count, sampling):
    stop = jnp.any(token[:, None] == sampling["stop_ids"], axis=1)
    return (stop & (count >= sampling["min_new"])) | (count >= sampling["max_new"])


@functools.partial(jax.jit, static_argnums=(0, 1, 12), donate_argnums=(3, 8))
def prefill(cfg: ModelConfig, filters: bool, params, pool, page_table, tokens, positions, segment_ids, state, slots,
            completes, sampling, top: int = 0, mask=None, images=None, native=None):
    """Writes a chunk of prompt tokens [R, C] (valid tokens first in each row) into the pages.
    For rows with `completes` the chunk ends the prompt: the first output token is sampled from
    its last position and the row's slot (`slots`) gets its decode state. Returns the pool, the
    state, the sampled tokens and log-probs [R], and the extra log-probs [R, ...] asked for
    (`top` alternatives, `sampling["logprob_ids"]`; see `logit_process.extra_logprobs`).
    `filters`: see `sampling.sample_tokens`; `mask`: the rows' grammar masks (packed) or None.
    `images` (a VLM, see `image_chunk`): (rope ids [R, C, 3], features [R, C, E], is_image [R, C]).
    `native`: NativeDecode() to attend with the native CPU kernel (the engine's, when its decode
    does), else None (XLA)."""
    last = jnp.maximum(jnp.sum(segment_ids != 0, axis=1) - 1, 0)
    embeds = rope = None
    if images is not None:
        rope, features, is_image = images
        embeds = jnp.where(is_image[..., None], features.astype(cfg.dtype),
                           Transformer(cfg).apply({"params": params}, tokens, method=Transformer.embed))
    logits, cache = forward_last(cfg, params, tokens, positions, segment_ids, _cache(pool, page_table, native), last,
                                 embeds, rope)
    next_pos = jnp.take_along_axis(positions, last[:, None], axis=1)[:, 0] + 1
    one = jnp.ones_like(next_pos)
    penalized = "counts" in state
    counts = jnp.zeros((tokens.shape[0], logits.shape[-1]), jnp.int32) if penalized else None
    token, logprob = _sample(logits, sampling, one - 1, next_pos, filters, counts, mask)
    extras = extra_logprobs(logits, sampling["temperature"], top, sampling.get("logprob_ids"))
    target = jnp.where(completes, slots, state["token"].shape[0])  # out of range: dropped
    updates = {"token": token, "position": next_pos, "count": one, "done": _finished(token, one, sampling)}
    new_state = {name: state[name].at[target].set(value, mode="drop") for name, value in updates.items()}
    if penalized:
        new_state["counts"] = reset_counts(state["counts"], target, token)
    return {"k": cache["k"], "v": cache["v"]}, new_state, token, logprob, extras


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 10), donate_argnums=(4, 7))
def decode(cfg: ModelConfig, steps: int, filters: bool, params, pool, page_table, ragged, state, active, sampling,
           top: int = 0, mask=None, limit=None):
    """Up to `steps` decode steps for every slot [S] (at most `limit`, a traced step count, when
    given: the same program serves a grammar's one-step calls); rows not `active` are treated as done. A
    row stops (and writes nothing more) after a stop token (past min_new_tokens) or at
    max_new_tokens; the loop ends when all rows have. Returns the pool, the new state, the
    sampled tokens and log-probs [S, steps], how many tokens each row emitted, and the extra
    log-probs [S, steps, ...] asked for (`top`, `sampling["logprob_ids"]`).
    `ragged`: the rows' pages as a flat list (`kernels/paged_attention/ragged.py`: work follows
    the pages held), or None: the call gathers every slot's pages once into a contiguous window
    that its steps attend over densely (no gather per layer and step; the engine's choice for
    small slots x max_len, see `Engine`). The pool is written in both cases.
    `filters`: see `sampling.sample_tokens`. `mask` (packed grammar masks, see `logit_process`)
    holds for one token: the host passes limit=1 with it. Penalties run when the state has counts."""
    slots = state["token"].shape[0]
    start = jnp.where(active, state["count"], 0)
    empty = {}
    if top:
        empty["top_values"], empty["top_ids"] = (jnp.zeros((slots, steps, top), d) for d in (jnp.float32, jnp.int32))
    if "logprob_ids" in sampling:
        empty["ids_values"] = jnp.zeros((slots, steps, sampling["logprob_ids"].shape[1]), jnp.float32)

    def cond(carry):
        i, done = carry[0], carry[5]
        return (i < (steps if limit is None else limit)) & ~jnp.all(done)

    def body(carry):
        i, pool, token, pos, count, done, toks, logprobs, counts, extras = carry
        segment = (~done).astype(jnp.int32)[:, None]
        cache = {**_cache(pool, page_table, ragged),
                 "rope": tuple(jax.lax.dynamic_slice_in_dim(table, i, 1, axis=1) for table in rope)}
        logits, cache = forward(cfg, params, token[:, None], pos[:, None], segment, cache)
        u = jax.lax.dynamic_index_in_dim(draws, i, axis=1, keepdims=False)
        nxt, logprob = _sample(logits[:, 0], sampling, count, pos + 1, filters, counts, mask, u)
        counts = count_tokens(counts, nxt, ~done)
        extras = {k: jax.lax.dynamic_update_slice(extras[k], v[:, None], (0, i, *([0] * (v.ndim - 1))))
                  for k, v in extra_logprobs(logits[:, 0], sampling["temperature"], top,
                                             sampling.get("logprob_ids")).items()}
        count = count + (~done).astype(jnp.int32)
        toks = jax.lax.dynamic_update_slice(toks, nxt[:, None], (0, i))
        logprobs = jax.lax.dynamic_update_slice(logprobs, logprob[:, None], (0, i))
        pool = {name: cache[name] for name in pool}
        return (i + 1, pool, jnp.where(done, token, nxt), pos + (~done).astype(jnp.int32), count,
                done | _finished(nxt, count, sampling), toks, logprobs, counts, extras)

    # every step's uniforms at once (a row that runs advances one position per step; the draws of
    # rows that are done are never used): one batched draw instead of one per step
    ahead = state["position"][:, None] + 1 + jnp.arange(steps, dtype=jnp.int32)[None]
    draws = uniforms(jnp.repeat(sampling["seed"], steps), ahead.reshape(-1)).reshape(slots, steps)
    # every step's RoPE tables [S, steps, D] at once (a running row is at position + i at step i;
    # + the M-RoPE delta after images): the steps read theirs (see `Transformer.hidden_states`)
    rope = rope_tables(cfg, ahead - 1 + (sampling["rope_delta"][:, None] if "rope_delta" in sampling else 0))
    kv = dict(pool) if ragged is not None else {**pool, "window_k": _window(pool["k"], page_table, True),
                                                 "window_v": _window(pool["v"], page_table)}
    carry = (jnp.int32(0), kv, state["token"], state["position"], state["count"], state["done"] | ~active,
             jnp.zeros((slots, steps), jnp.int32), jnp.zeros((slots, steps), jnp.float32), state.get("counts"),
             empty)
    _, kv, token, pos, count, done, toks, logprobs, counts, extras = jax.lax.while_loop(cond, body, carry)
    pool = {"k": kv["k"], "v": kv["v"]}
    new_state = {"token": token, "position": pos, "count": count, "done": jnp.where(active, done, state["done"])}
    if counts is not None:
        new_state["counts"] = counts
    return pool, new_state, toks, logprobs, jnp.where(active, count, 0) - start, extras


@functools.partial(jax.jit, static_argnums=0)
def encode_images(cfg: ModelConfig, visual_params, patches, vit_positions, frame_ids, window_ids):
    """The vision tower's output [1, capacity / merge_unit, E]: one decoder input per placeholder
    (`rlvr.models.vision.VisionTransformer`; inputs as `image_inputs` lays them out)."""
    from rlvr.models.vision import VisionTransformer

    return VisionTransformer(cfg.vision, cfg.dtype, cfg.param_dtype).apply(
        {"params": visual_params}, patches, vit_positions, frame_ids, window_ids)


@functools.partial(jax.jit, donate_argnums=0)
def arm(state, slots, tokens, positions):
    """Slots whose prompt has one token left start decoding from it: the decode step that reads
    it writes its KV and samples the first output token, exactly as a prefill of that token
    would (same RNG position, same count). Entries with slot out of range are ignored."""
    updates = {"token": tokens, "position": positions, "count": jnp.zeros_like(tokens),
               "done": jnp.zeros(tokens.shape, bool)}
    new_state = {name: state[name].at[slots].set(value, mode="drop") for name, value in updates.items()}
    if "counts" in state:
        new_state["counts"] = reset_counts(state["counts"], slots)
    return new_state


@functools.partial(jax.jit, donate_argnums=0)
def add_counts(state, slots, counts):
    """state["counts"][slots[i]] += counts[i]: a retracted sequence's earlier output tokens, for its
    penalties (prefill and arm start a slot's counts over)."""
    return {**state, "counts": state["counts"].at[slots].add(counts)}


@functools.partial(jax.jit, static_argnums=(0, 1))
def score(cfg: ModelConfig, top: int, params, tokens, ids=None, images=None):
    """Raw log-probs (temperature 1) of a prompt [T] scoring itself: entry t is log p(token t+1 | tokens <= t) (the
    last is meaningless), plus the extras of every position (`top` alternatives, the log-probs of
    `ids` [M]; see `logit_process.extra_logprobs`). Padding after the prompt does not change them
    (causal attention)."""
    positions = jnp.arange(tokens.shape[0])[None]
    logits, _ = forward(cfg, params, tokens[None], positions, jnp.ones_like(positions), None, images=images)
    logits = logits[0].astype(jnp.float32)
    nxt = jnp.concatenate([tokens[1:], tokens[-1:]])
    own = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), nxt[:, None], axis=-1)[:, 0]
    wanted = None if ids is None else jnp.broadcast_to(ids, (tokens.shape[0], ids.shape[0]))
    return own, extra_logprobs(logits, None, top, wanted)


@functools.partial(jax.jit, donate_argnums=0)
def copy_pages(pool, src, dst):
    """pool[:, dst[i]] = pool[:, src[i]] (copy-on-write of a shared partial prompt page);
    entries with dst out of range are ignored."""
    return {name: arr.at[:, dst].set(arr[:, jnp.clip(src, 0, arr.shape[1] - 1)], mode="drop")
            for name, arr in pool.items()}
