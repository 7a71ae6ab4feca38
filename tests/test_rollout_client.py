"""SGLangClient against several embedded servers (FakeEngine): routing, retries, failover, weight sync."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rollout_fakes import start_server, wait_for

from rlvr.rollout.client import SGLangClient, SGLangError
from rlvr.rollout.types import Request, SamplingParams


def expected(prompt, n, seed=0, vocab=300):
    return [(sum(prompt) + i + seed) % vocab for i in range(n)]


@pytest.fixture
def servers():
    handles = []

    def factory(count=3, **kwargs):
        new = [start_server(**kwargs) for _ in range(count)]
        handles.extend(new)
        return new

    yield factory
    for handle in handles:
        handle.stop()


async def until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def fast_client(handles, **kwargs):
    kwargs = {"backoff": 0.01, "max_backoff": 0.05, "recheck_interval": 0.2, "health_timeout": 2.0, **kwargs}
    return SGLangClient([h.url for h in handles], **kwargs)


def served_by(handles):
    """rid -> index of the server whose recorder saw it finish (not aborted)."""
    return {r["rid"]: k for k, h in enumerate(handles) for r in h.records if r["finish_reason"]["type"] != "abort"}


def requests_for(count, max_new_tokens=8, prefix="r"):
    return [Request(f"{prefix}{i}", [i % 7 + 1, i % 5], SamplingParams(max_new_tokens=max_new_tokens))
            for i in range(count)]


def check(completions, requests):
    assert [c.rid for c in completions] == [r.rid for r in requests]
    for c, r in zip(completions, requests, strict=True):
        assert c.prompt_ids == r.input_ids
        assert c.output_ids == expected(r.input_ids, r.sampling.max_new_tokens)
        assert c.output_logprobs == pytest.approx([-0.1 * i for i in range(len(c.output_ids))])
        assert c.finish_reason == {"type": "length", "length": r.sampling.max_new_tokens}


def test_concurrent_requests_spread_over_servers(servers):
    handles = servers(3, step_delay=0.002)
    client = fast_client(handles)
    requests = requests_for(64, max_new_tokens=16)
    completions = client.generate_sync(requests)
    check(completions, requests)
    counts = [sum(1 for k in served_by(handles).values() if k == i) for i in range(3)]
    assert sum(counts) == 64 and min(counts) >= 15, counts  # least-loaded: an even spread


def test_n_samples_stick_together_and_sessions_are_sticky(servers):
    handles = servers(3)
    client = fast_client(handles)

    async def scenario():
        group = await client.generate([Request("grp", [3, 4], SamplingParams(max_new_tokens=3, n=4,
                                                                              sampling_seed=7))])
        turns = []
        for turn in range(3):
            batch = [Request(f"s{k}-t{turn}", [k + 1] * (turn + 1), SamplingParams(max_new_tokens=2))
                     for k in range(6)]
            turns.append(await client.generate(batch, session_ids=[f"session{k}" for k in range(6)]))
        await client.aclose()
        return group, turns

    group, turns = asyncio.run(scenario())
    assert [c.rid for c in group] == [f"grp_{i}" for i in range(4)]
    assert [c.output_ids for c in group] == [expected([3, 4], 3, seed=7 + i) for i in range(4)]
    where = served_by(handles)
    assert len({where[f"grp_{i}"] for i in range(4)}) == 1  # one server: the prompt prefix is shared
    for k in range(6):
        assert len({where[f"s{k}-t{t}"] for t in range(3)}) == 1
    assert len({where[f"s{k}-t0"] for k in range(6)}) > 1  # sessions themselves are spread


def test_timeout_then_retry_on_another_server(servers):
    stuck, ok = servers(2)
    stuck.driver.pause("in_place")  # accepts requests, never answers
    client = fast_client([stuck, ok], timeout=0.3)
    requests = requests_for(6)
    completions = client.generate_sync(requests)
    check(completions, requests)
    assert set(served_by([stuck, ok]).values()) == {1}
    stuck.driver.resume()  # the abandoned attempts were aborted (client gone / abort_request)
    wait_for(lambda: stuck.driver.load() == {"num_running_reqs": 0, "num_waiting_reqs": 0})
    assert all(r["finish_reason"]["type"] == "abort" for r in stuck.records)


class _Flaky(BaseHTTPRequestHandler):
    """/generate answers 429 twice, then a canned completion; rid "bad" gets a 400."""

    protocol_version = "HTTP/1.1"
    calls: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append(body["rid"])
        if body["rid"] == "bad":
            status, answer = 400, {"error": {"message": "no"}}
        elif len(type(self).calls) <= 2:
            status, answer = 429, {"error": {"message": "slow down"}}
        else:
            meta = {"id": body["rid"], "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "default",
                    "output_token_logprobs": [[-0.5, 1, None], [-0.25, 2, None]], "cached_tokens": 1}
            status, answer = 200, {"text": "", "output_ids": [1, 2], "meta_info": meta}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_retry_with_backoff_on_429_and_no_retry_on_400():
    _Flaky.calls = []
    stub = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=stub.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        client = SGLangClient([f"http://127.0.0.1:{stub.server_address[1]}"], backoff=0.01, max_backoff=0.02)
        [c] = client.generate_sync([Request("x", [5, 6], SamplingParams(max_new_tokens=4))])
        assert _Flaky.calls == ["x", "x.retry1", "x.retry2"]
        assert (c.rid, c.prompt_ids, c.output_ids, c.output_logprobs) == ("x", [5, 6], [1, 2], [-0.5, -0.25])
        assert c.finish_reason == {"type": "stop", "matched": 2} and c.cached_tokens == 1 and c.weight_version == 0
        with pytest.raises(SGLangError) as error:
            client.generate_sync([Request("bad", [1])])
        assert error.value.status == 400 and _Flaky.calls[-1] == "bad" and _Flaky.calls.count("bad") == 1
        exhausted = SGLangClient([f"http://127.0.0.1:{stub.server_address[1]}"], backoff=0.01, max_retries=1)
        _Flaky.calls = []
        with pytest.raises(SGLangError, match="after 2 attempts"):
            exhausted.generate_sync([Request("y", [1])])
    finally:
        stub.shutdown()
        stub.server_close()


def test_failover_when_a_server_dies_mid_batch(servers):
    handles = servers(3, step_delay=0.01, tokens_per_step=1)
    client = fast_client(handles, recheck_interval=60.0)
    requests = requests_for(48, max_new_tokens=20)

    async def scenario():
        task = asyncio.ensure_future(client.generate(requests))
        await until(lambda: handles[0].driver.load()["num_running_reqs"] > 0)  # it dies with work in flight
        handles[0].stop(hard=True)
        completions = await task
        health = await client.health()
        await client.aclose()
        return completions, health

    completions, health = asyncio.run(scenario())
    check(completions, requests)  # every request answered exactly once, in order
    assert len({c.rid for c in completions}) == 48
    assert health == {handles[0].url: False, handles[1].url: True, handles[2].url: True}
    assert client.healthy_urls() == [handles[1].url, handles[2].url]


def test_dead_server_is_resynced_when_it_comes_back(servers, tmp_path):
    first, other = servers(2)
    port = first.server.server_address[1]
    client = fast_client([first, other], recheck_interval=0.05)
    first.stop(hard=True)

    async def scenario():
        await client.update_weights_from_disk(str(tmp_path), 5)  # the dead one is skipped ...
        assert other.engine.weight_version == 5
        revived = start_server(port=port)
        try:
            health = await client.health()  # ... and re-synced before it takes traffic
            assert health[first.url] and revived.engine.weight_version == 5
            assert revived.engine.weight_paths == [str(tmp_path)]
            completions = await client.generate(requests_for(8))
            assert {c.weight_version for c in completions} == {5}
        finally:
            await client.aclose()
            revived.stop()

    asyncio.run(scenario())


def test_a_weight_sync_between_steps_flushes_the_prefix_cache(servers, tmp_path):
    """An in-place weight update cannot flush SGLang's cache with the update (requests may be frozen in
    place), so the client flushes after it: on an idle server (a synchronous step's sync) the cache is
    gone and no later request reuses KV of the old weights (it did: `cached_tokens` after the update)."""
    (handle,) = servers(1)
    client = fast_client([handle])

    async def scenario():
        await client.generate(requests_for(3, prefix="a"))
        again = await client.generate(requests_for(3, prefix="b"))
        await client.update_weights_from_disk(str(tmp_path), 1)
        after = await client.generate(requests_for(3, prefix="c"))
        await client.aclose()
        return again, after

    again, after = asyncio.run(scenario())
    assert [c.cached_tokens for c in again] == [1, 1, 1]  # the same prompts: served from the cache ...
    assert [c.cached_tokens for c in after] == [0, 0, 0]  # ... until the weights change


def test_update_weights_mid_rollout_pauses_updates_and_continues(servers, tmp_path):
    handles = servers(3, step_delay=0.005, tokens_per_step=1)
    client = fast_client(handles)
    requests = requests_for(12, max_new_tokens=40)

    async def scenario():
        task = asyncio.ensure_future(client.generate(requests))
        await until(lambda: all(h.driver.load()["num_running_reqs"] > 0 for h in handles))
        results = await client.update_weights_from_disk(str(tmp_path), 7)
        completions = await task
        await client.aclose()
        return results, completions

    results, completions = asyncio.run(scenario())
    assert all(r["success"] for r in results.values())
    check(completions, requests)  # in_place pause: nothing aborted
    for handle in handles:
        assert handle.engine.weight_version == 7 and handle.engine.weight_paths == [str(tmp_path)]
        assert not handle.driver.paused
    mixed = [c for c in completions if set(c.output_versions) == {0, 7}]
    assert mixed and all(c.output_versions == sorted(c.output_versions) for c in mixed)


def test_pause_abort_all_and_resume(servers):
    handles = servers(2, step_delay=0.005, tokens_per_step=1)
    client = fast_client(handles)
    requests = requests_for(6, max_new_tokens=2000)

    async def scenario():
        task = asyncio.ensure_future(client.generate(requests))
        await until(lambda: sum(h.driver.load()["num_running_reqs"] for h in handles) == 6)
        paused = await client.pause("in_place")
        assert all(r["status"] == "ok" for r in paused.values())
        loads = await client.loads()
        assert sum(v["num_running_reqs"] for v in loads.values()) == 6
        await client.abort_all(wait_idle=True, timeout=5)
        aborted = await task
        await client.resume()
        after = await client.generate(requests_for(2, prefix="after"))
        await client.aclose()
        return aborted, after

    aborted, after = asyncio.run(scenario())
    assert [c.finish_reason["type"] for c in aborted] == ["abort"] * 6
    assert all(0 < len(c.output_ids) < 2000 for c in aborted)
    check(after, requests_for(2, prefix="after"))


def test_client_argument_checks():
    with pytest.raises(ValueError):
        SGLangClient([])
    client = SGLangClient(["http://127.0.0.1:9"])
    with pytest.raises(ValueError, match="unique"):
        client.generate_sync([Request("a", [1]), Request("a", [2])])
    started = time.monotonic()
    unreachable = SGLangClient(["http://127.0.0.1:9"], max_retries=1, backoff=0.01, unavailable_timeout=0.2,
                               recheck_interval=0.05, health_timeout=0.2)
    with pytest.raises(SGLangError):
        unreachable.generate_sync([Request("a", [1])])
    assert time.monotonic() - started < 5


def test_payload_carries_penalties_constraints_and_stop_regex():
    sp = SamplingParams(max_new_tokens=4, frequency_penalty=0.5, logit_bias={7: -1.0}, stop_regex=["a+"],
                        choices=["x.y", "z"])
    params = SGLangClient.payload(Request("r", [1], sp), "r")["sampling_params"]
    assert params["frequency_penalty"] == 0.5 and params["logit_bias"] == {"7": -1.0}
    assert params["stop_regex"] == ["a+"] and params["regex"] == r"(x\.y|z)"
    assert "presence_penalty" not in params and "json_schema" not in params
    plain = SGLangClient.payload(Request("r", [1], SamplingParams()), "r")["sampling_params"]
    assert not {"regex", "frequency_penalty", "logit_bias", "stop_regex"} & set(plain)
