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
                   reward components, some printed

rl.mode = "sync" generates each batch with the current weights. rl.mode = "async" generates
on a background thread up to rl.max_staleness versions ahead, overlapping rollout with
training; a weight update mid-generation continues in-flight sequences on the new weights
(partial rollouts). max_staleness = 0 is the synchronous loop exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlvr import api, evaluation, observe, start
from rlvr.envs.sandboxes import pool_counters
from rlvr.rl import backends
from rlvr.rl.batching import build_batch
from rlvr.rl.objective import Objective, rl_loss, token_means
from rlvr.rl.producer import Producer, ScoredBatch, load_moments, passed
from rlvr.rl.replay import ReplayBuffer
from rlvr.tasks import build_tasks
from rlvr.tasks import graph as task_graph
from rlvr.tasks.curriculum import Curriculum
from rlvr.train import step as step_lib
from rlvr.train.checkpoint import Checkpointer
from rlvr.train.optimizer import build_optimizer, learning_rate_schedule
from rlvr.train.preemption import Preempted, PreemptionGuard

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


def warm_start(config: ml_collections.ConfigDict, workdir: str, tasks) -> str:
    """SFT on `rl.sft_demos` demonstrations into `workdir/sft` (resumable; skipped when done).
    Returns the SFT workdir."""
    from rlvr.trainers import sft

    rl = config.rl
    sft_dir = os.path.join(workdir, "sft")
    if os.path.exists(os.path.join(sft_dir, "summary.json")):
        return sft_dir
    os.makedirs(sft_dir, exist_ok=True)
    demos = os.path.join(sft_dir, "demos.jsonl")
    with open(demos, "w") as f:
        for demo in demonstrations(tasks, rl.sft_demos, config.seed, rl.sft_off_format, rl.prompt_format,
                                   rl.env.to_dict()):
            f.write(json.dumps(demo) + "\n")
    c = ml_collections.ConfigDict(config.to_dict())
    c.job = "sft"
    c.data.source, c.data.path, c.data.eval_path = "jsonl", demos, ""
    c.data.batch_size, c.data.seq_len, c.data.pack = rl.sft_batch_size, rl.sft_seq_len or rl.seq_len * 4, True
    c.optimizer.learning_rate = rl.sft_learning_rate
    c.optimizer.warmup_steps = min(config.optimizer.warmup_steps, rl.sft_steps // 10)
    c.train.num_steps = rl.sft_steps
    c.train.log_every = max(rl.sft_steps // 4, 1)
    c.checkpoint.every_steps = rl.sft_steps
    print(f"warm start: SFT on {rl.sft_demos} demonstrations for {rl.sft_steps} steps -> {sft_dir}")
    start.write_workdir(c, sft_dir)
    sft.train(c, sft_dir)
    return sft_dir


def initial_model(config: ml_collections.ConfigDict, workdir: str, tasks) -> tuple[api.Model, str]:
    """(the policy RL starts from, a pointer to it for the record and for resuming)."""
    if config.rl.sft_steps:
        sft_dir = warm_start(config, workdir, tasks)
        return api.load_trained(sft_dir), f"rlvr-workdir:{sft_dir}"
    return api.build_model(config), policy_pointer(config)


def policy_pointer(config: ml_collections.ConfigDict) -> str:
    """Where the policy came from, for the record: rlvr-workdir:DIR, an HF directory, or random-init."""
    src = start.source(config)
    return {"workdir": f"rlvr-workdir:{src.path}", "hf": src.path}.get(src.kind, f"random-init:seed={config.seed}")


def build_backend(config: ml_collections.ConfigDict, model: api.Model, params, tokenizer, workdir: str,
                  version: int):
    rl = config.rl
    if rl.backend == "embedded":
        e = rl.engine
        return backends.EmbeddedBackend(model.cfg, params, tokenizer, version=version, max_slots=e.max_slots,
                                        max_len=e.max_len, page_size=e.page_size, decode_steps=e.decode_steps,
                                        prefill_rows=e.prefill_rows, prefill_chunk=e.prefill_chunk,
                                        seed=config.seed)
    urls = [u.strip() for u in rl.sglang_urls.split(",") if u.strip()]
    backend = backends.SGLangBackend(urls, model.cfg, os.path.join(workdir, "weights"),
                                     tokenizer_dir=config.tokenizer.path or None)
    backend.update_weights(params, version)  # the servers start from the trainer's policy
    return backend


def build_objective(rl: ml_collections.ConfigDict) -> Objective:
    gspo = rl.policy_loss == "gspo"
    return Objective(policy_loss=rl.policy_loss,
                     clip_low=rl.gspo_clip_low if gspo else rl.clip_low,
                     clip_high=rl.gspo_clip_high if gspo else rl.clip_high,
                     dual_clip=rl.dual_clip or None, kl_coef=rl.kl_coef if rl.kl_mode == "loss" else 0.0,
                     kl_estimator=rl.kl_estimator, entropy_coef=rl.entropy_coef, tis_cap=rl.tis_cap,
                     tis_level=rl.tis_level, num_seqs=rl.prompts_per_step * rl.group_size,
                     value_coef=rl.value_coef if rl.advantage == "gae" else 0.0, value_clip=rl.value_clip or None)


# --- evaluation ----------------------------------------------------------------------------------

def evaluate(backend, tasks, tokenizer, rl: ml_collections.ConfigDict, tag: str, seed: int = 0,
             records: list | None = None) -> dict[str, Any]:
    """Held-out evaluation on `rl.eval_examples` tasks (stratified over families): pass@1 greedy,
    or pass@k over `rl.eval_samples` samples; per family, level and domain (rlvr.evaluation)."""
    return evaluation.evaluate_tasks(backend, tokenizer, tasks, tasks.held_out(rl.eval_examples),
                                     max_new_tokens=rl.max_new_tokens, samples=rl.eval_samples,
                                     temperature=rl.eval_temperature, prompt_format=rl.prompt_format,
                                     seed=seed, tag=f"eval-{tag}", max_len=rl.seq_len, make_env=env_factory(rl),
                                     max_turns=rl.max_turns, episode_workers=rl.episode_workers, records=records)


def env_factory(rl: ml_collections.ConfigDict):
    """task -> its environment (rlvr.envs.make_env with the config's `rl.env` options)."""
    options = rl.env.to_dict()

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

def _spread(samples, count: int) -> list[dict[str, Any]]:
    """`count` samples of the batch, from different groups first, as SampleLog records."""
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    rounds = max((len(g) for g in groups.values()), default=0)
    chosen = [g[i] for i in range(rounds) for g in groups.values() if i < len(g)][:count]
    return [{"family": s.family, "level": s.level, "task_index": s.task_index, "prompt_ids": s.prompt_ids,
             "output_ids": s.output_ids, "rewards": s.rewards, "truncated": s.truncated} for s in chosen]


def rollout_metrics(batch: ScoredBatch, version: int) -> dict[str, float]:
    """Reward (total and components), pass rates, lengths and staleness of one batch."""
    samples = batch.samples
    out: dict[str, float] = {}
    for key in sorted({k for s in samples for k in s.rewards}):  # components present in each family's samples
        out[f"reward/{key}" if key != "reward" else "reward"] = float(np.mean(
            [s.rewards[key] for s in samples if key in s.rewards]))
    correct = np.array([passed(s.rewards) for s in samples], np.float32)
    by_group: dict[int, list[float]] = {}
    for c, s in zip(correct, samples, strict=True):  # groups cut by the scheduler are smaller
        by_group.setdefault(s.group, []).append(c)
    out["pass_rate"] = float(correct.mean())
    for f in sorted({s.family for s in samples} - {""}):  # families present in this batch
        out[f"pass_rate/{f}"] = float(np.mean([c for c, s in zip(correct, samples, strict=True) if s.family == f]))
    out["pass_at_group"] = float(np.mean([max(g) for g in by_group.values()]))
    out["samples"] = float(len(samples))
    out["response_length"] = float(np.mean([len(s.output_ids) for s in samples]))
    out["truncated_fraction"] = float(np.mean([s.truncated for s in samples]))
    oldest = [min(s.versions) if s.versions else version for s in samples]
    out["staleness_mean"] = float(np.mean([version - v for v in oldest]))
    out["staleness_max"] = float(max(version - v for v in oldest))
    out["partial_rollout_fraction"] = float(np.mean([len(set(s.versions)) > 1 for s in samples]))
    out["failures"] = float(len(batch.failures))
    out.update(batch.stats)
    return out


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


# --- the loop ------------------------------------------------------------------------------------

def _ref_logprobs_fn(cfg, ref_params, rl, pad_id: int):
    """samples -> per-token reference log-probs of their outputs (for rl.kl_mode="reward")."""
    logprobs = _logprobs_fn(cfg)

    def fn(samples):
        lp = logprobs(ref_params, build_batch(samples, rl.seq_len, pad_id))
        return [lp[i, len(s.prompt_ids): len(s.prompt_ids) + len(s.output_ids)] for i, s in enumerate(samples)]
    return fn


def _logprobs_fn(cfg):
    """(params, batch) -> the policy's log-prob of every token [B, T] (0 at position 0), aligned
    like behaviour_logp: the proximal policy of PPO mini-batch updates."""
    from rlvr import losses
    from rlvr.models.transformer import forward

    @jax.jit
    def logprobs(params, tokens, positions, segment_ids):
        logits, _ = forward(cfg, params, tokens, positions, segment_ids)
        lp = losses.next_token_logprobs(logits, tokens)
        return jnp.pad(lp, ((0, 0), (1, 0)))

    return lambda params, b: np.asarray(logprobs(params, b["tokens"], b["positions"], b["segment_ids"]))


def _record_value_head(workdir: str) -> None:
    """Marks model.value_head in the run's config.json, so `api.load_trained(workdir)` rebuilds
    the checkpoint's structure (policy + value head)."""
    path = os.path.join(workdir, "config.json")
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
        recorded["model"]["value_head"] = True
        with open(path, "w") as f:
            json.dump(recorded, f, indent=2, sort_keys=True)


def _gae_fn(cfg, rl):
    """(params, batch) -> batch with per-token GAE advantages (whitened over tokens), returns and
    old values: the reward sits on each sequence's last sampled token, values come from the
    value head before the update."""
    from rlvr import losses
    from rlvr.models.transformer import forward_with_values
    from rlvr.rl.advantages import gae

    @jax.jit
    def compute(params, tokens, positions, segment_ids, loss_mask, final_reward):
        _, values, _ = forward_with_values(cfg, params, tokens, positions, segment_ids)
        mask = losses.target_mask(loss_mask, segment_ids).astype(jnp.float32)
        values = values[:, :-1]
        adv, returns = gae(final_reward[:, 1:], values, mask, rl.gae_gamma, rl.gae_lambda)
        mean = jnp.sum(adv * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        std = jnp.sqrt(jnp.sum(jnp.square(adv - mean) * mask) / jnp.maximum(jnp.sum(mask), 1.0))
        adv = (adv - mean) / (std + 1e-6) * mask
        pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
        return pad(adv), pad(returns), pad(values * mask)

    def fn(params, arrays, samples):
        final_reward = np.zeros_like(arrays["advantages"])
        rows, cols = np.nonzero(arrays["loss_mask"])  # row-major: a sequence's sampled tokens in order
        seqs = arrays["seq_index"][rows, cols]
        _, from_end = np.unique(seqs[::-1], return_index=True)
        last = len(seqs) - 1 - from_end  # each sequence's last sampled token (multi-turn: of its last turn)
        final_reward[rows[last], cols[last]] = [samples[i].rewards["reward"] for i in seqs[last]]
        adv, returns, old_values = compute(params, arrays["tokens"], arrays["positions"], arrays["segment_ids"],
                                           arrays["loss_mask"], final_reward)
        return {**arrays, "advantages": np.asarray(adv), "returns": np.asarray(returns),
                "old_values": np.asarray(old_values)}
    return fn


def _mini_batches(arrays: dict[str, np.ndarray], count: int, rng: np.random.Generator):
    """`count` equal mini-batches of shuffled rows (one optimizer step each)."""
    if count == 1:
        yield arrays
        return
    order = rng.permutation(arrays["tokens"].shape[0])
    for part in np.split(order, count):
        yield {k: v[part] for k, v in arrays.items()}


class PolicyUpdate:
    """One scored batch -> `rl.updates_per_batch` optimizer steps: GAE advantages (PPO) and the
    proximal log-probs first when needed, then one jitted, sharded step per shuffled mini-batch
    (compiled once per mini-batch shape). Returns the new state and the mean metrics."""

    def __init__(self, config: ml_collections.ConfigDict, model: api.Model, optimizer, shardings, frozen,
                 learning_rate):
        rl = config.rl
        self.config, self.model, self.optimizer, self.shardings = config, model, optimizer, shardings
        self.frozen, self.learning_rate, self.updates = frozen, learning_rate, rl.updates_per_batch
        self.frozen_sharding = {"ref": shardings["params"]} if frozen is not None else None
        objective = dataclasses.replace(build_objective(rl), logprob_chunk_size=config.train.logprob_chunk_size)
        self.loss_fn = functools.partial(rl_loss, model.cfg, objective)
        self.old_logprobs = _logprobs_fn(model.cfg) if self.updates > 1 else None
        self.gae = _gae_fn(model.cfg, rl) if rl.advantage == "gae" else None
        self.rng = jax.random.key(config.seed)
        self._steps: dict[tuple[int, ...], Any] = {}

    def _step(self, mini: dict[str, np.ndarray]):
        shape = mini["tokens"].shape
        if shape not in self._steps:
            batch_sh = step_lib.batch_shardings(mini, self.model.mesh)
            self._steps[shape] = (step_lib.build_train_step(
                self.loss_fn, self.optimizer, self.model.mesh, self.shardings, batch_sh,
                micro_batches=self.config.train.micro_batches, learning_rate=self.learning_rate,
                frozen_sharding=self.frozen_sharding), batch_sh)
        return self._steps[shape]

    def __call__(self, state, arrays: dict[str, np.ndarray], samples, step: int):
        if self.gae is not None:
            arrays = self.gae(state["params"], arrays, samples)
        if self.old_logprobs is not None:  # the proximal policy of every mini-batch: the weights before them
            arrays["old_logp"] = self.old_logprobs(state["params"], arrays)
        metrics = []
        for mini in _mini_batches(arrays, self.updates, np.random.default_rng([self.config.seed, step])):
            train_step, batch_sh = self._step(mini)
            state, m = train_step(state, jax.device_put(mini, batch_sh), self.rng, self.frozen)
            metrics.append(m)
        metrics = jax.device_get(metrics)
        return state, {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    rl, wall_start = config.rl, time.perf_counter()
    tokenizer = api.build_tokenizer(config)
    tasks = build_tasks(rl, config.seed)
    model, reference_pointer = initial_model(config, workdir, tasks)
    if rl.advantage == "gae":
        model = api.with_value_head(model)
        _record_value_head(workdir)
    api.check_vocab(model.cfg, tokenizer)
    num_steps, updates = config.train.num_steps, rl.updates_per_batch
    optimizer = build_optimizer(config.optimizer, num_steps * updates)  # one optimizer step per mini-batch
    shardings = step_lib.state_shardings(model.cfg, optimizer, model.mesh)
    use_ref = rl.reference_model or rl.kl_coef > 0
    ref_params = jax.tree.map(jnp.copy, model.params) if use_ref else None
    checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.keep,
                               config.checkpoint.async_save)

    extra: dict[str, Any] = {}
    if config.checkpoint.resume and checkpoints.latest_step() is not None:
        state, extra = checkpoints.restore(step_lib.abstract_state(model.cfg, optimizer, shardings))
        print(f"resumed from step {int(state['step']) // updates} ({checkpoints.directory})")
        for log in ("metrics.jsonl", "samples.jsonl"):
            observe.drop_metrics_after(workdir, int(state["step"]) // updates, log)
    else:
        state = step_lib.init_state(model.params, optimizer, shardings)
    model.params = None  # owned (and donated) by `state`
    start = int(state["step"]) // updates
    producer_state = extra.get("producer", {"cursor": 0, "buffered": []})
    reward_model = None
    if rl.reward_model:
        from rlvr.rewards.reward_model import RewardModel

        reward_model = RewardModel.from_workdir(rl.reward_model)
        load_moments(reward_model, producer_state.get("reward_model_moments"))
    backend = build_backend(config, model, state["params"], tokenizer, workdir, version=start)
    history: list[dict[str, float]] = extra.get("history", [])
    # [step, pass@1, value, {domain: pass@1}] (checkpoints from before per-domain evaluation: no dict)
    evals: list[list] = [[*e, {}][:4] for e in extra.get("evals", [])]
    eval_details: list[dict[str, Any]] = extra.get("eval_details", [])

    samples_log = observe.SampleLog(workdir, tokenizer)

    def run_eval(step: int, tag: str) -> None:
        records: list[dict[str, Any]] = []
        result = evaluate(backend, tasks, tokenizer, rl, tag, config.seed, records)
        samples_log.write(step, f"eval-{tag}", records)
        if result["skipped_too_long"]:
            print(f"WARNING: evaluation {tag}: {result['skipped_too_long']} held-out prompts are longer than "
                  f"rl.max_prompt_len={rl.max_prompt_len} and were left out (rl.max_prompt_len=0 fits them all)")
        evals.append(_eval_point(step, result))
        eval_details.append({"step": step, **result})

    ref_fn = _ref_logprobs_fn(model.cfg, ref_params, rl, tokenizer.pad_id) if rl.kl_mode == "reward" and use_ref \
        else None
    curriculum = None
    if rl.curriculum:
        curriculum = Curriculum(tasks.levels(), mixture=tasks.weights,
                                band=(rl.curriculum_band_low, rl.curriculum_band_high), floor=rl.curriculum_floor,
                                min_samples=rl.curriculum_min_samples, seed=config.seed,
                                prerequisites=task_graph.prerequisites(tasks.names),
                                threshold=rl.prerequisite_threshold)
        if producer_state.get("curriculum"):
            curriculum.load_state(producer_state["curriculum"])
    replay = None
    if rl.replay_capacity:
        replay = ReplayBuffer(rl.replay_capacity, rl.replay_max_pass_rate, rl.replay_max_uses, config.seed)
        if producer_state.get("replay"):
            replay.load_state(producer_state["replay"])
    agent = None
    if rl.agent:
        from rlvr.envs.agent import AgentRunner, load_agent

        agent = AgentRunner(backend.driver, load_agent(rl.agent, rl.agent_options.to_dict()),
                            lambda task, answer: tasks.score(task, answer, False),
                            rl.agent_timeout_s)
    producer = Producer(backend, tasks, tokenizer, rl, config.seed, cursor=producer_state["cursor"],
                        buffered=[ScoredBatch.from_json(b) for b in producer_state["buffered"]],
                        ref_logprobs=ref_fn, curriculum=curriculum, replay=replay, reward_model=reward_model,
                        episode_log=os.path.join(workdir, "episodes.jsonl"), make_env=env_factory(rl),
                        agent=agent)
    # The reference runs inside the step for a KL loss term, or (rl.reference_model) to report the KL.
    frozen = {"ref": ref_params} if (use_ref and rl.kl_mode == "loss") or rl.reference_model else None
    update = PolicyUpdate(config, model, optimizer, shardings, frozen,
                          learning_rate_schedule(config.optimizer, num_steps * updates))
    mesh_shape = dict(model.mesh.shape)
    row_multiple = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1) * config.train.micro_batches * updates
    writer = observe.MetricsWriter(workdir, tensorboard=config.train.tensorboard)
    failures_log = open(os.path.join(workdir, "failures.jsonl"), "a")
    progress = observe.Progress(num_steps, start)

    def extra_state() -> dict[str, Any]:
        return {"producer": producer.state(), "reference": reference_pointer, "history": history, "evals": evals,
                "eval_details": eval_details}

    guard, preempted_at, skipped = PreemptionGuard().__enter__(), None, 0.0
    try:  # from here on, any failure (evaluation included) closes the backend and producer
        if not evals:
            run_eval(0, "before")
            print(f"held-out accuracy before RL: {evals[0][1]:.3f}")
        if rl.mode == "async":
            producer.start(start, num_steps, version=start)
        for step in range(start, num_steps):
            t0 = time.perf_counter()
            batch = producer.next_batch(step)
            t1 = time.perf_counter()
            arrays = build_batch(batch.samples, rl.seq_len, tokenizer.pad_id, rl.aggregation, rl.max_new_tokens,
                                 rl.pack, row_multiple, min_rows=rl.prompts_per_step * rl.group_size)
            state, metrics = update(state, arrays, batch.samples, step)
            t2 = time.perf_counter()
            backend.update_weights(state["params"], step + 1)
            producer.set_version(step + 1)
            t3 = time.perf_counter()

            record = {**rollout_metrics(batch, step), **token_means(metrics)}
            record.update(wait_for_rollout_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2, step_s=t3 - t0,
                          rows=float(arrays["tokens"].shape[0]))
            record["util/trainer"] = (t3 - t1) / max(t3 - t0, 1e-9)  # busy share: not waiting for rollouts
            record.update(backend.health())  # dead servers and rerouted requests
            record.update(pool_counters())  # dead sandboxes and re-run tasks
            for failure in batch.failures:
                failures_log.write(json.dumps({"step": step, **failure}) + "\n")
            failures_log.flush()
            done = step + 1
            if rl.eval_every and done % rl.eval_every == 0 and done != num_steps:
                run_eval(done, f"s{done}")
                record["heldout_accuracy"] = evals[-1][1]
                record.update({f"heldout/{d}": v for d, v in evals[-1][3].items()})
            history.append({"step": done, "reward": record["reward"]})
            writer.write(done, record)
            show = 2 if done == start + 1 or (rl.print_samples_every and done % rl.print_samples_every == 0) else 0
            samples_log.write(done, "train", _spread(batch.samples, rl.samples_per_step), show)
            skipped, skipped_before = record.get("prompts_too_long", 0), skipped
            if skipped > skipped_before:
                print(f"WARNING: step {done}: {int(skipped - skipped_before)} prompts of rl.task were longer than "
                      f"rl.max_prompt_len={rl.max_prompt_len} and were skipped ({int(skipped)} so far; "
                      "rl.max_prompt_len=0 fits every measured prompt)")
            if done % config.train.log_every == 0 or done == num_steps or done == start + 1:
                progress.update(done, {"reward": record["reward"], "acc": evals[-1][1],
                                       "stale": record["staleness_max"]})
            if done % config.checkpoint.every_steps == 0 or done == num_steps:
                if done == num_steps:
                    run_eval(done, "after")
                checkpoints.save(done, state, extra_state(), force=True)
            if guard.requested and done < num_steps:
                # async: let the batch being generated finish (bounded), so it is saved, not regenerated
                producer.drain(config.checkpoint.preemption_grace_s)
                checkpoints.save_now(done, state, extra_state())
                preempted_at = done
                break
        progress.close()
    finally:
        guard.__exit__()
        producer.stop()
        checkpoints.close()
        writer.close()
        samples_log.close()
        failures_log.close()
        if agent is not None:
            agent.close()
        backend.close()
    if preempted_at is not None:
        raise Preempted(preempted_at, checkpoints.directory)
    if evals[-1][0] != num_steps:  # resumed after the final step was already saved
        raise RuntimeError("final evaluation missing from the last checkpoint")
    before, after = evals[0][1], evals[-1][1]
    last = history[-10:]
    summary = {"job": "rl", "seed": config.seed, "final_step": num_steps, "mode": rl.mode,
               "advantage": rl.advantage, "policy_loss": rl.policy_loss,
               "heldout_accuracy_before": before, "heldout_accuracy_after": after,
               "improvement_points": round(100 * (after - before), 2),
               "heldout_value_accuracy_before": evals[0][2], "heldout_value_accuracy_after": evals[-1][2],
               "final_reward_mean_last10": float(np.mean([h["reward"] for h in last])) if last else None,
               "evals": [e[:3] for e in evals], "wall_s": round(time.perf_counter() - wall_start, 1),
               "reference": reference_pointer, "families": len(tasks.names),
               "balance": evaluation.balance_report([(e[0], e[3]) for e in evals]),
               "prompts_too_long": int(skipped), "eval_final": eval_details[-1]}
    if "tool_use" in eval_details[0]["overall"]:  # multi-turn tool tasks: the share of episodes using a tool
        summary["heldout_tool_use_before"] = eval_details[0]["overall"]["tool_use"]
        summary["heldout_tool_use_after"] = eval_details[-1]["overall"]["tool_use"]
    if curriculum is not None:
        summary["curriculum"] = curriculum.report()
    plot = write_plot(workdir, history, evals)
    if plot:
        summary["plot"] = plot
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"held-out accuracy: before RL {before:.3f} -> after RL {after:.3f} "
          f"({summary['improvement_points']:+.1f} points)")
    if len(tasks.names) > 1:
        print(evaluation.table(eval_details[-1], "by_domain"))
        if summary["balance"]["crowded_out"]:
            print(f"capability balance: crowded out during training: {summary['balance']['crowded_out']}")
    print("summary: " + json.dumps({k: v for k, v in summary.items() if k not in ("evals", "eval_final")}))
    return summary
