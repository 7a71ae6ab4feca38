"""Rollout production: tasks -> generate -> verify -> advantages -> a scored batch per train step.

`Producer.make_batch(step)` is the synchronous recipe. `Producer` also runs it on a background
thread for asynchronous RL: batch `b` may start generating once the policy has reached version
`b - max_staleness`, so with k = max_staleness the rollouts of up to k future steps overlap the
current training step, and every sample trained at step b came from weights at most k versions
old (tokens produced after a mid-generation weight update carry the newer version: partial
rollouts). With k = 0 the thread only ever generates for the current version, which is exactly
the synchronous loop (same requests, same seeds, same batches).

Determinism: the prompts of a batch come from a cursor over the task stream, and every sample's
sampling seed is a function of (seed, task index, sample index), so a batch does not depend on
timing, only on the weights that generated it.

Checkpointing: `state()` is the data cursor after the last COMPLETED batch and the completed but
untrained batches themselves; a batch still generating is not included, so after a crash it is
regenerated from the same cursor (lost in-flight work, never a duplicate).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

import jax.numpy as jnp
import numpy as np

from rlvr.rl import advantages as adv_lib
from rlvr.rl.batching import Sample
from rlvr.rl.filters import overlong_penalty
from rlvr.rollout.types import Request, SamplingParams


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


def sample_seed(seed: int, task_index: int, k: int) -> int:
    return int(np.random.SeedSequence([seed, task_index, k]).generate_state(1)[0] % 2**31)


class Producer:
    """Makes `ScoredBatch`es from a task family through a rollout backend (see module doc)."""

    def __init__(self, backend, family, tokenizer, rl, seed: int, cursor: int = 0,
                 buffered: list[ScoredBatch] | None = None, ref_logprobs=None, curriculum=None):
        self.backend, self.family, self.tokenizer, self.rl, self.seed = backend, family, tokenizer, rl, seed
        # rlvr.tasks.curriculum.Curriculum: draws each task's difficulty level, learns from its group
        self.curriculum = curriculum
        self._completed_curriculum = curriculum.state() if curriculum is not None else None
        self.cursor = cursor  # next task index to draw (advanced while generating)
        self.ref_logprobs = ref_logprobs  # samples -> per-token ref log-probs (KL as reward penalty)
        self._cond = threading.Condition()
        self._queue: collections.deque[ScoredBatch] = collections.deque(buffered or [])
        self._completed_cursor = buffered[-1].cursor_end if buffered else cursor
        if buffered:
            self.cursor = self._completed_cursor
        self._version = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop = False

    # --- one batch ------------------------------------------------------------------------

    def _requests(self, tasks, step: int) -> list[Request]:
        rl = self.rl
        out = []
        for task in tasks:
            ids = self.tokenizer.encode(task.prompt)
            for k in range(rl.group_size):
                params = SamplingParams(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                                        sampling_seed=sample_seed(self.seed, task.index, k))
                out.append(Request(f"s{step}-t{task.index}-k{k}", ids, params))
        return out

    def _score(self, task, completion, group: int) -> tuple[Sample, dict[str, Any] | None]:
        finish = completion.finish_reason or {}
        text, truncated = completion_text(self.tokenizer, completion)
        failure = None
        try:
            if finish.get("type") == "abort":
                raise RuntimeError(f"rollout aborted: {finish.get('message')}")
            rewards = dict(self.family.score(task, text, truncated))
            rewards["verifier_error"] = 0.0
        except Exception as e:  # recorded (metrics + failures.jsonl), never silently dropped
            rewards = {"reward": 0.0, "verifier_error": 1.0}
            failure = {"task_index": task.index, "rid": completion.rid, "error": f"{type(e).__name__}: {e}"}
        sample = Sample(group, task.index, list(completion.prompt_ids), list(completion.output_ids),
                        list(completion.output_logprobs), list(completion.output_versions), truncated, rewards,
                        level=task.level)
        return sample, failure

    def _generate_round(self, count: int, step: int):
        if self.curriculum is None:
            tasks = self.family.tasks(self.cursor, count)
        else:
            levels = [level for _, level in self.curriculum.sample(count)]
            tasks = [self.family.task(self.cursor + i, level=level) for i, level in enumerate(levels)]
        self.cursor += count
        completions = self.backend.generate(self._requests(tasks, step))
        t0 = time.perf_counter()
        k = self.rl.group_size
        scored = [self._score(task, c, g) for g, task in enumerate(tasks) for c in completions[g * k:(g + 1) * k]]
        failures = [f for _, f in scored if f is not None]
        groups = [[s for s, _ in scored[g * k:(g + 1) * k]] for g in range(len(tasks))]
        if self.rl.overlong_buffer:
            self._overlong_penalty([s for s, _ in scored])
        if self.curriculum is not None:
            for task, group in zip(tasks, groups, strict=True):
                self.curriculum.update(self.rl.task, task.level, [passed(s.rewards) for s in group])
        return groups, failures, time.perf_counter() - t0

    def make_batch(self, step: int) -> ScoredBatch:
        """Generates and scores `prompts_per_step` groups (refilling zero-variance groups when
        `rl.dynamic_sampling`), then sets every sample's advantage."""
        rl = self.rl
        t0 = time.perf_counter()
        kept, dropped, failures, rounds, generated, verify_s = [], [], [], 0, 0, 0.0
        while len(kept) < rl.prompts_per_step:
            need = rl.prompts_per_step - len(kept)
            groups, round_failures, round_verify_s = self._generate_round(need, step)
            verify_s += round_verify_s
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
        if self.ref_logprobs is not None and rl.kl_mode == "reward" and rl.kl_coef:
            self._kl_penalty(samples)
        rewards = np.array([s.rewards["reward"] for s in samples], np.float32).reshape(len(kept), rl.group_size)
        if rl.advantage == "gae":  # per token, from the value head: set by the trainer before the update
            advantages = np.zeros(rewards.size, np.float32)
        else:
            advantages = np.asarray(adv_lib.ADVANTAGE_FNS[rl.advantage](jnp.asarray(rewards))).reshape(-1)
        for s, a in zip(samples, advantages, strict=True):
            s.advantage = float(a)
        # generate_s: rollout wall time, scoring included; verify_s: the scoring (verifier) part of it
        stats = {"generate_s": gen_s, "verify_s": verify_s, "generation_rounds": float(rounds),
                 "groups_generated": float(generated), "groups_filtered": float(len(dropped))}
        if self.curriculum is not None:
            stats["difficulty_mean"] = float(np.mean([s.level for s in samples]))
            stats["difficulty_current"] = float(self.curriculum.current[rl.task])
        return ScoredBatch(step, samples, self.cursor, stats, failures)

    def _overlong_penalty(self, samples: list[Sample]) -> None:
        """reward += DAPO's soft overlong penalty of each response length (one call per batch)."""
        rl = self.rl
        lengths = np.array([len(s.output_ids) for s in samples])
        penalties = np.asarray(overlong_penalty(lengths, rl.max_new_tokens, rl.overlong_buffer, rl.overlong_penalty))
        for s, p in zip(samples, penalties.tolist(), strict=True):
            s.rewards["overlong_penalty"] = p
            s.rewards["reward"] += p

    def _kl_penalty(self, samples: list[Sample]) -> None:
        """reward -= kl_coef · Σ_t k(behaviour_t, ref_t): the KL to the reference as a reward penalty
        (one estimator call over all tokens of the batch, then per-sample sums)."""
        from rlvr.rl.policy_loss import KL_ESTIMATORS

        ref = np.concatenate(self.ref_logprobs(samples))
        behaviour = np.concatenate([s.behaviour_logp for s in samples])
        per_token = np.asarray(KL_ESTIMATORS[self.rl.kl_estimator](behaviour, ref))
        starts = np.cumsum([0] + [len(s.behaviour_logp) for s in samples[:-1]])
        for s, kl in zip(samples, np.add.reduceat(per_token, starts).tolist(), strict=True):
            s.rewards["kl_penalty"] = -self.rl.kl_coef * kl
            s.rewards["reward"] += s.rewards["kl_penalty"]

    # --- synchronous / asynchronous production ------------------------------------------------

    def start(self, first_step: int, end_step: int, version: int) -> None:
        """Starts the background thread producing batches first_step, …, end_step - 1 (async mode)."""
        self._version = version
        self._thread = threading.Thread(target=self._run, args=(first_step + len(self._queue), end_step),
                                        name="rlvr-rollout-producer", daemon=True)
        self._thread.start()

    def _run(self, step: int, end_step: int) -> None:
        k = self.rl.max_staleness
        try:
            while step < end_step:
                with self._cond:
                    while not self._stop and self._version < step - k:
                        self._cond.wait()
                    if self._stop:
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
            return batch
        with self._cond:
            while not self._queue and self._error is None:
                self._cond.wait()
            if self._error is not None and not self._queue:
                raise RuntimeError("rollout producer failed") from self._error
            batch = self._queue.popleft()
        if batch.step != step:
            raise RuntimeError(f"producer made batch {batch.step} for train step {step}")
        return batch

    def _mark_completed(self, batch: ScoredBatch) -> None:
        self._completed_cursor = batch.cursor_end
        if self.curriculum is not None:
            self._completed_curriculum = self.curriculum.state()

    def state(self) -> dict[str, Any]:
        """Checkpointable: the cursor (and curriculum) after the last completed batch, and the
        completed but untrained batches."""
        with self._cond:
            return {"cursor": self._completed_cursor, "buffered": [b.to_json() for b in self._queue],
                    "curriculum": self._completed_curriculum}

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
