"""Greedy decoding with the position-indexed KV cache: a small reference generator.

It is the simple path used for evaluation in tiny jobs and as a reference in tests;
the rollout engine (paged cache, continuous batching, sampling) lives in `rlvr.rollout`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlvr.models.config import ModelConfig
from rlvr.models.transformer import forward, init_cache


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens"))
def _greedy(cfg: ModelConfig, params, tokens, lengths, max_new_tokens: int, eos_id: int, images=None, deltas=None):
    batch, prompt_len = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(prompt_len), tokens.shape)
    segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
    cache = init_cache(cfg, batch, prompt_len + max_new_tokens)
    logits, cache = forward(cfg, params, tokens, positions, segment_ids, cache, images=images)
    deltas = jnp.zeros((batch,), jnp.int32) if deltas is None else deltas  # M-RoPE: ids after an image prompt
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)

    def decode(carry, _):
        token, pos, done, cache = carry
        logits, cache = forward(cfg, params, token[:, None], pos[:, None], None, cache,
                                rope_positions=(pos + deltas)[:, None])
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        done = done | (token == eos_id)
        nxt = jnp.where(done, eos_id, nxt)
        return (nxt, pos + 1, done, cache), token

    init = (first, lengths, jnp.zeros((batch,), bool), cache)
    _, out = jax.lax.scan(decode, init, None, length=max_new_tokens)
    return out.T  # [batch, max_new_tokens]


def greedy_generate(cfg: ModelConfig, params, prompts: list[list[int]], max_new_tokens: int,
                    eos_id: int, pad_id: int = 0, images: tuple[list, list] | None = None) -> list[list[int]]:
    """Greedy continuations of each prompt, cut after the first eos (kept). `images` (a VLM):
    (per prompt its patches [n, patch_dim], per prompt its grids), as `rlvr.data.images.preprocess`
    gives them; the prompts hold the expanded placeholders."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.full((len(prompts), int(lengths.max())), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    inputs, deltas = None, None
    if images is not None:
        from rlvr.models.vision import image_inputs, mrope_positions

        segments = (np.arange(tokens.shape[1]) < lengths[:, None]).astype(np.int32)
        inputs = image_inputs(cfg.vision, images[0], images[1], tokens, segments)
        deltas = np.concatenate([mrope_positions(cfg.vision, tokens[i:i + 1], segments[i:i + 1], images[1][i])[1]
                                 for i in range(len(prompts))])
    out = np.asarray(_greedy(cfg, params, jnp.asarray(tokens), jnp.asarray(lengths),
                             max_new_tokens, eos_id, inputs, deltas))
    results = []
    for row in out.tolist():
        results.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return results
