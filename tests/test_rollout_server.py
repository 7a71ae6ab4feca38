"""The SGLang-compatible server (and its EngineDriver) over a deterministic FakeEngine, via real HTTP."""

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_fakes import FakeEngine, start_server, wait_for

from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.rollout.driver import DriverClosedError, EngineDriver
from rlvr.rollout.server_protocol import SAMPLING_KEYS
from rlvr.rollout.tool_calls import parse_tool_calls
from rlvr.rollout.types import Request, SamplingParams

TOK = byte_level_tokenizer()
EOS = TOK.eos_id


@pytest.fixture
def make():
    handles = []

    def factory(**kwargs):
        handle = start_server(**kwargs)
        handle.http = httpx.Client(base_url=handle.url, timeout=10)
        handles.append(handle)
        return handle

    yield factory
    for handle in handles:
        handle.http.close()
        handle.stop()


@pytest.fixture
def srv(make):
    return make()


@pytest.fixture(scope="module")
def shared():
    """One server for the stateless error tests (starting one per case costs ~0.1 s)."""
    handle = start_server()
    handle.http = httpx.Client(base_url=handle.url, timeout=10)
    yield handle
    handle.http.close()
    handle.stop()


def expected(prompt, n, seed=0, vocab=300):
    return [(sum(prompt) + i + seed) % vocab for i in range(n)]


def post_in_thread(url, path, body, timeout=10):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(httpx.post, url + path, json=body, timeout=timeout)
    pool.shutdown(wait=False)
    return future


# --- /generate ------------------------------------------------------------------------------


def test_generate_single_meta_info_and_logprobs(srv):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}, "return_logprob": True, "rid": "r1"}
    out = srv.http.post("/generate", json=body).json()
    assert out["output_ids"] == expected([1, 2, 3], 5)
    meta = out["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 5}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (3, 5, "0")
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] >= 0
    logprobs = [[pytest.approx(-0.1 * i), t, None] for i, t in enumerate(out["output_ids"])]
    assert meta["output_token_logprobs"] == logprobs
    assert meta["output_token_logprobs_length"] == 5
    again = srv.http.put("/generate", json={**body, "rid": "r2"}).json()  # PUT too; prefix now cached
    assert again["output_ids"] == out["output_ids"] and again["meta_info"]["cached_tokens"] == 2
    plain = srv.http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert "output_token_logprobs" not in plain.json()["meta_info"]


def test_generate_text_and_prompt_ids(srv):
    out = srv.http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3},
                                           "return_prompt_token_ids": True}).json()
    assert out["prompt_token_ids"] == TOK.encode("hi", add_special_tokens=True)
    assert out["output_ids"] == expected(TOK.encode("hi"), 3)
    assert out["text"] == TOK.decode(out["output_ids"])


def test_batch_n_prompt_major_order_and_rids(srv):
    body = {"input_ids": [[1], [2, 3]], "rid": "g", "sampling_params": {"max_new_tokens": 2, "n": 3,
                                                                        "sampling_seed": 10}}
    outs = srv.http.post("/generate", json=body).json()
    assert [o["meta_info"]["id"] for o in outs] == [f"g_{k}" for k in range(6)]
    for k, out in enumerate(outs):
        prompt = [[1], [2, 3]][k // 3]
        assert out["output_ids"] == expected(prompt, 2, seed=10 + k % 3)
    listed = srv.http.post("/generate", json={"input_ids": [[1], [2]], "rid": ["a", "b"],
                                              "sampling_params": {"max_new_tokens": 1, "n": 2}}).json()
    assert [o["meta_info"]["id"] for o in listed] == ["a_0", "a_1", "b_0", "b_1"]
    per_item = srv.http.post("/generate", json={"input_ids": [[1], [2]], "return_logprob": [True, False],
                                                "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 3}]})
    first, second = per_item.json()
    assert len(first["output_ids"]) == 1 and "output_token_logprobs" in first["meta_info"]
    assert len(second["output_ids"]) == 3 and "output_token_logprobs" not in second["meta_info"]
    single_n = srv.http.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1, "n": 2}})
    assert isinstance(single_n.json(), list) and len(single_n.json()) == 2


