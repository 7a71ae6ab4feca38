"""Agentic RL end to end: multi-turn episodes in the RL loop, stored episodes, black-box agents.

The smoke runs use tiny random models (rewards are near zero; what is checked is that the loop
plays real episodes, masks observations, records every episode and failure, and does not crash).
The scripted tool-use episodes check the stored trace is complete: exported as SFT data and
replayed in a fresh environment, it gives the same observations and rewards.
"""

from __future__ import annotations

import json
import re
from unittest import mock

import numpy as np
import pytest

from rlvr import config_lib
from rlvr.envs import episodes as episodes_lib
from rlvr.envs import make_env
from rlvr.envs import rollout as rollout_lib
from rlvr.envs.rollout import EpisodeJob, EpisodeSettings, run_episodes
from rlvr.main import run
from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.rl.batching import build_batch
from rlvr.rl.producer import Producer, ProducerSettings
from rlvr.rollout.driver import EngineDriver
from rlvr.tasks import build_tasks
from tests.rollout_fakes import FakeEngine


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_agentic_tools_smoke_trains_on_multi_turn_episodes(tmp_path):
    config = config_lib.load_config("configs/agentic_tools.py:smoke", {})
    summary = run(config, str(tmp_path))
    assert summary["final_step"] == config.train.num_steps
    episodes = _records(tmp_path / "episodes.jsonl")
    per_step = config.rl.prompts_per_step * config.rl.group_size
    assert len(episodes) == per_step * config.train.num_steps
    for e in episodes:
        assert e["task"]["family"] == "tool_calc_compact" and "reward" in e["rewards"]
        assert e["trace"]["turns"] and e["trace"]["env"]["env"] == "tool_calc"
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    rl_rows = [m for m in metrics if "episodes" in m]
    assert rl_rows and all(m["episodes"] == per_step for m in rl_rows)
    for m in rl_rows:  # the share of episode time in the environment, by hand from the stored traces
        # (episodes.jsonl numbers the batches from 0, metrics.jsonl the steps done from 1)
        traces = [e["trace"] for e in episodes if e["step"] == m["step"] - 1]
        env_s, generate_s = sum(t["env_s"] for t in traces), sum(t["generate_s"] for t in traces)
        assert len(traces) == per_step and generate_s > 0
        assert m["episode_env_share"] == pytest.approx(env_s / (env_s + generate_s), rel=1e-6), m["step"]


class _ScriptedCalculatorPolicy:
    """Solves compact tool_calc episodes: calls the calculator, then answers with its result."""

    def __init__(self, tokenizer):
        def script(prompt_ids):
            text = tokenizer.decode(prompt_ids)
            result = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
            if result:
                return tokenizer.encode(f"<answer>{result[-1]}</answer>")
            expression = re.findall(r"Compute (.*?)\.<\|im_end\|>", text)[-1]
            call = json.dumps({"name": "calc", "arguments": {"expr": expression}}, separators=(",", ":"))
            return tokenizer.encode(f"<tool_call>{call}</tool_call>")

        self.driver = EngineDriver(FakeEngine(vocab_size=tokenizer.vocab_size, tokenizer=tokenizer,
                                              output_fn=script))

    def generate(self, requests):
        return self.driver.generate(list(requests))

    def close(self):
        self.driver.close()


