"""optax optimizers built from `config.optimizer`: schedule, clipping, decay masks."""

from __future__ import annotations

import jax
import ml_collections
import optax


def learning_rate_schedule(opt: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
    """Linear warmup, then cosine or linear decay to 0 (or constant)."""
    warmup = min(opt.warmup_steps, max(num_steps - 1, 0))
    decay_steps = max(num_steps - warmup, 1)
    if opt.schedule == "cosine":
        decay = optax.cosine_decay_schedule(opt.learning_rate, decay_steps)
    elif opt.schedule == "linear":
        decay = optax.linear_schedule(opt.learning_rate, 0.0, decay_steps)
    else:
        decay = optax.constant_schedule(opt.learning_rate)
    if warmup == 0:
        return decay
    ramp = optax.linear_schedule(0.0, opt.learning_rate, warmup)
    return optax.join_schedules([ramp, decay], [warmup])


def decay_mask(params):
    """Weight decay on weight matrices (kernels, embeddings) only; none on norms and biases."""
    def is_matrix(path, _):
        name = getattr(path[-1], "key", "")
        return name in ("kernel", "embed_tokens")

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def build_optimizer(opt: ml_collections.ConfigDict, num_steps: int) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(opt, num_steps)
    if opt.name == "adamw":
        core = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                           weight_decay=opt.weight_decay, mask=decay_mask)
    elif opt.name == "adafactor":
        core = optax.adafactor(schedule, weight_decay_rate=opt.weight_decay or None,
                               weight_decay_mask=decay_mask)
    else:
        core = optax.sgd(schedule)
    if opt.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(opt.grad_clip), core)
    return core