def test_text_in_logprobs_stop_strings_and_stop_tokens(srv):
    body = {"input_ids": [97], "return_logprob": True, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 10, "stop": "cd"}}
    out = srv.http.post("/generate", json=body).json()  # outputs "abcd..." (sum=97)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "cd"}
    assert out["text"] == "ab" and out["output_ids"] == [97, 98, 99, 100]
    assert [item[2] for item in out["meta_info"]["output_token_logprobs"]] == ["a", "b", "c", "d"]
    body["sampling_params"]["no_stop_trim"] = True
    assert srv.http.post("/generate", json=body).json()["text"] == "abcd"
    tok_stop = {"input_ids": [97], "sampling_params": {"max_new_tokens": 10, "stop_token_ids": [100]}}
    out = srv.http.post("/generate", json=tok_stop).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 100} and out["text"] == "abc"
    tok_stop["sampling_params"]["no_stop_trim"] = True
    assert srv.http.post("/generate", json=tok_stop).json()["text"] == "abcd"


def test_skip_special_tokens(make):
    script = [104, 105, TOK.token_to_id("<|endoftext|>"), 33]
    handle = make(output_fn=lambda prompt: script)
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 10}}
    out = handle.http.post("/generate", json=body).json()
    assert out["output_ids"] == [*script, EOS] and out["meta_info"]["finish_reason"]["matched"] == EOS
    assert out["text"] == "hi!"
    body["sampling_params"].update(skip_special_tokens=False, no_stop_trim=True)
    assert handle.http.post("/generate", json=body).json()["text"] == "hi<|endoftext|>!<|im_end|>"


def sse_events(response):
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stream_single_cumulative(make):
    handle = make(tokens_per_step=2)
    body = {"input_ids": [1, 2], "stream": True, "return_logprob": True, "sampling_params": {"max_new_tokens": 7}}
    with handle.http.stream("POST", "/generate", json=body) as response:
        assert response.headers["content-type"] == "text/event-stream"
        chunks = sse_events(response)
    assert len(chunks) >= 3 and all("index" not in c for c in chunks)
    for prev, nxt in zip(chunks, chunks[1:], strict=False):
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert len(nxt["output_ids"]) > len(prev["output_ids"])
        assert prev["meta_info"]["finish_reason"] is None
    assert chunks[-1]["output_ids"] == expected([1, 2], 7)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 7


def test_stream_batch_carries_index(make):
    handle = make(tokens_per_step=1)
    body = {"input_ids": [[1], [2]], "stream": True, "sampling_params": {"max_new_tokens": 3, "n": 2}}
    with handle.http.stream("POST", "/generate", json=body) as response:
        chunks = sse_events(response)
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    for index, final in finals.items():
        assert final["output_ids"] == expected([[1], [2]][index // 2], 3)


# --- control --------------------------------------------------------------------------------


def test_abort_request_and_abort_all(make):
    handle = make(tokens_per_step=1, step_delay=0.005)
    body = {"input_ids": [1], "rid": "long", "sampling_params": {"max_new_tokens": 4000}}
    future = post_in_thread(handle.url, "/generate", body)
    wait_for(lambda: handle.http.get("/v1/loads").json()["num_running_reqs"] == 1)
    assert handle.http.post("/abort_request", json={"rid": "long"}).status_code == 200
    out = future.result(5).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < 4000
    group = post_in_thread(handle.url, "/generate", {**body, "rid": "grp", "sampling_params": {
        "max_new_tokens": 4000, "n": 2}})
    wait_for(lambda: handle.http.get("/v1/loads").json()["num_running_reqs"] == 2)
    handle.http.post("/abort_request", json={"rid": "grp"})  # prefix: aborts grp_0 and grp_1
    assert [o["meta_info"]["finish_reason"]["type"] for o in group.result(5).json()] == ["abort", "abort"]
    other = post_in_thread(handle.url, "/generate", {**body, "rid": "x"})
    wait_for(lambda: handle.http.get("/v1/loads").json()["num_running_reqs"] == 1)
    handle.http.post("/abort_request", json={"abort_all": True})
    assert other.result(5).json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_pause_in_place_then_continue(make):
    handle = make(tokens_per_step=1, step_delay=0.005)
    future = post_in_thread(handle.url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 40}})
    wait_for(lambda: handle.http.get("/v1/loads").json()["num_running_reqs"] == 1)
    reply = handle.http.post("/pause_generation", json={"mode": "in_place"}).json()
    assert reply["status"] == "ok" and "1 requests" in reply["message"]
    steps = handle.engine.steps
    time.sleep(0.2)
    assert not future.done() and handle.engine.steps <= steps + 1  # no busy stepping while paused
    assert handle.http.post("/flush_cache").status_code == 400  # KV kept for the paused request
    assert handle.http.get("/health_generate").status_code == 200
    assert handle.http.post("/continue_generation", json={}).json()["status"] == "ok"
    out = future.result(5).json()
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["output_ids"] == expected([1], 40)


