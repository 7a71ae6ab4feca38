"""The server and client over the REAL rollout engine on a tiny random model (CPU)."""

import asyncio
import json

import httpx
import jax
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
