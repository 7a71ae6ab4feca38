"""The engine's extras against independent references on a tiny random model: prompt and top
log-probs vs a full forward, penalties and logit_bias vs a NumPy greedy loop, constrained decoding
(every output matches its regex / parses against its JSON schema), stop_regex, pause "retract"
(the same tokens as an uninterrupted run), and memory release / resume."""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from rlvr.kernels.chunked_logprob.reference import Sampling, target_sampling_logits

from rlvr import sharding
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.models.transformer import forward
from rlvr.rollout.engine import Engine
from rlvr.rollout.types import Request, SamplingParams

CFG = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=300, rope_theta=10_000.0)
OPTS = dict(max_slots=4, max_len=128, page_size=8, decode_steps=4, prefill_rows=2, prefill_chunk=16)
TOK = byte_level_tokenizer()


@pytest.fixture(scope="module")
def params():
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    return params_lib.init_params(CFG, jax.random.key(0), mesh)


@pytest.fixture(scope="module")
def engine(params):
    return Engine(CFG, params, tokenizer=TOK, **OPTS)


@jax.jit
def _logprobs(params, tokens):
    """Reference: raw log-probs [T, V] of a full forward over `tokens` [T] (no cache)."""
    logits = forward(CFG, params, tokens[None], None, jnp.ones_like(tokens)[None])[0][0]
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def reference(params, tokens):
    width = 128
    buffer = np.zeros(width, np.int32)
    buffer[: len(tokens)] = tokens
    return np.asarray(_logprobs(params, jnp.asarray(buffer)))[: len(tokens)]


def test_prompt_and_top_logprobs_match_a_full_forward(engine, params):
    prompt = TOK.encode("The quick brown fox")
    request = Request("p", prompt, SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=3),
                      logprob_start_len=2, top_logprobs_num=3, token_ids_logprob=[5, 97])
    [c] = engine.generate([request])
    ref = reference(params, prompt + c.output_ids)
    assert c.input_logprobs[0] is None and c.input_top_logprobs[0] is None and c.input_token_ids_logprobs[0] is None
    expected = [ref[p - 1, prompt[p]] for p in range(3, len(prompt))]
    np.testing.assert_allclose(c.input_logprobs[1:], expected, atol=1e-4)
    for p, row in zip(range(3, len(prompt)), c.input_top_logprobs[1:], strict=True):
        assert [t for _, t in row] == np.argsort(-ref[p - 1])[:3].tolist()
        np.testing.assert_allclose([v for v, _ in row], np.sort(ref[p - 1])[::-1][:3], atol=1e-4)
    for i, (token, lp) in enumerate(zip(c.output_ids, c.output_logprobs, strict=True)):
        position = len(prompt) + i - 1
        assert lp == pytest.approx(ref[position, token], abs=1e-4)  # the sampled token's (temperature 1)
        assert [t for _, t in c.output_top_logprobs[i]] == np.argsort(-ref[position])[:3].tolist()
        np.testing.assert_allclose([v for v, _ in c.output_token_ids_logprobs[i]], ref[position, [5, 97]], atol=1e-4)
    scored = engine.generate([Request("s", prompt, SamplingParams(max_new_tokens=0), logprob_start_len=0)])[0]
    assert scored.output_ids == [] and len(scored.input_logprobs) == len(prompt)  # scoring only (choices, RMs)
    np.testing.assert_allclose(scored.input_logprobs[1:], [ref[p - 1, prompt[p]] for p in range(1, len(prompt))],
                               atol=1e-4)


def test_penalized_and_constrained_rows_report_the_trainers_logprobs(engine, params):
    """Penalties and a grammar mask change what is drawn, not the log-prob reported: the policy's
    at the row's temperature and top-p, the sampled token kept (`target_sampling_logits`, what the
    trainer scores), from a full forward."""
    prompt = TOK.encode("Answer: ")
    kw = dict(max_new_tokens=8, temperature=0.7, top_p=0.8, sampling_seed=1, ignore_eos=True)
    requests = [Request("mask", prompt, SamplingParams(regex="[a-z]{8}", **kw)),
                Request("penalty", prompt, SamplingParams(frequency_penalty=1.5, logit_bias={101: 5.0}, **kw))]
    for c in engine.generate(requests):
        ref = reference(params, prompt + c.output_ids)[len(prompt) - 1: -1]
        ids = jnp.asarray(c.output_ids)
        scored = jax.nn.log_softmax(target_sampling_logits(jnp.asarray(ref), ids, Sampling(0.7, -1, 0.8)), axis=-1)
        np.testing.assert_allclose(c.output_logprobs, scored[jnp.arange(len(ids)), ids], atol=1e-4)


def _greedy_penalized(params, prompt, steps, frequency=0.0, presence=0.0, repetition=1.0, bias=None):
    """NumPy reference of SGLang's order: penalties over the generated tokens, then logit_bias."""
    out = []
    for _ in range(steps):
        logits = reference(params, prompt + out)[-1].astype(np.float64)  # log-softmax = logits + const
        counts = np.bincount(out, minlength=CFG.vocab_size)
        logits = logits - frequency * counts - presence * (counts > 0)
        logits = np.where(counts > 0, np.where(logits < 0, logits * repetition, logits / repetition), logits)
        for token, value in (bias or {}).items():
            logits[token] += value
        out.append(int(np.argmax(logits)))
    return out