def test_pause_abort_and_retract(make):
    handle = make(tokens_per_step=1, step_delay=0.005)
    future = post_in_thread(handle.url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 4000}})
    wait_for(lambda: handle.http.get("/v1/loads").json()["num_running_reqs"] == 1)
    assert handle.http.post("/pause_generation").json()["status"] == "ok"  # default mode: abort
    assert future.result(5).json()["meta_info"]["finish_reason"]["type"] == "abort"
    queued = post_in_thread(handle.url, "/generate", {"input_ids": [2], "sampling_params": {"max_new_tokens": 2}})
    time.sleep(0.2)
    assert not queued.done()  # paused: new requests wait
    handle.http.post("/continue_generation")
    assert queued.result(5).json()["output_ids"] == expected([2], 2)
    reply = handle.http.post("/pause_generation", json={"mode": "retract"}).json()
    assert "retract" in reply["message"] and handle.driver.paused
    handle.http.post("/continue_generation")


def test_sglang_empty_values_and_unknown_fields(srv):
    """What SGLang's own clients send: empty = unset, null = default, unknown top-level fields ignored."""
    plain = srv.http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}).json()
    noisy = {"input_ids": [1, 2], "image_data": [], "token_ids_logprob": [], "custom_labels": {"a": "b"},
             "return_bytes": False, "sampling_logprobs_mode": None, "return_output_logprob_only": True,
             "logprob_start_len": 0, "top_logprobs_num": 3,  # ignored without return_logprob
             "sampling_params": {"max_new_tokens": 3, "stop_regex": [], "regex": "", "json_schema": None,
                                 "stop": [], "beam_width": None, "temperature": None, "top_k": 2**30,
                                 "logit_bias": {}, "spaces_between_special_tokens": False, "choice": []}}
    out = srv.http.post("/generate", json=noisy)
    assert out.status_code == 200, out.text
    assert out.json()["output_ids"] == plain["output_ids"] == expected([1, 2], 3)
    assert "input_token_logprobs" not in out.json()["meta_info"]
    unknown = srv.http.post("/generate", json={"input_ids": [1], "sampling_params": {"temprature": 0}})
    assert unknown.status_code == 400 and "temprature" in unknown.json()["error"]["message"]


