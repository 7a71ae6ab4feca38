"""Builders shared by the trainers and by notebooks.

    from rlvr import api
    config = api.load_config("configs/tiny.py")
    model = api.build_model(config)                  # ModelConfig, sharded params, mesh
    logits, _ = api.forward(model, [[1, 2, 3]])      # or rlvr.models.transformer.forward
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from rlvr import sharding
from rlvr.config_lib import ConfigError, load_config  # noqa: F401  (re-exported)
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.models.tokenizer import Tokenizer, byte_level_tokenizer
from rlvr.models.transformer import forward as _forward


@dataclasses.dataclass
class Model:
    """A model ready to run: architecture, (sharded) params, the mesh they live on."""

    cfg: ModelConfig
    params: Any
    mesh: Mesh


def build_mesh(config: ml_collections.ConfigDict) -> Mesh:
    return sharding.make_mesh(dict(config.mesh))


def build_tokenizer(config: ml_collections.ConfigDict) -> Tokenizer:
    """The tokenizer of `tokenizer.path` (or `init.hf_checkpoint`), else the byte-level one."""
    path = config.tokenizer.path or config.init.hf_checkpoint
    return Tokenizer.from_dir(path) if path else byte_level_tokenizer()


def build_model(config: ml_collections.ConfigDict, mesh: Mesh | None = None) -> Model:
    """Loads `init.hf_checkpoint` if set, else initialises `model.*` from `seed`, sharded."""
    mesh = mesh or build_mesh(config)
    if config.init.hf_checkpoint:
        from rlvr.models import hf

        cfg, params = hf.load_hf_checkpoint(config.init.hf_checkpoint, mesh=mesh,
                                           overrides={"attention": config.model.attention})
        return Model(cfg, params, mesh)
    cfg = ModelConfig.from_mapping(config.model)
    params = params_lib.init_params(cfg, jax.random.key(config.seed), mesh)
    return Model(cfg, params, mesh)


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config a job wrote to `workdir/config.json`."""
    import json
    import os

    with open(os.path.join(workdir, "config.json")) as f:
        return ml_collections.ConfigDict(json.load(f))


def load_trained(workdir: str, step: int | None = None, mesh: Mesh | None = None) -> Model:
    """The model a job trained in `workdir`, from its latest (or `step`) checkpoint."""
    import os

    from rlvr.train import step as step_lib
    from rlvr.train.checkpoint import Checkpointer
    from rlvr.train.optimizer import build_optimizer

    config = load_run_config(workdir)
    mesh = mesh or build_mesh(config)
    cfg = ModelConfig.from_mapping(config.model)
    optimizer = build_optimizer(config.optimizer, config.train.num_steps)
    abstract = step_lib.abstract_state(cfg, optimizer, step_lib.state_shardings(cfg, optimizer, mesh))
    checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
        state, _ = checkpoints.restore(abstract, step)
    finally:
        checkpoints.close()
    return Model(cfg, state["params"], mesh)


def check_vocab(cfg: ModelConfig, tokenizer: Tokenizer) -> None:
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} ids; raise model.vocab_size.")


def forward(model: Model, tokens: list[list[int]] | np.ndarray):
    """Logits [B, T, V] for equal-length token lists (no padding, no cache)."""
    tokens = jnp.asarray(np.asarray(tokens, np.int32))
    return jax.jit(_forward, static_argnums=0)(model.cfg, model.params, tokens)
