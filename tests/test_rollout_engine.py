"""The embedded engine against independent references: a naive full-forward loop, the
trainer's log-probs, itself alone vs batched; stop conditions, abort, pause/update/resume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlvr import sharding
from rlvr.losses import next_token_logprobs
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.models.transformer import forward
from rlvr.rollout import device_fns
from rlvr.rollout.engine import Engine
from rlvr.rollout.types import Request, SamplingParams

CFG = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=300, rope_theta=10_000.0)
OPTS = dict(max_slots=4, max_len=128, page_size=8, decode_steps=4, prefill_rows=2, prefill_chunk=16)


@pytest.fixture(scope="module")
def params():
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    return params_lib.init_params(CFG, jax.random.key(0), mesh)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


@jax.jit
def _full_forward(params, tokens, segment_ids):
    return forward(CFG, params, tokens, None, segment_ids)[0]


def _naive_greedy(params, prompt, steps, width=128):
    """Reference: a full forward pass (no cache) over the whole sequence for every new token,
    in a fixed-width padded buffer so it compiles once."""
    tokens, out = list(prompt), []
    for _ in range(steps):
        buffer = np.zeros((1, width), np.int32)
        buffer[0, : len(tokens)] = tokens
        segments = (np.arange(width) < len(tokens)).astype(np.int32)[None]
        logits = _full_forward(params, jnp.asarray(buffer), jnp.asarray(segments))
        out.append(int(jnp.argmax(logits[0, len(tokens) - 1])))
        tokens.append(out[-1])
    return out


def _req(rid, prompt, **sampling):
    return Request(rid, prompt, SamplingParams(**{"max_new_tokens": 10, "temperature": 0.0, **sampling}))


def test_greedy_equals_naive_loop_for_ragged_batch_with_chunked_prefill(params):
    prompts = _prompts([5, 20, 37, 3, 16, 9])  # more requests than slots, prompts longer than a chunk
    engine = Engine(CFG, params, **OPTS)
    outs = engine.generate([_req(f"r{i}", p, max_new_tokens=12) for i, p in enumerate(prompts)])
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_ids == _naive_greedy(params, prompt, 12)
        assert out.finish_reason == {"type": "length", "length": 12}


def test_engine_logprobs_equal_trainer_logprobs(params):
    engine = Engine(CFG, params, **OPTS)
    prompts = _prompts([7, 19, 30], seed=1)
    outs = engine.generate([_req(f"s{i}", p, temperature=1.0, max_new_tokens=16, sampling_seed=i)
                            for i, p in enumerate(prompts)])
    gaps = []
    for out in outs:
        sequence = jnp.asarray([out.prompt_ids + out.output_ids])
        logits, _ = forward(CFG, params, sequence)
        trainer = np.asarray(next_token_logprobs(logits, sequence)[0, len(out.prompt_ids) - 1:])
        gaps.append(np.abs(trainer - np.asarray(out.output_logprobs)).max())
    print(f"engine-trainer log-prob gap: {max(gaps):.2e}")
    assert max(gaps) <= 1e-5


def test_output_is_the_same_alone_or_batched_and_seeds_reproduce(params):
    prompts = _prompts([11, 4, 25, 8], seed=2)
    requests = [_req(f"b{i}", p, temperature=1.0, top_p=0.9, top_k=50, sampling_seed=100 + i)
                for i, p in enumerate(prompts)]
    batched = Engine(CFG, params, **OPTS).generate(requests)
    for request, together in zip(requests, batched, strict=True):
        alone = Engine(CFG, params, **OPTS).generate([request])[0]
        assert alone.output_ids == together.output_ids
    other_seed = Engine(CFG, params, **OPTS).generate([_req("o", prompts[0], temperature=1.0, sampling_seed=7)])[0]
    assert other_seed.output_ids != batched[0].output_ids


def test_group_samples_share_the_prompt_prefix(params):
    prompt = _prompts([37], seed=3)[0]
    engine = Engine(CFG, params, **OPTS)
    group = engine.generate([_req(f"g{i}", prompt, temperature=1.0, sampling_seed=i) for i in range(4)])
    assert sorted(c.cached_tokens for c in group) == [0, 36, 36, 36]
    assert len({tuple(c.output_ids) for c in group}) > 1  # different seeds, different samples
    alone = Engine(CFG, params, **OPTS).generate([_req("x", prompt, temperature=1.0, sampling_seed=2)])[0]
    assert alone.output_ids == group[2].output_ids  # sharing pages changes nothing


def test_stop_token_ids_stop_strings_eos_and_min_new_tokens(params):
    tokenizer = byte_level_tokenizer()
    prompt = _prompts([6], seed=4)[0]
    free = _naive_greedy(params, prompt, 20)
    engine = Engine(CFG, params, tokenizer, **OPTS)
    stop_id = free[5]
    first = free.index(stop_id)
    out = engine.generate([_req("a", prompt, max_new_tokens=20, stop_token_ids=[stop_id])])[0]
    assert out.output_ids == free[: first + 1] and out.finish_reason == {"type": "stop", "matched": stop_id}
    later = engine.generate([_req("b", prompt, max_new_tokens=20, stop_token_ids=[stop_id], min_new_tokens=first + 2)])
    assert len(later[0].output_ids) > first + 1  # the early stop token was suppressed
    text = tokenizer.decode(free)
    stop = text[len(tokenizer.decode(free[:3])):][:2]
    if stop:
        out = engine.generate([_req("c", prompt, max_new_tokens=20, stop=[stop])])[0]
        assert out.finish_reason == {"type": "stop", "matched": stop}
        assert stop not in out.text and tokenizer.decode(out.output_ids).find(stop) >= 0
    eos_engine = Engine(CFG, params, _EosTokenizer(tokenizer, free[2]), **OPTS)
    out = eos_engine.generate([_req("d", prompt, max_new_tokens=20)])[0]
    assert out.output_ids == free[: free.index(free[2]) + 1]
    ignored = eos_engine.generate([_req("e", prompt, max_new_tokens=20, ignore_eos=True)])[0]
    assert ignored.output_ids == free


class _EosTokenizer:
    def __init__(self, tokenizer, eos_id):
        self.inner, self.eos_id = tokenizer, eos_id

    def decode(self, ids, skip_special_tokens=False):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_continuous_batching_refills_freed_slots(params):
    engine = Engine(CFG, params, **{**OPTS, "max_slots": 2})
    for i, n in enumerate([2, 30, 2, 2]):
        engine.submit(_req(f"c{i}", _prompts([5], seed=i)[0], max_new_tokens=n))
    finished_order = []
    while engine.has_work():
        finished_order += [c.rid for c in engine.step()]
    # Short requests queued behind the long one finish before it: they took the freed slot.
    assert finished_order.index("c2") < finished_order.index("c1")
    assert finished_order.index("c3") < finished_order.index("c1")
    assert engine.pages.used == engine.prefix.pages  # what is left is only the prefix cache's


def test_abort_pause_update_resume_tags_versions(params):
    engine = Engine(CFG, params, **OPTS)
    prompt = _prompts([9], seed=5)[0]
    engine.submit(_req("keep", prompt, max_new_tokens=24))
    engine.submit(_req("drop", prompt, max_new_tokens=24))
    engine.step()
    engine.abort("drop")
    aborted = engine.step()
    assert [c.rid for c in aborted if c.finish_reason["type"] == "abort"] == ["drop"]
    assert engine.pause("in_place") == 1 and engine.step() == []
    partial = engine.snapshot("keep")
    new_params = jax.tree.map(lambda x: x * 1.01, params)
    engine.update_weights(new_params, version=1)
    engine.resume()
    done = []
    while engine.has_work():
        done += engine.step()
    (out,) = done
    n_old = len(partial.output_ids)
    assert out.output_ids[:n_old] == partial.output_ids
    assert set(out.output_versions[:n_old]) == {0} and set(out.output_versions[n_old:]) == {1}
    assert out.weight_version == 1


def test_compilations_are_bounded_by_the_fixed_buckets(params):
    """Decode compiles once per power-of-two read bucket (at most log2(pages_per_row)+1 = 5
    here) and prefill at most 4 shapes; repeating a workload with other ids, seeds and
    lengths inside the same buckets compiles nothing new."""
    def counts():
        return device_fns.decode._cache_size(), device_fns.prefill._cache_size()

    engine = Engine(CFG, params, **OPTS)
    start = counts()

    def workload(tag, seed):
        engine.generate([_req(f"{tag}s", _prompts([5], seed=seed)[0])])
        lengths = [3, 40, 17, 9, 61, 2, 70]
        engine.generate([_req(f"{tag}{i}", p, max_new_tokens=5 + i, temperature=1.0, sampling_seed=seed + i)
                         for i, p in enumerate(_prompts(lengths, seed=seed))])

    workload("a", 0)
    first = counts()
    assert first[0] - start[0] <= 5 and first[1] - start[1] <= 4
    workload("b", 1)
    assert counts() == first


def test_bad_requests_are_refused_with_the_field(params):
    engine = Engine(CFG, params, **OPTS)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(_req("v", [1, 2, 999]))
    with pytest.raises(ValueError, match="empty input_ids"):
        engine.submit(_req("e", []))
    with pytest.raises(ValueError, match="does not fit"):
        engine.submit(_req("l", list(range(200))))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 0})
    with pytest.raises(ValueError, match="unsupported keys"):
        SamplingParams.from_dict({"temprature": 1.0})


def test_prefix_cache_shares_a_system_prompt_across_requests_and_evicts(params):
    """Prompts sharing a 20-token system prompt, then the same prompts again, then unrelated ones
    that only fit after evicting cached pages: every output equals a fresh engine's for the same
    seed (nothing shared), while the cache supplies the shared pages."""
    system = _prompts([20], seed=7)[0]
    prompts = [system + p for p in _prompts([5, 9, 13], seed=8)]
    others = _prompts([30, 31, 29], seed=9)

    def requests(tag, batch):
        return [_req(f"{tag}{i}", p, temperature=1.0, sampling_seed=i, max_new_tokens=8) for i, p in enumerate(batch)]

    def fresh(batch):
        return [Engine(CFG, params, **OPTS).generate([r])[0].output_ids for r in requests("f", batch)]

    engine = Engine(CFG, params, **{**OPTS, "num_pages": 20})  # 19 pages: 3 rows of 5-6 pages, little to spare
    first, again, unrelated = (engine.generate(requests(tag, batch))
                               for tag, batch in (("a", prompts), ("b", prompts), ("c", others)))
    assert [c.output_ids for c in first] == [c.output_ids for c in again] == fresh(prompts)
    assert [c.output_ids for c in unrelated] == fresh(others)
    assert [c.cached_tokens for c in first] == [0, 16, 16]  # the system prompt's two full pages
    assert [c.cached_tokens for c in again] == [24, 24, 32]  # whole prompts' full pages
    stats = engine.metrics()
    assert stats["prefix_cache_hit_tokens"] == 32 + 80 and stats["prefix_cache_evicted_pages"] > 0
    assert engine.pages.used == engine.prefix.pages <= 19
