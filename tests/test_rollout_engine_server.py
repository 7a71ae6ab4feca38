"""The server and client over the REAL rollout engine on a tiny random model (CPU)."""

import asyncio
import json
import re

import httpx
import jax
import numpy as np
import pytest

from rlvr import sharding
from rlvr.models.config import ModelConfig
from rlvr.models.hf import export_hf_checkpoint
from rlvr.models.params import init_params
from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.rollout.client import SGLangClient
from rlvr.rollout.driver import EngineDriver
from rlvr.rollout.engine import Engine
from rlvr.rollout.server import serve
from rlvr.rollout.types import Request, SamplingParams

CFG = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=300, rope_theta=10000.0)
PROMPTS = [[1, 2, 3], [40, 41, 42, 43, 44], [7] * 9]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def make_params(seed):
    return init_params(CFG, jax.random.key(seed), sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]))


@pytest.fixture(scope="module")
def stack():
    """(direct greedy completions, driver, server) for one engine: direct runs come first, on
    the engine itself, before the driver thread owns it."""
    engine = Engine(CFG, make_params(0), tokenizer=byte_level_tokenizer(), max_len=128, max_slots=8)
    direct = engine.generate([Request(f"d{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    driver = EngineDriver(engine)
    server, _ = serve(driver)
    yield direct, driver, server
    server.stop()
    driver.close()


def test_greedy_generate_over_http_matches_engine(stack):
    direct, _, server = stack
    body = {"input_ids": PROMPTS, "return_logprob": True, "rid": "h",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
    outs = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    for out, ref in zip(outs, direct, strict=True):
        assert out["output_ids"] == ref.output_ids
        assert out["meta_info"]["finish_reason"] == ref.finish_reason
        lps = [item[0] for item in out["meta_info"]["output_token_logprobs"]]
        assert lps == pytest.approx(ref.output_logprobs, abs=1e-4)
        assert [item[1] for item in out["meta_info"]["output_token_logprobs"]] == ref.output_ids
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert (info["max_running_requests"], info["context_length"], info["page_size"], info["dp_size"]) == (8, 128, 16, 1)
    assert info["max_total_num_tokens"] == 8 * 128 and info["dtype"] == info["kv_cache_dtype"] == "float32"
    metrics = info["internal_states"][0]["engine_metrics"]  # the engine's counters as of its last step
    assert metrics["compiles_decode"] >= 1 and metrics["generated_tokens"] >= 2 * sum(len(r.output_ids) for r in direct)
    # the 3 prompts twice (engine, then HTTP): 2 x (3 + 5 + 9) tokens admitted; none fills a 16-token page,
    # so none is a hit (the hand count of a nonzero rate: test_prefix_cache.py)
    assert (metrics["prefix_cache_prompt_tokens"], metrics["prefix_cache_hit_tokens"]) == (34, 0)
    assert metrics["prefix_cache_hit_rate"] == 0.0


def test_stream_over_real_engine(stack):
    direct, _, server = stack
    body = {"input_ids": PROMPTS[1], "stream": True, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["output_ids"] == direct[1].output_ids
    for prev, nxt in zip(chunks, chunks[1:], strict=False):
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]


def test_client_round_trips_ids_and_logprobs_then_syncs_weights(stack, tmp_path):
    direct, driver, server = stack
    client = SGLangClient([server.url], timeout=120)
    got = client.generate_sync([Request(f"c{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    for c, ref in zip(got, direct, strict=True):
        assert (c.prompt_ids, c.output_ids, c.finish_reason) == (ref.prompt_ids, ref.output_ids, ref.finish_reason)
        assert c.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-4)
    export_hf_checkpoint(CFG, make_params(1), str(tmp_path))
    asyncio.run(client.update_weights_from_disk(str(tmp_path), 1))
    assert driver.weight_version == 1 and not driver.paused
    after = client.generate_sync([Request("new", PROMPTS[0], GREEDY)])[0]
    assert after.weight_version == 1 and set(after.output_versions) == {1}
    assert after.output_ids != direct[0].output_ids  # other weights, other greedy tokens


# --- real clients over the real engine: structured output, penalties, log-probs ----------------

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 6}}, "required": ["text"]}}}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"]}


@pytest.fixture(scope="module")
def chat_server():
    """A roomier engine (chat templates with tools are long in a byte-level vocabulary)."""
    engine = Engine(CFG, make_params(0), tokenizer=byte_level_tokenizer(), max_len=1024, max_slots=4, page_size=16,
                    prefill_chunk=256)
    driver = EngineDriver(engine)
    server, _ = serve(driver)
    yield server
    server.stop()
    driver.close()


def test_openai_structured_output_tool_choice_and_penalties(chat_server):
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    reply = client.chat.completions.create(model="m", messages=messages, response_format=fmt, n=3, temperature=1.0,
                                           max_tokens=48, seed=1)
    for choice in reply.choices:  # a random model, every sample valid
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
    forced = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                            max_tokens=120, seed=2)
    assert forced.choices[0].finish_reason == "tool_calls"
    for call in forced.choices[0].message.tool_calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)
    named = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=100, seed=3,
                                           tool_choice={"type": "function", "function": {"name": "echo"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "echo" and len(json.loads(call.function.arguments)["text"]) <= 6
    stream = client.chat.completions.create(model="m", messages=messages, response_format={"type": "json_object"},
                                            max_tokens=40, seed=4, stream=True)
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), dict)
    for bad in ({"regex": "(unclosed"}, {"json_schema": "{not json"}):
        reply = httpx.post(chat_server.url + "/generate", json={"input_ids": [1], "sampling_params": bad})
        assert reply.status_code == 400 and "compile" in reply.json()["error"]["message"]
    greedy = dict(model="m", prompt="abababab", max_tokens=16, temperature=0)
    plain = client.completions.create(**greedy).choices[0].text
    assert client.completions.create(**greedy, frequency_penalty=2.0).choices[0].text != plain


def test_top_logprobs_are_the_k_most_likely(chat_server):
    import openai

    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         logprobs=True, top_logprobs=4, temperature=0)
    for entry in out.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0], abs=1e-5)  # greedy: the sampled token is the top one
        assert entry.token == entry.top_logprobs[0].token


def test_sglang_frontend_regex_and_choices_on_the_real_engine(stack):
    from test_rollout_server_clients import sglang_frontend

    sgl, endpoint = sglang_frontend()
    backend = endpoint(stack[2].url)

    @sgl.function
    def quiz(s):
        s += "Q: number?\nA: "
        s += sgl.gen("number", regex=r"[0-9]{3}", max_tokens=8, temperature=1.0)
        s += "\nPick: "
        s += sgl.gen("pick", choices=["cat", "dog", "bird"])

    state = quiz.run(backend=backend)
    assert re.fullmatch(r"[0-9]{3}", state["number"])
    prefix = f"Q: number?\nA: {state['number']}\nPick: "
    tok = byte_level_tokenizer()
    start = len(tok.encode(prefix, add_special_tokens=True)) - 2

    def normalized(choice):  # the frontend's token_length_normalized, from the engine's own scoring
        ids = tok.encode(prefix + choice, add_special_tokens=True)
        out = httpx.post(stack[2].url + "/generate", json={"input_ids": ids, "return_logprob": True,
                                                           "logprob_start_len": start,
                                                           "sampling_params": {"max_new_tokens": 0}}).json()
        values = [x[0] for x in out["meta_info"]["input_token_logprobs"] if x[0]]
        return sum(values) / len(values)

    assert state["pick"] == max(["cat", "dog", "bird"], key=normalized)


