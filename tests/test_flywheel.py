"""The flywheel (issue 27): capture traffic and feedback, build training data, gate and promote.

1. The log: CRC-framed lines; a torn last line is dropped, a corrupt middle line reported, a repeated
   record read once.
2. Capture through the server: records carry the answer's id, prompt/output ids, log-probs, model
   version and latency; POST /v1/feedback validates and records.
3. A server process SIGKILLed mid-traffic, then restarted on the same directory: every answer a client
   received is in the log exactly once.
4. Build: hand-made traffic -> the expected SFT / DPO / RL rows, dedup, the split by time, the card.
5. The gate refuses a regression beyond a domain's margin (hand-computed evaluations).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from rlvr.flywheel import build as build_lib
from rlvr.flywheel import capture, log, promote
from rlvr.tasks.datasets import TaskFileFamily

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- 1. the log ---------------------------------------------------------------------------------------


def test_log_drops_torn_line_reports_corrupt_and_dedups(tmp_path):
    writer = log.AppendLog(str(tmp_path), "s")
    written = [writer.append({"n": i, "text": "é\n\"x"}) for i in range(4)]
    writer.close()
    (path,) = log.part_files(str(tmp_path), "s")
    lines = open(path, "rb").read().splitlines(keepends=True)
    assert all(log.unframe(line) == rec for line, rec in zip(lines, written, strict=True))
    corrupt = lines[1].replace(b'"n":1', b'"n":7')  # same length, CRC no longer matches
    with open(path, "wb") as f:
        f.write(lines[0] + corrupt + lines[2] + lines[3] + lines[0] + lines[3][:-9])  # a repeat, a torn tail
    stats: dict[str, int] = {}
    got = list(log.read(str(tmp_path), "s", stats))
    assert [r["n"] for r in got] == [0, 2, 3]
    assert stats == {"corrupt": 1, "duplicate": 1, "torn": 1}


# --- 2. capture through the server --------------------------------------------------------------------


@pytest.fixture
def captured(tmp_path):
    """A fake-engine server whose recorder is a TrafficCapture on tmp_path."""
    from rollout_fakes import FakeEngine

    from rlvr.models.tokenizer import byte_level_tokenizer
    from rlvr.rollout.driver import EngineDriver
    from rlvr.rollout.server import serve

    cap = capture.TrafficCapture(str(tmp_path))
    driver = EngineDriver(FakeEngine(tokenizer=byte_level_tokenizer()))
    server, _ = serve(driver, recorder=cap.record, routes=cap.routes())
    yield server.url, cap
    server.stop()
    driver.close()
    cap.close()


def test_capture_records_answers_and_feedback(captured):
    url, cap = captured
    reply = httpx.post(url + "/v1/completions", json={"prompt": "12+3=", "max_tokens": 4, "n": 2}).json()
    chat = httpx.post(url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).json()
    with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "yo"}],
                                                                  "max_tokens": 3, "stream": True}) as stream:
        chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
    streamed = json.loads(chunks[0][6:])["id"]
    records = list(log.read(cap.root, capture.TRAFFIC))
    assert [(r["response_id"], r["index"]) for r in records] == [(reply["id"], 0), (reply["id"], 1), (chat["id"], 0),
                                                                 (streamed, 0)]
    first = records[0]
    assert first["request"]["prompt"] == "12+3=" and first["prompt_ids"] == list(b"12+3=")
    assert first["text"] == reply["choices"][0]["text"] and len(first["output_ids"]) == 4
    assert len(first["output_logprobs"]) == 4 and first["model_version"] == "0" and first["latency_s"] >= 0
    ok = httpx.post(url + "/v1/feedback", json={"response_id": reply["id"], "index": 1, "rating": 2,
                                                "correction": "15", "outcome": {"passed": False, "answer": "15"}})
    assert ok.status_code == 200 and ok.json()["status"] == "recorded"
    bad = [({"response_id": "nope", "rating": 1}, 404, "not in this server's traffic log"),
           ({"response_id": reply["id"]}, 400, "at least one of"),
           ({"response_id": reply["id"], "rating": "good"}, 400, "rating must be"),
           ({"response_id": reply["id"], "ratng": 1}, 400, "unknown feedback field"),
           ({"response_id": reply["id"], "outcome": {"verifier": {"kind": "magic"}}}, 400, "outcome.verifier")]
    for body, status, words in bad:
        answer = httpx.post(url + "/v1/feedback", json=body)
        assert answer.status_code == status and words in answer.json()["error"]["message"], body
    (fb,) = log.read(cap.root, capture.FEEDBACK)
    assert (fb["response_id"], fb["index"], fb["rating"], fb["correction"]) == (reply["id"], 1, 2.0, "15")


def test_known_answers_stay_eight_bytes_each_and_answer_exactly(monkeypatch):
    """The feedback route's record of answered ids: every added (id, index) is found, across the
    merges of the newest into the sorted array, and no other (a string set of the ids grew
    without bound on a long-running server)."""
    monkeypatch.setattr(capture.KnownAnswers, "MERGE_AT", 1000)
    known = capture.KnownAnswers()
    ids = [f"chatcmpl-{i:08x}" for i in range(5500)]
    for rid in ids:
        known.add(rid, 0)
    known.add(ids[7], 3)
    assert len(known) == 5501 and known.nbytes == 8 * 5501  # 5,000 merged + 501 newest
    assert all(known.contains(rid, 0) for rid in ids) and known.contains(ids[7], 3)
    assert not any(known.contains(rid, 1) for rid in ids[:500] if rid != ids[7])
    assert not known.contains("chatcmpl-unknown", 0) and not known.contains(ids[0] + "x", 0)


# --- 3. SIGKILL mid-traffic ---------------------------------------------------------------------------

_SERVER = """
import sys, time
sys.path.insert(0, {tests!r})
from rollout_fakes import FakeEngine
from rlvr.flywheel.capture import TrafficCapture
from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.rollout.driver import EngineDriver
from rlvr.rollout.server import serve
cap = TrafficCapture({root!r})
server, thread = serve(EngineDriver(FakeEngine(tokenizer=byte_level_tokenizer())), recorder=cap.record,
                       routes=cap.routes())
