"""The one step builder every trainer uses: a pure `(state, batch, rng) -> (state, metrics)`.

A loss is a pure function `loss_fn(params, batch, rng) -> (loss, aux_metrics)` handed to
`build_train_step`; there are no trainer subclasses. The step is jitted with explicit
in/out shardings from the logical rules and the state is donated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlvr import sharding
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig

State = dict[str, Any]
LossFn = Callable[[Any, dict[str, jax.Array], jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def state_shardings(cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh,
                    rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES) -> State:
    """Shardings of {step, params, opt_state}: optimizer moments follow their parameters."""
    param_sh = params_lib.param_shardings(cfg, mesh, rules)
    abstract = params_lib.abstract_params(cfg)
    opt_shape = jax.eval_shape(optimizer.init, abstract)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_shape, param_sh,
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
    params = params_lib.abstract_params(cfg)
    shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
              "opt_state": jax.eval_shape(optimizer.init, params)}
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def batch_shardings(batch_like: dict[str, Any], mesh: Mesh) -> dict[str, NamedSharding]:
    """Every batch array is [batch, length, ...]: batch over data×fsdp, length over sequence."""
    def one(x):
        axes = ("batch", "length") + (None,) * (len(x.shape) - 2)
        return sharding.logical_to_sharding(axes[: len(x.shape)], x.shape, mesh)
    return jax.tree.map(one, batch_like)


def build_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, mesh: Mesh,
                     shardings: State, batch_sharding: dict[str, NamedSharding]):
    """Returns jitted `step(state, batch, rng) -> (state, metrics)` with the state donated."""

    def step(state: State, batch: dict[str, jax.Array], rng: jax.Array):
        step_rng = jax.random.fold_in(rng, state["step"])
        with sharding.activation_sharding(mesh):
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state["params"], batch, step_rng)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), **aux}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sharding, replicated),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )
