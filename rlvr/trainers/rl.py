"""Reinforcement learning with verifiable rewards (GRPO/PPO family), sync or async.

Read top to bottom:

  initial policy   an HF checkpoint, an rlvr workdir or random init (rlvr.start), optionally after
                   an SFT warm start on demonstrations (rl.sft_steps); its copy is the frozen
                   reference policy
  each step        producer: sample tasks → rollout (embedded engine or SGLang servers) →
                   verify → advantages (→ drop zero-variance groups and refill)
                   trainer:  batch (pad or pack) → jitted sharded step → weight sync →
                   metrics → checkpoint
  at the end       held-out greedy accuracy before and after RL, summary.json, rl_curve.png
  throughout       samples.jsonl: a few completions per step (and every evaluation's) with their
                   reward components (train ones also per-token log-probs, versions, loss mask and
                   the advantage: `python -m rlvr.explore WORKDIR` shows them), some printed

rl.mode = "sync" generates each batch with the current weights. rl.mode = "async" generates
on a background thread up to rl.max_staleness versions ahead, overlapping rollout with
training; a weight update mid-generation continues in-flight sequences on the new weights
(partial rollouts). max_staleness = 0 is the synchronous loop exactly. rl.mode = "lockstep" is
asynchronous RL with a fixed lag: before training step s, batch s + max_staleness is generated from
the weights of step s (on the trainer's thread), so every batch is exactly max_staleness versions old
whatever the timing: the mode that runs on several JAX processes (check_processes). It trains as
async does (the same lag) at the speed of sync (generation and training do not overlap).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlvr import api, compile_log, evaluation, observe, start
from rlvr.envs.sandboxes import close_shared_pools, pool_counters, use_code_pool
from rlvr.job import Job
from rlvr.launch.ray_workers import make_verifier_workers
from rlvr.models.config import LoraConfig
from rlvr.rl import backends
from rlvr.rl.batching import build_batch
from rlvr.rl.objective import sampling_of, token_means
from rlvr.rl.producer import Producer, ProducerSettings, ScoredBatch, load_moments, passed
from rlvr.rl.replay import ReplayBuffer
from rlvr.rl.update import PolicyUpdate, reference_logprobs_fn
from rlvr.tasks import build_tasks
from rlvr.tasks import graph as task_graph
from rlvr.tasks.curriculum import Curriculum
from rlvr.train import step as step_lib
from rlvr.train.checkpoint import Checkpointer
from rlvr.train.optimizer import build_optimizer, learning_rate_schedule
from rlvr.train.preemption import Preempted, PreemptionGuard
from rlvr.trainers.loop import policy_params, split_trained

# --- the initial policy ------------------------------------------------------------------------

def demonstrations(tasks, count: int, seed: int, off_format_fraction: float, prompt_format: str,
                   env_options: dict | None = None):
    """`count` SFT records from the demonstration stream (tasks without a reference are skipped).
    Multi-turn tasks give their scripted episode ({"messages", "tools"}, played through the
    environment); off-format, they answer directly without using a tool."""
    from rlvr.rl.producer import is_episode_task

    off_format = np.random.default_rng([seed, 2]).random(count) < off_format_fraction
    out, index = [], 0
    while len(out) < count:
        task = tasks.task(index, stream=2)
        index += 1
        family = tasks.family_of(task)
        if is_episode_task(task):
            record = family.demonstration_record(task, **(env_options or {}))
            if off_format[len(out)] and task.answer is not None:
                opening = list(itertools.takewhile(lambda m: m["role"] != "assistant", record["messages"]))
                record["messages"] = [*opening, {"role": "assistant", "content": f"<answer>{task.answer}</answer>"}]
            out.append(record)
            continue
        if family.reference_completion(task) is None:
            if index > 10 * count + 100:
                raise ValueError("rl.sft_steps: the families of rl.task have no reference answers to demonstrate")
            continue
        demo = tasks.demonstration(task, bool(off_format[len(out)]))
        if prompt_format == "chat":
            demo = {"messages": [*task.chat(), {"role": "assistant", "content": demo["completion"]}]}
        out.append(demo)
    return out


def warm_start(job: Job, tasks) -> str:
    """SFT on `rl.sft_demos` demonstrations into `workdir/sft` (resumable; skipped when done).
    Returns the SFT workdir. From a random init it trains every weight even for a LoRA run (whose
    frozen base is then this SFT model); from a checkpoint it trains what the RL run will."""
    from rlvr.trainers import sft

    config, rl = job.config, job.config.rl
    sft_dir = os.path.join(job.workdir, "sft")
    if os.path.exists(os.path.join(sft_dir, "summary.json")):
        return sft_dir
    os.makedirs(sft_dir, exist_ok=True)
    demos = os.path.join(sft_dir, "demos.jsonl")
    # every process writes the same file, then reads it: each through its own temporary name and an
    # atomic rename, so no process reads a file another one is still writing
    partial = f"{demos}.{jax.process_index()}.tmp"
    with open(partial, "w") as f:
        for demo in demonstrations(tasks, rl.sft_demos, config.seed, rl.sft_off_format, rl.prompt_format,
                                   rl.env.to_dict()):
            f.write(json.dumps(demo) + "\n")
    os.replace(partial, demos)
    c = ml_collections.ConfigDict(config.to_dict())
    c.job = "sft"
    c.data.source, c.data.path, c.data.eval_path = "jsonl", demos, ""
    c.data.batch_size, c.data.seq_len, c.data.pack = rl.sft_batch_size, rl.sft_seq_len or rl.seq_len * 4, True
    c.optimizer.learning_rate = rl.sft_learning_rate
    c.optimizer.warmup_steps = min(config.optimizer.warmup_steps, rl.sft_steps // 10)
    c.train.num_steps = rl.sft_steps
    c.train.log_every = max(rl.sft_steps // 4, 1)
    c.checkpoint.every_steps = rl.sft_steps
    model_cfg = job.model_cfg
    if job.source.kind == "random":  # adapters on a random base learn nothing: SFT trains every weight
        c.lora.rank, c.lora.quantize = 0, "none"
        model_cfg = dataclasses.replace(model_cfg, lora=LoraConfig())
    c.lock()
    print(f"warm start: SFT on {rl.sft_demos} demonstrations for {rl.sft_steps} steps -> {sft_dir}")
    start.write_workdir(c, sft_dir)
    sft.train(job.derive(c, sft_dir, model_cfg))
    return sft_dir


def initial_model(job: Job, tasks) -> tuple[api.Model, str]:
    """(the policy RL starts from, a pointer to it for the record and for resuming)."""
    if job.config.rl.sft_steps:
        sft_dir = warm_start(job, tasks)
        return job.build_model(start.Source("workdir", sft_dir)), f"rlvr-workdir:{sft_dir}"
    return job.build_model(), job.policy_pointer()


def build_backend(config: ml_collections.ConfigDict, model: api.Model, params, tokenizer, workdir: str,
                  version: int):
    rl = config.rl
    if rl.backend == "embedded":
        e = rl.engine
        return backends.EmbeddedBackend(model.cfg, params, tokenizer, version=version, max_slots=e.max_slots,
                                        max_len=e.max_len, page_size=e.page_size, decode_steps=e.decode_steps,
                                        prefill_rows=e.prefill_rows, prefill_chunk=e.prefill_chunk,
                                        dtype=e.dtype, kv_dtype=e.kv_dtype or None,
                                        decode_attention=e.decode_attention, decode_matmul=e.decode_matmul,
                                        schedule_policy=e.schedule_policy,
                                        replicas=e.replicas, seed=config.seed)
    urls = [u.strip() for u in rl.sglang_urls.split(",") if u.strip()]
    backend = backends.SGLangBackend(urls, model.cfg, os.path.join(workdir, "weights"),
                                     tokenizer_dir=config.tokenizer.path or None,
                                     router=rl.sglang_router.strip() or None)
    backend.update_weights(params, version)  # the servers start from the trainer's policy
    return backend


# --- evaluation ----------------------------------------------------------------------------------

def evaluate(backend, tasks, tokenizer, rl: ml_collections.ConfigDict, tag: str, seed: int = 0,
             records: list | None = None) -> dict[str, Any]:
    """Held-out evaluation on `rl.eval_examples` tasks (stratified over families): pass@1 greedy,
    or pass@k over `rl.eval_samples` samples; per family, level and domain (rlvr.evaluation).
    `records` receives every completion with its rewards."""
    return evaluation.evaluate_tasks(backend, tokenizer, tasks, tasks.held_out(rl.eval_examples),
                                     evaluation.EvalSettings.for_rl(rl), seed=seed, tag=f"eval-{tag}",
                                     make_env=env_factory(rl), records=records)


def env_factory(rl: ml_collections.ConfigDict, workdir: str | None = None):
    """task -> its environment (rlvr.envs.make_env with the config's `rl.env` options; environments that save
    files, such as the CAD kit's images, write them to WORKDIR/episode_images, next to episodes.jsonl)."""
    options = rl.env.to_dict()
    if workdir:
        options.setdefault("artifact_dir", os.path.join(workdir, "episode_images"))

    def make(task):
        from rlvr.envs import make_env

        return make_env(task, **options)
    return make


def _eval_point(step: int, result: dict[str, Any]) -> list:
    """[step, pass@1, value (any-format accuracy; = pass@1 when the family has none), per domain]."""
    overall = result["overall"]
    return [step, overall["pass@1"], overall.get("value", overall["pass@1"]),
            {d: agg["pass@1"] for d, agg in result["by_domain"].items()}]


# --- metrics -------------------------------------------------------------------------------------

def rollout_metrics(batch: ScoredBatch, version: int) -> dict[str, float]:
    """Reward (total and components), pass rates, lengths and staleness of one batch."""
    samples = batch.samples
    if not samples:  # every sample was an infrastructure failure: nothing was trained on
        return {"reward": float("nan"), "samples": 0.0, "failures": float(len(batch.failures)), **batch.stats}
    out: dict[str, float] = {}
    for key in sorted({k for s in samples for k in s.rewards}):  # components present in each family's samples
        out[f"reward/{key}" if key != "reward" else "reward"] = float(np.mean(
            [s.rewards[key] for s in samples if key in s.rewards]))
    correct = np.array([passed(s.rewards) for s in samples], np.float32)
    groups: dict[int, list[int]] = {}  # sample indices per group (groups cut by the scheduler are smaller)
    for i, s in enumerate(samples):
        groups.setdefault(s.group, []).append(i)
    out["pass_rate"] = float(correct.mean())
    for f in sorted({s.family for s in samples} - {""}):  # families present in this batch
        out[f"pass_rate/{f}"] = float(np.mean([c for c, s in zip(correct, samples, strict=True) if s.family == f]))
    out["pass_at_group"] = float(np.mean([correct[g].max() for g in groups.values()]))
    # groups whose samples all got the same reward: GRPO/RLOO give them zero advantage, no signal
    out["zero_variance_groups"] = float(np.mean([np.ptp([samples[i].rewards.get("reward", 0.0) for i in g]) == 0
                                                 for g in groups.values()]))
    out["samples"] = float(len(samples))
    out["response_length"] = float(np.mean([len(s.output_ids) for s in samples]))
    out["prompt_length"] = float(np.mean([len(s.prompt_ids) for s in samples]))
    out["truncated_fraction"] = float(np.mean([s.truncated for s in samples]))
    oldest = [min(s.versions) if s.versions else version for s in samples]
    out["staleness_mean"] = float(np.mean([version - v for v in oldest]))
    out["staleness_max"] = float(max(version - v for v in oldest))
    out["partial_rollout_fraction"] = float(np.mean([len(set(s.versions)) > 1 for s in samples]))
    out["failures"] = float(len(batch.failures))
    out.update(batch.stats)
    return out


def _spread(samples, count: int, gae: bool = False) -> list[dict[str, Any]]:
    """`count` samples of the batch, from different groups first, as SampleLog records (with GAE
    the advantage is per token, computed in the trainer: not recorded)."""
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    rounds = max((len(g) for g in groups.values()), default=0)
    chosen = [g[i] for i in range(rounds) for g in groups.values() if i < len(g)][:count]
    return [{"family": s.family, "level": s.level, "task_index": s.task_index, "prompt_ids": s.prompt_ids,
             "output_ids": s.output_ids, "rewards": s.rewards, "truncated": s.truncated,
             "behaviour_logp": s.behaviour_logp, "versions": s.versions, "loss_mask": s.loss_mask,
             "advantage": None if gae else s.advantage} for s in chosen]


def write_plot(workdir: str, history: list[dict[str, float]], evals: list[list]) -> str | None:
    """rl_curve.png: training reward per step and held-out accuracy at each evaluation (and,
    with several domains, a third panel: held-out pass rate per domain — capability balance)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    domains = sorted({d for e in evals for d in e[3]})
    fig, axes = plt.subplots(1, 3 if len(domains) > 1 else 2, figsize=(15 if len(domains) > 1 else 10, 3.6))
    left, right = axes[0], axes[1]
    left.plot([h["step"] for h in history], [h["reward"] for h in history], lw=1)
    left.set(xlabel="RL step", ylabel="mean training reward", title="reward")
    right.plot([e[0] for e in evals], [e[1] for e in evals], marker="o", label="exact (the reward)")
    right.plot([e[0] for e in evals], [e[2] for e in evals], marker=".", ls="--", label="value, any format")
    right.legend(loc="lower right")
    right.set(xlabel="RL step", ylabel="held-out greedy accuracy", title="held-out accuracy", ylim=(0, 1))
    if len(domains) > 1:
        for d in domains:
            points = [(e[0], e[3][d]) for e in evals if d in e[3]]
            axes[2].plot(*zip(*points, strict=True), marker=".", label=d)
        axes[2].legend(loc="best", fontsize=6, ncol=2)
        axes[2].set(xlabel="RL step", ylabel="held-out pass@1", title="per domain", ylim=(0, 1))
    fig.tight_layout()
    path = os.path.join(workdir, "rl_curve.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _record_value_head(workdir: str) -> None:
    """Marks model.value_head in the run's config.json, so `api.load_trained(workdir)` rebuilds
    the checkpoint's structure (policy + value head)."""
    path = os.path.join(workdir, "config.json")
    if observe.writes_shared_files() and os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
        recorded["model"]["value_head"] = True
        with open(path, "w") as f:
            json.dump(recorded, f, indent=2, sort_keys=True)


# --- the run -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    """What an RL run holds between steps: the policy's train state, the rollout backend, the
    producer and the update, and the record so far (checkpointed with the state)."""

    config: ml_collections.ConfigDict
    workdir: str
    tokenizer: Any
    tasks: Any
    model: api.Model
    reference_pointer: str  # the initial policy, for the record and for resuming
    base: Any = None  # a LoRA policy's frozen base (the state trains its adapters); None otherwise
    optimizer: Any = None
    checkpoints: Checkpointer | None = None
    state: Any = None
    start: int = 0  # the first RL step to run (> 0 when resuming)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # restored non-array state
    backend: Any = None
    producer: Producer | None = None
    update: PolicyUpdate | None = None
    curriculum: Curriculum | None = None
    agent: Any = None
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    evals: list[list] = dataclasses.field(default_factory=list)  # [step, pass@1, value, {domain: pass@1}]
    eval_details: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    samples_log: observe.SampleLog | None = None  # samples.jsonl: completions with their rewards
    prompts_too_long: float = 0.0  # tasks skipped so far: prompt longer than rl.max_prompt_len
    compiles: compile_log.CompileLog | None = None  # every XLA compile of the job (workdir/compile.jsonl)

    def evaluate(self, step: int, tag: str) -> None:
        records: list[dict[str, Any]] = []
        rl = self.config.rl
        result = evaluate(self.backend, self.tasks, self.tokenizer, rl, tag, self.config.seed, records)
        self.samples_log.write(step, f"eval-{tag}", records)
        if result["skipped_too_long"]:
            print(f"WARNING: evaluation {tag}: {result['skipped_too_long']} held-out prompts are longer than "
                  f"rl.max_prompt_len={rl.max_prompt_len} and were left out (rl.max_prompt_len=0 fits them all)")
        self.evals.append(_eval_point(step, result))
        self.eval_details.append({"step": step, **result})

    def policy_params(self):
        """The whole policy: the state's params, with a LoRA policy's frozen base."""
        return policy_params(self.state["params"], self.base)

    def extra_state(self) -> dict[str, Any]:
        record = {"lora_base": self.reference_pointer} if self.base is not None else {}
        return {"producer": self.producer.state(), "reference": self.reference_pointer, "history": self.history,
                "evals": self.evals, "eval_details": self.eval_details, **record}

    def row_multiple(self) -> int:
        """Train rows are a multiple of this: data shards × micro-batches × mini-batches."""
        mesh = dict(self.model.mesh.shape)
        return (mesh.get("data", 1) * mesh.get("fsdp", 1) * self.config.train.micro_batches
                * self.config.rl.updates_per_batch)

    def log_samples(self, step: int, batch: ScoredBatch, record: dict[str, float]) -> None:
        """A few of the batch's completions to samples.jsonl (two printed on schedule); a loud line
        when tasks were skipped as too long."""
        rl = self.config.rl
        show = 2 if step == self.start + 1 or (rl.print_samples_every and step % rl.print_samples_every == 0) else 0
        self.samples_log.write(step, "train", _spread(batch.samples, rl.samples_per_step, rl.advantage == "gae"), show)
        skipped, before = record.get("prompts_too_long", 0.0), self.prompts_too_long
        self.prompts_too_long = max(skipped, before)
        if skipped > before:
            print(f"WARNING: step {step}: {int(skipped - before)} prompts of rl.task were longer than "
                  f"rl.max_prompt_len={rl.max_prompt_len} and were skipped ({int(skipped)} so far; "
                  "rl.max_prompt_len=0 fits every measured prompt)")

    def close(self) -> None:
        if self.samples_log is not None:
            self.samples_log.close()
        if self.producer is not None:
            self.producer.stop()
        use_code_pool(0)  # code verdicts in this process go back to fresh sandboxes,
        close_shared_pools()  # and the run's warm sandboxes (code, CAD, episodes) close with it
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.agent is not None:
            self.agent.close()
        if self.backend is not None:
            self.backend.close()


def train(job: Job) -> dict[str, Any]:
    """The RL job (see the module docstring; `job`: resolved by `rlvr.job.resolve`): start (or
    resume) the run, train, summarise."""
    wall_start = time.perf_counter()
    config, workdir = job.config, job.workdir
    check_processes(config.rl, jax.process_count())
    compile_log.enable_cache(config.compile.cache_dir, config.compile.cache_min_compile_s)
    with compile_log.CompileLog(workdir, config.compile.print_min_s) as compiles:
        run = start_run(job)
        run.compiles = compiles
        try:  # from here on, any failure (evaluation included) closes the backend and producer
            preempted_at = run_steps(run)
        finally:
            run.close()
    if preempted_at is not None:
        raise Preempted(preempted_at, run.checkpoints.directory)
    return write_summary(run, time.perf_counter() - wall_start)


def check_processes(rl: ml_collections.ConfigDict, processes: int) -> None:
    """Several JAX processes (a multi-host job) run the rollout SPMD: each drives the same embedded
    engine over the global mesh, so every process must take the same host-side decisions in the same
    order. Synchronous and lockstep rollout do (tests/test_multihost.py: the one-process result). Async
    mode cannot, by construction: where a weight update lands in a generation (which decode step, which
    tokens get the new version) and how far the producer runs ahead depend on each process's own timing,
    so the processes' engines would run different programs; and its producer thread launches engine
    collectives while the main thread launches training ones, in an order no process agrees on: it is
    refused in favour of rl.mode='lockstep' (the same off-policy lag, fixed by step count). SGLang
    answers and time-based scheduling depend on timing too, and so do free-running episode threads and
    a black-box agent (rl.agent: it calls the engine on its own schedule): multi-turn episodes run in
    rounds (rl.deterministic_rollout, which rlvr.main sets on several processes; without it a 2-process
    agentic run built different batches on its two processes and JAX's device_put check stopped it).
    All are refused; raises api.ConfigError naming the setting and what to use instead."""
    if processes == 1:
        return
    refused = {"rl.mode='async'": rl.mode == "async", "rl.backend='sglang'": rl.backend == "sglang",
               "rl.schedule.lag_factor > 0": rl.schedule.lag_factor > 0,
               "rl.schedule.deadline_s > 0": rl.schedule.deadline_s > 0,
               "rl.deterministic_rollout=False": not rl.deterministic_rollout, "rl.agent": bool(rl.agent)}
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise api.ConfigError(f"{', '.join(bad)} with {processes} JAX processes: every process drives the same "
                              "embedded engine, so all must take identical rollout decisions, which a background "
                              "producer, remote servers or a clock cannot guarantee. On several hosts use "
                              "rl.mode='sync' or rl.mode='lockstep' (asynchronous RL with a lag of exactly "
                              "rl.max_staleness steps), rl.backend='embedded', rl.deterministic_rollout=True, "
                              "rl.schedule.lag_factor=0 and deadline_s=0, and no rl.agent; or run the trainer as "
                              "one JAX process (one host) with rl.backend='sglang' and SGLang servers on the other "
                              "machines (docs/how-to/launch-on-a-pod.md, 'Running across hosts').")


def start_run(job: Job) -> Run:
    """The initial policy, its train state (restored from the latest checkpoint when resuming) and
    frozen reference, the rollout backend on the current weights, the producer and the update."""
    config, workdir, tokenizer = job.config, job.workdir, job.tokenizer
    tasks = build_tasks(config.rl, config.seed)
    model, reference_pointer = initial_model(job, tasks)
    if config.rl.advantage == "gae":
        model = api.with_value_head(model)
        _record_value_head(workdir)
    run = Run(config, workdir, tokenizer, tasks, model, reference_pointer)
    run.samples_log = observe.SampleLog(workdir, tokenizer)
    ref_params = restore_or_init_state(run)
    run.backend = build_backend(config, model, run.policy_params(), tokenizer, workdir, version=run.start)
    rl, steps = config.rl, config.train.num_steps * config.rl.updates_per_batch
    teacher_cfg, teacher = (api.load_teacher(rl.teacher, model.mesh, tokenizer.vocab_size, step=rl.teacher_step)
                            if rl.teacher else (None, None))
    sampled = teacher is not None and rl.distill_estimator == "sampled"
    run.producer = build_producer(run, ref_params, (teacher_cfg, teacher) if sampled else None)
    # The reference runs inside the step for a KL loss term, or (rl.reference_model) to report the KL;
    # the teacher for the full-vocabulary distillation term.
    frozen = {}
    if ref_params is not None and (rl.kl_mode == "loss" or rl.reference_model):
        frozen["ref"] = ref_params
    if teacher is not None and rl.distill_estimator == "full":
        frozen["teacher"] = teacher
    shardings = step_lib.state_shardings(model.cfg, run.optimizer, model.mesh)
    run.update = PolicyUpdate(config, model, run.optimizer, shardings, frozen or None,
                              learning_rate_schedule(config.optimizer, steps), base=run.base, teacher_cfg=teacher_cfg)
    return run


def restore_or_init_state(run: Run):
    """Sets the run's optimizer, checkpointer and train state (restored when resuming, with the
    record so far); returns the frozen reference params (None when no KL is used or reported): a copy
    of the initial policy, or a LoRA policy's frozen base (no copy)."""
    config, model, rl = run.config, run.model, run.config.rl
    updates = rl.updates_per_batch
    run.optimizer = build_optimizer(config.optimizer, config.train.num_steps * updates)  # a step per mini-batch
    shardings = step_lib.state_shardings(model.cfg, run.optimizer, model.mesh)
    use_ref = rl.reference_model or rl.kl_coef > 0
    trained, run.base = split_trained(model)
    ref_params = None
    if use_ref:
        ref_params = run.base if run.base is not None else jax.tree.map(jnp.copy, model.params)
    run.checkpoints = Checkpointer(os.path.join(run.workdir, "checkpoints"), config.checkpoint.keep,
                                   config.checkpoint.async_save)
    if config.checkpoint.resume and run.checkpoints.latest_step() is not None:
        run.state, run.extra = run.checkpoints.restore(step_lib.abstract_state(model.cfg, run.optimizer, shardings))
        print(f"resumed from step {int(run.state['step']) // updates} ({run.checkpoints.directory})")
        for log in ("metrics.jsonl", "samples.jsonl"):
            observe.drop_metrics_after(run.workdir, int(run.state["step"]) // updates, log)
    else:
        run.state = step_lib.init_state(trained, run.optimizer, shardings)
    model.params = trained = None  # owned (and donated) by `state`
    run.start = int(run.state["step"]) // updates
    run.history = run.extra.get("history", [])
    # (checkpoints from before per-domain evaluation have no domain dict)
    run.evals = [[*e, {}][:4] for e in run.extra.get("evals", [])]
    run.eval_details = run.extra.get("eval_details", [])
    return ref_params


def build_producer(run: Run, ref_params, teacher=None) -> Producer:
    """The producer (and what it draws on: curriculum, replay buffer, reward model, black-box
    agent), resumed at the checkpointed task-stream position with the untrained batches.
    `teacher`: (ModelConfig, params) scoring each sampled token (rl.distill_estimator="sampled")."""
    config, rl = run.config, run.config.rl
    producer_state = run.extra.get("producer", {"cursor": 0, "buffered": []})
    reward_model = None
    if rl.reward_model:
        from rlvr.rewards.reward_model import RewardModel

        reward_model = RewardModel.from_workdir(rl.reward_model)
        load_moments(reward_model, producer_state.get("reward_model_moments"))
    ref_fn = None
    if rl.kl_mode == "reward" and ref_params is not None:
        ref_fn = reference_logprobs_fn(run.model.cfg, ref_params, rl.seq_len, run.tokenizer.pad_id, sampling_of(rl),
                                       config.train.logprob_chunk_size)
    teacher_fn = None
    if teacher is not None:
        teacher_fn = reference_logprobs_fn(*teacher, rl.seq_len, run.tokenizer.pad_id,
                                           sampling_of(rl), config.train.logprob_chunk_size)
    if rl.curriculum:
        run.curriculum = Curriculum(run.tasks.levels(), mixture=run.tasks.weights,
                                    band=(rl.curriculum_band_low, rl.curriculum_band_high), floor=rl.curriculum_floor,
                                    min_samples=rl.curriculum_min_samples, seed=config.seed,
                                    prerequisites=task_graph.prerequisites(run.tasks.names),
                                    threshold=rl.prerequisite_threshold)
        if producer_state.get("curriculum"):
            run.curriculum.load_state(producer_state["curriculum"])
    replay = None
    if rl.replay_capacity:
        replay = ReplayBuffer(rl.replay_capacity, rl.replay_max_pass_rate, rl.replay_max_uses, config.seed)
        if producer_state.get("replay"):
            replay.load_state(producer_state["replay"])
    if rl.agent:
        from rlvr.envs.agent import AgentRunner, load_agent

        run.agent = AgentRunner(run.backend.driver, load_agent(rl.agent, rl.agent_options.to_dict()),
                                lambda task, answer: run.tasks.score(task, answer, False), rl.agent_timeout_s)
    use_code_pool(rl.code_pool)  # code verdicts on a warm sandbox pool (this process; Ray actors: ScoringActor)
    verifiers = make_verifier_workers(rl.verifier_backend, max(1, rl.verifier_workers), rl, config.seed,
                                      rl.verifier_address, tasks=run.tasks)
    return Producer(run.backend, run.tasks, run.tokenizer, ProducerSettings.from_config(rl), config.seed,
                    cursor=producer_state["cursor"],
                    buffered=[ScoredBatch.from_json(b) for b in producer_state["buffered"]], ref_logprobs=ref_fn,
                    curriculum=run.curriculum, replay=replay, reward_model=reward_model,
                    episode_log=os.path.join(run.workdir, "episodes.jsonl"), make_env=env_factory(rl, run.workdir),
                    agent=run.agent, verifiers=verifiers, teacher_logprobs=teacher_fn)


def run_steps(run: Run) -> int | None:
    """Held-out evaluation before RL, then each step (`one_step`) with evaluation and checkpoints
    on their schedules. Returns the step a preemption request stopped the run at (None when done)."""
    config, rl, num_steps = run.config, run.config.rl, run.config.train.num_steps
    writer = observe.MetricsWriter.for_config(run.workdir, config.train)
    failures_log = observe.open_log(os.path.join(run.workdir, "failures.jsonl"))
    progress = observe.Progress(num_steps, run.start)
    guard = PreemptionGuard().__enter__()
    try:
        if not run.evals:
            run.evaluate(0, "before")
            print(f"held-out accuracy before RL: {run.evals[0][1]:.3f}")
        if rl.mode == "async":
            run.producer.start(run.start, num_steps, version=run.start)
        for step in range(run.start, num_steps):
            record, batch = one_step(run, step)
            for failure in batch.failures:
                failures_log.write(json.dumps({"step": step, **failure}) + "\n")
            failures_log.flush()
            done = step + 1
            if rl.eval_every and done % rl.eval_every == 0 and done != num_steps:
                run.evaluate(done, f"s{done}")
                record["heldout_accuracy"] = run.evals[-1][1]
                record.update({f"heldout/{d}": v for d, v in run.evals[-1][3].items()})
            run.history.append({"step": done, "reward": record["reward"]})
            writer.write(done, record)
            run.log_samples(done, batch, record)
            if done % config.train.log_every == 0 or done == num_steps or done == run.start + 1:
                progress.update(done, {"reward": record["reward"], "acc": run.evals[-1][1],
                                       "stale": record.get("staleness_max", 0.0)})
            if done % config.checkpoint.every_steps == 0 or done == num_steps:
                if done == num_steps:
                    run.evaluate(done, "after")
                run.checkpoints.save(done, run.state, run.extra_state(), force=True)
            if done < num_steps and guard.should_stop():
                # async: let the batch being generated finish (bounded), so it is saved, not regenerated
                run.producer.drain(config.checkpoint.preemption_grace_s)
                run.checkpoints.save_now(done, run.state, run.extra_state())
                return done
        progress.close()
        return None
    finally:
        guard.__exit__()
        writer.close()
        failures_log.close()


def one_step(run: Run, step: int) -> tuple[dict[str, float], ScoredBatch]:
    """A scored batch (waiting for the producer) -> train batch -> policy update -> weight sync.
    Returns the step's metrics and the scored batch."""
    rl, t0 = run.config.rl, time.perf_counter()
    compiled_before = run.compiles.mark() if run.compiles else 0
    if rl.mode == "lockstep":
        run.producer.fill_ahead(step, run.config.train.num_steps)
    batch = run.producer.next_batch(step)
    t1 = time.perf_counter()
    arrays = build_batch(batch.samples, rl.seq_len, run.tokenizer.pad_id, rl.aggregation, rl.max_new_tokens,
                         rl.pack, run.row_multiple(), min_rows=rl.prompts_per_step * rl.group_size,
                         vision=run.model.cfg.vision, trim=rl.trim_columns, sampled_logits_only=rl.sampled_logits_only,
                         share_prompts=rl.share_prompts, row_len=rl.row_len)
    run.state, metrics = run.update(run.state, arrays, batch.samples, step)
    t2 = time.perf_counter()
    run.backend.update_weights(run.policy_params(), step + 1)
    run.producer.set_version(step + 1)
    t3 = time.perf_counter()
    record = {**rollout_metrics(batch, step), **token_means(metrics)}
    record.update(wait_for_rollout_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2, step_s=t3 - t0,
                  rows=float(arrays["tokens"].shape[0]),  # the compiled shape's, and those holding tokens:
                  rows_used=float(np.count_nonzero(arrays["segment_ids"].any(axis=1))),
                  row_tokens=float(np.count_nonzero(arrays["segment_ids"])))  # tokens the train passes run
    if run.compiles:  # compile + lowering seconds within this step (its share of step_s)
        record["compile_s"] = run.compiles.seconds_since(compiled_before)
    record["util/trainer"] = (t3 - t1) / max(t3 - t0, 1e-9)  # busy share: not waiting for rollouts
    record.update(run.backend.health())  # dead servers and rerouted requests
    record.update(pool_counters())  # dead sandboxes and re-run tasks
    return record, batch


def write_summary(run: Run, wall_s: float) -> dict[str, Any]:
    """summary.json (held-out accuracy before and after, per domain, the curriculum's report) and
    rl_curve.png; prints the result."""
    config, evals, details, num_steps = run.config, run.evals, run.eval_details, run.config.train.num_steps
    hosts = run.producer.hosts  # this process's share of the task stream and of the verifying
    print(hosts.report())
    if evals[-1][0] != num_steps:  # resumed after the final step was already saved
        raise RuntimeError("final evaluation missing from the last checkpoint")
    before, after = evals[0][1], evals[-1][1]
    last = run.history[-10:]
    summary = {"job": "rl", "seed": config.seed, "final_step": num_steps, "mode": config.rl.mode,
               "advantage": config.rl.advantage, "policy_loss": config.rl.policy_loss,
               "heldout_accuracy_before": before, "heldout_accuracy_after": after,
               "improvement_points": round(100 * (after - before), 2),
               "heldout_value_accuracy_before": evals[0][2], "heldout_value_accuracy_after": evals[-1][2],
               "final_reward_mean_last10": float(np.mean([h["reward"] for h in last])) if last else None,
               "evals": [e[:3] for e in evals], "wall_s": round(wall_s, 1),
               "reference": run.reference_pointer, "families": len(run.tasks.names),
               "balance": evaluation.balance_report([(e[0], e[3]) for e in evals]),
               "prompts_too_long": int(run.prompts_too_long), "eval_final": details[-1],
               "host_share": {"process": hosts.process, "processes": hosts.processes, "tasks_read": hosts.tasks_read,
                              "completions_verified": hosts.completions_verified}}
    if "tool_use" in details[0]["overall"]:  # multi-turn tool tasks: the share of episodes using a tool
        summary["heldout_tool_use_before"] = details[0]["overall"]["tool_use"]
        summary["heldout_tool_use_after"] = details[-1]["overall"]["tool_use"]
    if run.curriculum is not None:
        summary["curriculum"] = run.curriculum.report()
    if run.compiles is not None:
        summary.update(run.compiles.summary())
    plot = write_plot(run.workdir, run.history, evals)
    if plot:
        summary["plot"] = plot
    with observe.open_log(os.path.join(run.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"held-out accuracy: before RL {before:.3f} -> after RL {after:.3f} "
          f"({summary['improvement_points']:+.1f} points)")
    if len(run.tasks.names) > 1:
        print(evaluation.table(details[-1], "by_domain"))
        if summary["balance"]["crowded_out"]:
            print(f"capability balance: crowded out during training: {summary['balance']['crowded_out']}")
    print("summary: " + json.dumps({k: v for k, v in summary.items() if k not in ("evals", "eval_final")}))
    return summary
