"""The in-loop scheduler (rlvr.rl.scheduler): priority order, backfill, preemption that loses and
duplicates nothing, degradation (shorter budgets, cut groups, skipped domains), time-weighted
utilisation on a hand-set clock, and the real engine giving the same tokens to a preempted group."""

import concurrent.futures
import threading
import time

import jax
import numpy as np
import pytest

from rlvr import sharding
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.rl import backends
from rlvr.rl.batching import Sample, build_batch
from rlvr.rl.producer import group_advantages
from rlvr.rl.scheduler import GroupJob, SchedulePolicy, Scheduler, TurnBackend, parse_priorities
from rlvr.rollout.types import Completion, Request, SamplingParams


class ManualBackend:
    """Requests finish when the test says so (`finish(rid)`), or after `auto_s` seconds; abort
    resolves the future at once with finish_reason abort. Records every submitted request."""

    def __init__(self, capacity: int, auto_s: float | None = None):
        self.capacity, self.auto_s = capacity, auto_s
        self.submitted: list[Request] = []
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.aborted: list[str] = []
        self.lock = threading.Lock()

    def submit(self, requests):
        out = []
        with self.lock:
            for r in requests:
                self.submitted.append(r)
                self.futures[r.rid] = fut = concurrent.futures.Future()
                out.append(fut)
        if self.auto_s is not None:
            for r in requests:
                threading.Timer(self.auto_s, self.finish, args=(r.rid,)).start()
        return out

    def _complete(self, rid: str, kind: str):
        with self.lock:
            fut = self.futures.pop(rid, None)
            request = next(r for r in self.submitted if r.rid == rid)
        if fut is not None and not fut.done():
            tokens = [1] * request.sampling.max_new_tokens
            fut.set_result(Completion(rid, list(request.input_ids), tokens, [0.0] * len(tokens), [0] * len(tokens),
                                      {"type": kind}))

    def finish(self, rid: str):
        self._complete(rid, "stop")

    def abort(self, rids):
        self.aborted += list(rids)
        for rid in rids:
            self._complete(rid, "abort")

    def running(self) -> list[str]:
        with self.lock:
            return list(self.futures)


def _requests(name: str, n: int, max_new_tokens: int = 8) -> list[Request]:
    return [Request(f"{name}-k{i}", [1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens, sampling_seed=i))
            for i in range(n)]


def _job(key, priority, n, family="", name=None, scored=None):
    name = name or f"g{key}"

    def score(c):
        if scored is not None:
            scored.append(c.rid)
        return c.rid
    return GroupJob(key, family or name, priority, _requests(name, n), score=score)


def _until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


@pytest.fixture
def pool():
    executor = concurrent.futures.ThreadPoolExecutor(4)
    yield executor
    executor.shutdown()


def _scheduler(backend, pool, clock=time.monotonic, **policy):
    return Scheduler(SchedulePolicy(**policy), backend, pool, 4, clock=clock, poll_s=0.005)


def _first_dispatch(backend, name):
    return next(i for i, r in enumerate(backend.submitted) if r.rid.startswith(name + "-"))


def test_parse_priorities_and_errors():
    assert parse_priorities("math=2, code=0.5,") == {"math": 2.0, "code": 0.5}
    assert parse_priorities("") == {}
    with pytest.raises(ValueError, match="rl.schedule.priorities"):
        parse_priorities("math:2")
    with pytest.raises(ValueError, match="rl.schedule.priorities"):
        parse_priorities("=2")
    policy = SchedulePolicy(priorities={"add": 3.0, "math": 2.0})
    assert (policy.priority("add", "math"), policy.priority("sub", "math"), policy.priority("x", "y")) == (3, 2, 1)


def test_groups_run_highest_priority_first_and_smaller_ones_backfill(pool):
    backend = ManualBackend(capacity=6)
    s = _scheduler(backend, pool)
    jobs = [_job(0, 1.0, 2, name="low"), _job(1, 3.0, 4, name="high"), _job(2, 2.0, 4, name="mid")]
    try:
        runner = concurrent.futures.ThreadPoolExecutor(1).submit(s.run, jobs)
        # high (4) first; mid (4) does not fit beside it, low (2) does: it backfills. Preempting low
        # would not make room for mid (free 0 + 2 < 4), so nothing is preempted.
        _until(lambda: len(backend.running()) == 6)
        time.sleep(0.05)
        assert sorted(backend.running()) == sorted([f"high-k{i}" for i in range(4)] + ["low-k0", "low-k1"])
        assert not backend.aborted
        for rid in backend.running():
            backend.finish(rid)
        _until(lambda: len(backend.running()) == 4)
        assert sorted(backend.running()) == [f"mid-k{i}" for i in range(4)]
        for rid in backend.running():
            backend.finish(rid)
        done = runner.result(timeout=10)
    finally:
        s.close()
    assert s.counts["preemptions"] == 0
    assert [done[k].results for k in range(3)] == [[f"{n}-k{i}" for i in range(m)]
                                                  for n, m in (("low", 2), ("high", 4), ("mid", 4))]


