"""Multi-turn episodes (rlvr.envs.rollout): token-in/token-out, loss masks, concurrency, failures.

The policy is the deterministic `FakeEngine` behind a real `EngineDriver` thread (turns end
with the eos token, so episodes really are multi-turn) and, for determinism under concurrency,
the embedded engine with a tiny random model.
"""

from __future__ import annotations

import json
import threading

import pytest

from rlvr.envs.base import StepResult
from rlvr.envs.rollout import EpisodeJob, EpisodeSettings, observation_ids, run_episode, run_episodes
from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.rollout.driver import EngineDriver
from tests.rollout_fakes import FakeEngine

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "arithmetic",
                                           "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                          "required": ["expr"]}}}]


class CountingEnv:
    """Ends when the model says 'done'; every other turn gets a tool observation."""

    def __init__(self, task=None, max_turns: int = 6, tools=None, fail_on_step: bool = False):
        self.max_turns, self.time_budget_s = max_turns, 60.0
        self._tools, self.fail_on_step = tools, fail_on_step
        self.seen: list[str] = []
        self.closed = False

    @property
    def tools(self):
        return self._tools

    def reset(self):
        return [{"role": "user", "content": "count with me"}]

    def step(self, text):
        if self.fail_on_step:
            raise RuntimeError("environment bug")
        self.seen.append(text)
        if "done" in text:
            return StepResult([], {"format": 0.0}, True)
        return StepResult([{"role": "tool", "content": f"seen {len(self.seen)}"}], {"format": 0.0}, False)

    def final_rewards(self):
        solved = float(bool(self.seen) and "done" in self.seen[-1])
        return {"terminal": solved, "reward": solved, "correct": solved}

    def trace(self):
        return {"seen": list(self.seen)}

    def close(self):
        self.closed = True


class ScriptedPolicy:
    """A backend over FakeEngine whose turn n (= tool responses seen so far) says `turn n`,
    and 'done' at turn `done_at`; it records every completion it returns."""

    def __init__(self, tokenizer, done_at: int = 2):
        def script(prompt_ids):
            n = tokenizer.decode(prompt_ids).count("<tool_response>")
            return tokenizer.encode("done" if n >= done_at else f"turn {n}")

        self.engine = FakeEngine(vocab_size=tokenizer.vocab_size, tokenizer=tokenizer, output_fn=script)
        self.driver = EngineDriver(self.engine)
        self.completions, self._lock = [], threading.Lock()

    def generate(self, requests):
        out = self.driver.generate(list(requests))
        with self._lock:
            self.completions += out
        return out

    def close(self):
        self.driver.close()


@pytest.fixture
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture
def policy(tokenizer):
    p = ScriptedPolicy(tokenizer)
    yield p
    p.close()


SETTINGS = EpisodeSettings(max_new_tokens=16, max_tokens=2048)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_training_tokens_are_the_sampled_tokens(tokenizer, policy, tools):
    env = CountingEnv(tools=tools)
    traj = run_episode(policy, tokenizer, env, SETTINGS, seed=7, rid="e0")
    assert traj.turns == 3 and not traj.truncated and traj.rewards["reward"] == 1.0
    sampled = [t for c in policy.completions for t in c.output_ids]
    assert [t for t, m in zip(traj.output_ids, traj.loss_mask, strict=True) if m] == sampled
    # each turn's request was exactly the history so far: prompt + every earlier token
    for c in policy.completions:
        assert traj.prompt_ids + traj.output_ids[:len(c.prompt_ids) - len(traj.prompt_ids)] == c.prompt_ids
    assert [lp for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m] == \
        [lp for c in policy.completions for lp in c.output_logprobs]
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(traj.versions, traj.logprobs, traj.loss_mask, strict=True)
               if not m)
    # the whole sequence is what the chat template renders for the conversation (text-level)
    messages = env.reset()
    for i, text in enumerate(env.seen):
        messages.append({"role": "assistant", "content": text})
        if i < len(env.seen) - 1:
            messages.append({"role": "tool", "content": f"seen {i + 1}"})
    rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert tokenizer.decode(traj.prompt_ids + traj.output_ids) + "\n" == rendered
    assert env.closed is False  # run_episode leaves closing to its caller (run_episodes closes)
    json.dumps(traj.trace)


def test_observation_tokens_are_the_template_suffix(tokenizer):
    ids = observation_ids(tokenizer, [{"role": "tool", "content": "42"}])
    assert tokenizer.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                                     "<|im_start|>assistant\n")