def test_stored_episodes_export_as_sft_data_and_replay_exactly(tmp_path):
    tokenizer = byte_level_tokenizer()
    rl = config_lib.load_config("configs/agentic_tools.py:smoke", {}).rl
    tasks = build_tasks(rl, seed=0)
    policy = _ScriptedCalculatorPolicy(tokenizer)
    log = tmp_path / "episodes.jsonl"
    try:
        producer = Producer(policy, tasks, tokenizer, ProducerSettings.from_config(rl), seed=0, episode_log=str(log))
        try:
            batch = producer.make_batch(0)
        finally:
            producer.stop()
    finally:
        policy.close()
    assert all(s.rewards["correct"] == 1.0 and s.rewards["turns"] == 2.0 for s in batch.samples)
    # the train batch: loss only on the two sampled turns, never on the tool response between them
    arrays = build_batch(batch.samples, rl.seq_len, tokenizer.pad_id)
    for row, s in enumerate(batch.samples):
        p = len(s.prompt_ids)
        trained = arrays["tokens"][row][p:p + len(s.output_ids)][arrays["loss_mask"][row][p:p + len(s.output_ids)] == 1]
        text = tokenizer.decode(trained.tolist())
        assert text.startswith("<tool_call>") and "<answer>" in text and "<tool_response>" not in text
        assert np.all(arrays["behaviour_logp"][row][arrays["loss_mask"][row] == 0] == 0)
    records = _records(log)
    assert len(records) == rl.prompts_per_step * rl.group_size
    out = tmp_path / "sft.jsonl"
    assert episodes_lib.export(str(log), str(out), only="correct") == len(records)
    assert episodes_lib.export(str(log), str(tmp_path / "failed.jsonl"), only="failed") == 0
    exported = _records(out)[0]
    roles = [m["role"] for m in exported["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"] and exported["tools"] is None
    from rlvr.data.chat import encode_record

    ids, mask = encode_record(tokenizer, exported)
    assert sum(mask) > 0 and tokenizer.decode(ids).count("<tool_response>") == 1
    result = episodes_lib.replay(records[0])
    assert result == {"identical": True, "turns": 2, "differences": []}
    tampered = json.loads(json.dumps(records[0]))
    tampered["trace"]["turns"][0]["text"] = tampered["trace"]["turns"][0]["text"].replace('"expr":"', '"expr":"1+')
    assert not episodes_lib.replay(tampered)["identical"]
    assert episodes_lib.main(["replay", str(log), "--line", "1"]) == 0


def test_run_episodes_with_the_real_tool_environment(tmp_path):
    tokenizer = byte_level_tokenizer()
    rl = config_lib.load_config("configs/agentic_tools.py:smoke", {}).rl
    tasks = build_tasks(rl, seed=0)
    policy = _ScriptedCalculatorPolicy(tokenizer)
    try:
        jobs = [EpisodeJob(tasks.task(i), seed=i, rid=f"e{i}") for i in range(6)]
        settings = EpisodeSettings(max_new_tokens=rl.max_new_tokens, max_tokens=rl.seq_len)
        out = run_episodes(policy, tokenizer, jobs, settings, make_env, workers=6)
    finally:
        policy.close()
    assert [t.rewards["correct"] for t in out] == [1.0] * 6
    assert all(t.trace["env"]["turns"][0]["calls"] for t in out)


@pytest.mark.sandbox
def test_agentic_code_smoke_runs_code_repair_episodes_in_the_sandbox(tmp_path):
    config = config_lib.load_config("configs/agentic_code.py:smoke", {})
    summary = run(config, str(tmp_path))
    assert summary["final_step"] == config.train.num_steps
    episodes = _records(tmp_path / "episodes.jsonl")
    assert len(episodes) == config.rl.prompts_per_step * config.rl.group_size * config.train.num_steps
    assert all(e["trace"]["env"]["env"] == "code_repair" for e in episodes)
    assert all("terminal" in e["rewards"] and "format" in e["rewards"] for e in episodes)


def test_black_box_agent_is_trained_from_its_recorded_calls(tmp_path):
    """rl.agent: the example ReAct agent plays every task over the engine's OpenAI endpoint."""
    overrides = {"rl.agent": "rlvr.envs.agent:calculator_agent", "rl.agent_timeout_s": 120.0,
                 "rl.agent_options": {"max_turns": 2, "max_tokens": 16},
                 "rl.seq_len": 1024, "rl.engine.max_len": 1024, "rl.engine.prefill_chunk": 512,
                 "rl.sft_seq_len": 64, "train.num_steps": 1, "checkpoint.every_steps": 1}
    config = config_lib.load_config("configs/quickstart.py:smoke", overrides)
    summary = run(config, str(tmp_path))
    assert summary["final_step"] == config.train.num_steps
    episodes = _records(tmp_path / "episodes.jsonl")
    assert len(episodes) == config.rl.prompts_per_step * config.rl.group_size * config.train.num_steps
    assert all(e["trace"]["session"] and e["trace"]["calls"] for e in episodes)
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert any(m.get("episodes") for m in metrics)


def test_deterministic_rollout_plays_the_episodes_in_rounds():
    """rl.deterministic_rollout (several JAX processes): the producer plays the episodes in rounds
    (rlvr.envs.rollout.TurnRounds, after the single-turn groups): the scripted policy's two-turn
    episodes all solve their tasks, and every turn after the first reached the backend in a round."""
    tokenizer = byte_level_tokenizer()
    rl = config_lib.load_config("configs/agentic_tools.py:smoke", {"rl.deterministic_rollout": True}).rl
    policy = _ScriptedCalculatorPolicy(tokenizer)
    rounds = []
    real = rollout_lib.TurnRounds._run_round

    def recorded(self):
        if self._asked and len(self._asked) >= self.live:
            rounds.append(len(self._asked))
        real(self)
    try:
        producer = Producer(policy, build_tasks(rl, seed=0), tokenizer, ProducerSettings.from_config(rl), seed=0)
        try:
            with mock.patch.object(rollout_lib.TurnRounds, "_run_round", recorded):
                batch = producer.make_batch(0)
        finally:
            producer.stop()
    finally:
        policy.close()
    episodes = rl.prompts_per_step * rl.group_size
    assert len(batch.samples) == episodes
    assert all(s.rewards["correct"] == 1.0 and s.rewards["turns"] == 2.0 for s in batch.samples)
    assert rounds == [episodes, episodes]  # each turn of every episode in one engine call
