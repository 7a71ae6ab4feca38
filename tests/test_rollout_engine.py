"""The embedded engine against independent references: a naive full-forward loop, the
trainer's log-probs, itself alone vs batched; stop conditions, abort, pause/update/resume."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlvr import sharding
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.models.transformer import forward
from rlvr.rollout import device_fns
from rlvr.rollout.dispatch import Dispatch
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


@pytest.mark.parametrize("decode_attention", ["window", "ragged", "native"])
def test_greedy_equals_naive_loop_for_ragged_batch_with_chunked_prefill(params, decode_attention):
    prompts = _prompts([5, 20, 37, 3, 16, 9])  # more requests than slots, prompts longer than a chunk
    engine = Engine(CFG, params, **OPTS, decode_attention=decode_attention)
    outs = engine.generate([_req(f"r{i}", p, max_new_tokens=12) for i, p in enumerate(prompts)])
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_ids == _naive_greedy(params, prompt, 12)
        assert out.finish_reason == {"type": "length", "length": 12}


def _np_sampled_logprobs(logits, temperature, top_k=-1, top_p=1.0, min_p=0.0):
    """Independent reference: log-probs [T, V] of the distribution a temperature/top-k/top-p/min-p
    sampler draws from (the most likely tokens: at most top_k, while the mass before a token is
    < top_p, p >= min_p·p_max; renormalised), -inf outside it."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.full_like(p, -np.inf)
    for t in range(p.shape[0]):
        order = np.argsort(-p[t], kind="stable")
        ps = p[t, order]
        keep = (np.arange(len(ps)) < (top_k if top_k > 0 else len(ps))) & (np.cumsum(ps) - ps < top_p)
        keep &= ps >= min_p * ps[0]
        keep[0] = True
        kept = order[keep]
        out[t, kept] = np.log(p[t, kept] / p[t, kept].sum())
    return out


SAMPLING = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=20, min_p=0.05),
            dict(temperature=0.5, top_k=40, top_p=0.8, min_p=0.2)]


@pytest.mark.parametrize("decode_attention", ["auto", "native"])
def test_engine_logprobs_equal_trainer_logprobs(params, decode_attention):
    """One batch of requests with four sampling settings (raw; temperature 0.7 + top-p 0.9; top-k +
    min-p; all four): the engine reports each token's log-prob under the distribution it sampled
    from, and the trainer's objective (chunked log-probs) scores the same distribution: equal to
    1e-5 in fp32 (its reported `logprob_mismatch`), and to an independent NumPy reference; with the
    small test engine's default decode attention (its contiguous window) and the native kernel."""
    from rlvr.kernels.chunked_logprob import Sampling

    from rlvr.rl.batching import Sample, build_batch
    from rlvr.rl.objective import Objective, rl_loss

    engine = Engine(CFG, params, **OPTS, decode_attention=decode_attention)
    prompts = _prompts([7, 19, 30, 12], seed=1)
    outs = engine.generate([_req(f"s{i}", p, max_new_tokens=16, sampling_seed=i, **sampling)
                            for i, (p, sampling) in enumerate(zip(prompts, SAMPLING, strict=True))])
    samples = [Sample(0, 0, o.prompt_ids, o.output_ids, o.output_logprobs, o.output_versions, False, {"reward": 0})
               for o in outs]
    batch = {k: jnp.asarray(v) for k, v in build_batch(samples, 64, 0).items()}
    logits = np.asarray(_full_forward(params, batch["tokens"], batch["segment_ids"]))
    loss = jax.jit(lambda b, obj: rl_loss(CFG, obj, params, b, None, None)[1], static_argnums=1)
    for i, (out, sampling) in enumerate(zip(outs, SAMPLING, strict=True)):
        start, n = len(out.prompt_ids) - 1, len(out.output_ids)
        ref = _np_sampled_logprobs(logits[i, start:start + n], **sampling)[np.arange(n), out.output_ids]
        row = {k: v[i:i + 1] for k, v in batch.items()}
        aux = loss(row, Objective(sampling=Sampling(**sampling), logprob_chunk_size=8))
        mismatch = float(aux["logprob_mismatch"] / aux["tokens"])
        print(f"{sampling}: engine vs NumPy {np.abs(np.asarray(out.output_logprobs) - ref).max():.1e}, "
              f"reported train/sampler mismatch {mismatch:.1e}")
        np.testing.assert_allclose(out.output_logprobs, ref, atol=1e-5)
        assert mismatch <= 1e-5


