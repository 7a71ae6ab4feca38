"""Reward shaping from DAPO (Yu et al. 2025), as a pure jnp function (its dynamic sampling, which
drops zero-variance groups, lives in the producer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def overlong_penalty(lengths: jax.Array, max_len: int, buffer: int, penalty: float = 1.0) -> jax.Array:
    """DAPO soft overlong punishment, added to the reward: 0 for length <= max_len - buffer, then
    linear down to -penalty at max_len, and -penalty beyond. Punishing truncation gradually rather
    than with a cliff reduces reward noise from cut-off but otherwise sound answers."""
    lengths = lengths.astype(jnp.float32)
    start = max_len - buffer
    frac = jnp.clip((lengths - start) / max(buffer, 1), 0.0, 1.0)
    return -penalty * frac
