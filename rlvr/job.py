"""A job resolved once, before any trainer starts: what the config only implies, decided in one place.

`resolve(config, workdir)` (called by `rlvr.main.run`) turns a validated config into a `Job`: the
resolved config (`rlvr.start.resolve`: the checkpoint's architecture, the tokenizer directory, the
derived RL budgets), where the policy comes from, the architecture, the tokenizer with its chat
template and system prompt, and the device mesh. The trainers (`rlvr.trainers.*`), the RL producer,
scheduler and evaluation take these values from the `Job`; none of them reads the starting checkpoint's
directory or re-derives them from the config again.

    job = rlvr.job.resolve(config, workdir)
    model = job.build_model()        # the policy the job starts from, sharded on job.mesh
"""

from __future__ import annotations

import dataclasses

import ml_collections
from jax.sharding import Mesh

from rlvr import api, sharding, start
from rlvr.models.config import ModelConfig
from rlvr.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything a trainer needs that the config alone does not say directly."""

    config: ml_collections.ConfigDict  # resolved (`rlvr.start.resolve`) and locked
    workdir: str
    source: start.Source  # the configured starting point: random init, init.hf_checkpoint or init.workdir
    model_cfg: ModelConfig  # the architecture the job runs, with its adapters (lora.*)
    tokenizer: Tokenizer  # chat template and system prompt applied
    mesh: Mesh
    policy_source: start.Source  # what the trained policy starts from: the RL warm start's SFT run
    # (WORKDIR/sft, when rl.sft_steps > 0), else `source`; a LoRA run's frozen base

    def build_model(self, src: start.Source | None = None) -> api.Model:
        """The starting policy (`src`, default `source`) on this job's mesh (`api.materialize`)."""
        return api.materialize(self.model_cfg, self.mesh, src or self.source, self.config.seed)

    def policy_pointer(self) -> str:
        """Where the policy came from, for the record: rlvr-workdir:DIR, an HF directory, or random-init."""
        src = self.source
        return {"workdir": f"rlvr-workdir:{src.path}", "hf": src.path}.get(src.kind,
                                                                          f"random-init:seed={self.config.seed}")

    def derive(self, config: ml_collections.ConfigDict, workdir: str, model_cfg: ModelConfig | None = None) -> Job:
        """A sub-job (the RL warm start's SFT run) on the same starting point, tokenizer and mesh."""
        return dataclasses.replace(self, config=config, workdir=workdir, model_cfg=model_cfg or self.model_cfg,
                                   policy_source=self.source)


def resolve(config: ml_collections.ConfigDict, workdir: str, mesh: Mesh | None = None) -> Job:
    """The job `config` describes (validate it first: `rlvr.start.validate`); `config` is not changed.
    Raises ConfigError on a contradiction (rlvr.start)."""
    resolved, cfg, tokenizer = start.resolve_parts(config)
    return Job(resolved, workdir, start.source(resolved), cfg, tokenizer,
               mesh or sharding.make_mesh(dict(resolved.mesh)), start.run_source(resolved, workdir))