def test_sampler_draws_from_the_distribution_it_reports():
    """4096 seeded draws from one row's logits: the frequencies match exp(reported log-prob), and
    no token outside the kept set (top_k=5, top_p=0.9 at temperature 0.7) is ever drawn."""
    from rlvr.rollout.sampling import sample_tokens

    n, logits = 4096, jnp.asarray([2.0, 1.5, 1.4, 1.0, 0.5, 0.2, 0.1, -1.0])
    rows = lambda x, dtype=jnp.float32: jnp.full((n,), x, dtype)
    tokens, logp = jax.jit(sample_tokens)(jnp.tile(logits, (n, 1)), rows(0.7), rows(5, jnp.int32), rows(0.9),
                                          rows(0.0), jnp.arange(n), rows(3, jnp.int32))
    q = np.exp(_np_sampled_logprobs(logits[None], 0.7, 5, 0.9, 0.0)[0])
    np.testing.assert_allclose(np.exp(np.asarray(logp)), q[np.asarray(tokens)], atol=1e-6)
    freq = np.bincount(np.asarray(tokens), minlength=8) / n
    assert np.all(freq[q == 0] == 0) and (q == 0).sum() >= 3
    assert np.all(np.abs(freq - q) <= 4 * np.sqrt(q * (1 - q) / n) + 1e-9), (freq, q)


def test_a_rows_output_is_the_same_whatever_else_is_in_the_batch_and_seeds_reproduce(params):
    """Each row's tokens depend on its own prompt and seed only: moved to another slot and
    prefill row, every other request swapped for one with different tokens and seed (same
    lengths, so the same compiled shapes run), its output is unchanged. Same shapes on purpose:
    across different batch shapes XLA may round the logits differently (it did on CI's CPU), so
    bit-identity is only promised within a shape."""
    lengths = [11, 4, 25, 8]
    prompts, others = _prompts(lengths, seed=2), _prompts(lengths, seed=9)
    requests = [_req(f"b{i}", p, temperature=1.0, top_p=0.9, top_k=50, sampling_seed=100 + i)
                for i, p in enumerate(prompts)]
    batched = Engine(CFG, params, **OPTS).generate(requests)
    order = [1, 0, 3, 2]  # each request moves to its prefill partner's slot and row
    for i, together in enumerate(batched):
        mixed = [requests[j] if j == i else _req(f"x{j}", others[j], temperature=1.0, top_p=0.9, top_k=50,
                                                 sampling_seed=500 + j) for j in order]
        out = {c.rid: c.output_ids for c in Engine(CFG, params, **OPTS).generate(mixed)}
        assert out[f"b{i}"] == together.output_ids
        assert all(out[f"x{j}"] != batched[j].output_ids for j in order if j != i)
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
    assert len(later[0].output_ids) > first + 1  # the early stop token did not end the output,
    assert stop_id not in later[0].output_ids[: first + 2]  # nor was it drawn (masked, not only ignored)
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
    engine = Engine(CFG, params, **{**OPTS, "max_slots": 2}, decode_attention="window")  # window metrics below
    engine.call_times = []  # synchronous timing (benchmarks' cost models): outputs must not change
    for i, n in enumerate([2, 30, 2, 2]):
        engine.submit(_req(f"c{i}", _prompts([5], seed=i)[0], max_new_tokens=n))
    finished_order, outputs = [], {}
    for step in range(10**4):
        if not engine.has_work():
            break
        done = engine.step()
        finished_order += [c.rid for c in done]
        outputs.update({c.rid: c.output_ids for c in done})
        if step == 1:  # c0's max_new ended inside the first decode call: its slot was given back at
            # dispatch, so the second step admitted c2 without waiting a call for c0's tokens
            assert [s.request.rid for s in engine.waiting] == ["c3"]
    # Short requests queued behind the long one finish before it: they took the freed slot.
    assert finished_order.index("c2") < finished_order.index("c1")
    assert finished_order.index("c3") < finished_order.index("c1")
    for i, n in enumerate([2, 30, 2, 2]):  # reusing the slot while c0's call ran changed no output
        assert outputs[f"c{i}"] == _naive_greedy(params, _prompts([5], seed=i)[0], n)
    assert engine.pages.used == engine.prefix.pages  # what is left is only the prefix cache's
    # Hand-counted: c1 (30 tokens: the prefill's first + 29 decode steps) runs in every decode call,
    # so the loops ran 29 steps, each computing both slots; rows emitted all tokens but the prefills'.
    metrics = engine.metrics()
    assert metrics["decode_loop_steps"] == 29 and metrics["decode_row_steps_paid"] == 2 * 29
    assert metrics["decode_row_steps_used"] == sum(len(o) for o in outputs.values()) - 4
    assert 4 * 29 <= metrics["decode_window_page_steps"] <= 8 * 29  # windows of 4 or 8 pages (c1 reaches 35 tokens)
    decode = [size for kind, size, _ in engine.call_times if kind == "decode"]  # (rows, slots, steps, used)
    assert sum(d[2] for d in decode) == 29 and sum(d[3] for d in decode) == metrics["decode_row_steps_used"]
    assert len(decode) == metrics["decode_calls"] and all(d[1] == 2 for d in decode)