def test_max_new_tokens_omitted_null_and_explicit(make):
    handle = make(context_length=10)
    prompt = [1, 2, 3, 4, 5, 6]
    omitted = handle.http.post("/generate", json={"input_ids": prompt}).json()
    assert len(omitted["output_ids"]) == 4  # 128 clipped to the 10-token context, as SGLang does
    null = handle.http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": None}})
    assert len(null.json()["output_ids"]) == 4
    explicit = handle.http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 5}})
    assert explicit.status_code == 400 and "context length" in explicit.json()["error"]["message"]
    fits = handle.http.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}})
    assert fits.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_prompt_and_top_logprobs_native_format(srv):
    """SGLang's layout: input positions from logprob_start_len (the first None), top-k rows per
    position, token_ids_logprob rows, texts filled with return_text_in_logprobs (FakeEngine values)."""
    body = {"input_ids": [104, 105, 33], "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2,
            "token_ids_logprob": [7], "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 2}}
    meta = srv.http.post("/generate", json=body).json()["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 105, "i"], [pytest.approx(-0.02), 33, "!"]]
    assert meta["input_top_logprobs"][0] is None
    assert meta["input_top_logprobs"][1] == [[pytest.approx(-0.02), 33, "!"], [pytest.approx(-0.52), 34, '"']]
    out_ids = expected([104, 105, 33], 2)
    assert [row[0][1] for row in meta["output_top_logprobs"]] == out_ids and len(meta["output_top_logprobs"]) == 2
    assert meta["output_token_ids_logprobs"] == [[[pytest.approx(-1.007), 7, TOK.decode([7])]]] * 2
    assert meta["input_token_ids_logprobs"][0] is None
    whole = srv.http.post("/generate", json={**body, "logprob_start_len": 0, "top_logprobs_num": 0,
                                             "token_ids_logprob": None}).json()["meta_info"]
    assert [x[1] for x in whole["input_token_logprobs"]] == [104, 105, 33] and "input_top_logprobs" not in whole
    plain = srv.http.post("/generate", json={**body, "logprob_start_len": -1}).json()["meta_info"]
    assert plain["input_token_logprobs"] == []


def test_weight_version_labels_are_strings(srv, tmp_path):
    for label in ("policy-step-7", "policy-step-8"):
        reply = srv.http.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": label})
        assert reply.json()["success"], reply.text
        assert srv.http.get("/model_info").json()["weight_version"] == label
    out = srv.http.post("/generate", json={"input_ids": [1], "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 2}}).json()
    meta = out["meta_info"]
    assert meta["weight_version"] == "policy-step-8" and meta["output_weight_versions"] == [2, 2]
    assert srv.http.post("/update_weight_version", json={"new_version": "rc1"}).json()["new_version"] == "rc1"
    assert srv.http.get("/server_info").json()["internal_states"][0]["weight_version"] == "rc1"


def test_pause_retract_frees_kv_and_flush_works_while_paused(make):
    handle = make(tokens_per_step=1, step_delay=0.005)
    body = {"input_ids": [1], "return_logprob": True, "sampling_params": {"max_new_tokens": 60}}
    future = post_in_thread(handle.url, "/generate", body)
    wait_for(lambda: handle.http.get("/v1/loads").json()["num_running_reqs"] == 1)
    assert handle.http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    assert handle.http.post("/flush_cache").status_code == 400  # in_place keeps the KV: SGLang refuses too
    handle.http.post("/continue_generation")
    wait_for(lambda: handle.engine.num_running == 1)
    reply = handle.http.post("/pause_generation", json={"mode": "retract"}).json()
    assert "1 requests retracted" in reply["message"]
    loads = handle.http.get("/v1/loads").json()
    assert (loads["num_running_reqs"], loads["num_waiting_reqs"]) == (0, 1)  # back in the queue
    assert handle.http.post("/flush_cache").status_code == 200  # nothing holds KV now
    assert handle.http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    handle.http.post("/continue_generation")
    time.sleep(0.1)
    assert not future.done()  # the KV pool is released: nothing runs until it is resumed
    assert handle.http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    out = future.result(5).json()
    assert out["output_ids"] == expected([1], 60) and out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["meta_info"]["output_token_logprobs"]) == 60


def test_memory_release_needs_idle_and_more_routes(make):
    handle = make(tokens_per_step=1, step_delay=0.005)
    future = post_in_thread(handle.url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 4000}})
    wait_for(lambda: handle.http.get("/v1/loads").json()["num_running_reqs"] == 1)
    busy = handle.http.post("/release_memory_occupation", json={})
    assert busy.status_code == 400 and "idle" in busy.json()["error"]["message"]
    assert handle.http.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 1, "num_running_reqs": 1,
                                                    "num_waiting_reqs": 0}]
    handle.http.post("/abort_request", json={"abort_all": True})
    future.result(5)
    assert handle.http.get("/release_memory_occupation").status_code == 200  # GET too, all tags
    assert handle.engine.released == {"kv_cache", "weights", "cuda_graph"}
    assert handle.http.post("/resume_memory_occupation", json={"tags": None}).status_code == 200
    assert not handle.engine.released
    card = handle.http.get("/v1/models/fake-model").json()
    assert card["id"] == "fake-model" and card["max_model_len"] == 4096
    assert handle.http.get("/v1/models/other").json()["error"]["code"] == "model_not_found"
    for prefix in ("", "/v1"):
        tok = handle.http.post(prefix + "/tokenize", json={"prompt": "hi!", "add_special_tokens": False}).json()
        assert tok == {"tokens": TOK.encode("hi!"), "count": 3, "max_model_len": 4096}
        many = handle.http.post(prefix + "/tokenize", json={"prompt": ["a", "bc"]}).json()
        assert many["tokens"] == [TOK.encode("a", add_special_tokens=True), TOK.encode("bc", add_special_tokens=True)]
        chat = handle.http.post(prefix + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
        assert chat["tokens"] == TOK.apply_chat_template([{"role": "user", "content": "x"}],
                                                         add_generation_prompt=True)
        text = handle.http.post(prefix + "/detokenize", json={"tokens": [104, 105, EOS]}).json()
        assert text == {"text": "hi"}
        texts = handle.http.post(prefix + "/detokenize", json={"tokens": [[104], [105, EOS]],
                                                               "skip_special_tokens": False}).json()
        assert texts == {"text": ["h", "i" + TOK.decode([EOS])]}


def test_status_endpoints(srv):
    for path in ("/health", "/ready", "/health_generate"):
        assert srv.http.get(path).status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = srv.http.get(path).json()
        assert info["model_path"] == "fake-model" and info["weight_version"] == "0" and info["is_generation"]
        assert info["architectures"] == ["FakeForCausalLM"] and info["vocab_size"] == 300
    for path in ("/server_info", "/get_server_info"):
        info = srv.http.get(path).json()
        assert info["port"] == srv.server.server_address[1] and info["internal_states"][0]["num_running_reqs"] == 0
    loads = srv.http.get("/v1/loads").json()
    assert loads["loads"][0] == {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}
    models = srv.http.get("/v1/models").json()
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["max_model_len"] == 4096
    assert srv.http.get("/flush_cache").status_code == 200 and srv.http.post("/flush_cache").status_code == 200
    assert not any(r["rid"].startswith("HEALTH") for r in srv.records)  # health checks are not training data


def test_update_weights_from_disk_bumps_version(srv, tmp_path):
    reply = srv.http.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "3"})
    assert reply.status_code == 200 and reply.json()["success"] and reply.json()["num_paused_requests"] == 0
    assert srv.engine.weight_paths == [str(tmp_path)]
    assert srv.http.get("/model_info").json()["weight_version"] == "3"
    out = srv.http.post("/generate", json={"input_ids": [1], "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["weight_version"] == "3" and out["meta_info"]["output_weight_versions"] == [3, 3]
    assert srv.http.post("/update_weights_from_disk", json={"model_path": str(tmp_path)}).json()["success"]
    assert srv.http.get("/model_info").json()["weight_version"] == "4"  # default: current + 1
    bad = srv.http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
    assert bad.status_code == 400 and bad.json()["success"] is False
    assert srv.http.get("/model_info").json()["weight_version"] == "4"
    reply = srv.http.post("/update_weight_version", json={"new_version": "9"}).json()
    assert reply["success"] and srv.http.get("/model_info").json()["weight_version"] == "9"


# --- OpenAI API -----------------------------------------------------------------------------


def test_openai_completions(srv):
    body = {"model": "fake-model", "prompt": "ab", "max_tokens": 3, "n": 2, "logprobs": 1, "seed": 5,
            "return_token_ids": True, "return_meta_info": True}
    reply = srv.http.post("/v1/completions", json=body).json()
    prompt = TOK.encode("ab", add_special_tokens=True)
    assert reply["object"] == "text_completion" and len(reply["choices"]) == 2
    for i, choice in enumerate(reply["choices"]):
        assert choice["prompt_token_ids"] == prompt and choice["token_ids"] == expected(prompt, 3, seed=5 + i)
        assert choice["text"] == TOK.decode(choice["token_ids"]) and choice["finish_reason"] == "length"
        assert choice["logprobs"]["token_logprobs"] == pytest.approx([0.0, -0.1, -0.2])
        assert choice["meta_info"]["output_token_logprobs"][0][1] == choice["token_ids"][0]
    assert reply["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    ids = srv.http.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 1}).json()
    assert [c["text"] for c in ids["choices"]] == [TOK.decode(expected([1, 2], 1)), TOK.decode(expected([3], 1))]


def test_openai_chat_with_tool_call(make):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    handle = make(output_fn=lambda prompt: TOK.encode("Let me add. " + call))
    tools = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
    messages = [{"role": "system", "content": "You add."},
                {"role": "user", "content": [{"type": "text", "text": "1+2?"}]}]
    body = {"messages": messages, "tools": tools, "max_tokens": 200, "temperature": 0, "return_token_ids": True,
            "logprobs": True, "top_logprobs": 1}
    reply = handle.http.post("/v1/chat/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me add."
    [tool_call] = choice["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "add" and json.loads(tool_call["function"]["arguments"]) == {"a": 1, "b": 2}
    flat = [{"role": "system", "content": "You add."}, {"role": "user", "content": "1+2?"}]
    prompt = TOK.apply_chat_template(flat, tools=tools, add_generation_prompt=True)
    assert choice["prompt_token_ids"] == prompt
    assert choice["token_ids"] == [*TOK.encode("Let me add. " + call), EOS]
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    [record] = handle.records
    assert record["endpoint"] == "/v1/chat/completions" and record["prompt_ids"] == prompt
    assert record["output_ids"] == choice["token_ids"] and record["request"] == body
    follow = [*flat, {"role": "assistant", "content": None, "tool_calls": [tool_call]},
              {"role": "tool", "content": "3"}]
    again = handle.http.post("/v1/chat/completions", json={"messages": follow, "tools": tools, "max_tokens": 100})
    assert again.status_code == 200, again.text
    no_tools = handle.http.post("/v1/chat/completions", json={"messages": flat, "max_tokens": 100}).json()
    assert "tool_calls" not in no_tools["choices"][0]["message"] and no_tools["choices"][0]["finish_reason"] == "stop"


def test_parse_tool_calls_keeps_malformed_blocks():
    content, calls = parse_tool_calls('a <tool_call>{"name": "f", "arguments": "{}"}</tool_call> b '
                                      '<tool_call>not json</tool_call>')
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": "{}"}]
    assert content == "a  b <tool_call>not json</tool_call>"
    assert parse_tool_calls("plain") == ("plain", [])


def test_recorder_gets_exact_ids(srv):
    body = {"input_ids": [[4, 5], [6]], "rid": ["p", "q"], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3}}
    srv.http.post("/generate", json=body)
    records = sorted(srv.records, key=lambda r: r["rid"])
    assert [r["rid"] for r in records] == ["p", "q"]
    assert records[0]["prompt_ids"] == [4, 5] and records[0]["output_ids"] == expected([4, 5], 3)
    assert records[0]["output_logprobs"] == pytest.approx([0.0, -0.1, -0.2])
    assert records[0]["output_versions"] == [0, 0, 0] and records[0]["weight_version"] == 0
    assert records[0]["endpoint"] == "/generate" and records[0]["request"] == body
    assert records[0]["finish_reason"] == {"type": "length", "length": 3}


# --- failures -------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("POST", "/generate", b"{not json", 400),
    ("POST", "/generate", b"", 400),
    ("POST", "/generate", b"[1, 2]", 400),
    ("POST", "/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": NaN}}', 400),
    ("POST", "/generate", {"text": "a", "input_ids": [1]}, 400),
    ("POST", "/generate", {"sampling_params": {}}, 400),
    ("POST", "/generate", {"input_ids": []}, 400),
    ("POST", "/generate", {"text": ""}, 400),
    ("POST", "/generate", {"input_ids": [1, 300]}, 400),
    ("POST", "/generate", {"input_ids": [1, -1]}, 400),
    ("POST", "/generate", {"input_ids": [True]}, 400),
    ("POST", "/generate", {"input_ids": [1.5]}, 400),
    ("POST", "/generate", {"input_ids": [[1], 2]}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**30}}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"bogus": 1}}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, 400),  # fake lacks it
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"stop_regex": ["a+"]}}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 4}}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"beam_width": 4}}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"regex": "a", "json_schema": "{}"}}, 400),
    ("POST", "/generate", {"input_ids": [1], "return_logprob": True, "logprob_start_len": 2}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_logprobs_mode": "support"}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": [{}, {}]}, 400),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"stop": [1]}}, 400),
    ("POST", "/generate", {"input_ids": [[1], [2]], "rid": ["a"]}, 400),
    ("POST", "/generate", {"input_ids": [1], "stream": "yes"}, 400),
    ("POST", "/generate", {"input_ids": [1], "image_data": "x.png"}, 400),
    ("GET", "/generate", None, 405),
    ("DELETE", "/health", None, 405),
    ("GET", "/no_such_route", None, 404),
    ("POST", "/v1/chat/completions", {"messages": []}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     400),  # no tools
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                      "return_token_ids": True}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "response_format": {"type": "yaml"}}, 400),
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400),
    ("POST", "/v1/completions", {"prompt": "a", "suffix": "b"}, 400),
    ("POST", "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "x"}]}, 400),
    ("POST", "/detokenize", {"tokens": [1, 300]}, 400),
    ("POST", "/release_memory_occupation", {"tags": ["gpu"]}, 400),
    ("GET", "/v1/models/other-model", None, 404),
    ("POST", "/v1/completions", {"prompt": ""}, 400),
    ("POST", "/v1/completions", {"prompt": "a\ud800"}, 400),
    ("POST", "/generate", {"text": "\udfff"}, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400),
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": -3}, 400),
    ("POST", "/pause_generation", {"mode": "sideways"}, 400),
    ("POST", "/update_weights_from_disk", {}, 400),
    ("POST", "/update_weights_from_disk", {"model_path": "/x", "weight_version": ""}, 400),
    ("POST", "/abort_request", {"rid": 5}, 400),
]


