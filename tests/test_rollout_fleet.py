"""Rollout behind SGLang's own router (issue 49): the real `sglang-router` (loopback only) in front of two
SGLang-protocol servers, driven by `rlvr.rollout.router.RouterClient`.

1. Generation through the router gives the direct answers; weight sync, pause, loads reach every worker
   (the router itself answers 404 / nothing to them); a worker that misses a version fails loudly.
2. Sampling parameters the router drops silently are sent to a worker directly, never changed.
3. A worker killed mid-step: the router retries its requests on the other, the step completes.
4. (slow) An RL run of a few steps through the router matches the same run on the workers directly
   (deterministic rollout): same sampled tokens, rewards and log-probs.

The servers of 1-3 are FakeEngines (tests/rollout_fakes.py: deterministic tokens, no compiling); 4 runs
two real engines in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys

import httpx
import jax
import pytest
from rollout_fakes import FakeEngine, ServerHandle, wait_for

from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.rollout.client import SGLangClient, SGLangError
from rlvr.rollout.driver import EngineDriver
from rlvr.rollout.fleet import free_port, launch_router
from rlvr.rollout.router import RouterClient
from rlvr.rollout.server import serve
from rlvr.rollout.types import Request, SamplingParams

FAST = {"backoff": 0.01, "max_backoff": 0.05, "recheck_interval": 0.2, "health_timeout": 5.0}


def expected(prompt, n, vocab=300):
    """The FakeEngine's tokens for `prompt` (rollout_fakes: (sum(prompt) + i) % vocab)."""
    return [(sum(prompt) + i) % vocab for i in range(n)]


def requests_for(count, max_new_tokens=6, prefix="r"):
    return [Request(f"{prefix}{i}", [i % 7 + 1, i % 5 + 2], SamplingParams(max_new_tokens=max_new_tokens))
            for i in range(count)]


class FeaturedFake(FakeEngine):
    """A FakeEngine that also accepts penalties and stop_regex (and ignores them: what reached a
    server is read from its request records)."""

    def model_info(self):
        info = super().model_info()
        return {**info, "features": [*info["features"], "penalties", "stop_regex"]}


def fake_servers(count=2, **kwargs):
    handles = []
    for _ in range(count):
        engine = FeaturedFake(tokenizer=byte_level_tokenizer(), **kwargs)
        driver = EngineDriver(engine)
        records = []
        server, _ = serve(driver, port=0, recorder=records.append)
        handles.append(ServerHandle(engine, driver, server, records))
    return handles


class RouterFleet:
    """Fake workers behind a real router process (round robin: both workers get traffic)."""

    def __init__(self, tmp_path, name="router", policy="round_robin", **kwargs):
        self.handles = fake_servers(**kwargs)
        self.proc, self.url = launch_router([h.url for h in self.handles], str(tmp_path / f"{name}.log"),
                                            policy=policy, extra=["--retry-initial-backoff-ms", "10"])

    @property
    def worker_urls(self):
        return [h.url for h in self.handles]

    def client(self, **kwargs):
        return RouterClient(self.url, self.worker_urls, **{**FAST, **kwargs})

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)
        for h in self.handles:
            h.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = RouterFleet(tmp_path_factory.mktemp("fleet"))
    yield fleet
    fleet.stop()


def served(handles, key="rid"):
    """[{rid: the request body} of each server] for the requests it finished."""
    return [{r[key]: r["request"] for r in h.records} for h in handles]