def test_preemption_requeues_the_lower_group_and_loses_or_duplicates_nothing(pool):
    backend = ManualBackend(capacity=4)
    s = _scheduler(backend, pool)
    scored: list[str] = []
    try:
        low = s.submit(_job(0, 1.0, 4, name="low", scored=scored))
        _until(lambda: len(backend.running()) == 4)
        backend.finish("low-k0")  # one low sample finishes before the preemption: it is kept
        _until(lambda: len(backend.running()) == 3)
        high = s.submit(_job(1, 5.0, 4, name="high", scored=scored))
        _until(lambda: sorted(backend.running()) == [f"high-k{i}" for i in range(4)])
        assert sorted(backend.aborted) == ["low-k1", "low-k2", "low-k3"]
        for rid in backend.running():
            backend.finish(rid)
        s.wait(high)
        _until(lambda: len(backend.running()) == 3)  # low re-dispatched: only its unfinished requests
        retried = backend.running()
        assert all(".p" in rid for rid in retried) and sorted(r.split(".p")[0] for r in retried) == [
            "low-k1", "low-k2", "low-k3"]
        for rid in retried:
            backend.finish(rid)
        s.wait(low)
        for job in (low, high):
            for index, future in job.scoring:
                job.results[index] = future.result()
    finally:
        s.close()
    assert s.counts["preemptions"] == 1 and low.preemptions == 1
    assert low.results == [f"low-k{i}" for i in range(4)]  # original rids, each once
    assert sorted(scored) == sorted([f"low-k{i}" for i in range(4)] + [f"high-k{i}" for i in range(4)])
    retry_seeds = sorted(r.sampling.sampling_seed for r in backend.submitted if ".p" in r.rid)
    assert retry_seeds == [1, 2, 3]  # same seeds: the same tokens under the same weights


def test_degradation_budget_cut_and_skip_in_order(pool):
    now = [0.0]
    backend = ManualBackend(capacity=16)
    s = _scheduler(backend, pool, clock=lambda: now[0], deadline_s=10.0, min_group_size=2, budget_fraction=0.25,
                   priorities={"top": 5.0, "low": 1.0})
    try:
        s.begin_batch()
        top = s.submit(_job(0, 5.0, 4, name="top"))
        low = s.submit(_job(1, 1.0, 4, name="low"))
        _until(lambda: len(backend.running()) == 8)
        assert {r.sampling.max_new_tokens for r in backend.submitted} == {8}  # on time: full budgets
        now[0] = 10.0  # lagging x1: lower priorities get shorter budgets from now on
        late = s.submit(_job(2, 1.0, 4, name="late"))
        _until(lambda: len(backend.running()) == 12)
        assert {r.sampling.max_new_tokens for r in backend.submitted if r.rid.startswith("late")} == {2}
        assert {r.sampling.max_new_tokens for r in backend.submitted if r.rid.startswith("top")} == {8}
        backend.finish("low-k0")
        backend.finish("low-k1")
        now[0] = 15.0  # x1.5: in-flight lower groups with 2 finished samples are cut
        _until(lambda: low.finished.is_set())
        assert sorted(backend.aborted) == ["low-k2", "low-k3"] and low.degraded == ["cut"]
        assert sorted(low.done) == [0, 1]
        blocked = s.submit(_job(3, 0.5, 16, name="blocked"))  # does not fit: waits
        time.sleep(0.05)
        now[0] = 20.0  # x2: the lowest waiting priority is skipped
        _until(lambda: blocked.finished.is_set())
        assert blocked.skipped and not any(r.rid.startswith("blocked") for r in backend.submitted)
        for rid in backend.running():
            backend.finish(rid)
        s.wait(top)
        s.wait(late)
        metrics = s.end_batch()
    finally:
        s.close()
    assert metrics["sched/degraded_budget"] == 1 and metrics["sched/degraded_cut"] >= 1
    assert metrics["sched/skipped_groups"] == 1
    assert s.lag_threshold() == 10.0


