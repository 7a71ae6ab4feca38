"""Comparing two training runs' weights when their gradients differ by float round-off.

Adam divides each update by the gradient's running RMS, so a weight whose gradient is near zero turns a
last-bit difference (another reduction order, another batching of the same requests) into an update
difference worth a sizeable fraction of the learning rate: an elementwise tolerance on the weights
cannot hold. Over a whole tensor, the difference of the two runs' updates stays small next to the
update itself, and is of order 1 when the runs trained on different data or gradients.
"""

import jax
import numpy as np


def assert_same_updates(got, want, start, rel: float) -> None:
    """Each tensor moved from `start` the same way in both runs: ‖Δgot − Δwant‖ ≤ rel·‖Δwant‖."""
    named = jax.tree_util.tree_leaves_with_path(start)
    for (path, s), a, b in zip(named, jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        step_got, step_want = np.float64(a) - s, np.float64(b) - s
        name, moved = jax.tree_util.keystr(path), np.linalg.norm(step_want)
        assert moved > 0, f"{name} did not move"
        off = np.linalg.norm(step_got - step_want) / moved
        assert off <= rel, f"{name}: the updates differ by {off:.2e} of the update (allowed {rel})"