@pytest.mark.parametrize("method,path,body,status", BAD_REQUESTS)
def test_bad_requests_get_json_errors(shared, method, path, body, status):
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    reply = shared.http.request(method, path, content=content)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert isinstance(error["message"], str) and error["type"] and error["code"] in (status, "model_not_found")
    if status == 405:
        assert reply.headers["allow"]


def raw_http(url, data):
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    data = b"".join(chunks)
    if not data.startswith(b"HTTP/"):  # the stdlib answers an unparsable request line HTTP/0.9-style
        return None, data
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_transport_edge_cases(shared):
    chunked = shared.http.post("/generate", content=iter([b'{"input_ids": [1],', b' "sampling_params": {}}']))
    assert chunked.status_code == 200 and len(chunked.json()["output_ids"]) == 128
    huge = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n"
    assert raw_http(shared.url, huge)[0] == 413
    assert json.loads(raw_http(shared.url, b"GARBAGE\r\n\r\n")[1])["error"]["code"] == 400
    status, body = raw_http(shared.url, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n")
    assert status == 400 and "Content-Length" in json.loads(body)["error"]["message"]
    status, body = raw_http(shared.url, b"BREW /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert status == 405 and json.loads(body)["error"]["code"] == 405
    assert shared.http.head("/health").status_code == 200 and shared.http.options("/generate").status_code == 405
    assert shared.http.get("/health").status_code == 200


def test_duplicate_rid_in_flight_is_400(make):
    handle = make(tokens_per_step=1, step_delay=0.005)
    future = post_in_thread(handle.url, "/generate", {"input_ids": [1], "rid": "dup",
                                                      "sampling_params": {"max_new_tokens": 4000}})
    wait_for(lambda: handle.http.get("/v1/loads").json()["num_running_reqs"] == 1)
    reply = handle.http.post("/generate", json={"input_ids": [1], "rid": "dup"})
    assert reply.status_code == 400 and "already in use" in reply.json()["error"]["message"]
    handle.http.post("/abort_request", json={"rid": "dup"})
    assert future.result(5).status_code == 200


def test_engine_error_fails_request_and_server_survives(srv):
    srv.engine.fail_next_step = RuntimeError("boom")
    reply = srv.http.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 500 and "boom" in reply.json()["error"]["message"]
    ok = srv.http.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and ok.json()["output_ids"] == expected([1], 2)


def test_client_disconnect_aborts_its_request(make):
    handle = make(tokens_per_step=1, step_delay=0.005)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(handle.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 4000}},
                   timeout=0.3)
    wait_for(lambda: handle.records, timeout=5)  # recorded once the abort came back
    assert handle.records[-1]["finish_reason"]["type"] == "abort"
    assert handle.http.get("/v1/loads").json()["num_running_reqs"] == 0


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
VALID = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
_NOT_A_LIST = st.text(max_size=5) | st.floats(allow_nan=False) | st.integers() | st.booleans() | st.dictionaries(
    st.text(max_size=3), JSON, max_size=2)
