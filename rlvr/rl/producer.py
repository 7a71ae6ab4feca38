"""Rollout production: tasks -> generate -> verify -> advantages -> a scored batch per train step.

`Producer.make_batch(step)` is the synchronous recipe. `Producer` also runs it on a background
thread for asynchronous RL: batch `b` may start generating once the policy has reached version
`b - max_staleness`, so with k = max_staleness the rollouts of up to k future steps overlap the
current training step, and every sample trained at step b came from weights at most k versions
old (tokens produced after a mid-generation weight update carry the newer version: partial
rollouts). With k = 0 the thread only ever generates for the current version, which is exactly
the synchronous loop (same requests, same seeds, same batches). How far the thread runs ahead, and
which decode step a weight update lands on, depend on timing. `fill_ahead` is the deterministic
alternative (rl.mode = "lockstep"): on the trainer's thread, batch b is made from the weights of step
max(b - k, 0) exactly, whole (no partial rollouts), so it runs alike on every process of a multi-host job.

Determinism: the prompts of a batch come from a cursor over the task stream, and every sample's
sampling seed is a function of (seed, task index, sample index), so a batch does not depend on
timing, only on the weights that generated it.

Tasks come from a `rlvr.tasks.TaskMixture` (one or many families). With a curriculum, each
task's (family, level) is drawn by it and every group's pass results are fed back. With a replay
buffer (`rlvr.rl.replay`), a fraction of each round re-poses hard tasks the policy rarely solved.

Multi-turn tasks (`task.metadata["env"]`: tools, code repair) run as episodes of their environment
(`rlvr.envs.rollout`): one thread per episode, turns batched by the engine, the observation
tokens between turns masked out of the loss. Every episode's trace is appended to
`episode_log` (JSONL), failed ones included, for inspection, replay and SFT on repaired runs.

Checkpointing: `state()` is the data cursor (and the curriculum and replay buffer) after the
last COMPLETED batch and the completed but untrained batches themselves; a batch still
generating is not included, so after a crash it is regenerated from the same cursor (lost
in-flight work, never a duplicate).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
import time
from typing import Any

import jax.numpy as jnp
import numpy as np

from rlvr import observe
from rlvr.data.images import chat_prompt_ids, split_image_parts
from rlvr.envs import rollout as episodes_lib
from rlvr.launch.ray_workers import LocalVerifierWorkers
from rlvr.rl import advantages as adv_lib
from rlvr.rl import scheduler as scheduler_lib
from rlvr.rl.batching import Sample
from rlvr.rl.filters import overlong_penalty
from rlvr.rl.host_shards import HostShare
from rlvr.rollout.types import Request, SamplingParams
from rlvr.tasks.constraints import sampling_constraint


@dataclasses.dataclass
class ScoredBatch:
    step: int
    samples: list[Sample]
    cursor_end: int  # task-stream cursor after this batch's prompts
    stats: dict[str, float]
    failures: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "samples": [s.to_json() for s in self.samples], "cursor_end": self.cursor_end,
                "stats": self.stats, "failures": self.failures}

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> ScoredBatch:
        return cls(values["step"], [Sample.from_json(s) for s in values["samples"]], values["cursor_end"],
                   values["stats"], values["failures"])


def passed(rewards: dict[str, float]) -> float:
    """1.0 when a completion solved its task: the verifier's "correct" component, else reward > 0."""
    return float(rewards.get("correct", rewards["reward"] > 0))


def completion_text(tokenizer, completion) -> tuple[str, bool]:
    """(the completion's text without its end token, whether it was cut off rather than stopped)."""
    output = completion.output_ids
    ids = output[:-1] if output and output[-1] == tokenizer.eos_id else output
    return tokenizer.decode(list(ids)), (completion.finish_reason or {}).get("type") != "stop"


def without_image_placeholders(completion, vision):
    """(`completion` cut before the first image placeholder it generated, the cut position) for a VLM
    policy; (`completion`, None) when it generated none. An output `<|image_pad|>` has no image
    behind it: the trainer would put image features there (and could not place M-RoPE ids), the
    engine embedded it as text. The cut completion counts as cut off (finish `length`); the producer
    records such a sample as a failure, so it is not trained on."""
    if vision is None or vision.image_token_id not in completion.output_ids:
        return completion, None
    k = list(completion.output_ids).index(vision.image_token_id)
    return dataclasses.replace(completion, output_ids=list(completion.output_ids[:k]),
                               output_logprobs=list(completion.output_logprobs[:k]),
                               output_versions=list(completion.output_versions[:k]),
                               finish_reason={"type": "length", "length": k}), k