def test_without_priorities_lagging_groups_are_cut_but_no_domain_is_skipped(pool):
    now = [0.0]
    backend = ManualBackend(capacity=4)
    s = _scheduler(backend, pool, clock=lambda: now[0], deadline_s=1.0, min_group_size=3)
    try:
        s.begin_batch()
        a = s.submit(_job(0, 1.0, 4, name="a"))
        b = s.submit(_job(1, 1.0, 4, name="b"))
        _until(lambda: len(backend.running()) == 4)
        for rid in ("a-k0", "a-k1", "a-k2"):
            backend.finish(rid)
        now[0] = 5.0  # x5: every step applies, but with one priority class nothing can be skipped
        _until(lambda: a.finished.is_set())
        assert backend.aborted == ["a-k3"] and sorted(a.done) == [0, 1, 2]
        _until(lambda: len(backend.running()) == 4)
        assert {r.sampling.max_new_tokens for r in backend.submitted if r.rid.startswith("b")} == {4}
        for rid in backend.running():
            backend.finish(rid)
        s.wait(b)
    finally:
        s.close()
    assert not b.skipped and s.counts["skipped_groups"] == 0 and s.counts["degraded_cut"] == 1


def test_utilisation_and_queue_are_time_weighted(pool):
    now = [0.0]
    backend = ManualBackend(capacity=4)
    s = _scheduler(backend, pool, clock=lambda: now[0])
    try:
        s.begin_batch()
        a = s.submit(_job(0, 1.0, 2, name="a"))
        b = s.submit(_job(1, 1.0, 4, name="b"))  # does not fit beside a: queued
        _until(lambda: len(backend.running()) == 2)
        now[0] = 10.0
        backend.finish("a-k0")
        backend.finish("a-k1")
        _until(lambda: len(backend.running()) == 4)
        now[0] = 15.0
        for rid in backend.running():
            backend.finish(rid)
        s.wait(a)
        s.wait(b)
        now[0] = 20.0
        metrics = s.end_batch()
    finally:
        s.close()
    # busy 0-15 of 20; slots: 2 for 10 s + 4 for 5 s over 20 s, of 4; one group queued for 10 s
    assert metrics["util/inference"] == pytest.approx(15 / 20)
    assert metrics["util/inference_slots"] == pytest.approx((2 * 10 + 4 * 5) / 20 / 4)
    assert metrics["queue/inference"] == pytest.approx(10 / 20)


def test_episode_turns_go_through_the_scheduler_with_their_priority(pool):
    backend = ManualBackend(capacity=8, auto_s=0.01)
    s = _scheduler(backend, pool)
    try:
        turns = TurnBackend(s, {"s0-t3-k1": (2.0, "tool_calc")})
        out = turns.generate([Request("s0-t3-k1-turn2", [5, 6], SamplingParams(max_new_tokens=3))])
    finally:
        s.close()
    assert out[0].rid == "s0-t3-k1-turn2" and out[0].output_ids == [1, 1, 1]


def test_backend_errors_fail_the_job_not_the_scheduler(pool):
    class Broken(ManualBackend):
        def submit(self, requests):
            raise ConnectionError("server gone")

    s = _scheduler(Broken(capacity=4), pool)
    try:
        with pytest.raises(ConnectionError):
            s.run([_job(0, 1.0, 2)])
        assert s._thread.is_alive()
    finally:
        s.close()


def test_cut_groups_get_their_own_advantages_and_keep_the_batch_shape():
    def sample(group, reward):
        return Sample(group, 0, [1, 2], [3, 4], [0.0, 0.0], [0, 0], False, {"reward": reward})

    groups = [[sample(0, r) for r in (1.0, 0.0, 1.0, 0.0)], [sample(1, r) for r in (1.0, 0.0)]]
    adv = group_advantages(groups, "grpo")
    full = group_advantages([groups[0]], "grpo")
    cut = group_advantages([groups[1]], "grpo")
    np.testing.assert_allclose(adv, np.concatenate([full, cut]))
    assert abs(cut[0] + cut[1]) < 1e-6 and cut[0] > 0
    batch = build_batch([s for g in groups for s in g], 8, 0, row_multiple=8, min_rows=8)
    assert batch["tokens"].shape == (8, 8) and batch["row_weight"][6:].sum() == 0