BAD_SAMPLING = st.one_of(
    st.tuples(st.sampled_from(["max_new_tokens", "n", "min_new_tokens"]),
              st.text(max_size=5) | st.floats(allow_nan=False) | st.booleans() | st.integers(max_value=-2)
              | st.integers(min_value=2**31)),
    st.tuples(st.just("top_k"), st.text(max_size=5) | st.just(0) | st.integers(max_value=-2)
              | st.integers(min_value=2**63)),
    st.tuples(st.sampled_from(["temperature", "top_p", "min_p", "repetition_penalty"]),
              st.text(max_size=5) | st.floats(max_value=-1e-6) | st.floats(min_value=1e31, allow_infinity=False)
              | st.booleans() | st.lists(st.integers(), max_size=2)),
    st.tuples(st.just("stop_token_ids"), _NOT_A_LIST.filter(lambda v: v is not None)
              | st.lists(st.text(max_size=3) | st.floats(allow_nan=False), min_size=1)),
    st.tuples(st.sampled_from(["ignore_eos", "no_stop_trim", "skip_special_tokens"]),
              st.integers() | st.text(max_size=3) | st.floats(allow_nan=False)),
    st.tuples(st.text(min_size=1, max_size=10).filter(lambda k: k not in SAMPLING_KEYS), JSON),
)
BAD_IDS = _NOT_A_LIST | st.just([]) | st.lists(
    st.integers(min_value=300) | st.integers(max_value=-1) | st.text(max_size=3) | st.floats(allow_nan=False)
    | st.booleans(), min_size=1, max_size=4)
