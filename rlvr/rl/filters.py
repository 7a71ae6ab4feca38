"""Sample filters and reward shaping from DAPO (Yu et al. 2025), as pure jnp functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zero_variance_groups(rewards: jax.Array) -> jax.Array:
    """bool [G]: groups (rows of rewards [G, K]) whose rewards are all equal. Their group-relative
    advantages are all 0, so they carry no gradient signal; DAPO's dynamic sampling drops them."""
    return jnp.all(rewards == rewards[:, :1], axis=1)


def overlong_penalty(lengths: jax.Array, max_len: int, buffer: int, penalty: float = 1.0) -> jax.Array:
    """DAPO soft overlong punishment, added to the reward: 0 for length <= max_len - buffer, then
    linear down to -penalty at max_len, and -penalty beyond. Punishing truncation gradually rather
    than with a cliff reduces reward noise from cut-off but otherwise sound answers."""
    lengths = lengths.astype(jnp.float32)
    start = max_len - buffer
    frac = jnp.clip((lengths - start) / max(buffer, 1), 0.0, 1.0)
    return -penalty * frac