def test_sglang_launch_flags_configure_the_engine(tmp_path, caplog):
    """A `python -m sglang.launch_server` command line sets the engine it names; no-op flags are
    logged, a keyword set twice and SGLang choices the engine lacks are errors naming the flag."""
    from rlvr.rollout.server import build_engine, engine_options, parse_args

    export_hf_checkpoint(CFG, make_params(0), str(tmp_path))
    argv = ["--model-path", str(tmp_path), "--max-running-requests", "4", "--context-length", "100",
            "--page-size", "8", "--max-total-tokens", "200", "--chunked-prefill-size", "-1", "--dtype", "bfloat16",
            "--kv-cache-dtype", "auto", "--random-seed", "7", "--dp-size", "2", "--schedule-policy", "fcfs",
            "--served-model-name", "tiny", "--trust-remote-code", "--mem-fraction-static", "0.8",
            "--disable-radix-cache", "--attention-backend", "ragged", "--engine_option", "decode_steps=4"]
    args = parse_args(argv)
    with caplog.at_level("INFO", logger="rlvr.rollout.server"):
        options = engine_options(args)
    assert options == {"decode_steps": 4, "max_slots": 4, "max_len": 104, "page_size": 8, "num_pages": 26,
                       "prefill_chunk": 104, "dtype": "bfloat16", "seed": 7, "replicas": 2, "schedule_policy": "fcfs",
                       "prefix_cache": False, "decode_attention": "ragged"}
    assert args.served_model_name == "tiny" and args.hf_dir == str(tmp_path)
    assert {"--trust-remote-code", "--mem-fraction-static"} <= {r.getMessage().split()[0] for r in caplog.records}
    engine = build_engine(args.hf_dir, options)
    shapes = [(e.max_slots, e.max_len, e.page_size, len(e.pages.free) + 1) for e in engine.replicas]
    assert shapes == [(2, 104, 8, 13)] * 2  # slots and pages split over the replicas (+ each pool's reserved page)
    assert engine.replicas[0].kv_dtype == "bfloat16" and engine.replicas[0].prefill_chunk == 104
    assert engine.model_info()["server_args"] == {  # what /server_info reports, under SGLang's names
        "max_running_requests": 4, "context_length": 104, "page_size": 8, "max_total_num_tokens": 2 * 12 * 8,
        "chunked_prefill_size": 104, "dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "schedule_policy": "fcfs",
        "random_seed": 7, "dp_size": 2, "tp_size": 1, "disable_radix_cache": True, "attention_backend": "ragged"}
    with caplog.at_level("INFO", logger="rlvr.rollout.server"):  # SGLang's GPU kernels: the engine's own choice
        assert "decode_attention" not in engine_options(parse_args(["--model-path", "m", "--attention-backend", "fa3"]))
    assert "--attention-backend fa3 is an SGLang GPU kernel" in caplog.text
    with pytest.raises(SystemExit, match="--attention-backend both set"):
        engine_options(parse_args(["--model-path", "m", "--attention-backend", "native",
                                   "--engine_option", "decode_attention=ragged"]))

    with pytest.raises(SystemExit, match="page_size"):
        engine_options(parse_args(["--model-path", "m", "--page-size", "8", "--engine_option", "page_size=16"]))
    for bad in (["--kv-cache-dtype", "fp8_e4m3"], ["--schedule-policy", "lpm"]):
        with pytest.raises(SystemExit):
            parse_args(["--model-path", "m", *bad])


def test_tp_size_shards_the_checkpoint_over_the_tensor_axis_with_the_same_outputs(tmp_path):
    """`--tp 2` (SGLang's tensor parallelism) reads the weights split over two devices' tensor axis;
    greedy tokens and log-probs equal the one-device engine's; the KV pool is split over the KV heads
    too, and stays so across calls; /server_info says tp_size 2; more devices than the host has is an
    error naming the flag."""
    from rlvr.rollout.server import build_engine, engine_options, parse_args

    export_hf_checkpoint(CFG, make_params(0), str(tmp_path))
    args = parse_args(["--model-path", str(tmp_path), "--tp", "2", "--max-running-requests", "4",
                       "--context-length", "64"])
    assert args.tp_size == 2
    split, whole = build_engine(args.hf_dir, engine_options(args), args.tp_size), build_engine(args.hf_dir, {
        "max_slots": 4, "max_len": 64})
    kernel = split.params["layers_0"]["mlp"]["up_proj"]["kernel"]  # (a split engine keeps the projections unfused)
    assert kernel.sharding.mesh.shape["tensor"] == 2 and len(kernel.sharding.device_set) == 2
    assert kernel.sharding.spec != jax.sharding.PartitionSpec()  # split, not replicated on both
    assert split.server_args()["tp_size"] == 2 and whole.server_args()["tp_size"] == 1
    requests = [Request(rid=str(i), input_ids=list(range(3 + i, 14 + 2 * i)), sampling=SamplingParams(
        max_new_tokens=6, temperature=0.0)) for i in range(3)]
    pool = jax.sharding.PartitionSpec(None, None, None, "tensor")  # the pool's KV heads split like the weights'
    assert split.pool["k"].sharding.spec == pool and split.pool["v"].sharding.spec == pool
    got, want = split.generate(requests), whole.generate(requests)
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    np.testing.assert_allclose([c.output_logprobs for c in got], [c.output_logprobs for c in want], atol=1e-5)
    assert split.pool["k"].sharding.spec == pool  # the calls return it as they take it (no resharding, no recompile)
    compiles = split.metrics()["compiles_decode"], split.metrics()["compiles_prefill"]
    assert [c.output_ids for c in split.generate(requests)] == [c.output_ids for c in want]
    assert (split.metrics()["compiles_decode"], split.metrics()["compiles_prefill"]) == compiles
    with pytest.raises(SystemExit, match="--tp-size 16"):
        build_engine(args.hf_dir, {}, 16)