SURROGATES = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDBFF), min_size=1, max_size=3)  # lone
BAD_BODIES = st.one_of(
    JSON.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64).filter(lambda b: b.strip()[:1] != b"{"),
    st.binary(max_size=16).map(lambda b: b'{"text": "' + b"\xff" + b + b'"}'),  # invalid UTF-8
    st.builds(lambda kv: {**VALID, "sampling_params": {kv[0]: kv[1]}}, BAD_SAMPLING),
    st.builds(lambda v: {"input_ids": v}, BAD_IDS),
    st.builds(lambda v: {"text": v}, st.integers() | st.lists(st.integers(), max_size=3) | st.just("") | SURROGATES),
    st.builds(lambda t: {"text": "a", "input_ids": t}, JSON.filter(lambda t: t is not None)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BAD_BODIES, path=st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions"]))
def test_fuzz_bad_bodies_get_4xx_json(shared, body, path):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    if path != "/generate" and not isinstance(body, bytes):
        content = json.dumps({"prompt" if path == "/v1/completions" else "messages": body}).encode()
    reply = shared.http.post(path, content=content)
    assert 400 <= reply.status_code < 500, (content, reply.text)
    assert isinstance(reply.json()["error"]["message"], str)
    assert shared.http.get("/health").status_code == 200


OPENAI_KEYS = ["stream", "n", "logprobs", "top_logprobs", "echo", "tool_choice", "tools", "response_format",
               "stream_options", "max_tokens", "max_completion_tokens", "seed", "stop", "temperature", "top_p",
               "presence_penalty", "logit_bias", "rid", "return_token_ids", "model", "unknown_field", "suffix"]
OPENAI_BODIES = st.builds(
    lambda chat, extra: {**({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}),
                         "max_tokens": 3, **extra},
    st.booleans(), st.dictionaries(st.sampled_from(OPENAI_KEYS), JSON | st.integers(-5, 5), max_size=4))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=OPENAI_BODIES)
