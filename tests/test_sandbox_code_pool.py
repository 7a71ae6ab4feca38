"""Code verdicts of an RL run on a warm sandbox pool by default (`rl.code_pool`, rlvr.envs.sandboxes.use_code_pool):
the verdict is the same as a fresh sandbox's, a sandbox killed under a verdict is re-run and counted in
pool_counters, a stalled verdict still raises SandboxStalled, and 0 goes back to fresh sandboxes."""

import importlib.util
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from rlvr.sandbox import SandboxStalled, runsc
from rlvr.sandbox.pool import Pool

from rlvr import config_lib
from rlvr.envs import sandboxes
from rlvr.tasks import verifiers

ROOT = Path(__file__).resolve().parent.parent
SLOW_ADD = "import time\n\ndef slow_add(a, b):\n    time.sleep(1.0)\n    return a + b\n"
SPEC = {"kind": "code", "entry_point": "slow_add", "calls": [[[2, 3], 5], [[10, -4], 6]], "timeout_s": 10}


def _config(name: str, arg: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


@pytest.fixture
def code_pool():
    """use_code_pool(1) for the test; afterwards back to fresh sandboxes and the pool closed."""
    sandboxes.use_code_pool(1)
    try:
        yield
    finally:
        sandboxes.use_code_pool(0)
        sandboxes.close_shared_pools()
        runsc.REAPER.drain()


def _the_code_pool() -> Pool:
    executor = verifiers.active_code_executor()
    assert isinstance(executor, Pool) and len(executor._live) == 1
    return executor


def test_rl_configs_that_grade_code_default_to_a_warm_pool():
    assert config_lib.rl_config().code_pool == 4
    for name, arg in (("agentic_code", ""), ("agentic_code", "humaneval"), ("cad", "tiny,smoke")):
        assert _config(name, arg).rl.code_pool > 0, (name, arg)


def test_code_pool_size_is_checked():
    config = _config("agentic_code", "smoke")
    config.rl.code_pool = -1
    with pytest.raises(config_lib.ConfigError, match=r"rl\.code_pool=-1"):
        config_lib.validate(config, 8)
    with pytest.raises(ValueError, match=r"rl\.code_pool"):
        sandboxes.use_code_pool(-2)
    assert sandboxes.code_pool_size() == 0 and verifiers.active_code_executor() is None


def test_the_code_pool_clamps_no_verdict_below_its_fresh_sandbox_limits():
    """The pool lowers a task's memory, process, file and output limits to its own: code verdicts (64 KiB of
    output) and code-repair judging (256 KiB, environment limits) must both keep theirs."""
    from rlvr.sandbox import Limits
    from rlvr.sandbox.pool import _clamp

    pool = sandboxes.code_pool_limits()
    for fresh in (verifiers.code_limits(10.0), verifiers.code_limits(3.0), Limits(**sandboxes.DEFAULT_LIMITS_JSON)):
        assert _clamp(fresh, pool) == fresh
    assert pool.output_bytes == 256 << 10 and pool.memory_bytes == verifiers.MEMORY_BYTES


@pytest.mark.sandbox
def test_code_verdicts_run_on_the_default_pool_and_a_killed_sandbox_is_rerun_and_counted(code_pool):
    pool = _the_code_pool()
    assert verifiers.verify_code(SPEC, "def slow_add(a, b):\n    return a - b\n") == 0.0
    (worker,) = pool._live
    assert worker.tasks == 1  # the verdict ran on the pool, not in a fresh sandbox
    killed = []

    def kill_the_busy_sandbox() -> None:
        deadline = time.monotonic() + 60
        while not pool.busy() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.3)  # into the program's 1 s sleep
        cid = pool.busy()[0]
        state = subprocess.run(runsc.runsc_argv("state", cid), capture_output=True, timeout=30, check=True)
        os.kill(int(json.loads(state.stdout)["pid"]), 9)
        killed.append(cid)

    killer = threading.Thread(target=kill_the_busy_sandbox, daemon=True)
    killer.start()
    assert verifiers.verify_code(SPEC, SLOW_ADD) == 1.0  # re-run on the replacement, judged on its output
    killer.join(timeout=30)
    assert killed == [worker.cid]
    counters = sandboxes.pool_counters()
    assert counters["sandbox/lost"] == 1 and counters["sandbox/reruns"] == 1 and counters["sandbox/retired"] == 1


@pytest.mark.sandbox
def test_a_stalled_verdict_on_the_default_pool_still_raises(code_pool):
    spec = {**SPEC, "entry_point": "f", "calls": [[[1], 1]], "timeout_s": 1}
    with pytest.raises(SandboxStalled, match="twice"):
        verifiers.verify_code(spec, "import time\n\ndef f(x):\n    time.sleep(30)\n    return x\n")
    assert sandboxes.pool_counters()["sandbox/retired"] == 2  # each timed-out attempt retired its sandbox


@pytest.mark.sandbox
def test_code_pool_zero_means_fresh_sandboxes_and_closes_the_pool(code_pool):
    pool = _the_code_pool()
    sandboxes.use_code_pool(0)
    assert verifiers.active_code_executor() is None and pool._closed
    assert verifiers.verify_code(SPEC, "def slow_add(a, b):\n    return a + b\n") == 1.0  # a fresh sandbox
    assert sandboxes.pool_counters() == {}