def test_turn_limit_and_token_budget_truncate(tokenizer):
    policy = ScriptedPolicy(tokenizer, done_at=99)
    try:
        traj = run_episode(policy, tokenizer, CountingEnv(max_turns=3), SETTINGS, seed=1, rid="e")
        assert traj.truncated and traj.turns == 3 and traj.trace["stop"] == "turn_limit"
        assert traj.rewards["reward"] == 0.0
        short = EpisodeSettings(max_new_tokens=16, max_tokens=60)
        traj = run_episode(policy, tokenizer, CountingEnv(), short, seed=1, rid="f")
        assert traj.truncated and traj.trace["stop"] == "token_budget"
        assert len(traj.prompt_ids) + len(traj.output_ids) <= 60
    finally:
        policy.close()


def test_many_episodes_run_concurrently_and_failures_are_recorded(tokenizer, policy):
    class T:
        def __init__(self, i):
            self.index, self.family, self.level, self.stream = i, "count", 0, 0

    envs = {}

    def make_env(task):
        if task.index == 3:
            raise ValueError("cannot build this task")
        envs[task.index] = CountingEnv(fail_on_step=task.index == 5)
        return envs[task.index]

    jobs = [EpisodeJob(T(i), seed=i, rid=f"ep{i}") for i in range(12)]
    out = run_episodes(policy, tokenizer, jobs, SETTINGS, make_env, workers=12)
    assert len(out) == 12
    assert out[3].rewards["env_error"] == 1.0 and "cannot build" in out[3].trace["error"]
    assert out[5].rewards["env_error"] == 1.0 and "environment bug" in out[5].trace["error"]
    good = [t for i, t in enumerate(out) if i not in (3, 5)]
    assert all(t.rewards["reward"] == 1.0 and t.turns == 3 for t in good)
    assert all(e.closed for e in envs.values())
    assert out[0].trace["task"]["index"] == 0


def test_real_engine_episodes_are_deterministic_under_concurrency(tokenizer):
    """The embedded engine with a tiny random model: the same seeds give the same tokens
    whether episodes run one at a time or 8 at once (batched together by the engine)."""
    from rlvr import api, config_lib
    from rlvr.rl.backends import EmbeddedBackend

    config = config_lib.load_config("configs/quickstart.py:smoke", {})
    model = api.build_model(config)
    backend = EmbeddedBackend(model.cfg, model.params, tokenizer, version=3, seed=0, max_slots=16, max_len=128,
                              page_size=8)

    class T:
        family, level, stream = "count", 0, 0

        def __init__(self, i):
            self.index = i

    try:
        settings = EpisodeSettings(max_new_tokens=8, max_tokens=96)
        jobs = [EpisodeJob(T(i), seed=100 + i, rid=f"r{i}") for i in range(8)]
        serial = run_episodes(backend, tokenizer, jobs, settings, lambda t: CountingEnv(), workers=1)
        parallel = run_episodes(backend, tokenizer, jobs, settings, lambda t: CountingEnv(), workers=8)
        for a, b in zip(serial, parallel, strict=True):
            assert a.output_ids == b.output_ids and a.loss_mask == b.loss_mask
            assert set(a.versions) <= {3, -1} and a.output_ids
        assert len({tuple(t.output_ids) for t in serial}) > 1  # different seeds, different episodes
    finally:
        backend.close()


def test_episodes_in_rounds_reach_the_engine_in_the_same_batches_whatever_the_timing(tokenizer, policy):
    """rl.deterministic_rollout (several JAX processes: every process's engine must run the same batches):
    with random environment delays, two runs send the engine the same calls, each holding every live
    episode's next turn in request-id order; the episodes are those of free-running threads."""
    import random
    import time

    class T:
        family, level, stream = "count", 0, 0

        def __init__(self, i):
            self.index = i

    class SlowEnv(CountingEnv):
        def step(self, text):
            time.sleep(random.random() * 0.01)
            return super().step(text)

    class Recording:
        def __init__(self):
            self.calls = []

        def generate(self, requests):
            self.calls.append([r.rid for r in requests])
            return policy.generate(requests)

    jobs = [EpisodeJob(T(i), seed=i, rid=f"ep{i}") for i in range(6)]
    make_env = lambda task: SlowEnv(max_turns=1 + task.index % 3)  # noqa: E731 - episodes of 1, 2 or 3 turns
    rounds = EpisodeSettings(max_new_tokens=16, max_tokens=2048, rounds=True)
    runs = []
    for _ in range(2):
        backend = Recording()
        runs.append((backend.calls, run_episodes(backend, tokenizer, jobs, rounds, make_env)))
    assert runs[0][0] == runs[1][0] == [[f"ep{i}-turn{t}" for i in range(6) if t < 1 + i % 3] for t in range(3)]
    free = run_episodes(policy, tokenizer, jobs, SETTINGS, make_env, workers=6)
    for a, b, c in zip(runs[0][1], runs[1][1], free, strict=True):
        assert a.output_ids == b.output_ids == c.output_ids and a.turns == c.turns