def test_a_decode_call_is_cut_short_when_waiting_requests_would_use_the_freed_steps():
    """Hand-computed: 4 slots, 8-step calls, rows with 2, 3, 20, 20 tokens left. Two waiting
    requests: ending at step 3 frees 2 slots for 5 steps (10 row-steps >= 2 steps x 4 slots): cut.
    One waiting: the best is step 2 (1 x 6 = 6 row-steps < 8): the call runs its 8 steps."""
    def row(left):
        return types.SimpleNamespace(prompt=[0] * 5, max_new=left + 10, device_tokens=15)
    rows = [row(2), None, row(3), row(20), row(20)]
    engine = types.SimpleNamespace(max_slots=4, waiting=[object(), object()])
    assert Dispatch._refill_steps(engine, rows, 8) == 3
    engine.waiting = [object()]
    assert Dispatch._refill_steps(engine, rows, 8) == 8


def _aligned(x):
    """A copy of `x` starting at a 64-byte boundary: JAX on CPU zero-copies such a buffer (device_put
    then aliases it for good), so a test sees aliasing every time, not by the allocator's chance."""
    raw = np.empty(x.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def test_device_calls_get_copies_of_the_tables_the_host_keeps_editing(params, monkeypatch):
    """On CPU, jax.device_put of a 64-byte-aligned NumPy array aliases it (a large unaligned one is
    copied in the background): the page and sampling tables a decode call is handed must be copies,
    or the host's edits (a freed slot taking a new request, pages allocated) change calls already
    dispatched. The host tables are aligned here, so a missing copy fails every time."""
    engine = Engine(CFG, params, **{**OPTS, "max_slots": 2})
    engine.page_table = _aligned(engine.page_table)
    engine._sampling = {k: _aligned(v) for k, v in engine._sampling.items()}
    handed, decode = [], device_fns.decode

    def spy(*args):  # decode(cfg, steps, filters, params, pool, table, ragged, state, active, sampling, ...)
        handed.append([(x, np.array(x)) for x in (args[5], *args[9].values())])
        return decode(*args)
    monkeypatch.setattr(device_fns, "decode", spy)
    for i, n in enumerate([2, 30, 2, 2]):
        engine.submit(_req(f"c{i}", _prompts([5], seed=i)[0], max_new_tokens=n))
    while engine.has_work():
        engine.step()
    assert len(handed) > 4
    for arrays in handed:
        for device, at_call in arrays:
            np.testing.assert_array_equal(np.asarray(device), at_call)


def test_schedule_policies_admission_order(params):
    """schedule_policy="lof" (SGLang's): requests take the slots largest max_new_tokens first
    (equal ones in submission order), a later request too; "batch_lof" (the default): lof within
    the requests submitted together, so "e", submitted a step after the others, comes last;
    "fcfs": submission order. Sampled outputs and log-probs are the same under all three."""
    lengths = {"a": 2, "b": 9, "c": 5, "d": 9}
    expected = {"fcfs": ["a", "b", "c", "d", "e"], "lof": ["b", "d", "e", "c", "a"],
                "batch_lof": ["b", "d", "c", "a", "e"]}
    outputs = {}
    for policy, order in expected.items():
        engine = Engine(CFG, params, **{**OPTS, "max_slots": 2}, schedule_policy=policy)
        requests = [_req(rid, _prompts([6], seed=i)[0], max_new_tokens=n, temperature=1.0, sampling_seed=i)
                    for i, (rid, n) in enumerate({**lengths, "e": 12}.items())]
        for request in requests[:4]:
            engine.submit(request)
        admitted, place = [], engine._place
        engine._place = lambda seq, *args, place=place, log=admitted: (log.append(seq.request.rid), place(seq, *args))
        outputs.update({(policy, c.rid): (c.output_ids, c.output_logprobs) for c in engine.step()})
        engine.submit(requests[4])
        while engine.has_work():
            outputs.update({(policy, c.rid): (c.output_ids, c.output_logprobs) for c in engine.step()})
        assert admitted == order, policy
    assert all(outputs[(policy, rid)] == outputs[("fcfs", rid)] for policy in expected for rid in "abcde")
    assert len(outputs[("fcfs", "e")][0]) == 12
    assert Engine(CFG, params, **OPTS).schedule_policy == "batch_lof"
    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(CFG, params, **OPTS, schedule_policy="lpm")


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


def test_a_weight_update_drops_the_prefix_cache_and_old_kv_never_enters_it(params):
    """After `update_weights`, no request reuses KV computed with the old weights: not the cached pages
    (they were reused across RL steps: trainer/engine log-probs then disagreed by up to 3e-3 per token on
    VLM chart runs, whose prompts repeat), not the pages of a sequence that ran across the update. Every
    log-prob after the update equals a fresh engine's on the new weights, and the cache refills."""
    prompt = _prompts([20], seed=11)[0]
    new_params = jax.tree.map(lambda x: x * 1.05, params)

    def req(rid, max_new_tokens=8):
        return _req(rid, prompt, temperature=1.0, sampling_seed=3, max_new_tokens=max_new_tokens)

    (reference,) = Engine(CFG, new_params, **OPTS).generate([req("fresh")])
    engine = Engine(CFG, params, **OPTS)
    (old,) = engine.generate([req("old")])
    assert engine.generate([req("cached")])[0].cached_tokens == 16  # pages are cached ...
    engine.submit(req("across", max_new_tokens=24))  # ... and one sequence runs across the update
    engine.step()
    engine.update_weights(new_params, version=1)
    (after,) = engine.generate([req("after")])
    while engine.has_work():
        engine.step()
    (again,) = engine.generate([req("again")])
    assert after.cached_tokens == 0 and again.cached_tokens == 16  # refilled by "after", not by "across"
    for out in (after, again):
        assert out.output_ids == reference.output_ids
        np.testing.assert_allclose(out.output_logprobs, reference.output_logprobs, atol=1e-5)
    assert np.max(np.abs(np.subtract(old.output_logprobs, reference.output_logprobs))) > 1e-3  # stale KV shows


@pytest.mark.parametrize("decode_attention, buckets", [("window", [4, 8, 16]), ("auto", [16])])
def test_compilation_is_bounded_and_paid_up_front(params, decode_attention, buckets):
    """`warmup()` compiles the decode programs (one per window length, `window_buckets`: 4, 8
    and 16 pages here; one for "auto", the native kernel on CPU) and the prefill shapes (rows 1, 2
    x chunks 4, 16 here), once each: the page pool and decode state start on the params' mesh, as
    every call returns them (created uncommitted, the first call's program was one no later call
    used: 5 prefill compiles); workloads of other ids, seeds, prompt lengths and output lengths then
    compile nothing new."""
    def counts():
        return device_fns.decode._cache_size(), device_fns.prefill._cache_size()

    engine = Engine(CFG, params, **OPTS, decode_attention=decode_attention)
    start = counts()
    engine.warmup()
    warm = counts()
    assert engine.window_buckets() == buckets
    assert warm[0] - start[0] <= len(buckets) and warm[1] - start[1] <= 4

    def workload(tag, seed):
        engine.generate([_req(f"{tag}s", _prompts([5], seed=seed)[0])])
        lengths = [3, 40, 17, 9, 61, 2, 70, 120]
        engine.generate([_req(f"{tag}{i}", p, max_new_tokens=5 + i, temperature=1.0, sampling_seed=seed + i)
                         for i, p in enumerate(_prompts(lengths, seed=seed))])

    workload("a", 0)
    workload("b", 1)
    assert counts() == warm and engine.metrics()["compiles_decode"] == warm[0]


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


def test_prefix_cache_off_prefills_every_prompt_whole_with_the_same_outputs(params):
    """prefix_cache=False (--disable-radix-cache): a group's samples and a repeated batch share no
    page (no cached tokens, no hits, nothing cached), and every output equals the caching engine's."""
    prompt = _prompts([37], seed=3)[0]
    batch = [_req(f"g{i}", prompt, temperature=1.0, sampling_seed=i, max_new_tokens=6) for i in range(4)]
    cached, plain = Engine(CFG, params, **OPTS), Engine(CFG, params, **OPTS, prefix_cache=False)
    with_cache = [cached.generate(batch) for _ in range(2)]
    without = [plain.generate(batch) for _ in range(2)]
    assert [[c.output_ids for c in run] for run in without] == [[c.output_ids for c in run] for run in with_cache]
    assert [c.cached_tokens for run in with_cache for c in run] == [0, 36, 36, 36] + [32, 36, 36, 36]
    assert [c.cached_tokens for run in without for c in run] == [0] * 8
    stats = plain.metrics()
    assert stats["prefix_cache_hit_tokens"] == 0 and stats["prefix_cache_pages"] == 0 and plain.pages.used == 0
    assert plain.server_args()["disable_radix_cache"] and not cached.server_args()["disable_radix_cache"]
    for engine, expected in ((cached, 36), (plain, 0)):  # a sample arriving while its twin decodes
        engine.submit(_req("early", prompt, max_new_tokens=12))
        while not any(seq.prefilled >= len(prompt) - 1 for seq in engine._running()):
            engine.step()
        assert engine.generate([_req("late", prompt, max_new_tokens=2)])[0].cached_tokens == expected


def test_bfloat16_rollout_weights_and_kv_pages_stay_close_to_float32(params):
    """dtype="bfloat16": the pool and weights are bf16; log-probs (float32 from the logits) stay
    within bf16 rounding of the float32 engine's on the same greedy tokens."""
    request = _req("h", _prompts([12], seed=11)[0], max_new_tokens=3)
    full = Engine(CFG, params, **OPTS).generate([request])[0]
    half_engine = Engine(CFG, params, **OPTS, dtype="bfloat16")
    assert half_engine.pool["k"].dtype == jnp.uint16  # on CPU a bf16 pool is stored as its bits (kernels/bits.py)
    assert half_engine.params["layers_0"]["mlp"]["down_proj"]["kernel"].dtype == jnp.bfloat16
    half = half_engine.generate([request])[0]
    assert half.output_ids[:2] == full.output_ids[:2]
    np.testing.assert_allclose(half.output_logprobs[:2], full.output_logprobs[:2], atol=0.05)


@pytest.mark.parametrize("decode_attention", ["window", "ragged", "native"])
def test_a_bf16_pool_stored_as_bits_samples_what_a_bf16_pool_samples(params, monkeypatch, decode_attention):
    """On CPU the engine stores a bf16 page pool as its uint16 bits (rlvr.kernels.bits: XLA:CPU copied
    the whole pool at every bitcast inside the decode loop). The same requests (a group sharing its
    prompt's pages, a partial-page copy, chunked prefill, several decode calls) give the same
    tokens and log-probs as an engine whose pool holds bf16 values, under both decode attentions."""
    import rlvr.rollout.engine as engine_module

    def run():
        engine = Engine(CFG, params, **{**OPTS, "decode_steps": 3}, dtype="bfloat16", decode_attention=decode_attention)
        prompt = _prompts([21], seed=5)[0]
        requests = [Request(f"g{j}", prompt, SamplingParams(max_new_tokens=9, temperature=1.0, sampling_seed=j))
                    for j in range(3)] + [_req("x", _prompts([30], seed=6)[0], max_new_tokens=7)]
        return engine.pool["k"].dtype, engine.generate(requests)

    bits_dtype, bits = run()
    monkeypatch.setattr(engine_module, "bits_pool", lambda pool: pool)
    float_dtype, floats = run()
    assert (bits_dtype, float_dtype) == (jnp.uint16, jnp.bfloat16)
    for a, b in zip(bits, floats, strict=True):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-6)


