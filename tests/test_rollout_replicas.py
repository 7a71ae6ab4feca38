"""Engine replicas (`rlvr.rollout.replicas`) against a single engine with the same slots: the same
samples for the same seeds (drawn or given), a group's prompt kept on one replica, requests
routed for abort and snapshot, weights updated on every replica, and driven by `EngineDriver`."""

import jax
import numpy as np
import pytest

from rlvr import sharding
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.rollout.driver import EngineDriver
from rlvr.rollout.engine import Engine
from rlvr.rollout.replicas import ReplicatedEngine, build_engine
from rlvr.rollout.types import Request, SamplingParams

CFG = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=300, rope_theta=10_000.0)
OPTS = dict(max_slots=8, max_len=128, page_size=8, decode_steps=4, prefill_rows=2, prefill_chunk=16, seed=3)


@pytest.fixture(scope="module")
def params():
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    return params_lib.init_params(CFG, jax.random.key(0), mesh)


def _requests(tag, seeded=True):
    """Three prompts x a group of 3 samples (temperature 1, varied lengths)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (21, 9, 30)]
    return [Request(f"{tag}{p}-{j}", prompt, SamplingParams(max_new_tokens=6 + 3 * j, temperature=1.0,
                                                             sampling_seed=10 * p + j if seeded else None))
            for p, prompt in enumerate(prompts) for j in range(3)]


def _same_samples(got, expected):
    """The same tokens, and log-probs within float32 rounding (rows batched with others can differ
    in the last bits)."""
    return all(a.output_ids == b.output_ids and np.allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)
               for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("seeded", [True, False])
def test_replicas_sample_what_one_engine_samples(params, seeded):
    single = Engine(CFG, params, **OPTS)
    replicated = build_engine(CFG, params, replicas=2, **OPTS)
    assert isinstance(replicated, ReplicatedEngine) and [r.max_slots for r in replicated.replicas] == [4, 4]
    try:
        requests = _requests("a", seeded)
        expected = single.generate(requests)
        for request in requests:
            replicated.submit(request)
        holder = {r.rid: replicated.replicas.index(replicated._owner[r.rid]) for r in requests}
        done = {}
        while len(done) < len(requests):
            done.update((c.rid, c) for c in replicated.step())
        got = [done[r.rid] for r in requests]
        assert _same_samples(got, expected)  # unseeded: the wrapper draws the seeds one engine would
        assert not replicated._owner  # forgotten once finished
        groups = [{holder[r.rid] for r in requests[g:g + 3]} for g in (0, 3, 6)]
        assert all(len(g) == 1 for g in groups) and len(set().union(*groups)) == 2  # a group on one replica, both used
        total = replicated.metrics()
        assert total["replicas"] == 2 and total["generated_tokens"] == sum(len(c.output_ids) for c in got)
        assert total["prefix_cache_hit_tokens"] == single.metrics()["prefix_cache_hit_tokens"] > 0
    finally:
        replicated.close()


def test_replicas_route_abort_snapshot_and_weight_updates(params):
    replicated = ReplicatedEngine(CFG, params, replicas=2, **OPTS)
    single = Engine(CFG, params, **OPTS)
    try:
        long = Request("long", list(range(5, 25)), SamplingParams(max_new_tokens=60, temperature=0.0,
                                                                   ignore_eos=True))
        replicated.submit(long)
        replicated.step()
        replicated.step()
        assert replicated.snapshot("long").output_ids and replicated.snapshot("nope") is None
        replicated.abort("long")
        (done,) = replicated.step()
        assert done.rid == "long" and done.finish_reason["type"] == "abort"
        assert replicated.replicas[0].params is replicated.replicas[1].params  # one copy of the weights
        scaled = jax.tree.map(lambda x: x * 1.5, params)
        replicated.update_weights(scaled, 7)
        single.update_weights(scaled, 7)
        assert replicated.weight_version == 7 and all(r.weight_version == 7 for r in replicated.replicas)
        assert replicated.replicas[0].params is replicated.replicas[1].params
        got, expected = replicated.generate(_requests("b")), single.generate(_requests("b"))
        assert _same_samples(got, expected) and {v for c in got for v in c.output_versions} == {7}
    finally:
        replicated.close()


def test_driver_runs_replicas(params):
    engine = ReplicatedEngine(CFG, params, replicas=2, **OPTS)
    with EngineDriver(engine) as driver:
        first = driver.generate(_requests("c"))
        assert driver.pause("in_place") == 0
        driver.resume()
        again = driver.generate(_requests("d"))
        assert _same_samples(first, again) and driver.metrics()["replicas"] == 2
    engine.close()


def test_a_failing_replica_step_is_raised_after_both_stopped(params):
    """A replica's step error reaches the caller once the other replica's step has stopped too (so
    the driver's abort_all finds no engine running), and the engine keeps working after it."""
    engine = ReplicatedEngine(CFG, params, replicas=2, **OPTS)
    real, calls = engine.replicas[1].step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("replica step failed")
        return real()

    engine.replicas[1].step = failing_once
    try:
        for request in _requests("e"):
            engine.submit(request)
        with pytest.raises(RuntimeError, match="replica step failed"):
            while True:
                engine.step()
        assert not engine._stepping
        engine.abort_all()
        aborted = engine.step()
        assert aborted and {c.finish_reason["type"] for c in aborted} == {"abort"}
        assert _same_samples(engine.generate(_requests("f")), Engine(CFG, params, **OPTS).generate(_requests("f")))
    finally:
        engine.close()


def test_routing_follows_a_conversation_but_not_a_shared_system_prompt(params):
    """A prompt that mostly repeats a cached one (the next turn) goes to the replica holding it; new
    prompts that share only a short system prompt with it spread over the replicas."""
    engine = ReplicatedEngine(CFG, params, replicas=2, **OPTS)
    system, rng = list(range(40, 56)), np.random.default_rng(1)  # two pages of 8
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    try:
        (first,) = engine.generate([Request("t1", system + list(range(60, 80)), greedy)])
        holder = next(r for r in engine.replicas if r.prefix.match(first.prompt_ids[:-1], touch=False))
        turn = Request("t2", first.prompt_ids + first.output_ids + list(range(90, 96)), greedy)
        engine.submit(turn)
        assert engine._owner["t2"] is holder
        fresh = [Request(f"n{i}", system + rng.integers(100, 250, 30).tolist(), greedy) for i in range(4)]
        for request in fresh:
            engine.submit(request)
        owners = [engine.replicas.index(engine._owner[r.rid]) for r in fresh]
        assert sorted(owners) == [0, 0, 1, 1], owners  # least loaded, not all to the system prompt's holder
        while engine.has_work():
            engine.step()
    finally:
        engine.close()


@pytest.mark.parametrize("replicas", [1, 2])
def test_generate_keeps_other_requests_completions_for_the_next_step(params, replicas):
    """A request submitted before `generate` that finishes during it: generate returns its own
    requests (before, one engine counted the other completion toward its total, stopped early and
    raised KeyError), and the next `step()` returns the other one instead of dropping it."""
    engine = build_engine(CFG, params, replicas=replicas, **OPTS)
    try:
        early = Request("early", [5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0.0))
        engine.submit(early)
        late = Request("late", [8, 9, 10, 11], SamplingParams(max_new_tokens=24, temperature=0.0))
        (got,) = engine.generate([late])
        assert got.rid == "late" and len(got.output_ids) == 24
        assert engine.has_work()
        kept = engine.step()
        assert [c.rid for c in kept] == ["early"] and len(kept[0].output_ids) == 2
    finally:
        if replicas > 1:
            engine.close()
