"""The rollout server driven by clients nobody here wrote: the official `openai` package and SGLang's
own frontend (`sgl.function`, `sgl.gen`, `choices`, streaming, `run_batch`), over a FakeEngine.
Constrained decoding and penalties need the real engine: see test_rollout_engine_server.py."""

import importlib.util
import json
import sys
import threading
import types
from typing import Any

import openai
import pytest
from rollout_fakes import start_server, wait_for

from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.rollout.server_sessions import SessionRecorder

TOK = byte_level_tokenizer()
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]


def expected(prompt, n, seed=0, vocab=300):
    return [(sum(prompt) + i + seed) % vocab for i in range(n)]


@pytest.fixture(scope="module")
def server():
    handle = start_server(tokens_per_step=2)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


# --- the openai package -------------------------------------------------------------------------


def test_openai_completions_echo_logprobs_and_stream(client):
    prompt = TOK.encode("ab", add_special_tokens=True)
    out = client.completions.create(model="fake-model", prompt="ab", max_tokens=4, logprobs=2, echo=True)
    choice = out.choices[0]
    assert choice.text == "ab" + TOK.decode(expected(prompt, 4))
    assert choice.logprobs.tokens[:2] == ["a", "b"] and choice.logprobs.token_logprobs[0] is None  # echoed prompt
    assert choice.logprobs.token_logprobs[2:] == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert choice.logprobs.top_logprobs[0] is None and len(choice.logprobs.top_logprobs[2]) == 2
    assert out.usage.prompt_tokens == 2 and out.usage.completion_tokens == 4
    chunks = list(client.completions.create(model="fake-model", prompt="ab", max_tokens=7, n=2, seed=3, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {i: TOK.decode(expected(prompt, 7, seed=3 + i)) for i in (0, 1)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    finishes = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert finishes == ["length", "length"]


def test_openai_chat_stream_with_tool_call(server):
    handle = start_server(tokens_per_step=3, output_fn=lambda prompt: TOK.encode("Let me add. " + CALL))
    try:
        with openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0) as client:
            messages = [{"role": "user", "content": "1+2?"}]
            whole = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=200)
            stream = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=200,
                                                    stream=True, stream_options={"include_usage": True},
                                                    logprobs=True, top_logprobs=2)
            chunks = list(stream)
    finally:
        handle.stop()
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content == "Let me add."
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    content = "".join(d.content or "" for d in deltas)
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert content == "Let me add. " and "<tool_call" not in content  # the tag never leaks as text
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [(0, "add", {"a": 1,
                                                                                                      "b": 2})]
    assert calls[0].function.arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    tokens = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(tokens) == whole.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in tokens)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def _held_until(after_tokens: int) -> tuple[threading.Event, Any]:
    """A fake engine's output_fn for the prompt "x": endless "a"s (never eos), held back after
    `after_tokens` tokens until `closed` is set, so a stream is certainly still running when its
    client closes it (else a slow client could see it finish first). Other prompts are not held."""
    closed, produced = threading.Event(), [0]

    def output_fn(prompt: list[int]) -> list[int]:
        if "user\nx" in TOK.decode(prompt):
            produced[0] += 1
            if produced[0] > after_tokens:
                closed.wait(60)
        return TOK.encode("a" * 4000)

    output_fn.produced = produced  # type: ignore[attr-defined]
    return closed, output_fn