def test_penalties_and_logit_bias_match_a_numpy_greedy_loop(engine, params):
    prompt = TOK.encode("abcabc")
    cases = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(repetition_penalty=1.8),
             dict(frequency_penalty=0.5, logit_bias={97: 3.0, 98: -100.0})]
    requests = [Request(f"pen{i}", prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, **kw))
                for i, kw in enumerate(cases)]
    plain = Request("plain", prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    done = engine.generate([*requests, plain])  # penalized and plain rows in one batch
    for c, kw in zip(done, cases, strict=False):
        expected = _greedy_penalized(params, prompt, 12, kw.get("frequency_penalty", 0.0),
                                     kw.get("presence_penalty", 0.0), kw.get("repetition_penalty", 1.0),
                                     kw.get("logit_bias"))
        assert c.output_ids == expected, kw
    assert done[-1].output_ids == _greedy_penalized(params, prompt, 12)
    assert done[0].output_ids != done[-1].output_ids  # the penalty changed something
    assert "counts" not in engine.state or engine.num_running  # back to the plain path once idle
    engine.step()
    assert "counts" not in engine.state


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"]}


def test_constrained_outputs_always_parse_on_a_random_model(engine):
    """Temperature-1 samples from a random model: every output matches its constraint, even the
    unbounded json_object one cut by a tight max_new_tokens (the length budget closes it in time)."""
    prompt = TOK.encode("Answer: ")
    cases = [("json_schema", json.dumps(SCHEMA), 80), ("json_schema", '{"type": "object"}', 40),
             ("regex", r"(yes|no)-[0-9]{2,3}", 10), ("choices", ["red", "green", "blue"], 10)]
    requests = [Request(f"c{k}_{i}", prompt, SamplingParams(max_new_tokens=limit, temperature=1.0, sampling_seed=i,
                                                            **{kind: value}))
                for k, (kind, value, limit) in enumerate(cases) for i in range(6)]
    plain = Request("free", prompt, SamplingParams(max_new_tokens=20, temperature=1.0, sampling_seed=0))
    done = engine.generate([*requests, plain])
    for c, r in zip(done, requests, strict=False):
        text = TOK.decode(c.output_ids, skip_special_tokens=True)
        kind, value = r.sampling.constraint
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), json.loads(value))
        elif kind == "regex":
            assert re.fullmatch(value, text), text
        else:
            assert text in value
        assert c.finish_reason["type"] in ("stop", "length")
    assert len(done[-1].output_ids) == 20  # the unconstrained row in the same batch is untouched


def test_stop_regex_and_retract_resume_give_the_uninterrupted_tokens(params):
    """Retract mid-way, flush, release and resume memory: the same tokens as an uninterrupted run."""
    engine = Engine(CFG, params, tokenizer=TOK, **OPTS)
    prompt = TOK.encode("Once upon a time")
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0, sampling_seed=7, ignore_eos=True,
                              frequency_penalty=0.7)  # the penalty's counts survive the retraction
    [whole] = engine.generate([Request("a", prompt, sampling)])
    engine.submit(Request("b", prompt, sampling))
    while engine.num_running == 0 or not engine.snapshot("b") or len(engine.snapshot("b").output_ids) < 9:
        engine.step()
    assert engine.pause("retract") == 1
    assert engine.num_running == 0 and engine.num_waiting == 1
    engine.flush_cache()  # nothing holds KV: the retracted request recomputes its prompt + output
    engine.release_memory(["kv_cache", "weights"])
    assert engine.pool is None and engine.params is None
    engine.resume()
    assert engine.step() == [] and engine.num_running == 0  # released: nothing is admitted
    engine.resume_memory(["kv_cache", "weights"])
    done = []
    while not done:
        done = engine.step()
    [c] = done
    assert c.prompt_ids == prompt and c.output_ids == whole.output_ids
    np.testing.assert_allclose(c.output_logprobs, whole.output_logprobs, atol=1e-5)
    assert c.finish_reason == {"type": "length", "length": 40}
    first = next(i for i, t in enumerate(whole.output_ids) if i >= 3 and chr(t).isalnum() and t < 128)
    pattern = "[" + chr(whole.output_ids[first]) + "]"  # an ASCII byte: its first occurrence is the match
    end = whole.output_ids.index(whole.output_ids[first]) + 1
    [cut] = engine.generate([Request("r", prompt, SamplingParams(**{**sampling.__dict__, "stop_regex": [pattern]}))])
    assert cut.finish_reason == {"type": "stop", "matched": chr(whole.output_ids[first])}
    assert cut.output_ids == whole.output_ids[:end]


def test_rl_task_grammars_give_well_formed_answers(engine):
    """rl.constrained_decoding's grammars (rlvr.tasks.constraints) on the JSON and tool-call families:
    every random-model answer is in its tags, parses, and meets the schema / is a list of calls."""
    from rlvr.tasks.base import extract_answer
    from rlvr.tasks.constraints import sampling_constraint
    from rlvr.tasks.procedural import FAMILIES
    from rlvr.tasks.verifiers import parse_tool_calls

    tasks = [FAMILIES[name](seed=1).task(i, level=level) for name in ("json_person", "tool_bank")
             for i, level in ((0, 0), (1, 1))]
    requests = [Request(f"t{i}", TOK.encode("Answer: "),
                        SamplingParams(max_new_tokens=110, temperature=1.0, sampling_seed=i,
                                       **sampling_constraint(t.verifier, "tag")))
                for i, t in enumerate(tasks)]
    for task, c in zip(tasks, engine.generate(requests), strict=True):
        answer = extract_answer(TOK.decode(c.output_ids, skip_special_tokens=True))
        assert answer is not None, c.output_ids
        if task.verifier["kind"] == "json_schema":
            jsonschema.validate(json.loads(answer), task.verifier["schema"])
        else:
            assert parse_tool_calls(answer), answer
