"""Fault tolerance under kills (issue 10): a dead inference server or sandbox worker is detected and its
work rerouted, and nothing is lost or duplicated.

1. Two SGLang-protocol servers (`python -m rlvr.rollout.server`) run as separate processes; an RL run
   (`rl.backend=sglang`) uses both, and one is SIGKILLed while it holds requests of a step after the
   first. The run must finish every step with full batches, every rid answered and returned exactly once
   (the trainer's view from the client, the servers' view from their request logs), the dead server
   reported unhealthy, and its in-flight requests answered by the survivor under `{rid}.retry1`.
2. A warm gVisor sandbox (`rlvr.sandbox.Pool`) is killed from outside while it verifies a program: the
   pool retires and replaces it and re-runs the task on another sandbox (one verdict, judged once); a task
   that blew its own limit is not re-run; past `lost_retries` the loss is an error, never a verdict. The
   same through a code-repair episode as the RL producer runs it (`rlvr.envs.rollout.run_episodes`).

The sandbox tests need runsc and fail (never skip) without it, like tests/test_sandbox*.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import pytest
from rlvr.sandbox import CPU, WALL_TIME, CallTest, Limits, SandboxError, runsc, trace, verify_program
from rlvr.sandbox.pool import Pool, WorkerLost

from rlvr import config_lib, main
from rlvr.rollout import client as client_lib
from rlvr.rollout.types import Completion

SPEC = "configs/quickstart.py:smoke"
STEPS = 3
PROMPTS, GROUP = 4, 4  # smoke: rl.prompts_per_step, rl.group_size
# Random init (no SFT) rarely emits the end token, so every request decodes ~56 tokens one step at a time:
# the victim holds its requests long enough for the watcher to see them (in step 1 or 2; sync mode: step
# index s samples with weights v{s}).
RUN = {"train.num_steps": STEPS, "train.tensorboard": False, "checkpoint.every_steps": STEPS, "rl.sft_steps": 0,
       "rl.max_new_tokens": 56, "rl.seq_len": 64, "rl.engine.max_len": 64, "optimizer.warmup_steps": 0,
       "rl.backend": "sglang"}
SERVER_START_S = 240
# One page per sequence and one prefill row: each server compiles one decode and few prefill programs.
SERVER_ENGINE = {"max_slots": 16, "max_len": 64, "page_size": 64, "decode_steps": 1, "prefill_rows": 1,
                 "prefill_chunk": 32}


# --- inference servers as processes --------------------------------------------------------------------

def _server_env(cache_dir: str) -> dict[str, str]:
    """The servers run on one CPU device (not the tests' 8 fake ones) and share compiled programs."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def _start_server(hf_dir: str, log_dir, name: str) -> tuple[subprocess.Popen, str, str]:
    """(process, server log, request log) of `python -m rlvr.rollout.server` on a free port."""
    request_log, out = str(log_dir / f"{name}.requests.jsonl"), str(log_dir / f"{name}.log")
    argv = [sys.executable, "-m", "rlvr.rollout.server", f"--hf_dir={hf_dir}", "--port=0",
            f"--request_log={request_log}"]
    for key, value in SERVER_ENGINE.items():
        argv += ["--engine_option", f"{key}={json.dumps(value)}"]
    with open(out, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=_server_env(str(log_dir / "jax_cache")))
    return proc, out, request_log


def _wait_url(proc: subprocess.Popen, out: str) -> str:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        with open(out, errors="replace") as f:
            found = re.search(r"serving .* on (http://\S+)", f.read())
        if found and httpx.get(found.group(1) + "/health", timeout=10).status_code == 200:
            return found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    with open(out, errors="replace") as f:
        raise AssertionError(f"server did not start (rc {proc.poll()}):\n{f.read()[-3000:]}")


def _warm_up(url: str) -> None:
    """A sampled group of 2 (prefill, prefix sharing, decode): the server compiles its programs now (the
    second server finds them in the shared compilation cache), not during the run."""
    body = {"input_ids": list(range(1, 7)), "rid": "warm-up",
            "sampling_params": {"n": 2, "max_new_tokens": 3, "temperature": 1.0}}
    assert httpx.post(url + "/generate", json=body, timeout=SERVER_START_S).status_code == 200


def _step(rid: str) -> int | None:
    """The training step index of a request id `s{step}-t{task}-k{sample}[.retry{k}]` (None: another kind)."""
    found = re.match(r"s(\d+)-t\d+-k\d+", rid)
    return int(found.group(1)) if found else None


def _requests(path: str) -> list[dict]:
    """The finished requests a server logged (a line cut short by the kill is not a finished request)."""
    with open(path) as f:
        text = f.read()
    return [json.loads(line) for line in text.split("\n")[:-1]]


class KillWhenBusy(threading.Thread):
    """SIGKILLs `proc` the first time its server reports running or queued requests of a training step
    after the first (weight version 1 .. STEPS - 1; not the final evaluation at version STEPS).
    `in_flight` is how many it held when seen, `version` the weights it was serving."""

    def __init__(self, proc: subprocess.Popen, url: str):
        super().__init__(daemon=True)
        self.proc, self.url = proc, url
        self.in_flight, self.version, self.stop = 0, None, threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self.stop.is_set():
                state = http.get(self.url + "/server_info").json()["internal_states"][0]
                busy, version = state["num_running_reqs"] + state["num_waiting_reqs"], int(state["weight_version"])
                if version >= STEPS:
                    return
                if version >= 1 and busy:
                    self.proc.kill()
                    self.in_flight, self.version = busy, version
                    return
                time.sleep(0.002)


@pytest.fixture
def two_servers(tmp_path):
    """Two server processes of the run's model shape: [(proc, url, request log)]. They start from zeros:
    the run's first act is to send them its initial weights (rl.backend=sglang)."""
    from rlvr.models import hf
    from rlvr.models.config import ModelConfig
    from rlvr.models.params import abstract_params
    from rlvr.models.tokenizer import byte_level_tokenizer

    cfg = ModelConfig.from_mapping(config_lib.load_config(SPEC).model)
    hf_dir = str(tmp_path / "initial")
    hf.export_hf_checkpoint(cfg, jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_params(cfg)), hf_dir)
    byte_level_tokenizer().save(hf_dir)
    started = [_start_server(hf_dir, tmp_path, name) for name in ("a", "b")]
    try:
        servers = []
        for proc, out, log in started:  # one after the other: the second reuses the first's compilations
            servers.append((proc, _wait_url(proc, out), log))
            _warm_up(servers[-1][1])
        yield servers
    finally:
        for proc, _, _ in started:
            proc.kill()
            proc.wait(timeout=30)