print(server.url, flush=True)
thread.join()
"""


def _spawn(root: str) -> tuple[subprocess.Popen, str]:
    code = _SERVER.format(tests=os.path.join(ROOT, "tests"), root=root)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return proc, proc.stdout.readline().strip()


def _traffic(url: str, acked: list[str], stop: threading.Event) -> None:
    with httpx.Client(timeout=5) as http:
        while not stop.is_set():
            try:
                reply = http.post(url + "/v1/completions", json={"prompt": "1+1=", "max_tokens": 3})
            except httpx.HTTPError:
                return  # the server is gone
            if reply.status_code == 200:
                acked.append(reply.json()["id"])


def test_server_killed_mid_traffic_loses_and_duplicates_nothing(tmp_path):
    root = str(tmp_path / "traffic")
    acked: list[str] = []
    for round_ in range(2):  # killed mid-traffic, then restarted on the same directory and killed again
        proc, url = _spawn(root)
        stop = threading.Event()
        clients = [threading.Thread(target=_traffic, args=(url, acked, stop)) for _ in range(4)]
        for c in clients:
            c.start()
        while len(acked) < 40 * (round_ + 1):
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        stop.set()
        for c in clients:
            c.join()
    stats: dict[str, int] = {}
    logged = [r["response_id"] for r in log.read(root, capture.TRAFFIC, stats)]
    assert len(log.part_files(root, capture.TRAFFIC)) == 2  # one file per server process
    assert set(acked) <= set(logged)  # every answer a client received was recorded before it was sent
    assert len(logged) == len(set(logged)) and not stats.get("corrupt") and not stats.get("duplicate")
    assert len(logged) - len(acked) <= 8  # at most the requests in flight at each kill


# --- 4. build -------------------------------------------------------------------------------------------


def _answer(log_: log.AppendLog, rid: str, prompt, text: str, t: float, endpoint="/v1/completions", **extra):
    request = {"messages": prompt} if endpoint.endswith("chat/completions") else {"prompt": prompt}
    log_.append({"id": rid, "time": t, "response_id": rid, "index": 0, "endpoint": endpoint, "request": request,
                 "text": text, "model_version": "0", "finish_reason": {"type": "stop"}} | extra)


def test_build_turns_feedback_into_sft_dpo_rl_with_time_split(tmp_path):
    root, out = str(tmp_path / "t"), str(tmp_path / "data")
    traffic, feedback = log.AppendLog(root, capture.TRAFFIC), log.AppendLog(root, capture.FEEDBACK)
    chat = [{"role": "user", "content": "capital of France?"}]
    _answer(traffic, "a", "2+2=", "5", 1.0)
    _answer(traffic, "b", "2+2=", "4", 2.0)
    _answer(traffic, "c", chat, "Lyon", 3.0, "/v1/chat/completions")
    _answer(traffic, "d", "3+3=", "6", 4.0)
    _answer(traffic, "e", "9+9=", "", 5.0, finish_reason={"type": "abort"})
    _answer(traffic, "f", "7+1=", "8", 6.0)
    for fb in ({"response_id": "a", "rating": 0.0, "correction": "4"}, {"response_id": "a", "rating": -1.0},
               {"response_id": "b", "rating": 1.0, "outcome": {"passed": True}},
               {"response_id": "c", "preferred": "Paris", "outcome": {"passed": False}},
               {"response_id": "d", "outcome": {"passed": False, "answer": "6"}},  # failed, with a reference
               {"response_id": "e", "correction": "18"},
               {"response_id": "f", "outcome": {"verifier": {"kind": "numeric", "answer": "8"}}}):
        feedback.append(fb)
    card = build_lib.build(root, out, build_lib.BuildSettings(heldout_fraction=0.25))
    rows = {(s, k): [json.loads(x) for x in open(os.path.join(out, s, f"{k}.jsonl"))]
            for s in ("train", "heldout") for k in build_lib.KINDS}
    # 4 prompts in time order 2+2= (1.0), chat (3.0), 3+3= (4.0), 7+1= (6.0): the newest one is held out
    assert card["heldout_cutoff"] == 6.0
    assert [(r["prompt"], r["completion"]) for r in rows["train", "sft"]] == [("2+2=", "4")]
    pairs = {(json.dumps(r["prompt"]), r["chosen"], r["rejected"], r["from"]) for r in rows["train", "dpo"]}
    assert pairs == {('"2+2="', "4", "5", "correction"), (json.dumps(chat), "Paris", "Lyon", "preferred")}
    # the rating pair 4 > 5 duplicates the correction pair and is dropped
    assert card["dropped"]["duplicate dpo"] == 1 and card["dropped"]["aborted"] == 1
    assert card["dropped"]["outcome not checkable"] == 2  # chat: passed false; "4": passed alone; no reference
    assert [(r["question"], r["verifier"]) for r in rows["train", "rl"]] == [("3+3=", {"kind": "exact", "answer": "6"})]
    assert [(r["question"], r["verifier"]["kind"]) for r in rows["heldout", "rl"]] == [("7+1=", "numeric")]
    assert card["counts"] == {"train": {"sft": 1, "dpo": 2, "rl": 1}, "heldout": {"sft": 0, "dpo": 0, "rl": 1}}
    family = TaskFileFamily(os.path.join(out, "train", "rl.jsonl"))
    tasks = family.split_tasks()
    assert [t.prompt for t in tasks] == ["3+3="]
    assert family.score(tasks[0], "6", False)["correct"] == 1.0 and family.score(tasks[0], "5", False)["reward"] == 0


def test_an_answer_marked_passed_is_not_an_rl_reference_by_itself(tmp_path):
    """`passed: true` alone judges one answer; it does not make that answer's whole text the exact
    reference of an RL task (which would score every other right answer, "4" here, 0). With a
    reference or a verifier it is a task; without, it is counted as not checkable."""
    root, out = str(tmp_path / "t"), str(tmp_path / "data")
    traffic, feedback = log.AppendLog(root, capture.TRAFFIC), log.AppendLog(root, capture.FEEDBACK)
    _answer(traffic, "a", "2+2=", "The sum is 4.", 1.0)
    _answer(traffic, "b", "3+3=", "The sum is 6.", 2.0)
    feedback.append({"response_id": "a", "outcome": {"passed": True}})
    feedback.append({"response_id": "b", "outcome": {"passed": True, "answer": "6"}})
    card = build_lib.build(root, out, build_lib.BuildSettings(heldout_fraction=0.0))
    rl = [json.loads(x) for x in open(os.path.join(out, "train", "rl.jsonl"))]
    assert [(r["question"], r["verifier"]) for r in rl] == [("3+3=", {"kind": "exact", "answer": "6"})]
    assert card["dropped"] == {"outcome not checkable": 1}


def test_feedback_on_a_reused_response_id_goes_to_the_answer_it_followed(tmp_path):
    """A client's own `rid` on two requests names two answers: each feedback record belongs to the latest
    answer recorded before it, not to both."""
    root, out = str(tmp_path / "t"), str(tmp_path / "data")
    traffic, feedback = log.AppendLog(root, capture.TRAFFIC), log.AppendLog(root, capture.FEEDBACK)
    _answer(traffic, "x1", "2+2=", "5", 1.0, response_id="mine")
    _answer(traffic, "x2", "2+2=", "4", 3.0, response_id="mine")
    feedback.append({"time": 2.0, "response_id": "mine", "index": 0, "correction": "4"})
    feedback.append({"time": 4.0, "response_id": "mine", "index": 0, "preferred": "four"})
    card = build_lib.build(root, out, build_lib.BuildSettings(heldout_fraction=0.0))
    dpo = [json.loads(x) for x in open(os.path.join(out, "train", "dpo.jsonl"))]
    assert [(r["chosen"], r["rejected"]) for r in dpo] == [("4", "5"), ("four", "4")]  # each on its own answer
    assert card["with_feedback"] == 2


# --- 5. the gate ----------------------------------------------------------------------------------------


def _evaluation(tasks: int = 200, **by_domain) -> dict:
    """An eval result: pass@1 per domain, `tasks` split evenly; overall the mean."""
    per = tasks / len(by_domain)
    return {"by_domain": {d: {"pass@1": v, "tasks": per} for d, v in by_domain.items()},
            "overall": {"pass@1": sum(by_domain.values()) / len(by_domain), "tasks": float(tasks)}}


def test_gate_refuses_a_regression_beyond_the_domain_margin():
    result = _evaluation
    serving = result(traffic=0.50, arithmetic=0.80)
    gate = promote.Gate(margin=0.05, margins=(("traffic", 0.2),), min_tasks=0, alpha=1.0)
    ok = promote.compare(serving, result(traffic=0.35, arithmetic=0.76), gate)  # -0.15 <= 0.2, -0.04 <= 0.05
    assert ok["promote"] and not any(d["regressed"] for d in ok["domains"].values())
    bad = promote.compare(serving, result(traffic=0.9, arithmetic=0.74), gate)  # -0.06 > 0.05
    assert not bad["promote"] and bad["domains"]["arithmetic"]["regressed"]
    assert bad["domains"]["arithmetic"]["delta"] == pytest.approx(-0.06)
    assert "'arithmetic' dropped beyond its margin" in bad["reasons"][0]
    assert not promote.compare(serving, result(traffic=0.9), gate)["promote"]  # a domain the candidate lacks


def test_gate_needs_enough_tasks_and_a_significant_gain():
    """Overall pass@1 0.50 -> 0.60 on 100 tasks each: pooled 0.55, z = 0.1 / sqrt(0.55 * 0.45 * 2/100)
    = 1.421, one-sided p = 1 - Phi(1.421) = 0.078 > 0.05: refused. 0.50 -> 0.65: pooled 0.575,
    z = 0.15 / sqrt(0.575 * 0.425 * 2/100) = 2.146, p = 0.016: promoted. 99 tasks with min_tasks=100: refused."""
    gate = promote.Gate(margin=0.05, min_tasks=100, alpha=0.05)
    serving = _evaluation(100, traffic=0.50)
    weak = promote.compare(serving, _evaluation(100, traffic=0.60), gate)
    assert weak["significance"]["z"] == pytest.approx(1.4213, abs=1e-3)
    assert weak["significance"]["p_value"] == pytest.approx(0.0776, abs=1e-3)
    assert not weak["promote"] and "not significant" in weak["reasons"][0] and "alpha=0.05" in weak["reasons"][0]
    strong = promote.compare(serving, _evaluation(100, traffic=0.65), gate)
    assert strong["significance"]["z"] == pytest.approx(2.1456, abs=1e-3)
    assert strong["significance"]["p_value"] == pytest.approx(0.0160, abs=1e-3) and strong["promote"]
    few = promote.compare(_evaluation(99, traffic=0.0), _evaluation(99, traffic=1.0), gate)
    assert not few["promote"] and few["reasons"] == ["99 tasks evaluated, fewer than min_tasks=100: add tasks to "
                                                     "the suite (or lower --min_tasks)"]
    tie = promote.compare(serving, serving, promote.Gate(min_tasks=0, alpha=0.5))  # no gain: p = 0.5
    assert tie["significance"]["p_value"] == pytest.approx(0.5) and tie["promote"]


class _LyingServer:
    """/update_weights_from_disk succeeds, and /model_info keeps reporting the version it started with."""

    def __init__(self):
        self.loaded: list[tuple[str, str]] = []

    def post(self, url, body, timeout=600.0):
        self.loaded.append((body["model_path"], body["weight_version"]))
        return {"success": True}

    def get(self, url):
        return {"weight_version": "0", "model_path": "/models/served"}


def test_promote_loads_the_served_model_back_when_the_server_reports_another_version(tmp_path, monkeypatch):
    """The server answers the swap with success but reports its old version afterwards: the promotion
    fails with an error naming both versions, the served model is loaded back, serving.json is not
    written, and the promotion record says why."""
    server = _LyingServer()
    monkeypatch.setattr(promote, "_post", server.post)
    monkeypatch.setattr(promote, "_get", server.get)
    monkeypatch.setattr(promote, "as_hf_dir", lambda model, out: "/models/candidate")
    results = {"/models/served": _evaluation(200, traffic=0.2), "/models/candidate": _evaluation(200, traffic=0.8)}
    monkeypatch.setattr(promote, "evaluate", lambda hf_dir, *args: results[hf_dir])
    fly = str(tmp_path / "fly")
    with pytest.raises(RuntimeError, match="reports weight version '0'.*loaded '0' back"):
        promote.promote("run", "http://server", fly, "suite", promote.Gate(), label="v1")
    assert server.loaded == [("/models/candidate", "v1"), ("/models/served", "0")]
    assert not os.path.exists(os.path.join(fly, promote.SERVING))
    (name,) = os.listdir(os.path.join(fly, "promotions"))
    decision = json.loads(open(os.path.join(fly, "promotions", name)).read())
    assert not decision["promote"] and "reports weight version '0'" in decision["reasons"][-1]


# --- 6. end to end, on a local S3 server -------------------------------------------------------------

PROMPTS = ["12+30=", "7+8=", "41+5=", "9+9=", "23+4=", "6+60="]
ENGINE = {"max_slots": 8, "max_len": 32, "page_size": 8, "decode_steps": 2, "prefill_rows": 8, "prefill_chunk": 16}


@pytest.fixture
def s3(monkeypatch):
    """A bucket on a local S3-compatible server (moto_server, a subprocess), reached through
    AWS_ENDPOINT_URL as any S3-compatible store would be."""
    import socket

    import s3fs

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(env["AWS_ENDPOINT_URL"], timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and proc.poll() is None, "moto_server did not start"
            time.sleep(0.1)
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("flywheel")
    yield "s3://flywheel"
    proc.kill()
    proc.wait()
    s3fs.S3FileSystem.clear_instance_cache()


def _job(spec: str, workdir: str, **overrides) -> str:
    from rlvr import config_lib, main

    main.run(config_lib.load_config(spec, {"train.tensorboard": False, "model.preset": "", **overrides}), workdir)
    return workdir


def _deploy(hf_dir: str) -> None:
    """The quickstart's model (random init) as the HF directory a server loads."""
    from rlvr import api, config_lib
    from rlvr.models import hf

    config = config_lib.load_config("configs/quickstart.py:smoke")
    model, tokenizer = api.build_model(config), api.build_tokenizer(config)
    tokenizer.save(hf_dir + ".tokenizer")
    hf.export_hf_checkpoint(model.cfg, model.params, hf_dir, tokenizer_dir=hf_dir + ".tokenizer",
                            chat_template=tokenizer.chat_template)