def test_generation_goes_through_the_router_and_control_reaches_every_worker(fleet, tmp_path):
    requests = requests_for(8, prefix="g")
    completions = fleet.client().generate_sync(requests)
    assert [c.output_ids for c in completions] == [expected(r.input_ids, 6) for r in requests]
    direct = SGLangClient(fleet.worker_urls, **FAST).generate_sync(requests_for(8, prefix="d"))
    assert [c.output_logprobs for c in completions] == [c.output_logprobs for c in direct]
    by_worker = served(fleet.handles)
    assert all(any(rid.startswith("g") for rid in rids) for rids in by_worker)  # round robin: both served
    assert sum(rid.startswith("g") for rids in by_worker for rid in rids) == 8  # each once

    checkpoint = tmp_path / "v3"
    checkpoint.mkdir()

    async def control():
        plain = SGLangClient([fleet.url], **FAST)  # the router as if it were a server: its gaps
        with pytest.raises(SGLangError, match="404"):
            await plain.update_weights_from_disk(str(checkpoint), 3)
        with pytest.raises(SGLangError, match="v1/loads"):
            await plain.loads()  # was {}: "every server idle"
        await plain.aclose()
        client = fleet.client()
        await client.update_weights_from_disk(str(checkpoint), 3)
        loads = await client.loads()
        await client.pause("retract")
        paused = [h.driver.paused for h in fleet.handles]
        await client.resume()
        after = await client.generate(requests_for(2, prefix="after"))
        await client.aclose()
        return loads, paused, after
    loads, paused, after = asyncio.run(control())
    assert [h.engine.weight_paths[-1] for h in fleet.handles] == [str(checkpoint)] * 2
    assert [h.engine.weight_version for h in fleet.handles] == [3, 3]
    assert set(loads) == set(fleet.worker_urls) and paused == [True, True]
    assert [h.driver.paused for h in fleet.handles] == [False, False]
    assert [c.weight_version for c in after] == [3, 3]


def test_a_worker_that_misses_a_version_fails_loudly(tmp_path):
    fleet = RouterFleet(tmp_path)
    try:
        lazy = fleet.handles[1].engine
        lazy.update_weights_from_disk = lambda path, version: None  # answers success, keeps version 0
        checkpoint = tmp_path / "v1"
        checkpoint.mkdir()

        async def sync(client):
            try:
                await client.update_weights_from_disk(str(checkpoint), 1)
            finally:
                await client.aclose()
        with pytest.raises(SGLangError, match=rf"version 1 missing on workers \{{'{fleet.worker_urls[1]}': 0\}}"):
            asyncio.run(sync(fleet.client()))

        # a worker the router has but the client does not know: its stale answer is an error, not a sample
        del lazy.update_weights_from_disk
        one = RouterClient(fleet.url, fleet.worker_urls[:1], **FAST)
        asyncio.run(sync(one))
        assert [h.engine.weight_version for h in fleet.handles] == [1, 0]
        with pytest.raises(SGLangError, match="a worker this client does not sync"):
            one.generate_sync(requests_for(4, prefix="s"))
        # discovered from the router's GET /workers: the sync reaches both, and every answer is fresh
        found = asyncio.run(RouterClient.discover(fleet.url, **FAST))
        assert sorted(found.healthy_urls()) == sorted(fleet.worker_urls)
        asyncio.run(sync(found))
        assert [h.engine.weight_version for h in fleet.handles] == [1, 1]
        assert {c.weight_version for c in found.generate_sync(requests_for(4, prefix="f"))} == {1}
        # a worker back with old weights (as after a restart): its stale answers re-sync it and are retried
        relabel = httpx.post(fleet.worker_urls[1] + "/update_weight_version", json={"new_version": "0"}, timeout=30)
        assert relabel.status_code == 200 and fleet.handles[1].engine.weight_version == 0
        assert {c.weight_version for c in found.generate_sync(requests_for(4, prefix="b"))} == {1}
        assert found.report()["stale_answers"] >= 1 and [h.engine.weight_version for h in fleet.handles] == [1, 1]
    finally:
        fleet.stop()


def test_discovery_waits_for_a_router_that_is_still_starting(fleet, tmp_path):
    port = free_port()
    with pytest.raises(SGLangError, match="unreachable"):  # nobody there: bounded, then a clear error
        asyncio.run(RouterClient.discover(f"http://127.0.0.1:{port}", **{**FAST, "unavailable_timeout": 0.3}))

    async def discover_then_start():
        task = asyncio.ensure_future(RouterClient.discover(f"http://127.0.0.1:{port}", **FAST))
        await asyncio.sleep(1.5)  # the client is retrying when the router comes up
        assert not task.done()
        proc, _ = await asyncio.to_thread(launch_router, fleet.worker_urls, str(tmp_path / "late.log"), port=port)
        try:
            return (await task).healthy_urls()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    assert sorted(asyncio.run(discover_then_start())) == sorted(fleet.worker_urls)


