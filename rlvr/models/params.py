"""Shapes first, then shardings, then arrays: parameters are never materialised unsharded."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rlvr import sharding
from rlvr.models.config import ModelConfig
from rlvr.models.transformer import Transformer, init_vlm_boxed

Params = dict[str, Any]


def init_boxed(cfg: ModelConfig, rng: jax.Array):
    """The model's params with their logical-axis boxes (flax `Partitioned`); a VLM's (`cfg.vision`)
    include its encoder's under `visual`."""
    if cfg.vision is not None:
        return init_vlm_boxed(cfg, rng)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(cfg).init(rng, tokens)["params"]


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


@functools.lru_cache(maxsize=32)
def _boxed_shapes(cfg: ModelConfig) -> Any:
    """The boxed params' shapes: one trace of the model's init per config (a run asks for its shapes
    and axes a dozen times; each trace of a VLM's init costs ~0.3 s). Callers get fresh trees."""
    return jax.eval_shape(functools.partial(init_boxed, cfg), jax.random.key(0))


def logical_axes(cfg: ModelConfig) -> Any:
    """Pytree (same structure as params) of logical axis-name tuples."""
    return jax.tree.map(
        lambda p: tuple(p.names), _boxed_shapes(cfg), is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )


def abstract_params(cfg: ModelConfig) -> Any:
    """Pytree of jax.ShapeDtypeStruct: the parameters' shapes without allocating them."""
    return nn.unbox(_boxed_shapes(cfg))


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES):
    """NamedSharding for every parameter, from its logical axes and the rules table."""
    return jax.tree.map(
        lambda axes, x: sharding.logical_to_sharding(axes, x.shape, mesh, rules),
        logical_axes(cfg),
        abstract_params(cfg),
        is_leaf=_is_axes,
    )


def param_specs(cfg: ModelConfig, mesh: Mesh, rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES):
    """{'/'-joined param path: PartitionSpec} (used by the golden sharding tests)."""
    flat = jax.tree_util.tree_flatten_with_path(param_shardings(cfg, mesh, rules))[0]
    return {"/".join(k.key for k in path): s.spec for path, s in flat}


def init_params(
    cfg: ModelConfig,
    rng: jax.Array,
    mesh: Mesh,
    rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES,
) -> Params:
    """Random parameters created directly in their shardings (jit with out_shardings)."""
    shardings = param_shardings(cfg, mesh, rules)

    def random_init(r):  # named: the compile log (rlvr.compile_log) reports it as jit(random_init)
        return nn.unbox(init_boxed(cfg, r))
    return jax.jit(random_init, out_shardings=shardings)(rng)
