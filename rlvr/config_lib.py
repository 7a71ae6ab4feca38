"""The config schema every experiment file starts from, and its validation.

An experiment file (`configs/NAME.py`) calls `base_config()`, overrides what it needs and
returns the ConfigDict locked: a mistyped key is an error (with the nearest valid key),
a wrong type is an error (ConfigDict's typed fields), and `validate` checks values before
anything is compiled, naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable

import ml_collections

from rlvr.models.config import PRESETS, ModelConfig, validate_attention_mesh


class ConfigError(ValueError):
    """A bad config value; the message names the field and how to fix it."""


def model_config_dict(preset: str = "", **overrides) -> ml_collections.ConfigDict:
    """`model.*` fields: exactly the fields of `ModelConfig`, from its defaults, a named
    preset (`rlvr.models.config.PRESETS`), then the overrides."""
    values = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    if preset:
        if preset not in PRESETS:
            raise ConfigError(f"model preset {preset!r} is unknown; presets: {sorted(PRESETS)}")
        values.update(PRESETS[preset])
    unknown = set(overrides) - set(values)
    if unknown:
        name = sorted(unknown)[0]
        close = difflib.get_close_matches(name, values, n=1)
        hint = f' Did you mean "{close[0]}"?' if close else ""
        raise ConfigError(f"model.{name} is not a model field.{hint}")
    values.update(overrides)
    return ml_collections.ConfigDict(values)


def base_config() -> ml_collections.ConfigDict:
    """All keys a job may read, with defaults. Experiment files override and lock."""
    c = ml_collections.ConfigDict()
    c.job = "sft"  # which trainer: see rlvr.main.TRAINERS
    c.seed = 0
    c.model = model_config_dict()
    # Weights to start from: an HF dir, or an rlvr workdir's latest checkpoint (e.g. an SFT run).
    c.init = ml_collections.ConfigDict({"hf_checkpoint": "", "workdir": ""})
    c.tokenizer = ml_collections.ConfigDict({"path": ""})  # HF dir; "" = built-in byte-level
    c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1, "sequence": 1})
    c.data = ml_collections.ConfigDict({
        "source": "arithmetic",  # arithmetic (synthetic, built in) | jsonl | tfds
        # jsonl records: {"messages": [...], "tools"?} | {"text"} | {"prompt", "completion"};
        # preference jobs: {"prompt", "chosen", "rejected"} (strings or chat messages).
        "path": "",
        "eval_path": "",  # held-out records (jsonl) for evaluation; "" = none
        "tfds_name": "",
        "tfds_dir": "",
        "split": "train",
        "eval_split": "",  # tfds held-out split
        "batch_size": 8,  # sequences (SFT) or pairs (preference) per step
        "seq_len": 128,
        "pack": True,  # SFT: several examples per row with segment ids
        "max_operand": 99,
    })
    c.optimizer = ml_collections.ConfigDict({
        "name": "adamw",
        "learning_rate": 1e-3,
        "warmup_steps": 10,
        "schedule": "cosine",  # cosine | linear | constant
        "weight_decay": 0.0,
        "b1": 0.9,
        "b2": 0.95,
        "eps": 1e-8,
        "grad_clip": 1.0,
    })
    c.train = ml_collections.ConfigDict({
        "num_steps": 100,
        "log_every": 10,
        "micro_batches": 1,  # gradient accumulation: the batch is split into this many parts
        "eval_examples": 32,
        "tensorboard": True,
        # > 0: the SFT/RL losses compute token log-probs in chunks of this many positions (forward and
        # backward) instead of materialising [batch, seq_len, vocab] logits; 0 = full logits
        "logprob_chunk_size": 0,
    })
    c.preference = ml_collections.ConfigDict({
        "loss": "dpo",  # dpo | cdpo | ipo | simpo | orpo (jobs 'dpo'); 'rm' jobs use bradley_terry
        "beta": 0.1,
        "label_smoothing": 0.0,  # cdpo
        "simpo_gamma": 0.5,
        "orpo_lambda": 0.1,
        "reference": "precompute",  # precompute (one pass before training) | online (frozen params)
    })
    c.rl = rl_config()
    # job "eval" (rlvr.trainers.evaluate): the tasks of rl.task (and rl's generation settings),
    # evaluated per family and level on the held-out stream with pass@k
    c.eval = ml_collections.ConfigDict({
        "levels": "all",  # all | default (each family's level drawn per task) | comma-separated ints
        "examples_per_level": 32,
        "samples": 8,  # per task; pass@k for k = 1, 2, 4, … <= samples (1 = greedy pass@1)
        "temperature": 1.0,
    })
    c.checkpoint = ml_collections.ConfigDict({
        "every_steps": 50,
        "keep": 3,
        "async_save": True,
        "resume": True,
        # on SIGTERM (preemption) a checkpoint is saved at the next step boundary; RL in async mode first
        # waits up to this long for the batch being generated, so it is saved too (rlvr.train.preemption)
        "preemption_grace_s": 30.0,
    })
    return c


def rl_config() -> ml_collections.ConfigDict:
    """`rl.*`: the RL job (rlvr.trainers.rl). Each algorithm choice is one field."""
    return ml_collections.ConfigDict({
        # task families and verifiers (rlvr.tasks): "add", "list_sort:2,string_reverse", "rg/*", ...;
        # min/max_digits: the add/sub/mul families' operand digits
        "task": "add", "min_digits": 1, "max_digits": 3,
        # layered reward = terminal + format_weight·format + process_weight·process + safety_weight·safety
        "format_weight": 0.0, "process_weight": 0.0, "safety_weight": 1.0,
        # a trained reward model (job rm workdir) as an extra reward term: + weight · normalised score
        "reward_model": "", "reward_model_weight": 1.0,
        "verifier_workers": 8,  # threads scoring completions (verifiers that wait on sandboxes/processes)
        # where verifiers run: local (threads in this process) | ray (verifier_workers Ray actors, each with
        # its own task mixture; verifier_address = an existing cluster, "" = start a local one)
        "verifier_backend": "local", "verifier_address": "",
        "prompt_format": "raw",  # raw (task.prompt as text) | chat (task messages through the chat template)
        # multi-turn tasks (rlvr.envs: tools, code repair): episodes run concurrently on episode_workers
        # threads; max_new_tokens is then per model turn and seq_len bounds the whole episode;
        # max_turns caps the environment's own turn limit (0 = the environment's)
        "max_turns": 0, "episode_workers": 64,
        "env": ml_collections.ConfigDict({"sandbox_workers": 4}),  # options of rlvr.envs.make_env
        # a black-box agent program ("module:factory" -> agent(base_url, task) -> answer) that plays every
        # task through the embedded engine's OpenAI endpoint; its calls are recorded as token trajectories
        "agent": "", "agent_timeout_s": 600.0,
        "agent_options": ml_collections.ConfigDict(),  # keyword arguments of the agent factory
        # rollout
        "prompts_per_step": 16, "group_size": 8, "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0,
        # sample JSON-schema tasks under their schema and tool-call tasks under the tool-call format
        # (constrained decoding, rlvr.tasks.constraints; needs the "structured" extra)
        "constrained_decoding": False,
        "seq_len": 32,  # train rows: longest prompt + max_new_tokens must fit
        "backend": "embedded",  # embedded (in-process JAX engine) | sglang (HTTP servers at sglang_urls)
        "sglang_urls": "",  # comma-separated
        "engine": ml_collections.ConfigDict({"max_slots": 128, "max_len": 64, "page_size": 16, "decode_steps": 8,
                                             "prefill_rows": 16, "prefill_chunk": 32}),
        # loop
        "mode": "sync",  # sync | async
        "max_staleness": 1,  # async: max weight versions between sampling and training a sample
        # algorithm
        "advantage": "grpo",  # grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae (PPO)
        "value_coef": 0.5, "value_clip": 0.2, "gae_gamma": 1.0, "gae_lambda": 0.95,  # gae: value head + loss
        "policy_loss": "ppo_clip",  # ppo_clip | gspo
        "aggregation": "token_mean",  # token_mean | seq_mean_token_mean | seq_mean_token_sum | token_sum_norm
        "clip_low": 0.2, "clip_high": 0.2,  # clip_high > clip_low: DAPO clip-higher
        "dual_clip": 0.0,  # > 1 enables dual-clip with this c; 0 = off
        "gspo_clip_low": 3e-4, "gspo_clip_high": 4e-4,
        "kl_coef": 0.0, "kl_estimator": "k3", "kl_mode": "loss",  # loss (term) | reward (penalty)
        "reference_model": False,  # keep the frozen reference even at kl_coef=0 (KL is still reported)
        "entropy_coef": 0.0,
        "tis_cap": 2.0,  # truncated importance sampling cap on π_trainer/π_sampler; 0 = off
        "tis_level": "token",  # token | sequence
        "dynamic_sampling": False, "max_refill_rounds": 2,  # DAPO: drop zero-variance groups, refill
        "overlong_buffer": 0, "overlong_penalty": 1.0,  # DAPO soft overlong punishment (0 = off)
        # difficulty curriculum (rlvr.tasks.curriculum): levels = operand digits rl.min_digits..rl.max_digits,
        # sampled near the level whose pass rate is inside [band_low, band_high]
        "curriculum": False, "curriculum_band_low": 0.2, "curriculum_band_high": 0.8, "curriculum_min_samples": 32,
        "curriculum_floor": 0.02,  # no family below this share of draws
        # task graph: a composite family is drawn only once its prerequisites (rlvr.tasks.graph) pass this rate
        "prerequisite_threshold": 0.5,
        # experience replay of rare successes (group pass rate <= replay_max_pass_rate) on hard tasks:
        # replay_fraction of each round's prompts re-pose buffered tasks; a re-posed group that fails
        # entirely gets the stored success back as one of its samples
        "replay_capacity": 0, "replay_fraction": 0.125, "replay_max_pass_rate": 0.25, "replay_max_uses": 2,
        # in-loop scheduling (rlvr.rl.scheduler): groups run by priority ("family_or_domain=weight,...",
        # default 1) on at most `capacity` in-flight sequences (0 = the backend's limit); a waiting
        # higher-priority group preempts a lower one; a round lagging past deadline_s or lag_factor x
        # the mean round degrades lower priorities: max_new_tokens x budget_fraction, then cut groups
        # at min_group_size finished samples, then skip the lowest-priority domain (0/0 = never)
        "schedule": ml_collections.ConfigDict({
            "priorities": "", "capacity": 0, "preempt": True, "max_preemptions": 2, "lag_factor": 0.0,
            "deadline_s": 0.0, "budget_fraction": 0.5, "min_group_size": 2, "skip": True}),
        "pack": False,  # several rollouts per train row
        "updates_per_batch": 1,  # PPO mini-batches: optimizer steps per rollout batch (proximal = weights before)
        # evaluation (held-out greedy) and the SFT warm start
        "eval_examples": 128, "eval_every": 0,
        "eval_samples": 1, "eval_temperature": 1.0,  # > 1: also pass@k (k = 1, 2, 4, … <= eval_samples) sampled
        "sft_steps": 0, "sft_demos": 256, "sft_batch_size": 16, "sft_learning_rate": 3e-3,
        "sft_off_format": 0.0,  # fraction of demonstrations written in a format the verifier rejects
        "sft_seq_len": 0,  # warm-start rows (demonstrations packed); 0 = 4 × rl.seq_len
    })


def _validate_rl(config: ml_collections.ConfigDict) -> None:
    from rlvr.rl.advantages import ADVANTAGE_FNS
    from rlvr.rl.batching import AGGREGATIONS
    from rlvr.rl.policy_loss import KL_ESTIMATORS
    from rlvr.tasks.mixture import expand

    rl = config.rl
    try:
        expand(rl.task)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _one_of(config, "rl.backend", ("embedded", "sglang"))
    _one_of(config, "rl.mode", ("sync", "async"))
    _one_of(config, "rl.prompt_format", ("raw", "chat"))
    _one_of(config, "rl.verifier_backend", ("local", "ray"))
    _existing_path(config, "rl.reward_model", "reward-model workdir (a job 'rm' run)")
    if rl.replay_capacity and not 0 < rl.replay_fraction < 1:
        raise ConfigError(f"rl.replay_fraction={rl.replay_fraction}: must be in (0, 1) when replay is on.")
    if rl.eval_samples < 1:
        raise ConfigError(f"rl.eval_samples={rl.eval_samples}: must be >= 1.")
    _one_of(config, "rl.advantage", [*ADVANTAGE_FNS, "gae"])
    _one_of(config, "rl.policy_loss", ("ppo_clip", "gspo"))
    _one_of(config, "rl.aggregation", AGGREGATIONS)
    _one_of(config, "rl.kl_estimator", KL_ESTIMATORS)
    _one_of(config, "rl.kl_mode", ("loss", "reward"))
    _one_of(config, "rl.tis_level", ("token", "sequence"))
    if rl.agent and rl.backend != "embedded":
        raise ConfigError(f"rl.agent={rl.agent!r} needs rl.backend='embedded' (the agent's calls are recorded by "
                          "the in-process engine's OpenAI endpoint)")
    if rl.max_turns < 0:
        raise ConfigError(f"rl.max_turns={rl.max_turns}: must be >= 0 (0 = the environment's own limit).")
    for path in ("rl.prompts_per_step", "rl.group_size", "rl.max_new_tokens", "rl.seq_len", "rl.eval_examples",
                 "rl.updates_per_batch", "rl.episode_workers"):
        _positive(config, path)
    if rl.curriculum and not 0 <= rl.curriculum_band_low < rl.curriculum_band_high <= 1:
        raise ConfigError(f"rl.curriculum_band_low={rl.curriculum_band_low}, rl.curriculum_band_high="
                          f"{rl.curriculum_band_high}: need 0 <= low < high <= 1.")
    if rl.max_staleness < 0:
        raise ConfigError(f"rl.max_staleness={rl.max_staleness}: must be >= 0 (0 = synchronous).")
    if rl.policy_loss == "gspo" and rl.aggregation != "seq_mean_token_mean":
        raise ConfigError("rl.policy_loss='gspo' is a sequence-level loss: set rl.aggregation='seq_mean_token_mean'.")
    if rl.dual_clip and rl.dual_clip <= 1:
        raise ConfigError(f"rl.dual_clip={rl.dual_clip}: must be > 1 (or 0 to turn it off).")
    if rl.backend == "sglang" and not rl.sglang_urls.strip():
        raise ConfigError("rl.backend='sglang' needs rl.sglang_urls (comma-separated server URLs).")
    if rl.seq_len > rl.engine.max_len:
        raise ConfigError(f"rl.seq_len={rl.seq_len} exceeds rl.engine.max_len={rl.engine.max_len}; raise "
                          "rl.engine.max_len (a multiple of rl.engine.page_size).")
    if rl.max_new_tokens >= rl.seq_len:
        raise ConfigError(f"rl.max_new_tokens={rl.max_new_tokens} leaves no room for the prompt in "
                          f"rl.seq_len={rl.seq_len}; raise rl.seq_len.")
    if rl.group_size < 2 and rl.advantage in ("grpo", "dr_grpo", "rloo"):
        raise ConfigError(f"rl.advantage={rl.advantage!r} compares samples within a group: set rl.group_size >= 2.")
    _validate_schedule(rl)
    if rl.sft_steps and config.init.workdir:
        raise ConfigError("set either rl.sft_steps (warm start here) or init.workdir (start from a run), not both.")


def _validate_schedule(rl: ml_collections.ConfigDict) -> None:
    from rlvr.rl.scheduler import parse_priorities

    schedule = rl.schedule
    try:
        parse_priorities(schedule.priorities)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if schedule.capacity < 0 or schedule.lag_factor < 0 or schedule.deadline_s < 0:
        raise ConfigError("rl.schedule.capacity, lag_factor and deadline_s must be >= 0 (0 = off / no limit).")
    if not 0 < schedule.budget_fraction <= 1:
        raise ConfigError(f"rl.schedule.budget_fraction={schedule.budget_fraction}: must be in (0, 1].")
    if not 1 <= schedule.min_group_size <= rl.group_size:
        raise ConfigError(f"rl.schedule.min_group_size={schedule.min_group_size}: must be in [1, rl.group_size="
                          f"{rl.group_size}] (2 or more for group-relative advantages).")
    if schedule.max_preemptions < 0:
        raise ConfigError(f"rl.schedule.max_preemptions={schedule.max_preemptions}: must be >= 0.")


# --- validation --------------------------------------------------------------------------

def _positive(c, path: str) -> None:
    value = _get(c, path)
    if value <= 0:
        raise ConfigError(f"{path}={value}: must be positive.")


def _get(c, path: str):
    node = c
    for part in path.split("."):
        node = node[part]
    return node


def _validate_eval(config: ml_collections.ConfigDict) -> None:
    levels = config.eval.levels
    if levels not in ("all", "default") and not all(x.strip().lstrip("-").isdigit() for x in levels.split(",")):
        raise ConfigError(f"eval.levels={levels!r}: use 'all', 'default' or comma-separated level numbers.")
    _positive(config, "eval.examples_per_level")
    _positive(config, "eval.samples")


def _one_of(c, path: str, choices) -> None:
    value = _get(c, path)
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(x) for x in choices], n=1)
        hint = f' Did you mean "{close[0]}"?' if close else ""
        raise ConfigError(f"{path}={value!r}: must be one of {sorted(choices)}.{hint}")


def _existing_path(c, path: str, what: str) -> None:
    value = _get(c, path)
    if value and not os.path.exists(os.path.expanduser(value)):
        raise ConfigError(f"{path}={value!r}: no such {what}; give an existing path or ''.")


def validate(config: ml_collections.ConfigDict, num_devices: int,
             jobs: dict[str, Callable] | None = None) -> None:
    """Checks values before any compile. Raises ConfigError naming the field."""
    from rlvr import sharding  # local: keeps config files importable without jax set-up

    if jobs is not None:
        _one_of(config, "job", jobs)
    try:
        ModelConfig.from_mapping(config.model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        mesh = sharding.mesh_shape_from_config(dict(config.mesh), num_devices)
        validate_attention_mesh(ModelConfig.from_mapping(config.model), mesh)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for path in ("data.batch_size", "data.seq_len", "train.num_steps", "train.log_every",
                 "checkpoint.every_steps", "checkpoint.keep", "optimizer.learning_rate"):
        _positive(config, path)
    if config.optimizer.warmup_steps < 0:
        raise ConfigError(f"optimizer.warmup_steps={config.optimizer.warmup_steps}: must be >= 0.")
    _one_of(config, "optimizer.schedule", ("cosine", "linear", "constant"))
    _one_of(config, "optimizer.name", ("adamw", "adafactor", "sgd"))
    _one_of(config, "data.source", ("arithmetic", "jsonl", "tfds"))
    _positive(config, "train.micro_batches")
    if config.train.logprob_chunk_size < 0:
        raise ConfigError(f"train.logprob_chunk_size={config.train.logprob_chunk_size}: must be >= 0 "
                          "(0 = full logits).")
    # RL rows are rl.prompts_per_step × rl.group_size; its SFT warm start uses rl.sft_batch_size
    batch_path = "rl.sft_batch_size" if config.job == "rl" else "data.batch_size"
    batch_size = config.rl.sft_batch_size if config.job == "rl" else config.data.batch_size
    checks_batch = config.job != "rl" or config.rl.sft_steps > 0
    if checks_batch and batch_size % config.train.micro_batches:
        raise ConfigError(f"{batch_path}={batch_size} must be a multiple of "
                          f"train.micro_batches={config.train.micro_batches}.")
    _one_of(config, "preference.reference", ("precompute", "online"))
    if config.data.source == "tfds" and not config.data.tfds_name:
        raise ConfigError("data.tfds_name is empty but data.source='tfds'; name a TFDS dataset.")
    _existing_path(config, "data.eval_path", "data file")
    data_shards = mesh["data"] * mesh["fsdp"]
    if checks_batch and batch_size % data_shards:
        raise ConfigError(
            f"{batch_path}={batch_size} must be a multiple of mesh.data×mesh.fsdp="
            f"{data_shards}; change the batch size or the mesh.")
    rows = config.rl.prompts_per_step * config.rl.group_size
    multiple = data_shards * config.train.micro_batches * config.rl.updates_per_batch
    if config.job == "rl" and not config.rl.pack and rows % multiple:
        raise ConfigError(
            f"rl.prompts_per_step×rl.group_size={rows} must be a multiple of mesh.data×mesh.fsdp×train.micro_batches"
            f"×rl.updates_per_batch={multiple}; change them or the mesh.")
    if config.data.source == "jsonl" and not config.data.path:
        raise ConfigError("data.path is empty but data.source='jsonl'; give a JSONL file.")
    _existing_path(config, "data.path", "data file")
    _existing_path(config, "init.hf_checkpoint", "checkpoint directory")
    _existing_path(config, "tokenizer.path", "tokenizer directory")
    _existing_path(config, "init.workdir", "workdir")
    if config.job in ("rl", "eval"):
        _validate_rl(config)
    if config.job == "eval":
        _validate_eval(config)
    if config.data.seq_len > config.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={config.data.seq_len} exceeds model.max_position_embeddings="
            f"{config.model.max_position_embeddings}.")


def load_config(spec: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """Loads `path/to/config.py[:arg]` the way `rlvr.main --config=` does (locked),
    then applies `{"a.b": value}` overrides (a typo is an error naming the nearest key)."""
    import importlib.util

    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("rlvr_user_config", path)
    if module_spec is None or not os.path.exists(path):
        raise ConfigError(f"--config={spec!r}: no config file at {path!r}.")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
    config.lock()
    for key, value in (overrides or {}).items():
        parent = config
        *head, last = key.split(".")
        for part in head:
            parent = getattr(parent, part)
        setattr(parent, last, value)
    return config