def _spy_on_clients(monkeypatch) -> tuple[list, list]:
    """(the SGLangClients created, the rids of every generate() answer) — observation only."""
    clients, answers = [], []
    init, generate = client_lib.SGLangClient.__init__, client_lib.SGLangClient.generate

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        clients.append(self)

    async def spy_generate(self, requests, session_ids=None):
        out = await generate(self, requests, session_ids)
        answers.append([c.rid for c in out])
        return out
    monkeypatch.setattr(client_lib.SGLangClient, "__init__", spy_init)
    monkeypatch.setattr(client_lib.SGLangClient, "generate", spy_generate)
    return clients, answers


@pytest.mark.slow
def test_rl_run_survives_a_killed_inference_server(two_servers, tmp_path, monkeypatch):
    [(victim, victim_url, victim_log), (_, survivor_url, survivor_log)] = two_servers
    clients, answers = _spy_on_clients(monkeypatch)
    watcher = KillWhenBusy(victim, victim_url)
    watcher.start()
    config = config_lib.load_config(SPEC, {**RUN, "rl.sglang_urls": f"{victim_url},{survivor_url}"})
    try:
        main.run(config, str(tmp_path / "run"))
    finally:
        watcher.stop.set()
    assert watcher.version is not None, "the watcher never saw the victim busy in steps 1..STEPS-1"
    assert victim.wait(timeout=10) == -9 and watcher.in_flight > 0
    killed_in = watcher.version  # the step index whose requests the victim held

    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["failures"] == 0 for r in rows)
    if "samples" in rows[0]:  # the batch size, where the trainer reports it
        assert all(r["samples"] == PROMPTS * GROUP for r in rows)

    # What the trainer got: every rid once; every step's PROMPTS tasks x GROUP samples.
    returned = [rid for rids in answers for rid in rids]
    assert len(returned) == len(set(returned))
    steps = {}
    for rid in returned:
        if _step(rid) is not None:
            steps.setdefault(_step(rid), []).append(rid)
    assert sorted(steps) == list(range(STEPS))
    for step, rids in steps.items():
        assert len(rids) == len(set(rids)) == PROMPTS * GROUP, (step, rids)
        tasks = {rid.split("-")[1] for rid in rids}
        assert len(tasks) == PROMPTS and {rid.split("-")[2] for rid in rids} == {f"k{k}" for k in range(GROUP)}

    # What the servers did: every rid answered exactly once over both; the victim's unanswered requests
    # were re-sent to the survivor (once each), and nothing reached the victim after it died.
    before = [r["rid"] for r in _requests(victim_log)]
    after = [r["rid"] for r in _requests(survivor_log)]
    retried = [rid for rid in after if ".retry" in rid]
    assert retried and all(rid.endswith(".retry1") and _step(rid) == killed_in for rid in retried)
    answered = sorted(before + [rid.removesuffix(".retry1") for rid in after])
    for step, rids in steps.items():
        assert sorted(rid for rid in answered if _step(rid) == step) == sorted(rids), step
    assert not [rid for rid in before if (_step(rid) or 0) > killed_in]
    assert 1 <= watcher.in_flight <= len(retried)
    for record in _requests(survivor_log):  # the survivor kept up with every weight update (sync: step = version)
        if _step(record["rid"]) is not None:
            assert record["weight_version"] == _step(record["rid"]), record["rid"]

    # The client saw it: the victim unhealthy, one failover per request it held, no other retry.
    (client,) = clients
    report = client.report()
    assert report["servers"][victim_url]["healthy"] is False
    assert report["servers"][victim_url]["failed_attempts"] == len(retried)
    survivor = report["servers"][survivor_url]
    assert survivor["healthy"] and survivor["failed_attempts"] == 0 and survivor["inflight"] == 0
    assert report["failovers"] == report["retries"] == len(retried)
    assert httpx.get(survivor_url + "/model_info", timeout=30).json()["weight_version"] == str(STEPS)


