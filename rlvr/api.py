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

from rlvr import config_lib, sharding, start
from rlvr.config_lib import ConfigError, load_config  # noqa: F401  (re-exported)
from rlvr.models import lora
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.models.tokenizer import Tokenizer
from rlvr.models.transformer import forward as _forward


@dataclasses.dataclass
class Model:
    """A model ready to run: architecture, (sharded) params, the mesh they live on, and (when loaded
    from a workdir) the tokenizer it was trained with."""

    cfg: ModelConfig
    params: Any
    mesh: Mesh
    tokenizer: Tokenizer | None = None


def build_mesh(config: ml_collections.ConfigDict) -> Mesh:
    return sharding.make_mesh(dict(config.mesh))


def build_tokenizer(config: ml_collections.ConfigDict) -> Tokenizer:
    """The job's tokenizer: `tokenizer.path`, else the starting checkpoint's (init.*), else byte-level;
    with `tokenizer.chat_template` and `tokenizer.system_prompt` applied (rlvr.start)."""
    return start.build_tokenizer(start.tokenizer_settings(config))


def build_model(config: ml_collections.ConfigDict, mesh: Mesh | None = None, src=None) -> Model:
    """The policy the config starts from (rlvr.start): `init.hf_checkpoint`, `init.workdir`'s latest
    checkpoint (a LoRA run's adapters merged in), or `model.*` initialised from `seed`; sharded on
    `mesh`. With `lora.rank` > 0 that is the frozen base, quantised when `lora.quantize` is set, with
    fresh adapters (rlvr.models.lora). `src` (a `start.Source`) replaces the config's starting point.
    A job resolves these once (`rlvr.job.Job.build_model`); this is the notebook's way."""
    return materialize(start.model_config(config), mesh or build_mesh(config), src or start.source(config),
                       config.seed)


def materialize(cfg: ModelConfig, mesh: Mesh, src, seed: int) -> Model:
    """The model of architecture `cfg` (adapters included) starting from `src` (a `start.Source`),
    sharded on `mesh`; random weights and fresh adapters are drawn from `seed`."""
    params = start_params(cfg, mesh, src, seed)
    model = with_value_head(Model(dataclasses.replace(lora.without_lora(cfg), value_head="value_proj" in params),
                                  params, mesh), cfg.value_head)
    if not cfg.lora.enabled:
        return model
    cfg = dataclasses.replace(cfg, value_head=model.cfg.value_head)
    return Model(cfg, lora.attach(cfg, model.params, adapter_rng(seed), mesh), mesh)


def adapter_rng(seed: int) -> jax.Array:
    """The key fresh adapters are drawn from (the seed's; apart from the random-init key)."""
    return jax.random.fold_in(jax.random.key(seed), 1)


def start_params(cfg: ModelConfig, mesh: Mesh, src, seed: int) -> Any:
    """Plain weights (in `model.param_dtype`) of the starting point `src`: an HF directory, an rlvr
    workdir (a LoRA run's adapters merged into its base) or random init from `seed`."""
    from rlvr.models.config import RUNTIME_FIELDS

    if src.kind == "hf":
        from rlvr.models import hf

        runtime = {k: getattr(cfg, k) for k in RUNTIME_FIELDS}
        return hf.load_hf_checkpoint(src.path, mesh=mesh, overrides=runtime)[1]
    if src.kind == "workdir":
        trained = load_trained(src.path, mesh=mesh)
        params = lora.merge(trained.cfg, trained.params)
        return jax.tree.map(lambda x: x if x.dtype == cfg.param_dtype else x.astype(cfg.param_dtype), params)
    return params_lib.init_params(lora.without_lora(cfg), jax.random.key(seed), mesh)