def sample_seed(seed: int, task_index: int, k: int, replay: int = 0) -> int:
    entropy = [seed, task_index, k] + ([replay] if replay else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] % 2**31)


def prompt_ids(tokenizer, task, prompt_format: str, vision=None) -> list[int]:
    """The task's prompt as ids: raw text, or its chat messages through the chat template (image
    parts: placeholders expanded for the VLM's `vision` config; `task_images` are the images)."""
    if prompt_format == "chat":
        return chat_prompt_ids(tokenizer, task.chat(), vision)[0]
    if task_images(task):
        raise ValueError(f"rl.prompt_format='raw': the {task.family} tasks show images, which only chat messages "
                         "carry; set rl.prompt_format='chat'.")
    return tokenizer.encode(task.prompt)


def task_images(task) -> list:
    """The image sources of a task's chat messages, in order (empty for a text task)."""
    return split_image_parts(task.chat())[1] if task.messages else []


def is_episode_task(task) -> bool:
    """A multi-turn task, played as an episode of its environment (rlvr.envs)."""
    return bool(task.metadata.get("env"))


def _filled_versions(versions: list[int]) -> list[int]:
    """Observation tokens (version -1) take the version of the sampled token before them."""
    out, last = [], None
    for v in versions:
        last = v if v >= 0 else (last if last is not None else next((x for x in versions if x >= 0), 0))
        out.append(last)
    return out


def group_advantages(groups: list[list[Sample]], advantage: str) -> np.ndarray:
    """Every sample's advantage, group by group, in one estimator call over the batch: group
    statistics per group (groups cut by the scheduler or left short by failures are smaller),
    batch statistics (REINFORCE++) over every sample. A KL penalty (rewards["kl_penalty"],
    rl.kl_mode="reward") is added afterwards, so it never passes through a group's
    normalisation. Zeros for "gae" (per token, from the value head, set by the trainer)."""
    rewards = np.array([s.rewards["reward"] for g in groups for s in g], np.float32)
    if advantage == "gae":
        return np.zeros_like(rewards)
    group_ids = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    adv = adv_lib.ADVANTAGE_FNS[advantage](jnp.asarray(rewards), group_ids=jnp.asarray(group_ids),
                                           num_groups=len(groups))
    return np.asarray(adv) + np.array([s.rewards.get("kl_penalty", 0.0) for g in groups for s in g], np.float32)


def _moments_state(reward_model) -> dict[str, float] | None:
    if reward_model is None:
        return None
    return {k: float(v) for k, v in reward_model.moments._asdict().items()}


def load_moments(reward_model, state: dict[str, float] | None) -> None:
    """Restores a reward model's running score moments from `Producer.state()`."""
    if reward_model is not None and state:
        reward_model.moments = type(reward_model.moments)(**{k: jnp.float32(v) for k, v in state.items()})


@dataclasses.dataclass(frozen=True)
class ProducerSettings:
    """What the producer reads of the config (`rl.*`), built once by `from_config`."""

    task: str = "add"  # the rl.task spec (named in errors)
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 8
    seq_len: int = 32
    temperature: float = 1.0  # sampling: the objective scores the same distribution (rlvr.rl.objective)
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    constrained_decoding: bool = False  # JSON-schema / tool-call tasks sample under their grammar
    prompt_format: str = "raw"  # raw | chat
    advantage: str = "grpo"
    dynamic_sampling: bool = False
    max_refill_rounds: int = 2
    kl_penalty_coef: float = 0.0  # rl.kl_coef when rl.kl_mode = "reward": the KL as a reward penalty
    kl_estimator: str = "k3"
    distill_coef: float = 1.0  # weight of the teacher's per-token reverse KL (rl.teacher; rlvr.rl.distill)
    distill_task_advantage: bool = True  # False: the teacher's term alone (pure on-policy distillation)
    teacher: str = ""  # rl.teacher: "" = no distillation
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    reward_model_weight: float = 1.0
    replay_fraction: float = 0.125
    max_turns: int = 0
    episode_workers: int = 64
    max_staleness: int = 1
    deterministic_rollout: bool = False  # rounds, not timing, decide what the engine batches together
    verifier_workers: int = 8  # scoring threads when no verifier workers are given
    schedule: scheduler_lib.SchedulePolicy = dataclasses.field(default_factory=scheduler_lib.SchedulePolicy)

    @classmethod
    def from_config(cls, rl) -> ProducerSettings:
        """From the `rl` ConfigDict."""
        names = {f.name for f in dataclasses.fields(cls)} - {"kl_penalty_coef", "schedule"}
        return cls(**{name: rl[name] for name in names},
                   kl_penalty_coef=rl.kl_coef if rl.kl_mode == "reward" else 0.0,
                   schedule=scheduler_lib.SchedulePolicy.from_config(rl.schedule))