def test_parameters_the_router_drops_are_sent_to_a_worker(fleet):
    bias = SamplingParams(max_new_tokens=4, logit_bias={7: 2.5})
    regex = SamplingParams(max_new_tokens=4, stop_regex=("ab+",))
    # the premise: through the router, logit_bias silently disappears
    body = {"input_ids": [3, 4], "rid": "raw-bias", "sampling_params": {"max_new_tokens": 4, "logit_bias": {"7": 2.5}}}
    assert httpx.post(fleet.url + "/generate", json=body, timeout=30).status_code == 200
    [raw] = [b for got in served(fleet.handles) for rid, b in got.items() if rid == "raw-bias"]
    assert "logit_bias" not in raw["sampling_params"]

    client = fleet.client()
    plain = Request("plain", [3, 4], SamplingParams(max_new_tokens=4))
    out = client.generate_sync([Request("bias", [3, 4], bias), Request("regex", [3, 4], regex), plain])
    assert [c.output_ids for c in out] == [expected([3, 4], 4)] * 3
    bodies = {rid: b for got in served(fleet.handles) for rid, b in got.items()}
    assert bodies["bias"]["sampling_params"]["logit_bias"] == {"7": 2.5}
    assert bodies["regex"]["sampling_params"]["stop_regex"] == ["ab+"]
    assert client.report()["direct"] == 2 and client.report()["router"]["failed_attempts"] == 0
    assert out[2].text is None  # through the router: ids and log-probs only (see rlvr.rollout.router)


def test_a_worker_killed_mid_step_is_retried_by_the_router(tmp_path):
    fleet = RouterFleet(tmp_path, step_delay=0.05, tokens_per_step=1)
    try:
        client = fleet.client()
        requests = requests_for(8, max_new_tokens=20, prefix="k")

        async def step():
            task = asyncio.ensure_future(client.generate(requests))
            await asyncio.to_thread(wait_for, lambda: all(h.engine.num_running for h in fleet.handles), 10)
            fleet.handles[1].stop(hard=True)  # resets its connections, like a killed process
            return await task
        completions = asyncio.run(step())
        assert [c.output_ids for c in completions] == [expected(r.input_ids, 20) for r in requests]
        survivor = {r["rid"] for r in fleet.handles[0].records}
        victim = {r["rid"] for r in fleet.handles[1].records}
        assert not victim and {r.rid for r in requests} <= survivor  # every rid answered by the survivor
        assert client.report()["retries"] == 0  # the router retried, not the client
    finally:
        fleet.stop()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is not alive
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _start_fleet_command(tmp_path, workers, repo_root):
    """`python -m rlvr.rollout.fleet` over fake servers; (process, its description once ready)."""
    ready = tmp_path / "fleet.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo_root, os.path.join(repo_root, "tests")])}
    argv = [sys.executable, "-m", "rlvr.rollout.fleet", "--hf_dir=unused", f"--workers={workers}", "--router",
            "--port=0", "--policy=round_robin", "--server_module=fleet_fake_server", f"--ready_file={ready}",
            f"--log_dir={tmp_path}", "--start_timeout=120", "--stop_timeout=10"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: ready.exists() or proc.poll() is not None, timeout=180, interval=0.1)
    assert ready.exists(), proc.communicate(timeout=10)[0][-3000:]
    return proc, json.loads(ready.read_text())


