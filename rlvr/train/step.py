"""The one step builder every trainer uses: a pure `(state, batch, rng, frozen) -> (state, metrics)`.

A loss is a pure function handed to `build_train_step`; there are no trainer subclasses:

    loss_fn(params, batch, rng, frozen) -> (loss_sum, aux)

`loss_sum` is a SUM over the batch's units (target tokens for SFT, pairs for DPO) and
`aux["weight"]` is the number of units; every other `aux` entry is a sum too. The step divides
by the total weight after accumulating over micro-batches, so N micro-batches give exactly
the gradient of one full batch. `frozen` carries inputs that are not trained (e.g. the
reference policy's params) as a jit argument with its own shardings.

The state's params are what trains: every parameter, or for a LoRA model (`lora.rank` > 0,
rlvr.models.lora) only the adapters (and a value head), so the optimizer holds state for them
alone. The frozen base then comes in as `base` (not donated); the loss sees `combine(params, base)`
and gradients are taken with respect to the adapters only.

The step is jitted with explicit in/out shardings from the logical rules, the state is
donated, and the RNG is `fold_in(rng, step)`. No host sync happens inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlvr import sharding
from rlvr.models import lora
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig

State = dict[str, Any]
LossFn = Callable[[Any, dict[str, jax.Array], jax.Array, Any], tuple[jax.Array, dict[str, jax.Array]]]


def trained_part(cfg: ModelConfig, tree: Any) -> Any:
    """The part of a params-shaped tree that trains: all of it, or a LoRA model's adapters."""
    return lora.trainable(tree) if cfg.lora.enabled else tree


def base_shardings(cfg: ModelConfig, mesh: Mesh, rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES):
    """Shardings of a LoRA model's frozen base (the step's `base` argument); None without LoRA."""
    return lora.frozen(params_lib.param_shardings(cfg, mesh, rules)) if cfg.lora.enabled else None


def abstract_base(cfg: ModelConfig, mesh: Mesh) -> Any:
    """ShapeDtypeStructs (with shardings) of a LoRA model's frozen base, for ahead-of-time compiles;
    None without LoRA."""
    if not cfg.lora.enabled:
        return None
    shapes = lora.frozen(params_lib.abstract_params(cfg))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                        base_shardings(cfg, mesh))


def state_shardings(cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh,
                    rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES) -> State:
    """Shardings of {step, params, opt_state}: optimizer moments shaped like their parameter
    follow its sharding; other state (factored Adafactor rows/cols, counters) is replicated.
    `params` is the trained part (`trained_part`)."""
    param_sh = trained_part(cfg, params_lib.param_shardings(cfg, mesh, rules))
    abstract = trained_part(cfg, params_lib.abstract_params(cfg))
    opt_shape = jax.eval_shape(optimizer.init, abstract)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(
        optimizer, lambda leaf, sh, p: sh if leaf.shape == p.shape else replicated, opt_shape, param_sh, abstract,
        transform_non_params=lambda _: replicated,
    )
    return {"step": replicated, "params": param_sh, "opt_state": opt_sh}


def init_state(params, optimizer: optax.GradientTransformation, shardings: State) -> State:
    """Train state around already-sharded params; the optimizer state is created sharded."""
    opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
    return {"step": step, "params": params, "opt_state": opt_state}


def abstract_state(cfg: ModelConfig, optimizer: optax.GradientTransformation, shardings: State) -> State:
    """ShapeDtypeStructs (with shardings) of the train state, for checkpoint restore."""
    params = trained_part(cfg, params_lib.abstract_params(cfg))
    shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
              "opt_state": jax.eval_shape(optimizer.init, params)}
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def batch_shardings(batch_like: dict[str, Any], mesh: Mesh) -> dict[str, NamedSharding]:
    """Batch arrays are [batch, length, ...] (or [batch]): batch over data×fsdp, length over
    sequence."""
    def one(x):
        axes = ("batch", "length") + (None,) * max(len(x.shape) - 2, 0)
        return sharding.logical_to_sharding(axes[: len(x.shape)], x.shape, mesh)
    return jax.tree.map(one, batch_like)


def _split_micro_batches(batch: dict[str, jax.Array], micro_batches: int):
    """[B, ...] -> [M, B/M, ...] taking rows i, i+M, … for micro-batch i, so every device
    keeps its share of each micro-batch under a data-sharded batch."""
    def split(x):
        if x.shape[0] % micro_batches:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by {micro_batches} micro-batches")
        return x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:]).swapaxes(0, 1)
    return jax.tree.map(split, batch)


def accumulate_gradients(loss_fn: LossFn, params, batch, rng, frozen, micro_batches: int = 1):
    """Sums of (gradients, loss and aux) over micro-batches; nothing is normalised yet."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def one(micro_batch, micro_rng):
        (loss_sum, aux), grads = grad_fn(params, micro_batch, micro_rng, frozen)
        return grads, {"loss": loss_sum, **aux}

    if micro_batches == 1:
        return one(batch, rng)
    micro = _split_micro_batches(batch, micro_batches)
    shapes = jax.eval_shape(one, jax.tree.map(lambda x: x[0], micro), rng)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32 if s.dtype != jnp.int32 else s.dtype),
                         shapes)

    def body(acc, inputs):
        micro_batch, index = inputs
        out = one(micro_batch, jax.random.fold_in(rng, index))
        return jax.tree.map(jnp.add, acc, out), None

    (grads, sums), _ = jax.lax.scan(body, zeros, (micro, jnp.arange(micro_batches)))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return grads, sums


def build_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    shardings: State,
    batch_sharding: dict[str, NamedSharding],
    *,
    micro_batches: int = 1,
    learning_rate: optax.Schedule | None = None,
    frozen_sharding: Any = None,
    base_sharding: Any = None,
):
    """Returns jitted `step(state, batch, rng, frozen, base) -> (state, metrics)` (frozen may be
    None; base is a LoRA model's frozen base, `base_shardings`, else None).

    Metrics: every aux sum divided by the total weight, plus `weight`, `grad_norm`,
    `param_norm` (of what trains) and `learning_rate` (when a schedule is given).
    """

    def step(state: State, batch: dict[str, jax.Array], rng: jax.Array, frozen: Any, base: Any):
        step_rng = jax.random.fold_in(rng, state["step"])
        trained_loss = loss_fn if base is None else (
            lambda params, *args: loss_fn(lora.combine(params, base), *args))
        with sharding.activation_sharding(mesh):
            grads, sums = accumulate_gradients(trained_loss, state["params"], batch, step_rng, frozen,
                                               micro_batches)
        weight = jnp.maximum(sums["weight"].astype(jnp.float32), 1.0)
        grads = jax.tree.map(lambda g: g / weight.astype(g.dtype), grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {k: v / weight for k, v in sums.items() if k != "weight"}
        metrics.update(weight=sums["weight"], grad_norm=optax.tree.norm(grads),
                       param_norm=optax.tree.norm(params))
        if learning_rate is not None:
            metrics["learning_rate"] = learning_rate(state["step"])
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sharding, replicated, frozen_sharding, base_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )
