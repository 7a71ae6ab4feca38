"""Black-box agents over the OpenAI endpoint: recording sessions and their token-level trajectories.

The real-engine tests run a tiny random model whose output head only reaches lowercase letters and
space (every other logit column is zeroed), so its replies re-tokenise exactly and a well-behaved
multi-turn agent must merge into one trajectory. Expected tokens / logprobs come from the HTTP
responses (`return_token_ids`, `logprobs`: the engine's completions), never from the recorder.
"""

import json
import threading
import time

import httpx
import jax
import numpy as np
import pytest
from rollout_fakes import start_server

from rlvr import sharding
from rlvr.envs.agent import (
    calculate,
    calculator_agent,
    family_score_fn,
    records_to_trajectories,
    run_agent_episode,
)
from rlvr.models.config import ModelConfig
from rlvr.models.params import init_params
from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.rollout.driver import EngineDriver
from rlvr.rollout.engine import Engine
from rlvr.rollout.server import serve
from rlvr.rollout.server_sessions import SessionRecorder
from rlvr.rollout.tool_calls import parse_tool_calls
from rlvr.tasks.base import Family, Task

TOK = byte_level_tokenizer()
EOS = TOK.eos_id
CFG = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=300, rope_theta=10000.0)
LETTERS = "abcdefghijklmnop "


def letters_only_params():
    params = init_params(CFG, jax.random.key(0), sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    head = params["lm_head"]["kernel"]
    scale = np.zeros(CFG.vocab_size, np.float32)
    scale[[ord(c) for c in LETTERS]] = 1.0 / float(head.std())  # logits ~ N(0, 8^2) on letters, 0 elsewhere
    params["lm_head"]["kernel"] = jax.device_put(head * scale, head.sharding)
    return params


@pytest.fixture(scope="module")
def real():
    engine = Engine(CFG, letters_only_params(), tokenizer=TOK, max_len=256, max_slots=8)
    driver = EngineDriver(engine)
    records = []
    server, _ = serve(driver, recorder=records.append)
    sessions = SessionRecorder().attach(server)
    server.global_records = records
    yield server, sessions
    server.stop()
    driver.close()


def score_contains(task, answer):
    return {"reward": float(task in answer), "correct": 0.0}


class ChatAgent:
    """Multi-turn chat agent over httpx that keeps every response (the independent reference)."""

    def __init__(self, turns=3, rewrite=False, crash_after=None, max_tokens=10):
        self.turns, self.rewrite, self.crash_after, self.max_tokens = turns, rewrite, crash_after, max_tokens
        self.responses = []

    def __call__(self, base_url, task):
        messages = [{"role": "user", "content": f"task {task}"}]
        for turn in range(self.turns):
            body = {"model": "m", "messages": messages, "max_tokens": self.max_tokens, "temperature": 1.0,
                    "seed": 100 + turn, "logprobs": True, "return_token_ids": True, "return_meta_info": True}
            reply = httpx.post(base_url + "/chat/completions", json=body, timeout=120)
            reply.raise_for_status()
            choice = reply.json()["choices"][0]
            self.responses.append(choice)
            if self.crash_after == turn:
                raise RuntimeError("agent bug")
            if self.rewrite:  # summarises its history instead of sending the assistant turn back
                messages = [{"role": "user", "content": f"summary of {task}: {choice['message']['content']}"}]
            else:
                messages += [{"role": "assistant", "content": choice["message"]["content"]},
                             {"role": "user", "content": f"continue {turn}"}]
        return f"done {task} " + choice["message"]["content"]


def expected_trajectory(responses):
    """(prompt, output ids, loss mask, logprobs) of a merged episode, from the HTTP responses only."""
    prompt = responses[0]["prompt_token_ids"]
    last = responses[-1]
    full = last["prompt_token_ids"] + last["token_ids"]
    mask, logprobs = [0] * (len(full) - len(prompt)), [0.0] * (len(full) - len(prompt))
    for r in responses:
        start = len(r["prompt_token_ids"]) - len(prompt)
        assert full[start + len(prompt):start + len(prompt) + len(r["token_ids"])] == r["token_ids"]
        for i, entry in enumerate(r["logprobs"]["content"]):
            mask[start + i], logprobs[start + i] = 1, entry["logprob"]
    return prompt, full[len(prompt):], mask, logprobs


# --- the real engine ----------------------------------------------------------------------


def test_agent_calls_merge_into_one_trajectory_of_sampled_tokens(real):
    server, sessions = real
    agent = ChatAgent(turns=3)
    trajs, rewards, trace = run_agent_episode(agent, "alpha", sessions, server.url, score_contains, timeout_s=120)
    assert trace["status"] == "ok" and rewards == {"reward": 1.0, "correct": 0.0}
    assert trace["metrics"]["agent/prefix_breaks"] == 0 and trace["metrics"]["agent/calls"] == 3
    [traj] = trajs
    prompt, output, mask, logprobs = expected_trajectory(agent.responses)
    assert traj.prompt_ids == prompt and traj.output_ids == output
    assert traj.loss_mask == mask and sum(mask) == sum(len(r["token_ids"]) for r in agent.responses)
    assert traj.logprobs == pytest.approx(logprobs, abs=1e-6)
    assert traj.versions == [0 if m else -1 for m in mask]
    meta = [lp for r in agent.responses for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
    assert [lp for lp, m in zip(traj.logprobs, mask, strict=True) if m] == pytest.approx(meta, abs=1e-6)
    assert traj.rewards == rewards and traj.turns == 3 and traj.truncated  # max_tokens cut the last turn
    # the prompt is the server's own rendering, and the tokens are what the engine samples for it
    assert prompt == TOK.apply_chat_template([{"role": "user", "content": "task alpha"}], add_generation_prompt=True)
    first = agent.responses[0]
    replay = httpx.post(server.url + "/generate", timeout=120, json={
        "input_ids": first["prompt_token_ids"], "sampling_params": {"max_new_tokens": 10, "temperature": 1.0,
                                                                    "sampling_seed": 100}}).json()
    assert replay["output_ids"] == first["token_ids"]
    # the records: request, response, timing; the global recorder saw them tagged with the session
    calls = trace["calls"]
    assert [c["output_tokens"] for c in calls] == [len(r["token_ids"]) for r in agent.responses]
    assert all(c["start_time"] <= c["end_time"] and c["finish_reason"]["type"] == "length" for c in calls)
    assert trace["messages"][0] == {"role": "user", "content": "task alpha"}
    tagged = [r for r in server.global_records if r.get("session") == trace["session"]]
    assert [r["output_ids"] for r in tagged] == [r["token_ids"] for r in agent.responses]
    assert trace["session"] not in sessions  # closed and freed


def test_history_rewrite_is_a_prefix_break(real):
    server, sessions = real
    agent = ChatAgent(turns=2, rewrite=True)
    trajs, rewards, trace = run_agent_episode(agent, "beta", sessions, None, score_contains, timeout_s=120)
    assert trace["status"] == "ok" and trace["metrics"]["agent/prefix_breaks"] == 1 and len(trajs) == 2
    for traj, response in zip(trajs, agent.responses, strict=True):
        assert traj.prompt_ids == response["prompt_token_ids"] and traj.output_ids == response["token_ids"]
        assert traj.loss_mask == [1] * len(response["token_ids"]) and traj.rewards == rewards
    assert [t.trace["start"] for t in trajs] == ["first", "prefix_break"]


def test_crashing_timed_out_and_bad_agents_are_recorded_failures(real):
    server, sessions = real
    crash = ChatAgent(turns=3, crash_after=0)
    trajs, rewards, trace = run_agent_episode(crash, "gamma", sessions, None, score_contains, timeout_s=120)
    assert trace["status"] == "error" and "RuntimeError: agent bug" in trace["error"]
    assert rewards == {"reward": 0.0, "correct": 0.0} and trace["metrics"]["agent/failed"] == 1
    [traj] = trajs  # the call it made is kept, with reward 0
    assert traj.output_ids == crash.responses[0]["token_ids"] and traj.rewards == rewards
    assert run_agent_episode(crash, "gamma", sessions, None, score_contains, keep_failed=False)[0] == []

    release, urls = threading.Event(), []

    def stuck(base_url, task):
        urls.append(base_url)
        release.wait(30)
        return httpx.post(base_url + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                "max_tokens": 2}, timeout=30).status_code

    trajs, rewards, trace = run_agent_episode(stuck, "delta", sessions, None, score_contains, timeout_s=0.3)
    assert trace["status"] == "timeout" and rewards["reward"] == 0.0 and trajs == []
    assert trace["session"] not in sessions
    late = httpx.post(urls[0] + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert late.status_code == 404 and "closed" in late.json()["error"]["message"]
    release.set()

    _, rewards, trace = run_agent_episode(lambda url, task: 42, "e", sessions, None, score_contains)
    assert trace["status"] == "error" and "not a str" in trace["error"] and rewards["reward"] == 0.0

    def bad_score(task, answer):
        raise ValueError("verifier crashed")

    _, rewards, trace = run_agent_episode(lambda url, task: "ok", "f", sessions, None, bad_score)
    assert trace["status"] == "score_error" and "verifier crashed" in trace["error"] and rewards["reward"] == 0.0
    assert len(sessions) == 0


def test_concurrent_sessions_do_not_mix(real):
    server, sessions = real
    agents = {name: ChatAgent(turns=2) for name in ("one", "two", "three")}
    results = {}

    def episode(name):
        results[name] = run_agent_episode(agents[name], name, sessions, None, score_contains, timeout_s=120)

    threads = [threading.Thread(target=episode, args=(name,)) for name in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len({results[name][2]["session"] for name in agents}) == 3
    for name, agent in agents.items():
        trajs, rewards, trace = results[name]
        assert trace["status"] == "ok" and rewards["reward"] == 1.0 and len(trajs) == 1
        prompt, output, mask, _ = expected_trajectory(agent.responses)
        assert (trajs[0].prompt_ids, trajs[0].output_ids, trajs[0].loss_mask) == (prompt, output, mask)
        assert TOK.decode(prompt).count(f"task {name}") == 1
        assert [c["rid"] for c in trace["calls"]] == [r["meta_info"]["id"] for r in agent.responses]
    assert len(sessions) == 0


# --- sessions over the fake engine ----------------------------------------------------------


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression":"6*7"}}\n</tool_call>'


def calculator_script(prompt):
    text = TOK.decode(prompt)
    return TOK.encode("<answer>42</answer>" if "<tool_response>" in text else CALL)


def test_tool_calls_round_trip_and_merge():
    handle = start_server(output_fn=calculator_script)
    try:
        sessions = SessionRecorder().attach(handle.server)
        family = Family()
        task = Task(index=0, prompt="What is 6*7?", answer="42", verifier={"kind": "exact", "answer": "42"})
        trajs, rewards, trace = run_agent_episode(calculator_agent(max_tokens=200), task, sessions, handle.url,
                                                  family_score_fn(family))
        assert trace["status"] == "ok" and trace["answer"] == "<answer>42</answer>"
        assert rewards["reward"] == 1.0 and rewards["correct"] == 1.0
        assert trace["metrics"]["agent/prefix_breaks"] == 0
        [traj] = trajs
        first, second = handle.records  # the global recorder, tagged with the session
        assert first["session"] == second["session"] == trace["session"]
        call = first["response"]["message"]["tool_calls"][0]["function"]
        assert call == {"name": "calculator", "arguments": '{"expression":"6*7"}'}  # the model's own JSON text
        assert first["output_ids"] == [*TOK.encode(CALL), EOS]  # the sampled stop token is kept
        assert traj.prompt_ids == first["prompt_ids"]
        gap = second["prompt_ids"][len(first["prompt_ids"]) + len(first["output_ids"]):]
        assert TOK.decode(gap) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                                   "<|im_start|>assistant\n")
        assert traj.output_ids == first["output_ids"] + gap + second["output_ids"]
        assert traj.loss_mask == [1] * len(first["output_ids"]) + [0] * len(gap) + [1] * len(second["output_ids"])
        assert traj.logprobs[:3] == pytest.approx([0.0, -0.1, -0.2]) and not traj.truncated
        assert traj.trace["calls"][1]["observation_tokens"] == len(gap)
        messages = second["request"]["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
        assert second["request"]["tools"][0]["function"]["name"] == "calculator"
    finally:
        handle.stop()


def test_session_http_api_limits_and_expiry():
    handle = start_server()
    now = [0.0]
    try:
        sessions = SessionRecorder(ttl_s=10, max_sessions=2, max_calls=2, clock=lambda: now[0]).attach(handle.server)
        http = httpx.Client(base_url=handle.url, timeout=10)
        opened = http.post("/sessions", json={"id": "s1", "metadata": {"task": 1}}).json()
        assert opened["id"] == "s1" and opened["base_url"] == handle.url + "/sessions/s1/v1"
        assert http.post("/sessions", json={"id": "s1"}).status_code == 409
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        reply = http.post("/sessions/s1/v1/chat/completions", json={**chat, "return_token_ids": True}).json()
        assert http.get("/sessions/s1/v1/models").status_code == 200
        bad = http.post("/sessions/s1/v1/chat/completions", json={**chat, "stream": True, "return_token_ids": True})
        assert bad.status_code == 400  # counted as a call, kept in the session's errors
        assert http.post("/sessions/s1/v1/chat/completions", json=chat).status_code == 429  # max_calls
        got = http.get("/sessions/s1").json()
        assert got["metadata"] == {"task": 1} and got["calls"] == 2 and len(got["errors"]) == 1
        [record] = got["records"]
        assert record["output_ids"] == reply["choices"][0]["token_ids"] and record["call"] == 0
        assert http.post("/sessions/s1/v1/completions", json={"prompt": "x"}).status_code == 429
        assert http.delete("/sessions/s1").json()["records"] == got["records"]
        assert http.get("/sessions/s1").status_code == 404 and len(sessions) == 0
        assert http.post("/sessions/s1/v1/chat/completions", json=chat).status_code == 404
        assert http.get("/sessions/nope/v1/chat/completions").status_code in (404, 405)
        assert http.post("/sessions/s1/x").status_code == 404
        assert http.post("/sessions", json={"id": "bad/id"}).status_code == 400
        anonymous = http.post("/sessions").json()["id"]
        assert [s["id"] for s in http.get("/sessions").json()["sessions"]] == [anonymous]
        assert http.post(f"/sessions/{anonymous}/close").json()["state"] == "closed" and len(sessions) == 0
        # the plain routes are untouched
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        # ttl: idle sessions expire; the cap evicts the least recently active one
        a, b = sessions.open(), sessions.open()
        now[0] = 5.0
        assert http.post(f"/sessions/{a}/v1/chat/completions", json=chat).status_code == 200  # a is active
        c = sessions.open()  # over max_sessions: b (idle longest) goes
        assert sessions.session_ids() == [a, c] and sessions.expired == 1
        with pytest.raises(KeyError, match="evicted"):
            sessions.close(b)
        now[0] = 15.5  # c idle 15.5 s, a idle 10.5 s
        assert sorted(sessions.sweep()) == sorted([a, c]) and len(sessions) == 0
        expired = http.post(f"/sessions/{a}/v1/chat/completions", json=chat)
        assert expired.status_code == 404 and "expired" in expired.json()["error"]["message"]
        assert sessions._gone and len(sessions._sessions) == 0
        http.close()
    finally:
        handle.stop()


def test_closing_a_session_aborts_its_requests_in_flight():
    handle = start_server(step_delay=0.02, tokens_per_step=1)
    try:
        sessions = SessionRecorder().attach(handle.server)
        sid = sessions.open()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}
        box = {}
        thread = threading.Thread(target=lambda: box.update(r=httpx.post(
            sessions.base_url(sid) + "/chat/completions", json=body, timeout=30)))
        thread.start()
        deadline = time.monotonic() + 10
        while not handle.driver.live_rids() and time.monotonic() < deadline:
            time.sleep(0.01)
        log = sessions.close(sid)
        thread.join(10)
        assert box["r"].status_code == 200 and box["r"].json()["choices"][0]["finish_reason"] == "abort"
        assert log["records"] == [] and not handle.driver.live_rids()
    finally:
        handle.stop()


# --- merging rules and helpers ----------------------------------------------------------------


def rec(prompt, output, finish="stop", lp=-0.5, version=3):
    return {"prompt_ids": list(prompt), "output_ids": list(output), "output_logprobs": [lp] * len(output),
            "output_versions": [version] * len(output), "finish_reason": {"type": finish}, "rid": f"r{len(prompt)}"}


def test_merge_rules_on_ids():
    p, o = [1, 2, 3], [7, 8, EOS]
    # re-rendered stop token then template tokens: one trajectory; the stop token stays trained
    trajs, m = records_to_trajectories([rec(p, o), rec(p + o + [10, 11], [9, EOS])], {"reward": 1.0})
    [t] = trajs
    assert t.output_ids == [7, 8, EOS, 10, 11, 9, EOS] and t.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert t.logprobs == [-0.5] * 3 + [0.0] * 2 + [-0.5] * 2 and t.versions == [3] * 3 + [-1] * 2 + [3] * 2
    assert m["agent/prefix_breaks"] == 0 and m["agent/observation_tokens"] == 2 and not t.truncated
    # a turn cut by max_tokens: the template's end token is an observation token
    [t] = records_to_trajectories([rec(p, [7, 8], "length"), rec(p + [7, 8, EOS, 10], [9])])[0]
    assert t.loss_mask == [1, 1, 0, 0, 1]
    # any other id mismatch (a different stop token re-rendered, a rewritten last token) is a break
    trajs, m = records_to_trajectories([rec(p, [7, 8, 99]), rec(p + [7, 8, EOS, 10], [9])], {"reward": 0.5})
    assert len(trajs) == 2 and m["agent/prefix_breaks"] == 1 and all(t.rewards == {"reward": 0.5} for t in trajs)
    # n > 1 / retries are forks; interleaved conversations each extend their own trajectory
    q = [4, 5]
    trajs, m = records_to_trajectories([rec(p, o), rec(p, [6, EOS]), rec(q, [1]), rec(p + o + [10], [2]),
                                        rec(q + [1, 11], [3])])
    assert [t.turns for t in trajs] == [2, 1, 2] and m["agent/forks"] == 1 and m["agent/prefix_breaks"] == 1
    assert [t.trace["start"] for t in trajs] == ["first", "fork", "prefix_break"]
    assert records_to_trajectories([])[0] == []
    with pytest.raises(ValueError, match="output_logprobs"):
        records_to_trajectories([{**rec(p, o), "output_logprobs": [0.0]}])


def test_parse_tool_calls_keeps_the_models_argument_text():
    text = 'x\n<tool_call>\n{"name": "f", "arguments": {"b":2, "a": [1,2]}}\n</tool_call>'
    content, [call] = parse_tool_calls(text)
    assert content == "x" and call["function"]["arguments"] == '{"b":2, "a": [1,2]}'
    assert json.loads(call["function"]["arguments"]) == {"b": 2, "a": [1, 2]}
    rendered = TOK.apply_chat_template([{"role": "assistant", "content": content, "tool_calls": [call]}])
    assert TOK.decode(rendered) == f"<|im_start|>assistant\n{text}<|im_end|>\n"
    _, [nested] = parse_tool_calls('<tool_call>{"name": "g", "parameters": {"arguments": 1}}</tool_call>')
    assert nested["function"]["arguments"] == '{"arguments": 1}'


def test_calculator():
    assert calculate("6*7") == "42" and calculate("(1+2)/4") == "0.75" and calculate("2**10") == "1024"
    assert calculate("__import__('os')").startswith("error") and calculate("9**9999").startswith("error")
