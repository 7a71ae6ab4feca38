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
from ml_collections import config_dict

from rlvr.models.config import PRESETS, SHARED_PROMPT_ATTENTION, LoraConfig, ModelConfig, validate_attention_mesh


class ConfigError(ValueError):
    """A bad config value; the message names the field and how to fix it."""


_FIELD_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "tuple[int, ...]": tuple,
                "VisionConfig | None": object}  # model.vision: a VLM's encoder, a mapping of VisionConfig fields


def model_config_dict(preset: str = "", **overrides) -> ml_collections.ConfigDict:
    """`model.*`: `preset` (a named architecture of `rlvr.models.config.PRESETS`, for random init) and
    one field per `ModelConfig` field. A field left None is not set: it comes from the checkpoint the
    job starts from (init.*), else the preset, else ModelConfig's default. A field that is set is a
    choice: a checkpoint that contradicts it is an error (rlvr.start)."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig) if f.name != "lora"}  # lora: the `lora.*` section
    if preset and preset not in PRESETS:
        raise ConfigError(f"model preset {preset!r} is unknown; presets: {sorted(PRESETS)}")
    unknown = set(overrides) - set(fields)
    if unknown:
        name = sorted(unknown)[0]
        close = difflib.get_close_matches(name, fields, n=1)
        hint = f' Did you mean "{close[0]}"?' if close else ""
        raise ConfigError(f"model.{name} is not a model field.{hint}")
    c = ml_collections.ConfigDict({"preset": preset, **{
        name: config_dict.placeholder(_FIELD_TYPES[str(f.type)]) for name, f in fields.items()}})
    for name, value in overrides.items():
        c[name] = value
    return c


def base_config() -> ml_collections.ConfigDict:
    """All keys a job may read, with defaults. Experiment files override and lock."""
    c = ml_collections.ConfigDict()
    c.job = "sft"  # which trainer: see rlvr.main.TRAINERS
    c.seed = 0  # seeds the model init, data order, task streams and sampling
    c.model = model_config_dict()
    # Where the policy comes from (rlvr.start): both "" = random init from model.*; else one of
    c.init = ml_collections.ConfigDict({
        "hf_checkpoint": "",  # a Hugging Face directory: its architecture, weights and tokenizer
        "workdir": "",  # an rlvr workdir's latest checkpoint, with the architecture and tokenizer it recorded
    })
    # Low-rank adapters (rlvr.models.lora) on the starting policy: only they (and a value head) train, the
    # optimizer holds state for them alone, checkpoints hold them plus a pointer to the frozen base
    c.lora = ml_collections.ConfigDict({
        "rank": 0,  # adapter rank; 0 = full fine-tuning (every weight trains)
        "alpha": 16.0,  # the adapter's update is scaled by alpha / rank (PEFT's lora_alpha)
        # projections that get adapters: comma-separated q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,
        # or a group: all | attention | mlp
        "targets": "all",
        "dropout": 0.0,  # dropout on the adapters' input while training
        # QLoRA: the frozen base's projection weights stored as int8 | int4 (blockwise absmax scales); none = as is
        "quantize": "none",
        "quant_block": 64,  # quantisation block: input-dimension weights sharing one scale
    })
    # Logit distillation in SFT (job=sft; rlvr.losses.distill): loss per target token = (1 - weight)·NLL +
    # weight·KL(teacher's top_k distribution ‖ student), both models' logits in chunks of chunk_size positions
    c.distill = ml_collections.ConfigDict({
        "teacher": "",  # an HF directory or rlvr workdir with the student's tokenizer; "" = plain SFT
        "top_k": 32, "weight": 1.0, "chunk_size": 256,
    })
    c.tokenizer = ml_collections.ConfigDict({
        "path": "",  # a Hugging Face tokenizer dir; "" = the checkpoint's own (random init: byte-level)
        # the chat template: a jinja template, a .jinja file or "chatml"; "" = the tokenizer's own
        "chat_template": "",
        "system_prompt": "",  # put first in every conversation without a system message ("" = none)
    })
    # device mesh axis sizes (one may be -1: the remaining devices): data parallel, fully sharded data parallel
    # (params and optimizer state sharded), tensor parallel, sequence (context) parallel
    c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1, "sequence": 1})
    c.data = ml_collections.ConfigDict({
        "source": "arithmetic",  # arithmetic (synthetic, built in) | jsonl | tfds
        # jsonl records: {"messages": [...], "tools"?} | {"text"} | {"prompt", "completion"};
        # preference jobs: {"prompt", "chosen", "rejected"} (strings or chat messages).
        "path": "",
        "eval_path": "",  # held-out records (jsonl) for evaluation; "" = none
        "tfds_name": "",  # data.source="tfds": the dataset name
        "tfds_dir": "",  # data.source="tfds": its data directory
        "split": "train",  # the training split (tfds)
        "eval_split": "",  # tfds held-out split
        "batch_size": 8,  # sequences (SFT) or pairs (preference) per step
        "seq_len": 128,  # tokens per training row (SFT, preference pairs)
        "pack": True,  # SFT: several examples per row with segment ids
        "image_patches": 0,  # records with image parts (a VLM): patches per row; 0 = the batch's most (recompiles)
        "image_max_pixels": 28 * 28 * 1280,  # records with image parts: largest image area before patching
        "max_operand": 99,  # data.source="arithmetic": the largest operand
    })
    c.optimizer = ml_collections.ConfigDict({
        "name": "adamw",  # adamw | adafactor | sgd
        "learning_rate": 1e-3,  # peak learning rate
        "warmup_steps": 10,  # linear warmup from 0 to the peak
        "schedule": "cosine",  # cosine | linear | constant (after the warmup)
        "weight_decay": 0.0,  # decoupled weight decay (not on norms and biases)
        "b1": 0.9,  # Adam beta1
        "b2": 0.95,  # Adam beta2
        "eps": 1e-8,  # Adam epsilon
        "grad_clip": 1.0,  # global gradient-norm clipping (0 = off)
    })
    c.train = ml_collections.ConfigDict({
        "num_steps": 100,  # optimizer steps (RL: train steps, each on one rollout batch)
        "log_every": 10,  # steps between metrics records and progress lines
        "micro_batches": 1,  # gradient accumulation: the batch is split into this many parts
        "eval_examples": 32,  # SFT: held-out records (data.eval_path) or arithmetic problems evaluated at the end
        "tensorboard": True,  # also write metrics as TensorBoard events (workdir/tensorboard)
        # also log metrics to Weights & Biases: "" (off) | offline (workdir/wandb, no network; `wandb sync` later)
        # | online; needs the wandb extra. The run id is derived from the workdir, so a resumed job continues it
        "wandb": "", "wandb_project": "rlvr",
        # > 0: the SFT/RL losses compute token log-probs in chunks of this many positions (forward and
        # backward) instead of materialising [batch, seq_len, vocab] logits; 0 = full logits
        "logprob_chunk_size": 0,
    })
    c.preference = ml_collections.ConfigDict({
        "loss": "dpo",  # dpo | cdpo | ipo | simpo | orpo (jobs 'dpo'); 'rm' jobs use bradley_terry
        "beta": 0.1,  # inverse temperature of the implicit reward (dpo, cdpo, ipo, simpo)
        "label_smoothing": 0.0,  # cdpo
        "simpo_gamma": 0.5,  # simpo: the target reward margin
        "orpo_lambda": 0.1,  # orpo: weight of the odds-ratio term
        "reference": "precompute",  # precompute (one pass before training) | online (frozen params)
    })
    c.rl = rl_config()
    # job "eval" (rlvr.trainers.evaluate): the tasks of rl.task (and rl's generation settings),
    # evaluated per family and level on the held-out stream with pass@k
    c.eval = ml_collections.ConfigDict({
        "levels": "all",  # all | default (each family's level drawn per task) | comma-separated ints
        "examples_per_level": 32,  # held-out tasks per family and level
        "samples": 8,  # per task; pass@k for k = 1, 2, 4, … <= samples (1 = greedy pass@1)
        "temperature": 1.0,  # sampling temperature when samples > 1
        # off-policy distillation data: tasks from the held_out or train stream; sft_out = a JSONL path
        # for the completions as SFT records ("" = none), only the verified ones when sft_passed_only
        "split": "held_out", "sft_out": "", "sft_passed_only": True,
    })
    # start-up time (rlvr.compile_log, docs/how-to/start-up-time.md): jax's persistent compilation cache,
    # shared by every job of this user ("" = off; compiles shorter than cache_min_compile_s are not written),
    # and one line per XLA program that took >= print_min_s to compile (all of them in workdir/compile.jsonl)
    c.compile = ml_collections.ConfigDict({"cache_dir": "~/.cache/rlvr/jax", "cache_min_compile_s": 1.0,
                                           "print_min_s": 1.0})
    c.checkpoint = ml_collections.ConfigDict({
        "every_steps": 50,  # steps between checkpoints (and one at the end)
        "keep": 3,  # checkpoints kept
        "async_save": True,  # save in the background while training continues
        "resume": True,  # rerunning a job resumes from its latest checkpoint
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
        # raw (task.prompt as text) | chat (task messages through the chat template); "" = the run in
        # init.workdir's (an RL or eval run), else raw
        "prompt_format": "",
        # multi-turn tasks (rlvr.envs: tools, code repair): episodes run concurrently on episode_workers
        # threads; max_new_tokens is then per model turn and seq_len bounds the whole episode;
        # max_turns caps the environment's own turn limit (0 = the environment's)
        "max_turns": 0, "episode_workers": 64,
        "env": ml_collections.ConfigDict({"sandbox_workers": 4}),  # options of rlvr.envs.make_env
        # warm gVisor sandboxes for code verdicts (the code verifier, code-repair scoring, CAD runs), started
        # on the first one; 0 = a fresh sandbox per verdict (~7x dearer: docs/how-to/sandbox-pool.md)
        "code_pool": 4,
        # a black-box agent program ("module:factory" -> agent(base_url, task) -> answer) that plays every
        # task through the embedded engine's OpenAI endpoint; its calls are recorded as token trajectories
        "agent": "", "agent_timeout_s": 600.0,
        "agent_options": ml_collections.ConfigDict(),  # keyword arguments of the agent factory
        # rollout: prompts (tasks) per step, samples per prompt; sampling (temperature, top_p, top_k (-1 = all),
        # min_p): the trainer's log-probs are of the same truncated, tempered distribution
        # (rlvr.kernels.chunked_logprob.sampling_logits)
        "prompts_per_step": 16, "group_size": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        # sample JSON-schema tasks under their schema and tool-call tasks under the tool-call format
        # (constrained decoding, rlvr.tasks.constraints; needs the "structured" extra)
        "constrained_decoding": False,
        # budgets (rlvr.budgets): the response budget; 0 = the run in init.workdir's (an RL or eval run)
        "max_new_tokens": 0,
        "max_prompt_len": 0,  # prompts longer are skipped (and reported); 0 = the longest prompt of rl.task
        "seq_len": 0,  # train rows (multi-turn: the episode budget); 0 = max_prompt_len + max_new_tokens
        "backend": "embedded",  # embedded (in-process JAX engine) | sglang (HTTP servers at sglang_urls)
        "sglang_urls": "",  # comma-separated
        # an sglang-router in front of the servers (rlvr.rollout.router): generation goes through it, control
        # (weight sync, pause, abort, loads) to each server of sglang_urls, or of the router's GET /workers if empty
        "sglang_router": "",
        # embedded engine: sequences at once, cache per sequence (0 = rl.seq_len rounded up to page_size),
        # KV page size, decode steps per host round trip, prefill rows and chunk length; the rollout
        # weights' dtype and the KV pages' ("" = dtype): "bfloat16" halves the engine's memory, and its
        # log-probs then differ from the trainer's float32 ones (rl.tis_cap corrects that); the decode
        # attention ("auto" | "window" | "ragged" | "native"), its products ("auto" | "native" | "xla":
        # float32 weights packed once for the native CPU matmul, Engine's decode_matmul) and the order
        # waiting requests take free slots ("batch_lof" | "fcfs" | "lof"; see rlvr.rollout.engine.Engine);
        # replicas: the slots split over that many engines stepped at once (a CPU host's idle cores;
        # keep 1 on TPU/GPU: rlvr.rollout.replicas)
        "engine": ml_collections.ConfigDict({"max_slots": 128, "max_len": 0, "page_size": 16, "decode_steps": 8,
                                             "prefill_rows": 16, "prefill_chunk": 32, "dtype": "float32",
                                             "kv_dtype": "", "decode_attention": "auto", "decode_matmul": "auto",
                                             "schedule_policy": "batch_lof", "replicas": 1}),
        # what happens: samples_per_step completions of each step (with their reward components) go to
        # samples.jsonl; the first and every print_samples_every steps, two are printed (0 = never)
        "samples_per_step": 4, "print_samples_every": 10,
        # loop
        # sync | async (a producer thread, up to max_staleness versions ahead: timing decides how far) |
        # lockstep (async's off-policy lag, fixed: batch b from the weights of step b - max_staleness;
        # deterministic, so it also runs on several JAX processes; no overlap: a sync step's speed)
        "mode": "sync",
        "max_staleness": 1,  # async: max (lockstep: exact) weight versions between sampling and training
        # rollout that depends on nothing but the seeds and the step, not on thread timing: every request
        # of a round goes to the engine at once (its queue admits them), multi-turn episodes advance in
        # rounds (rlvr.envs.rollout.TurnRounds) with no time budget, after the round's single-turn groups.
        # On by itself on several JAX processes (each drives the same engine); set it to compare with one
        "deterministic_rollout": False,
        # algorithm
        "advantage": "grpo",  # grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae (PPO)
        "value_coef": 0.5, "value_clip": 0.2, "gae_gamma": 1.0, "gae_lambda": 0.95,  # gae: value head + loss
        "policy_loss": "ppo_clip",  # ppo_clip | gspo
        "aggregation": "token_mean",  # token_mean | seq_mean_token_mean | seq_mean_token_sum | token_sum_norm
        # the policy the PPO ratio is taken (and clipped) against: current (the weights before this batch's
        # updates; with updates_per_batch = 1 the ratio is 1 and only TIS corrects the sampler) | behaviour
        # (the sampler's recorded log-probs: clipping bounds the update against the policy that generated
        # the batch, e.g. stale async rollouts; TIS is then off)
        "proximal": "current",
        "clip_low": 0.2, "clip_high": 0.2,  # clip_high > clip_low: DAPO clip-higher
        "dual_clip": 0.0,  # > 1 enables dual-clip with this c; 0 = off
        "gspo_clip_low": 3e-4, "gspo_clip_high": 4e-4,  # gspo: clip range of the sequence-level ratio
        "kl_coef": 0.0, "kl_estimator": "k3", "kl_mode": "loss",  # loss (term) | reward (penalty)
        "reference_model": False,  # keep the frozen reference even at kl_coef=0 (KL is still reported)
        # on-policy distillation (rlvr.rl.distill): a teacher (HF directory or rlvr workdir, the student's
        # tokenizer) scores the student's samples. distill_estimator "sampled": advantage += -distill_coef ·
        # (log π_student - log π_teacher) per sampled token; "full": loss += distill_coef · KL(π_student ‖
        # π_teacher) over the whole vocabulary at every sampled position (the teacher runs in the train
        # step, chunked). distill_task_advantage=False drops the task reward's advantage (distillation alone)
        # teacher_step: the checkpoint of an rlvr-workdir teacher (0 = its latest)
        "teacher": "", "teacher_step": 0, "distill_coef": 1.0, "distill_task_advantage": True,
        "distill_estimator": "sampled",  # sampled (advantage term) | full (the whole-vocabulary KL in the loss)
        "distill_teacher_temperature": 1.0,  # "full" only: KL to softmax(teacher logits / this); < 1 sharpens it
        "entropy_coef": 0.0,  # entropy bonus weight in the loss
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
            "priorities": "",  # "family_or_domain=weight,..." (default 1): higher runs first
            "capacity": 0,  # in-flight sequences at most (0 = the backend's limit)
            "preempt": True,  # a waiting higher-priority group aborts lower ones and takes their place
            "max_preemptions": 2,  # times one group may be preempted
            "lag_factor": 0.0,  # degrade a round lagging past this x the mean round (0 = never)
            "deadline_s": 0.0,  # degrade a round running past this many seconds (0 = never)
            "budget_fraction": 0.5,  # degradation 1: max_new_tokens x this for lower priorities
            "min_group_size": 2,  # degradation 2: cut groups at this many finished samples
            "skip": True}),  # degradation 3: skip the lowest-priority domain
        "pack": False,  # several rollouts per train row
        "row_len": 0,  # packed train rows' width (rl.pack): 0 = rl.seq_len; wider rows hold more per row
        # a group's prompt once per packed row, its completions after it as branches (rl.pack, the "xla" or
        # "flash" attention, rl.sampled_logits_only): the same loss, the prompt's FLOPs once per group, not per
        # completion
        "share_prompts": False,
        # train rows as wide as the batch's longest, rounded up to a power of two (<= seq_len), not seq_len:
        # the loss is the same, short rollouts cost what they hold (one train-step compile per width)
        "trim_columns": True,
        # the output layer and the log-softmax over the vocabulary run only where the loss reads a log-prob
        # (sampled tokens), not on prompt tokens: the same loss, fewer FLOPs (one compile per width bucket)
        "sampled_logits_only": True,
        "updates_per_batch": 1,  # PPO mini-batches: optimizer steps per rollout batch (proximal = weights before)
        # evaluation (held-out greedy) and the SFT warm start
        "eval_examples": 128, "eval_every": 0,
        "eval_samples": 1, "eval_temperature": 1.0,  # > 1: also pass@k (k = 1, 2, 4, … <= eval_samples) sampled
        # SFT warm start on the tasks' demonstrations before RL: steps (0 = none), demonstrations, batch, lr
        "sft_steps": 0, "sft_demos": 256, "sft_batch_size": 16, "sft_learning_rate": 3e-3,
        "sft_on_checkpoint": False,  # allow the warm start on top of init.hf_checkpoint / init.workdir
        "sft_off_format": 0.0,  # fraction of demonstrations written in a format the verifier rejects
        "sft_seq_len": 0,  # warm-start rows (demonstrations packed); 0 = 4 × rl.seq_len
    })


def _validate_rl(config: ml_collections.ConfigDict) -> None:
    from rlvr.tasks.mixture import expand

    rl = config.rl
    try:
        expand(rl.task)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _one_of(config, "rl.backend", ("embedded", "sglang"))
    _one_of(config, "rl.mode", ("sync", "async", "lockstep"))
    _one_of(config, "rl.prompt_format", ("", "raw", "chat"))
    _one_of(config, "rl.verifier_backend", ("local", "ray"))
    _existing_path(config, "rl.reward_model", "reward-model workdir (a job 'rm' run)")
    if rl.replay_capacity and not 0 < rl.replay_fraction < 1:
        raise ConfigError(f"rl.replay_fraction={rl.replay_fraction}: must be in (0, 1) when replay is on.")
    if rl.eval_samples < 1:
        raise ConfigError(f"rl.eval_samples={rl.eval_samples}: must be >= 1.")
    _validate_objective(config)
    if rl.agent and rl.backend != "embedded":
        raise ConfigError(f"rl.agent={rl.agent!r} needs rl.backend='embedded' (the agent's calls are recorded by "
                          "the in-process engine's OpenAI endpoint)")
    if rl.max_turns < 0:
        raise ConfigError(f"rl.max_turns={rl.max_turns}: must be >= 0 (0 = the environment's own limit).")
    if isinstance(rl.code_pool, bool) or not isinstance(rl.code_pool, int) or rl.code_pool < 0:
        raise ConfigError(f"rl.code_pool={rl.code_pool!r}: must be an integer >= 0 (warm sandboxes for code "
                          "verdicts; 0 = a fresh sandbox per verdict).")
    for path in ("rl.prompts_per_step", "rl.group_size", "rl.eval_examples", "rl.updates_per_batch",
                 "rl.episode_workers"):
        _positive(config, path)
    for path in ("rl.max_new_tokens", "rl.max_prompt_len", "rl.seq_len", "rl.engine.max_len", "rl.samples_per_step",
                 "rl.print_samples_every"):
        if _get(config, path) < 0:
            raise ConfigError(f"{path}={_get(config, path)}: must be >= 0 (0 = derived or inherited: "
                              "rlvr.budgets).")
    if rl.curriculum and not 0 <= rl.curriculum_band_low < rl.curriculum_band_high <= 1:
        raise ConfigError(f"rl.curriculum_band_low={rl.curriculum_band_low}, rl.curriculum_band_high="
                          f"{rl.curriculum_band_high}: need 0 <= low < high <= 1.")
    if rl.max_staleness < 0:
        raise ConfigError(f"rl.max_staleness={rl.max_staleness}: must be >= 0 (0 = synchronous).")
    if rl.backend == "sglang" and not rl.sglang_urls.strip() and not rl.sglang_router.strip():
        raise ConfigError("rl.backend='sglang' needs rl.sglang_urls (comma-separated server URLs) or rl.sglang_router "
                          "(an sglang-router URL).")
    if rl.seq_len and rl.engine.max_len and rl.seq_len > rl.engine.max_len:
        raise ConfigError(f"rl.seq_len={rl.seq_len} exceeds rl.engine.max_len={rl.engine.max_len}; raise "
                          "rl.engine.max_len (a multiple of rl.engine.page_size), or set it to 0 (derived).")
    if rl.seq_len and rl.max_new_tokens >= rl.seq_len:
        raise ConfigError(f"rl.max_new_tokens={rl.max_new_tokens} leaves no room for the prompt in "
                          f"rl.seq_len={rl.seq_len}; raise rl.seq_len.")
    _validate_rows(config)
    _validate_schedule(rl)
    _validate_engine(rl.engine)
    checkpoint = config.init.hf_checkpoint and "init.hf_checkpoint" or config.init.workdir and "init.workdir"
    if config.job == "rl" and rl.sft_steps and checkpoint and not rl.sft_on_checkpoint:
        raise ConfigError(f"rl.sft_steps={rl.sft_steps} would run an SFT warm start on demonstrations on top of "
                          f"{checkpoint}: set rl.sft_steps=0 to start RL from the checkpoint as it is, or "
                          "rl.sft_on_checkpoint=True to warm-start it first.")


def _validate_rows(config: ml_collections.ConfigDict) -> None:
    """rl.row_len and rl.share_prompts: what the packed train rows may hold."""
    rl = config.rl
    if rl.row_len < 0 or (rl.row_len and rl.seq_len and rl.row_len < rl.seq_len):
        raise ConfigError(f"rl.row_len={rl.row_len}: must be 0 (= rl.seq_len) or at least rl.seq_len={rl.seq_len} "
                          "(a whole rollout fits one row).")
    if rl.row_len and not rl.pack:
        raise ConfigError(f"rl.row_len={rl.row_len} sets the width of packed rows: set rl.pack=True, or rl.row_len=0.")
    if not rl.share_prompts:
        return
    wrong = [f"{path}={have!r} (needs {want!r})" for path, have, want in (
        ("rl.pack", rl.pack, True), ("rl.sampled_logits_only", rl.sampled_logits_only, True)) if have != want]
    if (config.model.get("attention") or "xla") not in SHARED_PROMPT_ATTENTION:
        wrong.append(f"model.attention={config.model.attention!r} (needs one of {SHARED_PROMPT_ATTENTION})")
    if rl.advantage == "gae":
        wrong.append("rl.advantage='gae' (a value head reads every position; needs another advantage)")
    if rl.teacher and rl.distill_estimator == "full":
        wrong.append("rl.distill_estimator='full' (needs 'sampled')")
    if config.model.get("vision"):
        wrong.append("model.vision is set (needs a text policy)")
    if wrong:
        raise ConfigError("rl.share_prompts=True lays a group's completions after one copy of its prompt, which "
                          f"needs: {'; '.join(wrong)}. Change those, or set rl.share_prompts=False.")


def _validate_objective(config: ml_collections.ConfigDict) -> None:
    """The algorithm's fields: known choices, sampling settings, and combinations that would train
    on something other than what they say (a KL penalty whose gradient is not the KL's, clip
    knobs that cannot act)."""
    from rlvr.rl.advantages import ADVANTAGE_FNS
    from rlvr.rl.batching import AGGREGATIONS
    from rlvr.rl.objective import PROXIMAL
    from rlvr.rl.policy_loss import KL_ESTIMATORS

    rl = config.rl
    _one_of(config, "rl.advantage", [*ADVANTAGE_FNS, "gae"])
    _one_of(config, "rl.policy_loss", ("ppo_clip", "gspo"))
    _one_of(config, "rl.aggregation", AGGREGATIONS)
    _one_of(config, "rl.kl_estimator", KL_ESTIMATORS)
    _one_of(config, "rl.kl_mode", ("loss", "reward"))
    _one_of(config, "rl.tis_level", ("token", "sequence"))
    _one_of(config, "rl.proximal", PROXIMAL)
    if not rl.temperature > 0 or not 0 < rl.top_p <= 1 or not 0 <= rl.min_p < 1 or rl.top_k == 0 or rl.top_k < -1:
        raise ConfigError(f"rl.temperature={rl.temperature}, rl.top_p={rl.top_p}, rl.top_k={rl.top_k}, rl.min_p="
                          f"{rl.min_p}: need temperature > 0, 0 < top_p <= 1, top_k = -1 (all) or >= 1, "
                          "0 <= min_p < 1.")
    if rl.group_size < 2 and rl.advantage in ("grpo", "dr_grpo", "rloo"):
        raise ConfigError(f"rl.advantage={rl.advantage!r} compares samples within a group: set rl.group_size >= 2.")
    if rl.policy_loss == "gspo" and rl.aggregation != "seq_mean_token_mean":
        raise ConfigError("rl.policy_loss='gspo' is a sequence-level loss: set rl.aggregation='seq_mean_token_mean'.")
    if rl.teacher and rl.advantage == "gae":
        raise ConfigError(f"rl.teacher={rl.teacher!r} gives per-token advantages, which GAE would replace: use a "
                          "group advantage (rl.advantage='grpo', 'rloo', ...) for on-policy distillation.")
    if rl.distill_estimator not in ("sampled", "full"):
        raise ConfigError(f"rl.distill_estimator={rl.distill_estimator!r}: use 'sampled' (the per-token advantage "
                          "on the sampled token) or 'full' (the full-vocabulary reverse KL in the loss).")
    if not rl.distill_teacher_temperature > 0:
        raise ConfigError(f"rl.distill_teacher_temperature={rl.distill_teacher_temperature}: must be > 0 (1 = the "
                          "teacher's own distribution, below 1 sharper).")
    if rl.teacher and rl.distill_estimator == "sampled" and rl.distill_teacher_temperature != 1.0:
        raise ConfigError(f"rl.distill_teacher_temperature={rl.distill_teacher_temperature} acts only with "
                          "rl.distill_estimator='full' (the KL to softmax(teacher logits / it)); the 'sampled' "
                          "estimator scores the sampled tokens under the rollouts' own sampling. Set "
                          "rl.distill_estimator='full', or rl.distill_teacher_temperature=1.0.")
    if rl.teacher and not rl.distill_coef > 0:
        raise ConfigError(f"rl.distill_coef={rl.distill_coef}: must be > 0 with rl.teacher set (or set rl.teacher='').")
    if rl.dual_clip and rl.dual_clip <= 1:
        raise ConfigError(f"rl.dual_clip={rl.dual_clip}: must be > 1 (or 0 to turn it off).")
    if rl.kl_mode == "reward" and rl.kl_coef and rl.kl_estimator != "k1":
        raise ConfigError(f"rl.kl_mode='reward' with rl.kl_estimator={rl.kl_estimator!r}: as a reward penalty only "
                          "k1 (log π/π_ref) gives the KL's gradient; set rl.kl_estimator='k1' (or rl.kl_mode='loss').")
    default = rl_config()
    inert = [f"rl.{k}={rl[k]}" for k in ("clip_low", "clip_high", "dual_clip", "gspo_clip_low", "gspo_clip_high")
             if rl[k] != default[k]]
    if inert and rl.updates_per_batch == 1 and rl.proximal == "current":
        raise ConfigError(f"{', '.join(inert)} never acts: with rl.updates_per_batch=1 and rl.proximal='current' the "
                          "policy ratio is 1. Set rl.proximal='behaviour' (clip against the policy that sampled the "
                          "batch) or rl.updates_per_batch > 1.")


ENGINE_DTYPES = ("float32", "bfloat16")


def _validate_engine(engine: ml_collections.ConfigDict) -> None:
    """The embedded engine's choices (a typo would otherwise fail deep in the engine's first call)."""
    from rlvr.rollout.engine import DECODE_ATTENTION, DECODE_MATMUL, SCHEDULE_POLICIES

    for field, value, choices in (("dtype", engine.dtype, ENGINE_DTYPES),
                                  ("kv_dtype", engine.kv_dtype, ("",) + ENGINE_DTYPES),
                                  ("decode_attention", engine.decode_attention, DECODE_ATTENTION),
                                  ("decode_matmul", engine.decode_matmul, DECODE_MATMUL),
                                  ("schedule_policy", engine.schedule_policy, SCHEDULE_POLICIES)):
        if value not in choices:
            raise ConfigError(f"rl.engine.{field}={value!r}: use one of {', '.join(map(repr, choices))}.")
    if engine.replicas < 1 or engine.max_slots % engine.replicas:
        raise ConfigError(f"rl.engine.replicas={engine.replicas}: must be >= 1 and divide rl.engine.max_slots="
                          f"{engine.max_slots} (each replica runs max_slots / replicas sequences).")


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
    _one_of(config, "eval.split", ("held_out", "train"))


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


def _validate_distill(config: ml_collections.ConfigDict) -> None:
    d = config.get("distill")
    if not d or not d.teacher:
        return
    _existing_path(config, "distill.teacher", "teacher directory")
    if config.job != "sft":
        raise ConfigError(f"distill.teacher={d.teacher!r} is logit distillation in SFT (job='sft'); for RL use "
                          "rl.teacher (on-policy distillation).")
    if d.top_k < 1 or not 0 < d.weight <= 1 or d.chunk_size < 1:
        raise ConfigError(f"distill.top_k={d.top_k}, distill.weight={d.weight}, distill.chunk_size={d.chunk_size}: "
                          "need top_k >= 1, 0 < weight <= 1 (1 = the teacher alone), chunk_size >= 1.")


def recorded_model(config: ml_collections.ConfigDict) -> ModelConfig:
    """The architecture a config writes out (`model.*` and `lora.*`): what a random-init job runs, and
    what a finished job ran, read from its resolved config (configs recorded before adapters existed
    have no `lora` section: full fine-tuning)."""
    return dataclasses.replace(ModelConfig.from_mapping(config.model),
                               lora=LoraConfig.from_mapping(config.get("lora")))


def _written_model(config: ml_collections.ConfigDict) -> ModelConfig:
    """`recorded_model` of a random-init config, its bad values a ConfigError."""
    if config.init.hf_checkpoint or config.init.workdir:
        raise ConfigError("init.* names a checkpoint whose architecture config_lib.validate does not read: "
                          "validate with rlvr.start.validate (it passes the checkpoint's architecture).")
    try:
        return recorded_model(config)
    except ValueError as e:  # a model.* or lora.* value ModelConfig refuses
        raise ConfigError(str(e)) from None


def validate(config: ml_collections.ConfigDict, num_devices: int, jobs: dict[str, Callable] | None = None,
             architecture: Callable[[ml_collections.ConfigDict], ModelConfig] | None = None) -> None:
    """Checks values before any compile. Raises ConfigError naming the field. `architecture` reads the
    model the job runs (`rlvr.start.model_config`: a starting checkpoint's; what `rlvr.start.validate`
    passes); None: the config's own `model.*` and `lora.*`, for a random-init config."""
    from rlvr import sharding  # local: keeps config files importable without jax set-up

    if jobs is not None:
        _one_of(config, "job", jobs)
    _existing_path(config, "init.hf_checkpoint", "checkpoint directory")
    _existing_path(config, "init.workdir", "workdir")
    _validate_distill(config)
    model = (architecture or _written_model)(config)  # the checkpoint's architecture when there is one
    try:
        mesh = sharding.mesh_shape_from_config(dict(config.mesh), num_devices)
        validate_attention_mesh(model, mesh)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for path in ("data.batch_size", "data.seq_len", "train.num_steps", "train.log_every",
                 "checkpoint.every_steps", "checkpoint.keep", "optimizer.learning_rate"):
        _positive(config, path)
    if config.optimizer.warmup_steps < 0:
        raise ConfigError(f"optimizer.warmup_steps={config.optimizer.warmup_steps}: must be >= 0.")
    _one_of(config, "optimizer.schedule", ("cosine", "linear", "constant"))
    _one_of(config, "train.wandb", ("", "offline", "online"))
    _one_of(config, "optimizer.name", ("adamw", "adafactor", "sgd"))
    _one_of(config, "data.source", ("arithmetic", "jsonl", "tfds"))
    _positive(config, "train.micro_batches")
    for path in ("compile.cache_min_compile_s", "compile.print_min_s"):
        if _get(config, path) < 0:
            raise ConfigError(f"{path}={_get(config, path)}: must be >= 0 (seconds).")
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
    _existing_path(config, "tokenizer.path", "tokenizer directory")
    if config.job in ("rl", "eval"):
        _validate_rl(config)
    if config.job == "eval":
        _validate_eval(config)
    if config.data.seq_len > model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={config.data.seq_len} exceeds model.max_position_embeddings="
            f"{model.max_position_embeddings}.")


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