def with_value_head(model: Model, wanted: bool = True) -> Model:
    """The model with (a zero-initialised) or without a scalar value head on its backbone: the value
    starts at 0 everywhere and is learned by its loss (PPO's critic, a reward model)."""
    if model.cfg.value_head == wanted:
        return model
    cfg = dataclasses.replace(model.cfg, value_head=wanted)
    if not wanted:
        return Model(cfg, {k: v for k, v in model.params.items() if k != "value_proj"}, model.mesh, model.tokenizer)
    shardings = params_lib.param_shardings(cfg, model.mesh)
    head = jax.tree.map(lambda sh, a: jax.device_put(jnp.zeros(a.shape, a.dtype), sh),
                        shardings["value_proj"], params_lib.abstract_params(cfg)["value_proj"])
    return Model(cfg, {**model.params, "value_proj": head}, model.mesh, model.tokenizer)


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
    """The resolved config a job wrote to `workdir/config.json`."""
    return start.run_config(workdir)


def load_trained(workdir: str, step: int | None = None, mesh: Mesh | None = None) -> Model:
    """The model a job trained in `workdir`, from its latest (or `step`) checkpoint, with the
    tokenizer (chat template and system prompt included) it was trained with. A LoRA run's
    checkpoint holds the adapters; its base is rebuilt from what the run recorded (its starting
    point: `start.run_source`), so the model has the base and the adapters (`lora.merge` folds them)."""
    import os

    from rlvr.train import step as step_lib
    from rlvr.train.checkpoint import Checkpointer
    from rlvr.train.optimizer import build_optimizer

    config = load_run_config(workdir)
    mesh = mesh or build_mesh(config)
    cfg = config_lib.recorded_model(config)
    optimizer = build_optimizer(config.optimizer, config.train.num_steps)
    abstract = step_lib.abstract_state(cfg, optimizer, step_lib.state_shardings(cfg, optimizer, mesh))
    checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
        if checkpoints.latest_step() is None:
            raise ConfigError(f"{workdir!r} has no checkpoint yet (checkpoints/ is empty): did its job finish?")
        state, _ = checkpoints.restore(abstract, step)
    finally:
        checkpoints.close()
    params = state["params"]
    if cfg.lora.enabled:
        base = start_params(cfg, mesh, start.run_source(config, workdir), config.seed)
        params = lora.combine(params, lora.frozen(lora.attach(cfg, base, adapter_rng(config.seed), mesh)))
    return Model(cfg, params, mesh, start.workdir_tokenizer(workdir))


def load_teacher(path: str, mesh: Mesh, vocab: int, field: str = "rl.teacher", step: int = 0):
    """(ModelConfig, plain params) of the teacher at `path` (an HF directory or an rlvr workdir: a LoRA
    run's adapters merged; its checkpoint `step`, 0 = the latest), without a value head; also the SFT
    job's logit-distillation teacher (`distill.teacher`, rlvr.losses.distill). `vocab`: the student
    tokenizer's size, which the teacher's vocabulary must cover; `field`: the config key named in errors."""
    from rlvr.models import hf

    kind = start.init_overrides(path)  # raises a ConfigError naming the path when it is neither
    if "init.hf_checkpoint" in kind:
        if step:
            raise ConfigError(f"{field}_step={step}: {path!r} is a Hugging Face directory (one set of weights); "
                              "a checkpoint step applies to an rlvr workdir teacher only: set it to 0.")
        cfg, params = hf.load_hf_checkpoint(path, mesh=mesh)
    else:
        model = load_trained(path, step or None, mesh=mesh)
        cfg, params = lora.without_lora(model.cfg), lora.merge(model.cfg, model.params)
    params = {k: v for k, v in params.items() if k != "value_proj"}
    cfg = dataclasses.replace(cfg, value_head=False)
    if cfg.vocab_size < vocab:
        raise ConfigError(f"{field}={path!r}: its vocabulary ({cfg.vocab_size}) is smaller than the student "
                          f"tokenizer's ({vocab}); the teacher must share the student's tokenizer.")
    return cfg, params


def check_vocab(cfg: ModelConfig, tokenizer: Tokenizer) -> None:
    start.check_vocab(cfg, tokenizer)


def forward(model: Model, tokens: list[list[int]] | np.ndarray):
    """Logits [B, T, V] for equal-length token lists (no padding, no cache)."""
    tokens = jnp.asarray(np.asarray(tokens, np.int32))
    return jax.jit(_forward, static_argnums=0)(model.cfg, model.params, tokens)