# --- sandbox workers ------------------------------------------------------------------------------------

LIMITS = Limits(wall_s=5.0, cpu_s=5, memory_bytes=256 << 20, nproc=32, output_bytes=64 << 10,
                workspace_bytes=8 << 20)
SLOW_ADD = "import time\n\ndef slow_add(a, b):\n    time.sleep(1.0)\n    return a + b\n"
KILL_AFTER_S = 0.3  # into a task that sleeps 1 s: the sandbox dies while the program runs


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Two warm sandboxes with a trace; afterwards nothing of this process is left in runsc."""
    path = str(tmp_path_factory.mktemp("trace") / "pool.jsonl")
    p = Pool(2, LIMITS, trace_path=path)
    p.trace_file = path
    yield p
    p.close()
    _assert_no_leftovers()


def _assert_no_leftovers() -> None:
    from rlvr.envs.sandboxes import TEMPLATES, close_shared_pools

    close_shared_pools()
    TEMPLATES.clear()
    runsc.REAPER.drain()
    assert runsc.list_containers() == []
    assert runsc.leftover_cgroups(f"rlvr-pool-{os.getpid()}-") == []
    assert runsc.leftover_processes() == []


def _sandbox_pid(cid: str) -> int:
    """The host pid of a running sandbox (its sentry), from `runsc state`."""
    done = subprocess.run(runsc.runsc_argv("state", cid), capture_output=True, timeout=30, check=True)
    return int(json.loads(done.stdout)["pid"])


class KillBusySandbox(threading.Thread):
    """SIGKILLs the sandbox process of the first `count` pool tasks, KILL_AFTER_S after each starts."""

    def __init__(self, pool: Pool, count: int = 1):
        super().__init__(daemon=True)
        self.pool, self.count, self.killed = pool, count, []

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while len(self.killed) < self.count and time.monotonic() < deadline:
            busy = [cid for cid in self.pool.busy() if cid not in self.killed]
            if not busy:
                time.sleep(0.005)
                continue
            time.sleep(KILL_AFTER_S)
            os.kill(_sandbox_pid(busy[0]), 9)
            self.killed.append(busy[0])


def _entries(pool: Pool, tag: str) -> list[dict]:
    if not os.path.exists(pool.trace_file):
        return []
    return [e for e in trace.read(pool.trace_file) if e["tag"] == tag]


@pytest.mark.sandbox
def test_a_killed_sandbox_is_replaced_and_its_verification_rerun(pool):
    counts = (pool.lost, pool.reruns, pool.retired)
    traced = len(_entries(pool, "verify_program"))
    killer = KillBusySandbox(pool)
    killer.start()
    verdict = verify_program(SLOW_ADD, [CallTest((2, 3), 5), CallTest((10, -4), 6)], LIMITS,
                             entry_point="slow_add", pool=pool)
    killer.join(timeout=30)
    (killed,) = killer.killed
    assert verdict.passed and verdict.n_passed == 2, verdict.reason  # re-run elsewhere, judged on its output
    assert verdict.result.sandbox_id != killed
    assert (pool.lost, pool.reruns, pool.retired) == (counts[0] + 1, counts[1] + 1, counts[2] + 1)
    entries = _entries(pool, "verify_program")  # one verdict: the lost attempt is in it, not beside it
    assert len(entries) == traced + 1
    entry = entries[-1]
    assert entry["lost_sandboxes"] == [killed] and entry["sandbox_id"] == verdict.result.sandbox_id
    # the pool is whole again: two tasks at once on two sandboxes, neither the dead one
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        results = list(ex.map(lambda i: pool.run(python=f"import time; time.sleep(0.5); print({i})"), range(2)))
    assert [r.stdout for r in results] == [b"0\n", b"1\n"]
    assert len({r.sandbox_id for r in results} | {killed}) == 3


@pytest.mark.sandbox
def test_a_task_that_blows_its_limit_is_not_rerun(pool):
    counts = (pool.lost, pool.reruns, pool.retired)
    result = pool.run(python="while True: pass", limits=Limits(wall_s=2.0, cpu_s=1), tag="spin")
    assert result.limit_hit in (CPU, WALL_TIME), (result.exit_code, result.signal, result.stderr[-300:])
    assert (pool.lost, pool.reruns, pool.retired) == (counts[0], counts[1], counts[2] + 1)
    (entry,) = _entries(pool, "spin")
    assert "lost_sandboxes" not in entry


@pytest.mark.sandbox
def test_losses_past_the_retry_bound_are_an_error_not_a_verdict(pool):
    counts = (pool.lost, pool.reruns)
    pool.lost_retries = 1
    killer = KillBusySandbox(pool, count=2)
    killer.start()
    try:
        with pytest.raises(WorkerLost, match="died under the task 2 time"):
            verify_program(SLOW_ADD, [CallTest((2, 3), 5)], LIMITS, entry_point="slow_add", pool=pool)
    finally:
        pool.lost_retries = 2
        killer.join(timeout=30)
    assert (pool.lost, pool.reruns) == (counts[0] + 2, counts[1] + 1)
    assert isinstance(WorkerLost("x"), SandboxError)  # the executor contract: machinery failures raise
    assert pool.run(python="print('alive')", timeout_s=60).stdout == b"alive\n"


@pytest.mark.sandbox
def test_sandboxes_killed_while_idle_are_detected(pool):
    deadline = time.monotonic() + 60
    while pool.idle() < 2 and time.monotonic() < deadline:  # replacements of earlier tests' sandboxes
        time.sleep(0.05)
    runsc.REAPER.drain()
    retired, lost = pool.retired, pool.lost
    idle = runsc.list_containers()
    assert len(idle) == 2 and not pool.busy()
    for cid in idle:
        os.kill(_sandbox_pid(cid), 9)
    result = pool.run(python="print(6 * 7)", timeout_s=60)
    assert result.stdout == b"42\n" and result.sandbox_id not in idle
    assert pool.retired == retired + 2 and pool.lost - lost <= 2


# --- the same through a code-repair episode, as the RL producer runs it ---------------------------------

class ScriptedPolicy:
    """A backend whose turn n (= tool responses in the prompt so far) is `turns[n]`, ended by eos."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns = tokenizer, turns

    def generate(self, requests):
        out = []
        for r in requests:
            n = self.tokenizer.decode(r.input_ids).count("<tool_response>")
            ids = self.tokenizer.encode(self.turns[n]) + [self.tokenizer.eos_id]
            out.append(Completion(r.rid, list(r.input_ids), ids, [0.0] * len(ids), [0] * len(ids),
                                  {"type": "stop", "matched": self.tokenizer.eos_id}))
        return out