class Producer:
    """Makes `ScoredBatch`es from a task family through a rollout backend (see module doc).
    `verifiers` (rlvr.launch.ray_workers) score completions: by default `settings.verifier_workers`
    threads in this process."""

    def __init__(self, backend, tasks, tokenizer, settings: ProducerSettings, seed: int, cursor: int = 0,
                 buffered: list[ScoredBatch] | None = None, ref_logprobs=None, curriculum=None, replay=None,
                 reward_model=None, episode_log: str | None = None, make_env=None, agent=None, verifiers=None,
                 teacher_logprobs=None):
        self.backend, self.tasks, self.tokenizer, self.settings, self.seed = backend, tasks, tokenizer, settings, seed
        self.vision = getattr(backend, "vision", None)  # a VLM policy's VisionConfig: image tasks' placeholders
        # rlvr.tasks.curriculum.Curriculum: draws each task's (family, level), learns from its group
        self.curriculum = curriculum
        self._completed_curriculum = curriculum.state() if curriculum is not None else None
        self.replay = replay  # rlvr.rl.replay.ReplayBuffer or None
        self._completed_replay = replay.state() if replay is not None else None
        # rlvr.rewards.reward_model.RewardModel: a learned reward term (the RLHF path), normalised
        self.reward_model = reward_model
        self._completed_rm = _moments_state(reward_model)
        self.cursor = cursor  # next task index to draw (advanced while generating)
        self.prompts_too_long = 0  # tasks passed over: prompt + max_new_tokens > seq_len
        self.ref_logprobs = ref_logprobs  # samples -> per-token ref log-probs (KL as reward penalty)
        self.teacher_logprobs = teacher_logprobs  # samples -> per-token teacher log-probs (rlvr.rl.distill)
        self._cond = threading.Condition()
        self._queue: collections.deque[ScoredBatch] = collections.deque(buffered or [])
        self._completed_cursor = buffered[-1].cursor_end if buffered else cursor
        if buffered:
            self.cursor = self._completed_cursor
        self._version = 0
        self.episode_log = episode_log  # JSONL of every multi-turn episode's trace
        self.make_env = make_env  # task -> rlvr.envs.base.Environment (default: rlvr.envs.make_env)
        self.agent = agent  # rlvr.envs.agent.AgentRunner: every task played by a black-box agent (rl.agent)
        self._episode_stats: dict[str, float] = collections.defaultdict(float)
        self.hosts = HostShare()  # multi-host: this process's share of the task stream and of the verifying
        self._log_lock = threading.Lock()
        # verifiers that wait on subprocesses (code in a sandbox, math in worker processes) run concurrently
        # (in this process, or on Ray actors: rl.verifier_backend)
        self.verifiers = verifiers or LocalVerifierWorkers(tasks, max(1, settings.verifier_workers))
        self._verifier_pool = concurrent.futures.ThreadPoolExecutor(self.verifiers.concurrency,
                                                                    thread_name_prefix="rlvr-verifier")
        # rollout groups and their scoring, by priority, with preemption and degradation (rl.schedule)
        self.policy = settings.schedule
        self.scheduler = scheduler_lib.Scheduler(self.policy, backend, self._verifier_pool, self.verifiers.concurrency,
                                                 unbounded=settings.deterministic_rollout)
        self._domains = tasks.domains() if hasattr(tasks, "domains") else {}
        unknown = set(self.policy.priorities) - set(self._domains) - set(self._domains.values())
        if self._domains and unknown:
            raise ValueError(f"rl.schedule.priorities names {sorted(unknown)}, which are neither families nor domains "
                             f"of rl.task; families: {sorted(self._domains)}, domains: "
                             f"{sorted(set(self._domains.values()))}")
        self._skip_families: set[str] = set()  # skipped by degradation for the rest of the batch
        self._episode_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlvr-episodes")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop = False
        self._draining = False

    # --- one batch ------------------------------------------------------------------------

    def _family(self, task):
        return self.tasks.family_of(task) if hasattr(self.tasks, "family_of") else self.tasks

    def _episodic(self, task) -> bool:
        """Played as an episode (multi-turn environment, or every task when a black-box agent plays)."""
        return self.agent is not None or is_episode_task(task)

    def _requests(self, tasks, prompts: list[list[int]], replays: list[int], step: int) -> list[Request]:
        """group_size requests per task (prompt ids given); `replays[i]` > 0 marks a re-posed task
        (fresh seeds)."""
        rl = self.settings
        out = []
        for task, ids, replay in zip(tasks, prompts, replays, strict=True):
            suffix = f"-r{replay}" if replay else ""
            constraint = sampling_constraint(task.verifier, getattr(self._family(task), "answer_format", "raw")) \
                if rl.constrained_decoding else {}
            images = task_images(task)
            for k in range(rl.group_size):
                params = SamplingParams(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                                        top_k=rl.top_k, min_p=rl.min_p,
                                        sampling_seed=sample_seed(self.seed, task.index, k, replay), **constraint)
                out.append(Request(f"s{step}-t{task.index}-k{k}{suffix}", ids, params, image_data=images))
        return out

    def _score(self, task, completion, group: int) -> tuple[Sample, dict[str, Any] | None]:
        completion, cut = without_image_placeholders(completion, self.vision)
        finish = completion.finish_reason or {}
        text, truncated = completion_text(self.tokenizer, completion)
        failure = None if cut is None else {
            "task_index": task.index, "family": task.family, "rid": completion.rid,
            "error": f"the policy generated an image placeholder (token {self.vision.image_token_id}) at output "
                     f"position {cut}; recorded, not trained on"}
        try:
            if not self.hosts.verifies(group):  # another process verifies it: rewards arrive by `share_verdicts`
                rewards = {}
            elif finish.get("type") == "abort":
                raise RuntimeError(f"rollout aborted: {finish.get('message')}")
            else:
                rewards = dict(self.verifiers.score(task, text, truncated))
                rewards["verifier_error"] = 0.0
        except Exception as e:  # recorded (metrics + failures.jsonl), never silently dropped
            rewards = {"reward": 0.0, "verifier_error": 1.0}
            failure = {"task_index": task.index, "family": task.family, "rid": completion.rid,
                       "error": f"{type(e).__name__}: {e}"}
        sample = Sample(group, task.index, list(completion.prompt_ids), list(completion.output_ids),
                        list(completion.output_logprobs), list(completion.output_versions), truncated, rewards,
                        level=task.level, family=task.family, images=task_images(task) or None)
        return sample, failure

    def _draw_tasks(self, count: int) -> tuple[list, list[list[int]], list]:
        """(tasks, their prompt ids, their replay entries or None): re-posed hard tasks first, then
        fresh ones from the cursor (family and level from the curriculum when there is one)."""
        replayed = []
        if self.replay is not None and self.replay.entries:
            replayed = self.replay.draw(min(count - 1, round(count * self.settings.replay_fraction)))
        fresh = count - len(replayed)
        tasks, prompts = self._fresh_tasks(fresh)
        fmt = self.settings.prompt_format
        replay_prompts = [[] if self._episodic(e.task) else prompt_ids(self.tokenizer, e.task, fmt, self.vision)
                          for e in replayed]
        return [e.task for e in replayed] + tasks, replay_prompts + prompts, replayed + [None] * fresh

    def _fresh_tasks(self, count: int) -> tuple[list, list[list[int]]]:
        """`count` tasks from the cursor (and their prompt ids) whose prompt leaves room for
        rl.max_new_tokens in rl.seq_len; longer ones are passed over (counted in `prompts_too_long`)."""
        rl = self.settings
        out, prompts, drawn = [], [], 0
        while len(out) < count:
            need = count - len(out)
            if self.curriculum is None:
                tasks = self.hosts.read_tasks(lambda i, c=self.cursor: self.tasks.task(c + i), need)
            else:
                draws = self.curriculum.sample(need)
                tasks = self.hosts.read_tasks(lambda i, c=self.cursor, d=draws: self.tasks.task(
                    c + i, family=d[i][0], level=d[i][1]), need)
            self.cursor += need
            drawn += need
            for task in tasks:
                if task.family in self._skip_families:  # degraded: this domain is skipped for this batch
                    continue
                if self._episodic(task):  # its prompt is the environment's (or agent's); bounded per episode
                    out.append(task)
                    prompts.append([])
                    continue
                ids = prompt_ids(self.tokenizer, task, rl.prompt_format, self.vision)
                if len(ids) + rl.max_new_tokens <= rl.seq_len:
                    out.append(task)
                    prompts.append(ids)
                else:
                    self.prompts_too_long += 1
            if len(out) < count and drawn > 20 * count + 100:
                raise ValueError(f"{drawn - len(out)} of {drawn} prompts of rl.task={rl.task!r} are too long for "
                                 f"rl.seq_len={rl.seq_len} with rl.max_new_tokens={rl.max_new_tokens}: "
                                 "set rl.max_prompt_len=0 and rl.seq_len=0 (derived from the prompts: rlvr.budgets)")
        return out, prompts

    def _episode_samples(self, tasks, groups: list[int], replays: list[int], step: int):
        """Plays group_size episodes of each task in `groups` (indices into `tasks`), concurrently;
        returns {group: [(sample, failure or None)]} and logs every episode's trace."""
        rl, k = self.settings, self.settings.group_size
        jobs = []
        for g in groups:
            task, suffix = tasks[g], f"-r{replays[g]}" if replays[g] else ""
            jobs += [episodes_lib.EpisodeJob(task, sample_seed(self.seed, task.index, i, replays[g]),
                                             f"s{step}-t{task.index}-k{i}{suffix}") for i in range(k)]
        settings = episodes_lib.EpisodeSettings(max_new_tokens=rl.max_new_tokens, max_tokens=rl.seq_len,
                                                temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
                                                min_p=rl.min_p, max_turns=rl.max_turns,
                                                rounds=rl.deterministic_rollout)
        make_env = self.make_env
        if make_env is None:
            from rlvr.envs import make_env
        t0 = time.perf_counter()
        if self.agent is not None:
            with concurrent.futures.ThreadPoolExecutor(rl.episode_workers, thread_name_prefix="rlvr-agent") as pool:
                trajectories = list(pool.map(lambda job: self.agent.episode(job.task, rl.seq_len, job.rid), jobs))
        else:
            turns = scheduler_lib.TurnBackend(self.scheduler, {job.rid: (self.priority(job.task), job.task.family)
                                                               for job in jobs})
            trajectories = episodes_lib.run_episodes(turns, self.tokenizer, jobs, settings, make_env,
                                                     workers=rl.episode_workers)
        self._record_episodes(step, jobs, trajectories, time.perf_counter() - t0)
        out = {}
        for n, g in enumerate(groups):
            out[g] = [self._episode_sample(tasks[g], t, g) for t in trajectories[n * k:(n + 1) * k]]
        return out

    def _episode_sample(self, task, traj, group: int) -> tuple[Sample, dict[str, Any] | None]:
        rewards = {key: float(v) for key, v in traj.rewards.items()}
        rewards.setdefault("env_error", 0.0)
        failure = None
        if traj.trace.get("error"):  # (an agent's trace has "error": None when it ran fine)
            failure = {"task_index": task.index, "family": task.family, "rid": traj.trace.get("rid"),
                       "error": traj.trace["error"]}
        prompt = traj.prompt_ids or [self.tokenizer.eos_id]
        sample = Sample(group, task.index, list(prompt), list(traj.output_ids), list(traj.logprobs),
                        _filled_versions(traj.versions), traj.truncated, rewards, level=task.level,
                        family=task.family, loss_mask=list(traj.loss_mask))
        return sample, failure

    def _record_episodes(self, step: int, jobs, trajectories, wall_s: float) -> None:
        stats = self._episode_stats
        stats["episodes"] += len(trajectories)
        stats["episode_wall_s"] += wall_s
        stats["episode_turns"] += sum(t.turns for t in trajectories)
        stats["episode_generate_s"] += sum(t.trace.get("generate_s", 0.0) for t in trajectories)
        stats["episode_env_s"] += sum(t.trace.get("env_s", 0.0) for t in trajectories)
        if not self.episode_log:
            return
        with self._log_lock, observe.open_log(self.episode_log) as f:
            for job, t in zip(jobs, trajectories, strict=True):
                f.write(json.dumps({"step": step, "task": job.task.to_json(), "rewards": t.rewards,
                                    "truncated": t.truncated, "turns": t.turns, "trace": t.trace}) + "\n")

    def priority(self, task) -> float:
        """The task's scheduling priority (rl.schedule.priorities by family, then domain)."""
        return self.policy.priority(task.family, self._domains.get(task.family, ""))

    def _scheduled_groups(self, tasks, prompts, replays, single: list[int], step: int) -> dict[int, list]:
        """Generates and scores the single-turn groups through the scheduler; returns {group:
        [(sample, failure)]} for the groups it did not skip (cut groups have fewer samples)."""
        k = self.settings.group_size
        requests = self._requests([tasks[g] for g in single], [prompts[g] for g in single],
                                  [replays[g] for g in single], step)
        jobs = [scheduler_lib.GroupJob(g, tasks[g].family, self.priority(tasks[g]), requests[n * k:(n + 1) * k],
                                       score=lambda c, g=g: self._score(tasks[g], c, g))
                for n, g in enumerate(single)]
        done = self.scheduler.run(jobs)
        out = {}
        for g, job in done.items():
            if job.skipped:
                self._skip_families.add(job.family)
            else:
                out[g] = [r for r in job.results if r is not None]
        return out

    def _generate_round(self, count: int, step: int):
        tasks, prompts, entries = self._draw_tasks(count)
        replays = [e.uses if e else 0 for e in entries]
        single = [g for g, task in enumerate(tasks) if not self._episodic(task)]
        episode_groups = sorted(set(range(len(tasks))) - set(single), key=lambda g: (-self.priority(tasks[g]), g))
        episodes = None
        if episode_groups and not self.settings.deterministic_rollout:
            # their turns and the single-turn groups share the scheduler concurrently
            episodes = self._episode_pool.submit(self._episode_samples, tasks, episode_groups, replays, step)
        by_group = self._scheduled_groups(tasks, prompts, replays, single, step) if single else {}
        self.hosts.share_verdicts(by_group)
        if episodes is not None:
            by_group.update(episodes.result())
        elif episode_groups:  # deterministic: after the single-turn groups
            by_group.update(self._episode_samples(tasks, episode_groups, replays, step))
        failures = [f for g in sorted(by_group) for _, f in by_group[g] if f is not None]
        # an infrastructure failure (verifier crash, aborted rollout, environment error) is recorded in
        # `failures`, never trained on: it leaves its group (and the group's statistics)
        kept = [g for g in sorted(by_group) if any(f is None for _, f in by_group[g])]
        groups = [[s for s, f in by_group[g] if f is None] for g in kept]
        if self.settings.overlong_buffer:
            self._overlong_penalty([s for g, group in zip(kept, groups, strict=True) if g in single for s in group])
        if self.reward_model is not None:
            self._reward_model_term([tasks[g] for g in kept], groups)
        for n, g in enumerate(kept):
            task, entry = tasks[g], entries[g]
            passes = [passed(s.rewards) for s in groups[n]]
            if self.curriculum is not None and entry is None:
                self.curriculum.update(task.family, task.level, passes)
            if self.replay is not None:
                if entry is None:
                    self.replay.offer(task, groups[n], passes)
                else:
                    groups[n] = self.replay.inject(entry, groups[n], passes)
        return groups, failures

    def make_batch(self, step: int) -> ScoredBatch:
        """Generates and scores `prompts_per_step` groups (refilling zero-variance groups when
        `rl.dynamic_sampling`), then sets every sample's advantage."""
        rl = self.settings
        t0 = time.perf_counter()
        self._episode_stats.clear()
        self._skip_families.clear()
        self.scheduler.begin_batch()
        kept, dropped, failures, rounds, generated = [], [], [], 0, 0
        while len(kept) < rl.prompts_per_step:
            need = rl.prompts_per_step - len(kept)
            groups, round_failures = self._generate_round(need, step)
            failures += round_failures
            rounds += 1
            generated += len(groups)
            for group in groups:
                keep = not rl.dynamic_sampling or len({s.rewards["reward"] for s in group}) > 1
                (kept if keep else dropped).append(group)
            if rounds > rl.max_refill_rounds:
                break
        kept = (kept + dropped)[: rl.prompts_per_step]  # still short: train on some flat groups
        samples = [dataclasses.replace(s, group=g) for g, group in enumerate(kept) for s in group]
        gen_s = time.perf_counter() - t0
        if self.ref_logprobs is not None and rl.kl_penalty_coef:
            self._kl_penalty(samples)
        for s, a in zip(samples, group_advantages(kept, rl.advantage), strict=True):
            s.advantage = float(a) if rl.distill_task_advantage or not rl.teacher else 0.0
        if self.teacher_logprobs is not None:
            self._distill(samples)
        # generate_s: rollout wall time, scoring included; verify_s: the scoring not overlapped with generation
        stats = {"generate_s": gen_s, "generation_rounds": float(rounds),
                 "groups_generated": float(generated), "groups_filtered": float(len(dropped))}
        stats.update(self.scheduler.end_batch())
        if not isinstance(self.verifiers, LocalVerifierWorkers):  # cumulative: actors alive, restarted, jobs lost
            stats.update({f"verifier/{k}": float(v) for k, v in self.verifiers.stats().items()})
        if self.curriculum is not None:
            stats["difficulty_mean"] = float(np.mean([s.level for s in samples]))
            stats["difficulty_current"] = float(np.mean(list(self.curriculum.current.values())))
            stats["families_available"] = float(len(self.curriculum.available()))
        if self.replay is not None:
            stats.update(self.replay.stats())
        if self.prompts_too_long:
            stats["prompts_too_long"] = float(self.prompts_too_long)
        stats.update(self._episode_metrics())
        return ScoredBatch(step, samples, self.cursor, stats, failures)

    def _episode_metrics(self) -> dict[str, float]:
        """Episodes/s, turns per episode, and the share of episode time spent in the environment
        (tools, sandbox) rather than generating."""
        e = self._episode_stats
        if not e.get("episodes"):
            return {}
        busy = e["episode_generate_s"] + e["episode_env_s"]
        return {"episodes": e["episodes"], "episodes_per_s": e["episodes"] / max(e["episode_wall_s"], 1e-9),
                "episode_turns": e["episode_turns"] / e["episodes"],
                "episode_env_share": e["episode_env_s"] / max(busy, 1e-9)}

    def _overlong_penalty(self, samples: list[Sample]) -> None:
        """reward += DAPO's soft overlong penalty of each response length (one call per batch)."""
        rl = self.settings
        lengths = np.array([s.sampled_tokens for s in samples])
        penalties = np.asarray(overlong_penalty(lengths, rl.max_new_tokens, rl.overlong_buffer, rl.overlong_penalty))
        for s, p in zip(samples, penalties.tolist(), strict=True):
            s.rewards["overlong_penalty"] = p
            s.rewards["reward"] += p

    def _reward_model_term(self, tasks, groups: list[list[Sample]]) -> None:
        """reward += reward_model_weight · the reward model's normalised score (one call per round)."""
        samples = [s for group in groups for s in group]
        prompts = [task.chat() if self.settings.prompt_format == "chat" else task.prompt
                   for task, group in zip(tasks, groups, strict=True) for _ in group]
        eos = self.tokenizer.eos_id
        texts = [self.tokenizer.decode(s.output_ids[:-1] if s.output_ids[-1:] == [eos] else s.output_ids)
                 for s in samples]
        for s, score in zip(samples, self.reward_model.normalized(prompts, texts).tolist(), strict=True):
            s.rewards["reward_model"] = score
            s.rewards["reward"] += self.settings.reward_model_weight * score

    def _kl_penalty(self, samples: list[Sample]) -> None:
        """rewards["kl_penalty"] = -kl_coef · Σ_t k(behaviour_t, ref_t): the KL to the reference as a
        penalty, kept apart from the task reward: `group_advantages` adds it to the advantage after
        the group statistics (one estimator call over all tokens of the batch, then per-sample sums)."""
        from rlvr.rl.policy_loss import KL_ESTIMATORS

        ref = np.concatenate(self.ref_logprobs(samples))
        behaviour = np.concatenate([s.behaviour_logp for s in samples])
        sampled = np.concatenate([np.ones(len(s.output_ids)) if s.loss_mask is None else np.asarray(s.loss_mask)
                                  for s in samples])
        per_token = np.asarray(KL_ESTIMATORS[self.settings.kl_estimator](behaviour, ref)) * sampled  # not observations
        # per-sample sums (np.add.reduceat would give an empty output its neighbour's first token, or fail last)
        ends = np.cumsum([len(s.behaviour_logp) for s in samples])
        for s, kl in zip(samples, np.split(per_token, ends[:-1]), strict=True):
            s.rewards["kl_penalty"] = -self.settings.kl_penalty_coef * float(kl.sum())

    def _distill(self, samples: list[Sample]) -> None:
        """Every sample's per-token teacher advantage, and rewards["teacher_kl"]: its mean per-token
        reverse KL to the teacher (rlvr.rl.distill; one teacher pass over the batch)."""
        from rlvr.rl.distill import teacher_token_advantages

        advantages, kls = teacher_token_advantages([s.behaviour_logp for s in samples], self.teacher_logprobs(samples),
                                                   [s.loss_mask for s in samples], self.settings.distill_coef)
        for s, adv, kl in zip(samples, advantages, kls, strict=True):
            s.token_advantage, s.rewards["teacher_kl"] = adv.tolist(), kl

    # --- synchronous / asynchronous production ------------------------------------------------

    def start(self, first_step: int, end_step: int, version: int) -> None:
        """Starts the background thread producing batches first_step, …, end_step - 1 (async mode)."""
        self._version = version
        self._thread = threading.Thread(target=self._run, args=(first_step + len(self._queue), end_step),
                                        name="rlvr-rollout-producer", daemon=True)
        self._thread.start()

    def _run(self, step: int, end_step: int) -> None:
        k = self.settings.max_staleness
        try:
            while step < end_step:
                with self._cond:
                    while not (self._stop or self._draining) and self._version < step - k:
                        self._cond.wait()
                    if self._stop or self._draining:
                        return
                batch = self.make_batch(step)
                with self._cond:
                    self._queue.append(batch)
                    self._mark_completed(batch)
                    self._cond.notify_all()
                step += 1
        except BaseException as e:  # surfaced to the trainer by next_batch()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def fill_ahead(self, step: int, end_step: int) -> None:
        """Lockstep mode (asynchronous with a fixed lag, on this thread): before training step `step`,
        makes batches until the queue holds those of steps step..min(step + k, end_step - 1) with the
        current weights (version `step`), so batch b comes from the weights of step max(b - k, 0), by
        step count, never by timing: every process of a multi-host job makes the same batches, with its
        engine collectives in the same order as its training ones."""
        last = min(step + self.settings.max_staleness, end_step - 1)
        while step + len(self._queue) <= last:
            batch = self.make_batch(step + len(self._queue))
            with self._cond:
                self._queue.append(batch)
                self._mark_completed(batch)

    def drain(self, timeout: float) -> bool:
        """Preemption: start no new batch and wait up to `timeout` s for the one being generated
        (async), so `state()` includes it. Returns whether nothing was left in flight."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def set_version(self, version: int) -> None:
        """The trainer's policy version (= optimizer steps taken); unblocks the producer."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def next_batch(self, step: int) -> ScoredBatch:
        """The batch to train step `step` on: from the queue (async) or made now (sync)."""
        if self._thread is None:
            if self._queue:
                batch = self._queue.popleft()
            else:
                batch = self.make_batch(step)
                self._mark_completed(batch)
        else:
            batch = self._from_thread()
        if batch.step != step:
            raise RuntimeError(f"producer made batch {batch.step} for train step {step}")
        return batch

    def _from_thread(self) -> ScoredBatch:
        with self._cond:
            while not self._queue and self._error is None:
                self._cond.wait()
            if self._error is not None and not self._queue:
                raise RuntimeError("rollout producer failed") from self._error
            return self._queue.popleft()

    def _mark_completed(self, batch: ScoredBatch) -> None:
        self._completed_cursor = batch.cursor_end
        if self.curriculum is not None:
            self._completed_curriculum = self.curriculum.state()
        if self.replay is not None:
            self._completed_replay = self.replay.state()
        self._completed_rm = _moments_state(self.reward_model)

    def state(self) -> dict[str, Any]:
        """Checkpointable: the cursor (curriculum, replay buffer) after the last completed batch,
        and the completed but untrained batches."""
        with self._cond:
            return {"cursor": self._completed_cursor, "buffered": [b.to_json() for b in self._queue],
                    "curriculum": self._completed_curriculum, "replay": self._completed_replay,
                    "reward_model_moments": self._completed_rm}

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.scheduler.close()
        self._episode_pool.shutdown(wait=False, cancel_futures=True)
        self._verifier_pool.shutdown(wait=False, cancel_futures=True)
        self.verifiers.close()