def test_fleet_command_serves_through_the_router_and_stops_everything(tmp_path, repo_root):
    proc, fleet = _start_fleet_command(tmp_path, 2, repo_root)
    pids = [fleet["pids"]["router"], *fleet["pids"]["workers"]]
    try:
        assert all(_alive(pid) for pid in pids) and len(fleet["workers"]) == 2
        client = asyncio.run(RouterClient.discover(fleet["router"], **FAST))
        assert sorted(client.healthy_urls()) == sorted(fleet["workers"])
        completions = client.generate_sync(requests_for(4, prefix="c"))
        assert [c.output_ids for c in completions] == [expected(r.input_ids, 6) for r in requests_for(4)]
        os.kill(fleet["pids"]["workers"][0], signal.SIGKILL)  # a process of the fleet dies: all of it stops
        assert proc.wait(timeout=60) == 1
        wait_for(lambda: not any(_alive(pid) for pid in pids), timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    (tmp_path / "again").mkdir()
    proc, fleet = _start_fleet_command(tmp_path / "again", 1, repo_root)
    try:
        proc.send_signal(signal.SIGTERM)  # the clean way down: exit 0, nothing left
        assert proc.wait(timeout=60) == 0
        wait_for(lambda: not any(_alive(pid) for pid in [fleet["pids"]["router"], *fleet["pids"]["workers"]]), 30)
    finally:
        proc.kill()
        proc.wait(timeout=10)


# --- 4: an RL run through the router vs the workers directly ----------------------------------------

SPEC = "configs/quickstart.py:smoke"
RL_STEPS = 2
RL = {"train.num_steps": RL_STEPS, "train.tensorboard": False, "checkpoint.every_steps": RL_STEPS,
      "rl.sft_steps": 0, "rl.max_new_tokens": 12, "rl.seq_len": 32, "rl.engine.max_len": 32,
      "rl.engine.max_slots": 8, "rl.engine.page_size": 32, "rl.engine.decode_steps": 4, "rl.prompts_per_step": 2,
      "rl.group_size": 4, "rl.eval_examples": 2, "optimizer.warmup_steps": 0, "rl.deterministic_rollout": True,
      "rl.backend": "sglang"}


@contextlib.contextmanager
def _compile_cache(path):
    """JAX's persistent compilation cache at `path` for the block, then as it was: the second run compiles
    the first's programs again (new jitted closures), and loads them from disk instead."""
    from jax._src import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = [getattr(jax.config, name) for name in names]
    for name, value in zip(names, (str(path), 0, 0), strict=True):
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for name, value in zip(names, before, strict=True):
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def _spy_completions(monkeypatch):
    """{rid: (output ids, log-probs)} of every completion any SGLangClient returns (observation only)."""
    seen = {}
    generate = SGLangClient.generate

    async def spy(self, requests, session_ids=None):
        out = await generate(self, requests, session_ids)
        seen.update({c.rid: (c.output_ids, c.output_logprobs, c.weight_version) for c in out})
        return out
    monkeypatch.setattr(SGLangClient, "generate", spy)
    return seen


@pytest.mark.slow
def test_rl_run_through_the_router_matches_direct_workers(sglang_server, tmp_path, monkeypatch):
    from rlvr import api, config_lib, main

    config = config_lib.load_config(SPEC, RL)
    model = api.build_model(config)
    urls = ",".join(sglang_server(config, model) for _ in range(2))  # two engines in this process
    router, router_url = launch_router(urls.split(","), str(tmp_path / "router.log"), policy="round_robin")
    runs = {}
    try:
        with _compile_cache(tmp_path / "jax_cache"):
            for name, overrides in (("direct", {"rl.sglang_urls": urls}), ("router", {"rl.sglang_router": router_url})):
                seen = _spy_completions(monkeypatch)
                main.run(config_lib.load_config(SPEC, {**RL, **overrides}), str(tmp_path / name))
                with open(tmp_path / name / "metrics.jsonl") as f:
                    runs[name] = ([json.loads(line) for line in f], dict(seen))
                monkeypatch.undo()
    finally:
        router.terminate()
        router.wait(timeout=10)
    (direct_rows, direct_seen), (router_rows, router_seen) = runs["direct"], runs["router"]
    assert [r["step"] for r in router_rows] == list(range(1, RL_STEPS + 1))
    for a, b in zip(router_rows, direct_rows, strict=True):
        assert (a["reward"], a["response_length"]) == (b["reward"], b["response_length"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    train = sorted(rid for rid in direct_seen if rid.startswith("s"))
    assert train and sorted(rid for rid in router_seen if rid.startswith("s")) == train
    for rid in train:
        (ids, lps, version), (ids_r, lps_r, version_r) = direct_seen[rid], router_seen[rid]
        assert ids_r == ids and version_r == version
        assert lps_r == pytest.approx(lps, rel=1e-4, abs=1e-5)
    assert os.path.isdir(tmp_path / "router" / "weights")  # synced through the workdir, to both workers