def test_fuzz_openai_fields_never_5xx(shared, body):
    """Random values of the OpenAI fields (streaming or not): a 2xx answer or a 4xx JSON error."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with shared.http.stream("POST", path, content=json.dumps(body).encode()) as reply:
        data = reply.read()
    assert reply.status_code < 500, data
    if reply.status_code >= 400:
        assert isinstance(json.loads(data)["error"]["message"], str)
    elif body.get("stream") is True:
        assert data.rstrip().endswith(b"data: [DONE]")
    assert shared.http.get("/health").status_code == 200


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=JSON, path=st.sampled_from(["/abort_request", "/pause_generation", "/continue_generation",
                                        "/update_weights_from_disk", "/update_weight_version", "/flush_cache",
                                        "/release_memory_occupation", "/resume_memory_occupation", "/tokenize",
                                        "/detokenize"]))
def test_fuzz_control_endpoints_never_crash(srv, body, path):
    reply = srv.http.post(path, content=json.dumps(body).encode())
    assert reply.status_code < 500, reply.text
    srv.http.post("/continue_generation")
    srv.http.post("/resume_memory_occupation")
    assert srv.http.get("/health").status_code == 200


# --- EngineDriver directly ------------------------------------------------------------------


def test_driver_stream_generate_and_close():
    driver = EngineDriver(FakeEngine(tokens_per_step=2))
    try:
        partials = list(driver.stream(Request("s", [1, 2], SamplingParams(max_new_tokens=5))))
        assert [len(p.output_ids) for p in partials] == [2, 4, 5] and partials[-1].finish_reason["type"] == "length"
        outs = driver.generate([Request(f"g{i}", [i + 1], SamplingParams(max_new_tokens=3)) for i in range(4)])
        assert [o.rid for o in outs] == ["g0", "g1", "g2", "g3"] and outs[2].output_ids == expected([3], 3)
        with pytest.raises(ValueError, match="n must be 1"):
            driver.submit(Request("bad", [1], SamplingParams(n=2))).result(5)
        assert driver.load() == {"num_running_reqs": 0, "num_waiting_reqs": 0}
        driver.pause("in_place")
        pending = driver.submit(Request("p", [1], SamplingParams(max_new_tokens=3)))
    finally:
        driver.close()
    with pytest.raises(DriverClosedError):
        pending.result(5)
    with pytest.raises(DriverClosedError):
        driver.submit(Request("late", [1]))


def test_driver_idle_does_not_spin():
    engine = FakeEngine()
    driver = EngineDriver(engine)
    try:
        driver.generate([Request("a", [1], SamplingParams(max_new_tokens=2))])
        steps = engine.steps
        time.sleep(0.2)
        assert engine.steps == steps
        assert threading.active_count() < 50
    finally:
        driver.close()