def _texts(url: str, prompts: list[str]) -> tuple[str, list[str]]:
    """Greedy answers to `prompts` in one call: (the response id, each choice's text)."""
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 0.0}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=300).json()
    return reply["id"], [c["text"] for c in reply["choices"]]


@pytest.mark.slow
def test_flywheel_end_to_end(tmp_path, s3, monkeypatch):
    """Serve, send traffic with feedback, build, SFT -> DPO -> RL, gate, promote (the served version
    changes, and so do its answers to the corrected prompts), roll back; the flywheel's data, the jobs'
    workdirs and the promotion records on the S3 server."""
    monkeypatch.setenv("RLVR_STAGING_DIR", str(tmp_path / "staging"))
    from rlvr import storage
    from rlvr.flywheel import __main__ as cli
    from rlvr.rollout.driver import EngineDriver
    from rlvr.rollout.server import build_engine, serve

    fly, local = f"{s3}/fly", str(tmp_path)
    _deploy(f"{local}/hf")
    cap = capture.TrafficCapture(f"{local}/traffic")
    driver = EngineDriver(build_engine(f"{local}/hf", dict(ENGINE)))
    server, _ = serve(driver, recorder=cap.record, routes=cap.routes())
    try:
        url = server.url
        rid, before = _texts(url, PROMPTS)
        rights = [str(eval(p[:-1])) for p in PROMPTS]  # the downstream checker
        assert before != rights  # the untrained model is wrong, so every answer gets a correction
        for k, (text, right) in enumerate(zip(before, rights, strict=True)):
            feedback = {"response_id": rid, "index": k, "outcome": {"passed": text == right, "answer": right}}
            assert httpx.post(url + "/v1/feedback", json={**feedback, "correction": right}).status_code == 200
        assert cli.main(["sync", f"{local}/traffic", f"{fly}/traffic"]) == 0
        assert cli.main(["build", f"--traffic={fly}/traffic", f"--out={fly}/data", "--heldout_fraction=0.34"]) == 0
        card = json.loads(storage.read_text(f"{fly}/data/data_card.json"))
        assert card["counts"]["train"]["rl"] == 4 and card["counts"]["heldout"]["rl"] == 2
        assert card["counts"]["train"]["sft"] == 4 and card["model_versions"] == {"0": 6}
        runs, data = f"{fly}/runs", f"{fly}/data/train"  # the jobs' workdirs and inputs on the S3 server
        _job("configs/tiny.py:smoke", f"{runs}/sft", **{
            "init.hf_checkpoint": f"{local}/hf", "data.source": "jsonl", "data.path": f"{data}/sft.jsonl",
            "train.num_steps": 20, "data.batch_size": 8, "data.seq_len": 16, "optimizer.warmup_steps": 0,
            "checkpoint.every_steps": 20})
        _job("configs/dpo_tiny.py:smoke", f"{runs}/dpo", **{
            "init.workdir": f"{runs}/sft", "data.path": f"{data}/dpo.jsonl", "data.eval_path": "", "train.num_steps": 1,
            "checkpoint.every_steps": 1, "data.batch_size": 8, "data.seq_len": 16, "optimizer.learning_rate": 1e-5})
        _job("configs/quickstart.py:smoke", f"{runs}/rl", **{
            "init.workdir": f"{runs}/dpo", "rl.task": f"{data}/rl.jsonl", "rl.sft_steps": 0, "train.num_steps": 1,
            "checkpoint.every_steps": 1, "rl.prompt_format": "raw", "optimizer.learning_rate": 1e-5,
            "rl.eval_examples": 4})
        assert all(storage.listdir(f"{runs}/{job}/checkpoints") for job in ("sft", "dpo", "rl"))
        assert json.loads(storage.read_text(f"{runs}/rl/summary.json"))
        assert cli.main(["promote", f"--candidate={runs}/rl", f"--server={url}", f"--fly={fly}",
                         f"--suite={fly}/data/heldout/rl.jsonl,add", "--margin=0.5", f"--models_dir={local}/models",
                         "--min_tasks=0", "--alpha=1",
                         "--eval_config=configs/eval_tasks.py:smoke", "--label=v1",
                         "--set", "rl.max_new_tokens=6", "--set", "rl.prompt_format=raw"]) == 0
        assert httpx.get(url + "/model_info").json()["weight_version"] == "v1"
        serving = json.loads(storage.read_text(f"{fly}/serving.json"))
        assert serving["version"] == "v1" and serving["previous"]["version"] == "0"
        (name,) = storage.listdir(f"{fly}/promotions")
        decision = json.loads(storage.read_text(f"{fly}/promotions/{name}"))
        assert decision["promote"] and set(decision["domains"]) == {"traffic", "arithmetic"}
        trained = [p for p in PROMPTS if not any(r["question"] == p for r in _rows(f"{fly}/data/heldout/rl.jsonl"))]
        _, after = _texts(url, trained)
        assert after == [str(eval(p[:-1])) for p in trained]  # the promoted model learned the corrections
        assert cli.main(["rollback", f"--server={url}", f"--fly={fly}"]) == 0
        assert httpx.get(url + "/model_info").json()["weight_version"] == "0"
        assert _texts(url, PROMPTS)[1] == before  # the old weights, answering as before
    finally:
        server.stop()
        driver.close()
        cap.close()


def _rows(path: str) -> list[dict]:
    from rlvr import storage

    return [json.loads(line) for line in storage.read_text(path).splitlines()]