def test_streamed_calls_are_recorded_in_sessions():
    # The early-closed stream must still be running when the client closes it: its tokens are held back
    # (the engine blocks) from the third step until the close, so the server can only notice it at a write.
    # Without the gate a loaded box let the stream finish (eos) before the close: a record, no error.
    closed, output_fn = _held_until(after_tokens=4)
    handle = start_server(tokens_per_step=2, step_delay=0.002, output_fn=output_fn)
    try:
        sessions = SessionRecorder().attach(handle.server)
        sid = sessions.open(metadata={"task": 3})
        with openai.OpenAI(base_url=sessions.base_url(sid), api_key="unused", max_retries=0) as client:
            chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=5, n=2, seed=1, stream=True))
            early = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=4000, stream=True)
            next(iter(early))
            early.close()
        closed.set()  # the server sees the close at its next write
        wait_for(lambda: sessions.snapshot(sid)["errors"], timeout=30)
        got = sessions.close(sid)
    finally:
        closed.set()
        handle.stop()
    assert [r["choice"] for r in got["records"]] == [0, 1]
    for record in got["records"]:
        text = "".join(c.choices[0].delta.content or "" for c in chunks
                       if c.choices and c.choices[0].index == record["choice"])
        assert record["response"]["message"]["content"] == text == TOK.decode(record["output_ids"])
        assert record["response"]["finish_reason"] == "length" and len(record["output_ids"]) == 5
    assert got["errors"][0]["status"] == 499  # the stream closed early: an error, no record


def test_openai_models_and_errors(client, server):
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    assert client.models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="penalties"):  # the fake engine has none: refused, not ignored
        client.completions.create(model="m", prompt="x", frequency_penalty=0.5)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                           extra_body={"some_future_field": 1})  # unknown fields are ignored
    assert reply.choices[0].finish_reason == "length"


# --- SGLang's frontend --------------------------------------------------------------------------


def sglang_frontend():
    """`sglang.lang` without running `sglang/__init__.py`, which imports SGLang's CUDA runtime (torch,
    triton) although the frontend needs none of it (the test extra installs sglang with --no-deps)."""
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["sglang"] = package
    from sglang.lang import api
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
    return api, RuntimeEndpoint


@pytest.fixture(scope="module")
def sgl(server):
    api, endpoint = sglang_frontend()
    api.set_default_backend(endpoint(server.url))
    return api


def test_sglang_frontend_gen_stream_and_batch(sgl):
    @sgl.function
    def answer(s, question):
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=6, temperature=0)

    state = answer.run(question="hi")
    prompt = TOK.encode("Q: hi\nA:", add_special_tokens=True)
    assert state["answer"] == TOK.decode(expected(prompt, 6))
    streamed = answer.run(question="hi", stream=True)
    assert "".join(streamed.text_iter("answer")) == state["answer"]
    states = answer.run_batch([{"question": q} for q in ("a", "bb", "ccc")], num_threads=3)
    for q, s in zip(("a", "bb", "ccc"), states, strict=True):
        assert s["answer"] == TOK.decode(expected(TOK.encode(f"Q: {q}\nA:", add_special_tokens=True), 6))


def test_sglang_frontend_choices_use_prompt_logprobs(sgl, server):
    """`gen(choices=...)` scores each continuation by its prompt log-probs (logprob_start_len >= 0);
    with the fake's scripted log-probs (-0.01 * position) the expected pick is computed by hand."""
    @sgl.function
    def pick(s):
        s += "Q: pick\nA:"
        s += sgl.gen("choice", choices=["yes", "no way"])

    state = pick.run()
    prefix = len(TOK.encode("Q: pick\nA:", add_special_tokens=True))

    def normalized(choice):  # SGLang's token_length_normalized over positions prefix-1 .. end (first is None)
        total = prefix + len(TOK.encode(choice))
        values = [-0.01 * p for p in range(prefix - 1, total)]
        return sum(values) / len(values)

    assert state["choice"] == max(["yes", "no way"], key=normalized)
    assert any(r["request"].get("logprob_start_len") == prefix - 2 for r in server.records)


def test_client_disconnect_mid_stream_aborts_and_server_stays_healthy():
    closed, output_fn = _held_until(after_tokens=2)
    handle = start_server(tokens_per_step=1, step_delay=0.005, output_fn=output_fn)
    try:
        with openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0) as client:
            stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=4000, stream=True)
            next(iter(stream))
            stream.close()
        closed.set()
        wait_for(lambda: handle.engine.num_running == 0 and not handle.driver.live_rids())
        assert output_fn.produced[0] < 1000  # aborted at the close, not run to its 4,000 tokens
        with openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0) as client:
            assert client.completions.create(model="m", prompt="x", max_tokens=2).choices[0].finish_reason == "length"
    finally:
        closed.set()
        handle.stop()
