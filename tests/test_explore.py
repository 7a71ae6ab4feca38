"""The run explorer (`python -m rlvr.explore`) in a real headless Chromium, on real workdirs.

A session fixture trains a tiny quickstart run and a tiny agentic tool-use run (plus solved
tool-calling episodes from a scripted policy in the real calculator environment, so the episode
view has calls to show), and a copy of the quickstart run with one held-out reward and one
failure line edited in (so compare has a difference to highlight and failures one to link).
Each browser test checks what a view shows against the files; screenshots go to
tests/artifacts/explore/ (ignored by git). Chromium and its driver come from Debian
(`make install-test` installs them), selenium from the `browser` extra.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from rlvr import config_lib
from rlvr.explore import runs as views
from rlvr.explore.jsonl import JsonlIndex
from rlvr.explore.server import serve_in_background
from rlvr.main import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(REPO, "tests", "artifacts", "explore")
# the smoke configs, shorter, without the SFT warm start (the page does not care what the policy learnt)
QUICKSTART = {"rl.sft_steps": 0, "train.num_steps": 2, "checkpoint.every_steps": 2}
AGENTIC = {"rl.sft_steps": 0, "train.num_steps": 1, "checkpoint.every_steps": 1, "rl.prompts_per_step": 2,
           "rl.eval_examples": 4, "rl.max_new_tokens": 48}


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_index_pages_a_growing_file_and_starts_again_when_rewritten(tmp_path):
    path = tmp_path / "samples.jsonl"
    rows = [{"step": i, "tag": "train", "family": "add", "level": i % 3, "task_index": i, "rewards": {"reward": i / 10}}
            for i in range(7)]
    # five lines, a blank line, then half a line (a writer mid-record)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:5]) + "\n" + json.dumps(rows[5])[:10])
    index = JsonlIndex(str(path), views.sample_summary)
    assert index.refresh() == 5 and [index.read(i) for i in range(5)] == rows[:5]
    with open(path, "a") as f:
        f.write(json.dumps(rows[5])[10:] + "\n" + json.dumps(rows[6]) + "\n")
    assert index.refresh() == 7 and index.read(5) == rows[5] and index.read(6) == rows[6]
    page = views.page(index, {"level": "1", "limit": "1"})  # level 1: rows 1 and 4
    assert page["total"] == 2 and [r["i"] for r in page["rows"]] == [1]
    page = views.page(index, {"level": "1", "reward_min": "0.2"})  # rewards 0.1 and 0.4
    assert page["total"] == 1 and [r["i"] for r in page["rows"]] == [4]
    assert views.page(index, {"offset": "5"})["rows"][1]["reward"] == 0.6
    path.write_text(json.dumps(rows[0]) + "\n")  # rewritten shorter (a resumed run drops later steps)
    assert index.refresh() == 1 and len(index.summaries()) == 1


def test_failures_classify_and_link_and_list_sandbox_limit_hits(tmp_path):
    runs = [{"what": "run_tests", "limit_hit": None}, {"what": "run_tests", "limit_hit": "wall_time"}]
    episodes = [{"step": 0, "task": {"index": i, "family": "code_repair", "level": 1}, "rewards": {"reward": 0.0},
                 "trace": {"rid": f"s0-t{i}-k0", "env": {"sandbox": runs[:i + 1]}}} for i in range(3)]
    episodes[2]["trace"]["error"] = "SandboxError: the sandbox died"
    failures = [{"step": 0, "task_index": 2, "family": "code_repair", "rid": "s0-t2-k0", "error": "SandboxError: died"},
                {"step": 1, "task_index": 5, "family": "add", "rid": "s1-t5-k0",
                 "error": "RuntimeError: rollout aborted: x"},
                {"step": 1, "task_index": 6, "family": "add", "rid": "s1-t6-k0", "error": "ValueError: bad answer"}]
    for name, rows in (("episodes.jsonl", episodes), ("failures.jsonl", failures)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = views.failures(views.RunDir(str(tmp_path), "run"))
    assert [(r["kind"], r["episode"]) for r in out["recorded"]] == [
        ("environment error", 2), ("aborted rollout", None), ("verifier error", None)]
    assert [(e["i"], [h["limit_hit"] for h in e["limit_hits"]], e["error"]) for e in out["episodes"]] == [
        (1, ["wall_time"], None), (2, ["wall_time"], "SandboxError: the sandbox died")]


def test_train_samples_record_their_tokens_compactly():
    from rlvr.models.tokenizer import byte_level_tokenizer
    from rlvr.observe import token_fields

    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("42.")
    sample = {"output_ids": ids, "behaviour_logp": [-0.12345, -2.0, -0.0004], "versions": [3, 3, 2],
              "loss_mask": None, "advantage": 0.707106}
    assert token_fields(tokenizer, sample) == {"tokens": ["4", "2", "."], "logprobs": [-0.123, -2.0, -0.0],
                                               "versions": [3, 3, 2], "advantage": 0.7071}
    assert token_fields(tokenizer, {**sample, "loss_mask": [1, 0, 1]})["loss_mask"] == [1, 0, 1]
    assert "advantage" not in token_fields(tokenizer, {**sample, "advantage": None})  # GAE: per token, not kept
    assert token_fields(tokenizer, {"output_ids": ids}) == {}  # evaluation records: text only
    from tests.hf_fixtures import bpe  # a real BPE vocabulary (shared with the HF tests): the tokens join to the text

    bpe_tokenizer, text = bpe(1024), "Solve 3x + 5 = 20. <answer>5</answer>"
    ids = bpe_tokenizer.encode(text)
    tokens = token_fields(bpe_tokenizer, {**sample, "output_ids": ids, "behaviour_logp": [-1.0] * len(ids),
                                          "versions": [0] * len(ids)})["tokens"]
    assert len(tokens) == len(ids) < len(text) and "".join(tokens) == text


def test_command_line_serves_the_api_and_refuses_a_missing_workdir(tmp_path):
    import urllib.request

    (tmp_path / "config.json").write_text(json.dumps({"job": "rl", "seed": 3}))
    bad = subprocess.run([sys.executable, "-m", "rlvr.explore", str(tmp_path / "nope")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a directory" in bad.stderr
    server = subprocess.Popen([sys.executable, "-m", "rlvr.explore", str(tmp_path), "--port=0"], stdout=subprocess.PIPE,
                              text=True)
    try:
        url = server.stdout.readline().split()[3]  # "run explorer on http://127.0.0.1:PORT/ over 1 run(s)"
        overview = json.loads(urllib.request.urlopen(url + "api/overview").read())
        assert overview["runs"][0]["path"] == str(tmp_path) and overview["runs"][0]["job"] == "rl"
        assert {"key": "seed", "values": [3]} in overview["config_diff"]
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(url + "api/episode?run=0&i=5")
        assert error.value.code == 400 and "i=5" in json.loads(error.value.read())["error"]
    finally:
        server.terminate()
        server.wait()


# --- the browser tests ----------------------------------------------------------------------------


def _scripted_episodes(workdir: str) -> None:
    """Appends solved tool_calc episodes (a scripted policy calling the calculator) to the workdir."""
    from rlvr.models.tokenizer import byte_level_tokenizer
    from rlvr.rl.producer import Producer, ProducerSettings
    from rlvr.tasks import build_tasks
    from tests.test_agentic_rl import _ScriptedCalculatorPolicy

    tokenizer = byte_level_tokenizer()
    rl = config_lib.load_config("configs/agentic_tools.py:smoke", {}).rl
    policy = _ScriptedCalculatorPolicy(tokenizer)
    try:
        producer = Producer(policy, build_tasks(rl, seed=0), tokenizer, ProducerSettings.from_config(rl), seed=0,
                            episode_log=os.path.join(workdir, "episodes.jsonl"))
        try:
            producer.make_batch(0)
        finally:
            producer.stop()
    finally:
        policy.close()


@pytest.fixture(scope="session")
def workdirs(tmp_path_factory):
    """The three workdirs; RLVR_EXPLORE_WORKDIRS=DIR keeps them in DIR and reuses them in later
    sessions (when working on the page: the two runs take minutes on a loaded 2-core machine)."""
    cached = os.environ.get("RLVR_EXPLORE_WORKDIRS")
    root = cached or str(tmp_path_factory.mktemp("explore"))
    if cached and os.path.exists(os.path.join(root, "made.json")):
        return json.load(open(os.path.join(root, "made.json")))
    made = _make_workdirs(root)
    with open(os.path.join(root, "made.json"), "w") as f:
        json.dump(made, f)
    return made


def _make_workdirs(root: str) -> dict:
    quick, agentic, edited = (os.path.join(root, name) for name in ("quickstart", "agentic", "quickstart_edited"))
    # the agentic run in a second process while this one runs the quickstart (compiles take most of both)
    command = [sys.executable, "-m", "rlvr.main", "--config=configs/agentic_tools.py:smoke", f"--workdir={agentic}",
               *(f"--config.{k}={v}" for k, v in AGENTIC.items())]
    other = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run(config_lib.load_config("configs/quickstart.py:smoke", QUICKSTART), quick)
    output = other.communicate(timeout=1800)[0]
    assert other.returncode == 0, output[-3000:]
    _scripted_episodes(agentic)
    shutil.copytree(quick, edited, ignore=shutil.ignore_patterns("checkpoints", "sft", "tensorboard"))
    samples = _lines(os.path.join(edited, "samples.jsonl"))
    changed = next(i for i, s in enumerate(samples) if s["tag"] == "eval-after")
    samples[changed]["rewards"]["reward"] += 1.0
    with open(os.path.join(edited, "samples.jsonl"), "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    with open(os.path.join(edited, "failures.jsonl"), "a") as f:
        failed = samples[changed]
        f.write(json.dumps({"step": 1, "task_index": failed["task_index"], "family": failed["family"],
                            "rid": "s1-t0-k0", "error": "TimeoutError: verifier took longer than 10 s"}) + "\n")
    _write_sandbox_episode(edited)
    return {"quick": quick, "agentic": agentic, "edited": edited, "changed": changed}


def _write_sandbox_episode(workdir: str) -> None:
    """A code-repair episode record (the shape rlvr.envs writes: a `run_tests` call backed by sandbox
    run 0, then the judge's run 1, stopped by the wall-time limit), for the sandbox parts of the page."""
    sandbox = [{"what": "run_tests", "backend": "runsc", "exit_code": 1, "signal": None, "limit_hit": None,
                "stdout": "FAILED test_clamp (2 of 6)\n", "stderr": "AssertionError: 5 != 3\n"},
               {"what": "judge", "backend": "runsc", "exit_code": None, "signal": "SIGKILL", "limit_hit": "wall_time",
                "stdout": "", "stderr": "killed after 10 s\n"}]
    call = {"name": "run_tests", "arguments": {}, "status": "ok", "output": "2 of 6 tests fail", "sandbox": [0]}
    turns = [{"turn": 0, "tokens": 9, "text": '<tool_call>{"name":"run_tests"}</tool_call>', "observation": [],
              "rewards": {}, "info": {"calls": [call]}}]
    record = {"step": 1, "task": {"index": 4, "family": "code_repair", "level": 2}, "turns": 1,
              "rewards": {"terminal": 0.0, "reward": -0.1, "correct": 0.0},
              "trace": {"rid": "s1-t4-k0", "stop": "done", "messages": [], "turns": turns,
                        "env": {"env": "code_repair", "sandbox": sandbox}}}
    with open(os.path.join(workdir, "episodes.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


@pytest.fixture(scope="session")
def browser(workdirs):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path, chromium = shutil.which("chromedriver"), shutil.which("chromium")
    if not (driver_path and chromium):
        pytest.fail("chromium and chromedriver are missing: `make install-test` installs them (Debian packages "
                    "chromium, chromium-driver)")
    server = serve_in_background([workdirs["quick"], workdirs["agentic"], workdirs["edited"]])
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    options.binary_location = chromium
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    driver.get(f"http://127.0.0.1:{server.server_address[1]}/")
    _settle(driver)
    os.makedirs(ARTIFACTS, exist_ok=True)
    yield driver
    driver.quit()
    server.shutdown()


def _settle(driver, timeout: float = 30.0) -> None:
    """Waits for the page to be started and no API request in flight."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if driver.execute_script("return document.body.dataset.ready === '1' && !Number(document.body.dataset.busy)"):
            return
        time.sleep(0.05)
    raise TimeoutError("the page did not settle: " + driver.execute_script("return document.body.innerText")[:300])


def _css(driver, selector):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def _click(driver, selector):
    _css(driver, selector)[0].click()
    _settle(driver)


def _choose(driver, select_id, value):
    from selenium.webdriver.support.ui import Select

    Select(_css(driver, f"#{select_id}")[0]).select_by_value(str(value))
    _settle(driver)


def _view(driver, name):
    _click(driver, f'nav a[data-view="{name}"]')
    assert _css(driver, f"#view-{name}")[0].is_displayed()


def _shot(driver, name):
    """The whole page (up to 4000 px tall) as tests/artifacts/explore/NAME.png."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(max(height, 1000), 4000))
    driver.save_screenshot(os.path.join(ARTIFACTS, f"{name}.png"))
    driver.set_window_size(1400, 1000)


def _numeric_keys(path):
    return {k for r in _lines(path) for k, v in r.items() if k != "step" and isinstance(v, (int, float))}


def test_overview_shows_config_diff_curves_and_capability_table(browser, workdirs):
    _view(browser, "overview")
    paths = [workdirs[k] for k in ("quick", "agentic", "edited")]

    def flat(d, prefix=""):
        return {k2: v2 for k, v in d.items()
                for k2, v2 in (flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) and v else [(prefix + k, v)])}

    configs = [flat(json.load(open(os.path.join(p, "config.json")))) for p in paths]
    differing = {k for k in set().union(*configs) if len({json.dumps(c.get(k)) for c in configs}) > 1}
    assert {tr.get_attribute("data-key") for tr in _css(browser, "#config-diff-table tr[data-key]")} == differing
    assert "rl.task" in differing
    shown = {svg.get_attribute("data-metric") for svg in _css(browser, "#curves svg[data-metric]")}
    summaries = [json.load(open(os.path.join(p, "summary.json"))) for p in paths]
    evaluations = {"heldout_accuracy", *(f"heldout/{d}" for s in summaries for d in s["balance"]["domains"])}
    assert shown == set().union(evaluations, *(_numeric_keys(os.path.join(p, "metrics.jsonl")) for p in paths))
    points = [p.get_attribute("textContent") for p in _css(browser, 'svg[data-metric="heldout_accuracy"] title')]
    names = ("quickstart", "agentic", "quickstart_edited")
    expected = [f"{name} step {step}: {value}" for name, s in zip(names, summaries, strict=True)
                for step, value, *_ in s["evals"]]
    assert [p.rsplit(":", 1)[0] for p in points] == [e.rsplit(":", 1)[0] for e in expected]
    assert [float(p.rsplit(":", 1)[1]) for p in points] == pytest.approx([float(e.rsplit(":", 1)[1]) for e in expected],
                                                                         abs=1e-3)
    summary = summaries[0]
    for domain, curve in summary["balance"]["domains"].items():
        cells = _css(browser, f'.capability-table[data-run="0"] tr[data-key="{domain}"] td')
        assert float(cells[3].text) == pytest.approx(curve[-1][1], abs=1e-3)
    _shot(browser, "overview")


def test_sample_browser_filters_and_colours_tokens(browser, workdirs):
    _view(browser, "samples")
    _choose(browser, "s-run", 0)
    records = _lines(os.path.join(workdirs["quick"], "samples.jsonl"))
    for tag in ("eval-after", "train"):
        _choose(browser, "s-tag", tag)
        _click(browser, "#s-apply")
        lines = [i for i, r in enumerate(records) if r["tag"] == tag]
        assert _css(browser, "#s-total")[0].text.startswith(f"{len(lines)} samples")
        assert [int(tr.get_attribute("data-i")) for tr in _css(browser, "#samples-table tr[data-i]")] == lines[:50]
    _click(browser, f'#samples-table tr[data-i="{lines[-1]}"]')
    record = records[lines[-1]]
    assert _css(browser, "#sample-prompt")[0].text == record["prompt"].strip()
    tokens = _css(browser, "#sample-completion .tok")
    pictures = {c: chr(0x2400 + c) for c in [*range(9), *range(11, 32)]} | {0x7F: "\u2421"}  # control characters
    assert [t.get_attribute("textContent") for t in tokens] == [t.translate(pictures) for t in record["tokens"]]
    assert [float(t.get_attribute("data-logprob")) for t in tokens] == record["logprobs"]
    assert len(record["logprobs"]) == record["response_tokens"]
    _choose(browser, "colour-by", "advantage")
    _shot(browser, "samples")
    _choose(browser, "s-tag", "")
    browser.find_element("id", "s-reward-min").send_keys("0.5")
    _click(browser, "#s-apply")
    expected = sum(r["rewards"]["reward"] >= 0.5 for r in records)
    assert _css(browser, "#s-total")[0].text.startswith(f"{expected} samples")
    browser.find_element("id", "s-reward-min").clear()


def test_episode_viewer_shows_tool_calls_and_replays(browser, workdirs):
    _view(browser, "episodes")
    _choose(browser, "e-run", 1)
    records = _lines(os.path.join(workdirs["agentic"], "episodes.jsonl"))
    _click(browser, "#e-apply")
    assert _css(browser, "#e-total")[0].text.startswith(f"{len(records)} episodes")
    solved = next(i for i, r in enumerate(records) if r["rewards"].get("correct") == 1.0)
    assert solved < 50
    _click(browser, f'#episodes-table tr[data-i="{solved}"]')
    record = records[solved]
    shown = {tr.get_attribute("data-key"): float(tr.find_elements("css selector", "td")[1].text)
             for tr in _css(browser, "#episode-rewards tr[data-key]")}
    assert shown == pytest.approx({k: v for k, v in record["rewards"].items() if isinstance(v, float)}, abs=1e-3)
    calls = [c for t in record["trace"]["turns"] for c in t.get("info", {}).get("calls", [])]
    assert calls and len(_css(browser, "#episode-detail .call")) == len(calls)
    assert calls[0]["output"].strip() in _css(browser, "#episode-detail .call pre")[0].text
    _click(browser, "#replay")
    assert _css(browser, "#replay-result span")[0].get_attribute("data-identical") == "true"
    _shot(browser, "episodes")


def test_compare_highlights_the_prompts_whose_score_changed(browser, workdirs):
    _view(browser, "compare")
    _choose(browser, "cmp-a", "0:eval-after")
    _choose(browser, "cmp-b", "2:eval-after")
    _click(browser, "#cmp-go")
    quick = [r for r in _lines(os.path.join(workdirs["quick"], "samples.jsonl")) if r["tag"] == "eval-after"]
    prompts = {(r["family"], r["level"], r["task_index"], r["prompt"]) for r in quick}
    assert int(_css(browser, "#cmp-count")[0].text) == len(prompts)
    changed = _css(browser, "#compare-table tr.diff-pos")
    edited = _lines(os.path.join(workdirs["edited"], "samples.jsonl"))[workdirs["changed"]]
    assert len(changed) == 1 and len(_css(browser, "#compare-table tr.diff-neg")) == 0
    assert changed[0].get_attribute("data-key") == f"{edited['family']}/{edited['level']}/{edited['task_index']}"
    assert float(changed[0].find_elements("css selector", "td.diff")[0].text) == pytest.approx(1.0)
    browser.find_element("id", "cmp-changed").click()
    _click(browser, "#cmp-go")
    assert len(_css(browser, "#compare-table tr[data-key]")) == 1
    _shot(browser, "compare")


def test_failures_link_to_their_samples(browser, workdirs):
    _view(browser, "failures")
    _choose(browser, "f-run", 2)
    failures = _lines(os.path.join(workdirs["edited"], "failures.jsonl"))
    rows = _css(browser, "#failures-table tr[data-i]")
    assert len(rows) == len(failures) and failures[-1]["error"] in rows[-1].text and "verifier error" in rows[-1].text
    _shot(browser, "failures")
    _click(browser, "#failures-table tr[data-i] a[data-task]")
    assert _css(browser, "#view-samples")[0].is_displayed()
    records = _lines(os.path.join(workdirs["edited"], "samples.jsonl"))
    expected = sum(r["task_index"] == failures[-1]["task_index"] and r["family"] == failures[-1]["family"]
                   for r in records)
    assert _css(browser, "#s-total")[0].text.startswith(f"{expected} samples")


def test_failures_open_the_episode_whose_sandbox_hit_a_limit(browser, workdirs):
    _view(browser, "failures")
    _choose(browser, "f-run", 2)
    episode = _lines(os.path.join(workdirs["edited"], "episodes.jsonl"))[0]
    rows = _css(browser, "#failed-episodes-table tr[data-i]")
    assert len(rows) == 1 and "judge: wall_time" in rows[0].text
    _click(browser, "#failed-episodes-table a[data-episode]")
    assert _css(browser, "#view-episodes")[0].is_displayed()
    runs = _css(browser, "#episode-detail .sandbox-run")
    assert len(runs) == 2 and "limit hit: wall_time" in runs[1].text
    for shown, recorded in zip(runs, episode["trace"]["env"]["sandbox"], strict=True):
        assert shown.find_element("css selector", ".stdout").get_attribute("textContent") == recorded["stdout"]
        assert shown.find_element("css selector", ".stderr").get_attribute("textContent") == recorded["stderr"]
    assert runs[0].find_element("xpath", "..").get_attribute("class") == "call"  # shown under its tool call
    _shot(browser, "episode_sandbox")