CFG = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=300, rope_theta=10_000.0)


ENGINE_OPTS = dict(max_slots=4, max_len=128, page_size=8, decode_steps=1, prefill_rows=2, prefill_chunk=16)


@pytest.fixture(scope="module")
def engine_params():
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    return params_lib.init_params(CFG, jax.random.key(0), mesh)


def _seeded_group(name: str, n: int, tokens: int) -> list[Request]:
    """n sampled requests of `tokens` tokens each, seeds 100.. (the same tokens under any rid)."""
    return [Request(f"{name}-k{i}", [10 + i, 20, 30], SamplingParams(max_new_tokens=tokens, temperature=1.0,
                                                                     sampling_seed=100 + i, ignore_eos=True))
            for i in range(n)]


def _record_submits(backend) -> list[str]:
    """Wraps backend.submit to record every rid it is given."""
    submitted, original = [], backend.submit

    def submit(requests):
        submitted.extend(r.rid for r in requests)
        return original(requests)
    backend.submit = submit
    return submitted


def test_preempted_group_gets_the_same_tokens_on_the_real_engine(pool, engine_params):
    """The embedded engine: a low-priority group preempted mid-generation by a high-priority one
    comes back with exactly the tokens it gets when it runs alone."""
    from rlvr.models.tokenizer import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    params, opts, group = engine_params, ENGINE_OPTS, _seeded_group

    alone_backend = backends.EmbeddedBackend(CFG, params, tokenizer, **opts)
    try:
        alone = alone_backend.generate(group("low", 4, 48))
    finally:
        alone_backend.close()
    backend = backends.EmbeddedBackend(CFG, params, tokenizer, **opts)
    submitted = _record_submits(backend)
    s = Scheduler(SchedulePolicy(), backend, pool, 2, poll_s=0.005)
    try:
        low = s.submit(GroupJob(0, "low", 1.0, group("low", 4, 48), score=lambda c: c))
        _until(lambda: backend.driver.load()["num_running_reqs"] == 4)
        high = s.submit(GroupJob(1, "high", 9.0, group("high", 4, 4), score=lambda c: c))
        s.wait(high)
        s.wait(low)
        results = {i: f.result() for i, f in low.scoring}
    finally:
        s.close()
        backend.close()
    assert low.preemptions == 1 and s.counts["preemptions"] == 1
    assert any(".p" in rid for rid in submitted)  # the abort landed: unfinished requests were re-sent
    assert [results[i].rid for i in range(4)] == [f"low-k{i}" for i in range(4)]
    assert [results[i].output_ids for i in range(4)] == [c.output_ids for c in alone]


def test_preemption_through_the_sglang_backend_aborts_over_http(pool, tmp_path, engine_params):
    """The same preemption against the SGLang-protocol HTTP server (rl.backend=sglang): the abort
    travels as /abort_request, and the preempted group still gets the tokens it gets alone."""
    from rlvr.models.tokenizer import byte_level_tokenizer
    from rlvr.rollout.driver import EngineDriver
    from rlvr.rollout.engine import Engine
    from rlvr.rollout.server import serve

    params, opts, group = engine_params, ENGINE_OPTS, _seeded_group

    driver = EngineDriver(Engine(CFG, params, byte_level_tokenizer(), **opts))
    server, _ = serve(driver, port=0)
    backend = backends.SGLangBackend([server.url], CFG, str(tmp_path))
    submitted = _record_submits(backend)
    s = Scheduler(SchedulePolicy(capacity=4), backend, pool, 2, poll_s=0.005)
    try:
        alone = backend.generate(group("alone", 4, 48))
        low = s.submit(GroupJob(0, "low", 1.0, group("low", 4, 48), score=lambda c: c))
        _until(lambda: driver.load()["num_running_reqs"] == 4)
        high = s.submit(GroupJob(1, "high", 9.0, group("high", 4, 4), score=lambda c: c))
        s.wait(high)
        s.wait(low)
        results = {i: f.result() for i, f in low.scoring}
    finally:
        s.close()
        backend.close()
        server.stop(hard=True)
        driver.close()
    assert low.preemptions == 1
    assert any(".p" in rid for rid in submitted)  # the abort landed: unfinished requests were re-sent
    assert [results[i].rid for i in range(4)] == [f"low-k{i}" for i in range(4)]
    assert [results[i].output_ids for i in range(4)] == [c.output_ids for c in alone]
