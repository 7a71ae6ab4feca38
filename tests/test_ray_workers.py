"""Verifier workers on Ray (rlvr.launch.ray_workers): same results as the local pool, recovery from
dead actors, bounded retries of a job that kills its worker, and clear errors for bad options.

One local Ray cluster serves the whole module (ray.init is slow on 2 cores). Its actors import this
file (for the fault-injection family below): the cluster's workers get tests/ on their PYTHONPATH.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import threading
import time

import pytest
import ray
from rlvr.launch import ray_workers
from rlvr.launch.ray_workers import WorkerCrashed, make_verifier_workers

from rlvr.config_lib import rl_config
from rlvr.tasks import Family, Task, TaskMixture, build_tasks

FACTORY = f"{__name__}:build_test_tasks"
SEED = 3


class FaultFamily(Family):
    """Scores by instruction in the completion: "sleep:S" (1.0 after S seconds), "raise:X" (a
    verifier error), "crash" (kills the worker process: only ever sent to Ray actors)."""

    name = "fault"

    def score(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        action, _, arg = completion.partition(":")
        if action == "sleep":
            time.sleep(float(arg))
            return {"reward": 1.0, "slept": float(arg)}
        if action == "raise":
            raise ValueError(f"verifier rejected {arg!r}")
        if action == "crash":
            os._exit(3)
        return {"reward": 0.0}


def build_test_tasks(rl, seed: int) -> TaskMixture:
    """The run's mixture (build_tasks) plus the fault family."""
    mixture = build_tasks(rl, seed)
    return TaskMixture({**mixture.families, "fault": FaultFamily(seed)}, None, seed)


def _rl():
    rl = rl_config()
    rl.task = "add,fraction_sum,code_function"
    return rl


def _fault(index: int) -> Task:
    return Task(index=index, prompt="", answer=None, family="fault")


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RLVR_MATH_WORKERS", "1")  # one math-verify process per scorer, not four
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": path, "RLVR_MATH_WORKERS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def real_jobs():
    """Arithmetic (exact match), fractions (math-verify worker process) and code (gVisor sandbox)
    jobs: each family's reference answer, a wrong answer and a malformed one."""
    mixture = build_tasks(_rl(), SEED)
    jobs = []
    for family in ("add", "fraction_sum", "code_function"):
        task = mixture.task(0, family=family)
        right = mixture.family_of(task).reference_completion(task)
        wrong = "<answer>\ndef nothing():\n    return 0\n</answer>" if family == "code_function" else \
            "<answer>12345/7</answer>" if family == "fraction_sum" else str(int(task.answer) + 1)
        jobs += [(task, right, False), (task, wrong, False), (task, "no answer", family == "add")]
    return jobs


def _score_all(pool, jobs, timeout_s: float = 120.0) -> list:
    """pool.score_many(jobs) through `submit`, failing (not hanging) if a job never comes back."""
    futures = [pool.submit(*job) for job in jobs]
    _, missing = concurrent.futures.wait(futures, timeout=timeout_s)
    assert not missing, f"{len(missing)} of {len(jobs)} jobs never came back"
    return [f.exception() or f.result() for f in futures]


def _same(a, b) -> bool:
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b) and str(a) == str(b)
    return a == b


def test_ray_matches_local_pool_in_order(cluster, real_jobs):
    jobs = real_jobs
    jobs = [*jobs, (_fault(0), "raise:x", False), (_fault(1), "sleep:0.05", False)]
    local = make_verifier_workers("local", 4, _rl(), SEED, factory=FACTORY)
    remote = make_verifier_workers("ray", 2, _rl(), SEED, factory=FACTORY)
    try:
        expected, got = local.score_many(jobs), _score_all(remote, jobs)
        with concurrent.futures.ThreadPoolExecutor(remote.concurrency) as callers:  # the producer's way
            threaded = [f.exception() or f.result() for f in [callers.submit(remote.score, *job) for job in jobs]]
        stats = remote.stats()
    finally:
        local.close()
        remote.close()
    # the independent reference: each real family's own score, and the hand-known verdicts
    assert [r["correct"] for r in got[:9]] == [1.0, 0.0, 0.0] * 3
    assert isinstance(got[9], ValueError) and "verifier rejected 'x'" in str(got[9])
    assert got[10] == {"reward": 1.0, "slept": 0.05}
    assert all(_same(a, b) for a, b in zip(got, expected, strict=True))
    assert all(_same(a, b) for a, b in zip(threaded, expected, strict=True))
    assert stats["calls"] == 2 * len(jobs) and stats["restarts"] == 0 and stats["workers_alive"] == 2
    assert stats["busy_s"] >= 0.05
    assert local.stats()["calls"] == len(jobs)


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_killed_actors_mid_batch_lose_no_job(cluster, real_jobs):
    real = real_jobs
    jobs = [(_fault(i), f"sleep:{0.15 + 0.01 * i}", False) for i in range(12)] + real[:3]
    pool = make_verifier_workers("ray", 2, _rl(), SEED, factory=FACTORY)
    pids = ray.get([actor.ready.remote() for actor in pool.actors])
    out: dict = {}
    runner = threading.Thread(target=lambda: out.setdefault("results", pool.score_many(jobs)))
    try:
        runner.start()
        _wait_for(lambda: pool.stats()["calls"] >= 1 and pool.inflight_counts()[0] > 0)
        ray.kill(pool.actors[0])  # while it holds jobs
        _wait_for(lambda: pool.stats()["restarts"] >= 1 and pool.inflight_counts()[1] > 0)
        os.kill(pids[1], signal.SIGKILL)  # the other original actor, by its process id
        runner.join(timeout=120)
        stats = pool.stats()
    finally:
        pool.close()
    assert not runner.is_alive()
    results = out["results"]
    assert results[:12] == [{"reward": 1.0, "slept": 0.15 + 0.01 * i} for i in range(12)]
    assert results[12:] == [build_test_tasks(_rl(), SEED).score(*job) for job in real[:3]]
    assert stats["calls"] == len(jobs)  # each job delivered exactly once
    assert stats["restarts"] == 2 and stats["resent"] >= 2 and stats["crashed"] == 0


def test_job_that_always_crashes_ends_as_recorded_failure(cluster, real_jobs):
    real = real_jobs
    jobs = [(_fault(0), "sleep:0.01", False), (_fault(1), "crash", False), *real[:3]]
    pool = make_verifier_workers("ray", 2, _rl(), SEED, factory=FACTORY, max_attempts=2)
    try:
        results = _score_all(pool, jobs)
        stats = pool.stats()
    finally:
        pool.close()
    assert isinstance(results[1], WorkerCrashed) and "2 times" in str(results[1])
    assert results[0] == {"reward": 1.0, "slept": 0.01}
    assert results[2:] == [build_test_tasks(_rl(), SEED).score(*job) for job in real[:3]]
    assert stats["crashed"] == 1 and stats["restarts"] == 2 and stats["calls"] == len(jobs) - 1


def test_bad_options_name_the_field_and_fix(monkeypatch):
    with pytest.raises(ValueError, match=r"rl.verifier_backend='threads'.*'local'.*'ray'"):
        make_verifier_workers("threads", 2, _rl(), SEED)
    with pytest.raises(ValueError, match=r"rl.verifier_workers=0"):
        make_verifier_workers("local", 0, _rl(), SEED)
    with pytest.raises(ValueError, match=r"'module:function'"):
        ray_workers.load_factory("rlvr.tasks.build_tasks")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ImportError, match=r"pip install -e '\.\[ray\]'"):
        make_verifier_workers("ray", 2, _rl(), SEED)