def test_native_decode_matmul_packs_the_projections_and_samples_what_xla_samples(params, monkeypatch):
    """decode_matmul "native" (float32, one CPU device): every decoder and output projection of the
    decode tree is packed (no plain `kernel` left there) and multiplied by the native kernel; the
    greedy and sampled tokens equal an engine multiplying with XLA ("xla") and its log-probs agree
    to 1e-5. "auto" takes it only on a CPU with AVX-512 (without, it ran ~18x slower than XLA:
    benchmarks/results/decode_matmul_cpu.json). "native" where it cannot run (bf16 weights, no
    compiler) is an error saying why."""
    import rlvr.rollout.engine as engine_module

    native, xla = Engine(CFG, params, **OPTS, decode_matmul="native"), Engine(CFG, params, **OPTS, decode_matmul="xla")
    assert (native.native_matmul, xla.native_matmul) == (True, False)
    for avx512, expected in ((True, True), (False, False)):
        monkeypatch.setattr(engine_module.native_build, "cpu_has", lambda flag, on=avx512: on and flag == "avx512f")
        assert Engine(CFG, params, **OPTS).native_matmul == expected
    monkeypatch.setattr(engine_module.native_build, "cpu_has", lambda flag: True)
    names = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(native.params)}
    packed = {n for n in names if n.endswith("['kernel_packed']")}
    assert not {n for n in names if n.endswith("['kernel']")} and len(packed) == 4 * CFG.num_layers + 1
    assert native.params["layers_0"]["self_attn"]["o_proj"]["kernel_packed"].shape == (2, 64, 32)  # [h·d, e]
    assert native.params["lm_head"]["kernel_packed"].shape == (10, 64, 32)  # 300 columns: 9 panels + 12
    requests = [_req(f"r{i}", p, max_new_tokens=12, temperature=t, sampling_seed=i)
                for i, (p, t) in enumerate(zip(_prompts([5, 19, 40, 9]), [0.0, 1.0, 0.0, 1.0], strict=True))]
    for got, ref in zip(native.generate(requests), xla.generate(requests), strict=True):
        assert got.output_ids == ref.output_ids
        np.testing.assert_allclose(got.output_logprobs, ref.output_logprobs, atol=1e-5)
    assert not Engine(CFG, params, **OPTS, dtype="bfloat16").native_matmul
    with pytest.raises(ValueError, match="decode_matmul='native' cannot run: it multiplies float32 weights"):
        Engine(CFG, params, **OPTS, dtype="bfloat16", decode_matmul="native")
    monkeypatch.setattr(engine_module, "packed_matmul_unavailable_reason", lambda: "no C++ compiler 'g++' on PATH")
    assert not Engine(CFG, params, **OPTS).native_matmul
    with pytest.raises(ValueError, match="decode_matmul='native' cannot run: no C.*use 'xla' or 'auto'"):
        Engine(CFG, params, **OPTS, decode_matmul="native")


def test_auto_decode_attention_takes_the_native_kernel_where_it_builds(params, monkeypatch):
    """decode_attention="auto": the native CPU kernel when it builds here (whatever the window's
    size); else the contiguous window up to WINDOW_AUTO_BYTES and the ragged XLA path beyond; "native"
    asked for where it cannot run is an error that says why (and what to use instead)."""
    import rlvr.rollout.engine as engine_module

    def choice(**options):
        engine = Engine(CFG, params, **OPTS, **options)
        return engine.decode_window, engine.native_decode, engine.attention_backend()

    assert choice() == (False, True, "native")
    monkeypatch.setattr(engine_module, "native_unavailable_reason", lambda: "no C++ compiler 'g++' on PATH")
    assert choice() == (True, False, "window")
    monkeypatch.setattr(engine_module, "WINDOW_AUTO_BYTES", 0)
    assert choice() == (False, False, "ragged")
    assert choice(decode_attention="window") == (True, False, "window")
    with pytest.raises(ValueError, match="decode_attention='native' cannot run: no C.*use 'ragged' or 'auto'"):
        Engine(CFG, params, **OPTS, decode_attention="native")