def _repair_episode(pool: Pool, kills: int):
    """One code-repair episode that writes the right fix (its module sleeps 1 s on import, so the judge's
    run is slow) and answers; the judge's sandbox is killed `kills` times. Its trajectory."""
    from rlvr.envs import make_env
    from rlvr.envs.families import CodeRepair
    from rlvr.envs.rollout import EpisodeJob, EpisodeSettings, run_episodes
    from rlvr.envs.tools import call_text
    from rlvr.models.tokenizer import byte_level_tokenizer

    family = CodeRepair(seed=0)
    task = next(t for t in (family.task(i, level=1) for i in range(50)) if t.metadata["bug"] != "syntax_error")
    spec, fix = task.metadata, task.metadata["fix"]
    fixed = "import time\ntime.sleep(1.0)\n" + spec["files"][fix["path"]].replace(fix["old"], fix["new"])
    turns = [call_text("write_file", {"path": fix["path"], "content": fixed}), "Fixed.\n<answer>done</answer>"]
    tokenizer = byte_level_tokenizer()
    killer = KillBusySandbox(pool, count=kills)
    killer.start()
    (trajectory,) = run_episodes(ScriptedPolicy(tokenizer, turns), tokenizer, [EpisodeJob(task, None, "s0-t0-k0")],
                                 EpisodeSettings(max_new_tokens=1 << 14, max_tokens=1 << 16),
                                 lambda t: make_env(t, pool=pool, limits=LIMITS))
    killer.join(timeout=30)
    assert len(killer.killed) == kills
    return trajectory, killer.killed


@pytest.mark.sandbox
def test_code_repair_episode_survives_a_killed_judge_sandbox(pool):
    reruns = pool.reruns
    trajectory, (killed,) = _repair_episode(pool, kills=1)
    assert "error" not in trajectory.trace, trajectory.trace.get("error")
    assert trajectory.rewards["correct"] == 1.0 and trajectory.rewards.get("env_error", 0.0) == 0.0
    assert pool.reruns == reruns + 1
    (judge,) = [run for run in trajectory.trace["env"]["sandbox"] if run["what"] == "judge"]
    assert judge["sandbox_id"] != killed and judge["exit_code"] == 0

    # Past the retry bound the episode is recorded as failed (env_error, the error kept), not scored 0.
    pool.lost_retries = 0
    try:
        trajectory, _ = _repair_episode(pool, kills=1)
    finally:
        pool.lost_retries = 2
    assert trajectory.rewards["env_error"] == 1.0 and "WorkerLost" in trajectory.trace["error"]
