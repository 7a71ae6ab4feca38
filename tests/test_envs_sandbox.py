"""rlvr.envs under gVisor: the code-repair loop end to end with scripted policies, the workspace tools, the
safety rules (editing the tests, escaping the workspace, forging test output), the python tool on a warm
pool, and every environment family's scripted demonstration episode.

Like tests/test_sandbox*.py these need runsc and fail (never skip) without it.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from rlvr.sandbox import Limits

from rlvr.envs import Shaping, make_env, play
from rlvr.envs.families import FAMILIES, CodeRepair, ToolCalc
from rlvr.envs.sandboxes import TEMPLATES, close_shared_pools
from rlvr.envs.tools import call_text

pytestmark = pytest.mark.sandbox

S = Shaping()
LIMITS = Limits(wall_s=5.0, cpu_s=5, memory_bytes=512 << 20)


@pytest.fixture(scope="module", autouse=True)
def _no_leftovers():
    """Afterwards: no sandbox, cgroup or workspace mount of this process is left (as conftest checks for the
    sandbox modules)."""
    yield
    from rlvr.sandbox import runsc
    from rlvr.sandbox.workspace import MOUNTED_HERE

    close_shared_pools()
    TEMPLATES.clear()
    runsc.REAPER.drain()
    assert runsc.list_containers() == []
    assert runsc.leftover_cgroups(f"rlvr-{os.getpid()}-") == []
    mounted = {line.split()[1] for line in open("/proc/mounts").read().splitlines()}
    assert not mounted & MOUNTED_HERE


def _task(level: int = 0, index: int = 0, hidden: bool = False):
    """A procedural code-repair task (with hidden calls when asked)."""
    family = CodeRepair(seed=0)
    for i in range(index, index + 50):
        task = family.task(i, level=level)
        if task.metadata["bug"] != "syntax_error" and (not hidden or task.metadata["visible_calls"] < len(
                task.metadata["judge"]["calls"])):
            return task
    raise AssertionError("no such task")


def _env(task, **options):
    return make_env(task, limits=LIMITS, **options)


def _steps(env, turns):
    out = []
    for text in turns:
        out.append(env.step(text))
        if out[-1].done:
            break
    return out


def _fix_calls(task):
    fix = task.metadata["fix"]
    return call_text("str_replace", {"path": fix["path"], "old": fix["old"], "new": fix["new"]})


def test_repair_loop_edit_test_fix_pass():
    """read -> a wrong edit -> tests still fail -> the right fix -> tests pass: terminal 1, every process credit."""
    task = _task(level=1)
    spec = task.metadata
    env = _env(task)
    try:
        assert {t["function"]["name"] for t in env.tools} == {"list_files", "read_file", "write_file", "str_replace",
                                                                "run_tests", "python"}
        listing = env.step(call_text("list_files", {})).observation[0]["content"].split("\n")
        assert sorted(listing) == sorted(spec["files"])
        read = env.step(call_text("read_file", {"path": spec["faulty"]}))
        assert read.observation[0]["content"] == spec["files"][spec["faulty"]] and read.rewards == {}
        first = env.step(call_text("run_tests", {}))
        summary = first.observation[0]["content"]
        assert f"{spec['initial_failing']} failed" in summary and "Traceback" in summary
        assert first.rewards == {}  # no edit yet: nothing earned
        # a wrong edit elsewhere in the faulty file (a comment): compiles, touches the file, fixes nothing
        wrong = env.step(call_text("write_file", {"path": spec["faulty"],
                                                  "content": spec["files"][spec["faulty"]] + "\n# a note\n"}))
        assert wrong.rewards == {"process": pytest.approx(S.touched_faulty + S.compiles)}
        still = env.step(call_text("run_tests", {}))
        assert still.rewards == {"process": pytest.approx(S.tested_after_edit)}  # no fewer failing
        assert still.info["calls"][0]["verdict"]["visible_failing"] == spec["initial_failing"]
        env.step(call_text("write_file", {"path": spec["faulty"], "content": spec["files"][spec["faulty"]]}))
        fixed = env.step(_fix_calls(task))
        assert fixed.info["calls"][0]["output"].startswith("edited ")
        passing = env.step(call_text("run_tests", {}))
        assert passing.observation[0]["content"].splitlines()[0].endswith(" 0 failed")
        assert passing.rewards == {"process": pytest.approx(S.fewer_failing)}
        done = env.step("All tests pass. <answer>done</answer>")
        assert done.done and done.observation == []
        rewards = env.final_rewards()
        assert rewards["terminal"] == rewards["correct"] == 1.0
        assert {k: v for k, v in rewards.items() if k.startswith("process.")} == pytest.approx({
            "process.touched_faulty": S.touched_faulty, "process.compiles": S.compiles,
            "process.tested_after_edit": S.tested_after_edit, "process.fewer_failing": S.fewer_failing})
        assert rewards["format"] == rewards["safety"] == 0.0
        assert rewards["reward"] == pytest.approx(1.0 + S.touched_faulty + S.compiles + S.tested_after_edit
                                                  + S.fewer_failing)
        trace = json.loads(json.dumps(env.trace()))
        calls = [c["name"] for turn in trace["turns"] for c in turn["calls"]]
        assert calls == ["list_files", "read_file", "run_tests", "write_file", "run_tests", "write_file",
                         "str_replace", "run_tests"]
        runs = [s for s in trace["sandbox"] if s["what"] == "run_tests"]
        assert len(runs) == 3 and all(s["backend"] == "runsc" and "run_s" in s["timings"] for s in runs)
        assert any(s["what"] == "judge" for s in trace["sandbox"])
        assert trace["judge"]["passed"] is True and trace["edits"] == 3 and trace["changes"]["written"]
    finally:
        env.close()


def test_wrong_fix_and_hardcoded_fix_do_not_pass(tmp_path):
    from rlvr.sandbox import replay_episode

    task = _task(level=0, hidden=True)
    spec = task.metadata
    env = _env(task, snapshot_dir=str(tmp_path))
    try:
        _steps(env, [call_text("str_replace", {"path": spec["faulty"], "old": spec["fix"]["old"],
                                               "new": spec["fix"]["old"] + "  # looked at it"}),
                     call_text("run_tests", {}), "<answer>done</answer>"])
        rewards = env.final_rewards()
        assert rewards["terminal"] == 0.0 and rewards["correct"] == 0.0
        assert rewards["process.touched_faulty"] == S.touched_faulty and "process.fewer_failing" not in rewards
        snapshot = env.trace()["judge"]["snapshot"]  # the failed episode's scene, saved for replay
    finally:
        env.close()
    replayed = replay_episode(snapshot)
    assert replayed["replayed_exactly"], replayed
    assert [s["kind"] for s in replayed["steps"]] == ["write", "run"]
    # passes every visible test by looking the answers up: the workspace's tests pass, the hidden calls do not
    function = spec["function"]
    module = spec["faulty"][:-3]
    visible = {json.dumps(args): expected for m, f, args, expected, shown in spec["judge"]["calls"]
               if shown and f == function and m == module}
    cheat = spec["files"][spec["faulty"]] + (f"\n\n_ANSWERS = {json.dumps(visible)}\n\n\ndef {function}(*args):\n"
                                             "    import json\n    return _ANSWERS[json.dumps(list(args))]\n")
    env = _env(task)
    try:
        steps = _steps(env, [call_text("write_file", {"path": spec["faulty"], "content": cheat}),
                             call_text("run_tests", {}), "<answer>done</answer>"])
        assert " 0 failed" in steps[1].observation[0]["content"]  # what the model sees: all green
        verdict = steps[1].info["calls"][0]["verdict"]
        assert verdict["visible_failing"] == 0 and verdict["hidden_failing"] > 0
        assert env.final_rewards()["correct"] == 0.0
    finally:
        env.close()


def test_editing_the_tests_or_escaping_is_refused_and_cannot_pass():
    task = _task(level=0)
    spec = task.metadata
    test_file = spec["tests"][0]
    env = _env(task)
    try:
        steps = _steps(env, [
            call_text("write_file", {"path": test_file, "content": "import unittest\n"}),
            call_text("str_replace", {"path": test_file, "old": "assertEqual", "new": "assertNotEqual"}),
            call_text("read_file", {"path": "/etc/passwd"}),
            call_text("write_file", {"path": "../outside.py", "content": "x = 1\n"}),
            call_text("read_file", {"path": "sub/../../x"}),
        ])
        assert [s.info["calls"][0]["status"] for s in steps] == ["refused"] * 5
        assert "read-only" in steps[0].observation[0]["content"]
        assert "outside the repository" in steps[2].observation[0]["content"]
        assert sum(s.rewards.get("safety", 0.0) for s in steps) == S.safety_floor  # 5 x -0.5, floored at -1
        assert env.final_rewards()["correct"] == 0.0
        assert env.ep.read(test_file).decode() == spec["files"][test_file]
    finally:
        env.close()


def test_programs_that_tamper_with_tests_are_reverted_and_cannot_forge_a_pass():
    task = _task(level=0)
    spec = task.metadata
    test_file = spec["tests"][0]
    forged = ("import unittest\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n")
    # the module under test rewrites the tests and prints a fake summary at import time
    saboteur = (f"import os\nopen('/workspace/{test_file}', 'w').write({forged!r})\n"
                "print('99 passed, 0 failed', flush=True)\nos._exit(0)\n")
    env = _env(task)
    try:
        steps = _steps(env, [
            call_text("python", {"code": f"open({test_file!r}, 'w').write({forged!r})\nprint('rewrote')"}),
            call_text("python", {"code": "import os\nos.symlink('/etc/passwd', 'leak')\nprint(os.listdir('.'))"}),
            call_text("read_file", {"path": "leak"}),
            call_text("write_file", {"path": spec["faulty"], "content": saboteur}),
            call_text("run_tests", {}),
        ])
        first = steps[0].info["calls"][0]
        assert first["tampered"] == [test_file] and "reverted" in first["output"]
        assert steps[0].rewards["safety"] == S.safety_penalty
        assert steps[2].info["calls"][0]["status"] == "refused" and "symbolic link" in steps[2].observation[0][
            "content"]
        assert "(link, not followed)" in env.step(call_text("list_files", {})).observation[0]["content"]
        run = steps[4].info["calls"][0]
        assert run["tampered"] == [test_file] and "99 passed, 0 failed" in run["output"]  # forged, and reverted
        assert run["verdict"]["passed"] is False
        assert env.ep.read(test_file).decode() == spec["files"][test_file]
        rewards = env.final_rewards()
        assert rewards["correct"] == 0.0 and rewards["safety"] == S.safety_floor
    finally:
        env.close()


def test_str_replace_edge_cases_and_file_tools():
    task = _task(level=1)
    spec = task.metadata
    faulty = spec["faulty"]
    env = _env(task)
    try:
        def out(name, **arguments):
            step = env.step(call_text(name, arguments))
            return step.info["calls"][0]["status"], step.observation[0]["content"]

        assert out("str_replace", path=faulty, old="no such text", new="x") == (
            "error", f"error: `old` does not occur in {faulty}; the file was not changed")
        status, text = out("str_replace", path=faulty, old="    ", new="  ")
        assert status == "error" and "occurs" in text and "times" in text
        assert out("str_replace", path=faulty, old="", new="x")[1].startswith("error: `old` is empty")
        assert out("str_replace", path="missing.py", old="a", new="b") == ("error", "error: no such file: missing.py")
        assert out("read_file", path=".")[0] == "error"
        assert out("write_file", path="pkg/new.py", content="X = 1\n")[0] == "ok"
        assert out("read_file", path="/workspace/pkg/new.py") == ("ok", "X = 1\n")
        assert out("read_file", path="pkg") == ("error", "error: pkg is a directory or not a file")
        assert env.ep.read(faulty).decode() == spec["files"][faulty]  # nothing above changed the faulty file
        assert env.step(call_text("read_file", {})).info["calls"][0]["status"] == "format_error"  # missing path
        step = env.step(call_text("python", {"code": "import json, sys\nprint(sorted(__import__('os').listdir()))\n"
                                                     "sys.exit(3)"}))
        assert "new.py" not in step.observation[0]["content"] and "[exit code 3]" in step.observation[0]["content"]
    finally:
        env.close()


def test_timeouts_and_time_budget():
    task = _task(level=0)
    env = make_env(task, limits=Limits(wall_s=1.0, cpu_s=20), time_budget_s=1.0)
    try:
        step = env.step(call_text("python", {"code": "while True:\n    pass"}))
        assert "[timed out]" in step.info["calls"][0]["output"]
        assert step.done and env.stop == "time_budget" and step.observation == []
        assert env.final_rewards()["correct"] == 0.0
    finally:
        env.close()


def test_syntax_error_bug_and_compiles_credit():
    family = CodeRepair(seed=0)
    task = next(t for t in (family.task(i, level=0) for i in range(200)) if t.metadata["bug"] == "syntax_error")
    env = _env(task)
    try:
        first = env.step(call_text("run_tests", {}))
        assert "SyntaxError" in first.observation[0]["content"] or "Error" in first.observation[0]["content"]
        fix = env.step(_fix_calls(task))
        assert fix.rewards["process"] == pytest.approx(S.touched_faulty + S.compiles)
        env.step("<answer>done</answer>")  # no test run after the edit: no such credit, and still solved
        rewards = env.final_rewards()
        assert rewards["correct"] == 1.0 and "process.tested_after_edit" not in rewards
    finally:
        env.close()


def test_warm_pool_judge_and_step_timings(capsys):
    """The same episode with fresh sandboxes and with a warm pool for the verdicts; reports seconds per step."""
    task = _task(level=2)
    family = CodeRepair(seed=0)
    timings = {}
    for workers in (0, 1):
        env = _env(task, sandbox_workers=workers)
        env.sandbox.executor()  # the pool starts outside the timing (once per process in training)
        try:
            start = time.perf_counter()
            play(env, family.reference_turns(task))
            rewards = env.final_rewards()
            elapsed = time.perf_counter() - start
            trace = env.trace()
        finally:
            env.close()
        assert rewards["correct"] == 1.0
        per_call = {}
        for turn in trace["turns"]:
            for call in turn["calls"]:
                per_call.setdefault(call["name"], []).append(call["elapsed_s"])
                if "verdict" in call:
                    per_call.setdefault("verdict", []).append(call["verdict"]["elapsed_s"])
        timings[workers] = {"episode_s": round(elapsed, 2), "turns": len(trace["turns"]),
                            **{k: round(sum(v) / len(v), 3) for k, v in per_call.items()}}
    close_shared_pools()
    with capsys.disabled():
        print(f"\ncode repair seconds per call (0: fresh sandboxes, 1: a warm pool for test runs and verdicts): "
              f"{timings}")
    assert timings[1]["verdict"] < timings[0]["verdict"]


def test_python_tool_of_tool_use_on_a_pool():
    task = ToolCalc(seed=0).task(0, level=4)
    env = make_env(task, python=True, sandbox_workers=1, limits=LIMITS)
    try:
        assert {t["function"]["name"] for t in env.tools} == {"calculator", "python"}
        step = env.step(call_text("python", {"code": f"print({task.metadata['expression']})"}))
        assert step.observation[0]["content"] == task.metadata["value"]
        env.step(f"<answer>{task.metadata['value']}</answer>")
        rewards = env.final_rewards()
        assert rewards["correct"] == 1.0 and rewards["process.tool_result_in_answer"] == S.tool_result_in_answer
        assert env.trace()["sandbox"][0]["what"] == "python"
    finally:
        env.close()
        close_shared_pools()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_demonstration_episodes_solve_every_family(name):
    """The scripted episode of each family, at its first and last level, solves the task; the conversation
    alternates assistant turns and the environment's tool messages and renders with tools."""
    from rlvr.models.tokenizer import byte_level_tokenizer

    family = FAMILIES[name](seed=0)
    tokenizer = byte_level_tokenizer()
    for level in sorted({family.levels()[0], family.levels()[-1]}):
        task = family.task(2, level=level)
        record = family.demonstration_record(task, limits=LIMITS)
        messages = record["messages"]
        assert messages[:len(task.messages)] == [dict(m) for m in task.messages]
        turns = family.reference_turns(task)
        assert [m["content"] for m in messages if m["role"] == "assistant"] == turns
        assert all(m["role"] == "tool" for m in messages[len(task.messages):] if m["role"] != "assistant")
        text = tokenizer.apply_chat_template(messages, tools=record["tools"], tokenize=False)
        assert ("# Tools" in text) == (record["tools"] is not None) and "<tool_response>" in text
        assert family.score(task, family.reference_completion(task), False)["correct"] == 1.0


def test_concurrent_episodes_of_one_task(capsys):
    """A group of episodes of one task on threads (as the rollout runs them): one shared template layer, one
    shared warm pool, every episode solved, each in its own workspace."""
    import concurrent.futures

    from rlvr.envs.sandboxes import files_digest

    task = _task(level=1, index=5)
    turns = CodeRepair(seed=0).reference_turns(task)

    def one(i: int):
        env = _env(task, sandbox_workers=2)
        try:
            if i % 2:  # half of them also write a scratch file: workspaces must not leak into each other
                env.step(call_text("write_file", {"path": f"scratch{i}.txt", "content": str(i)}))
            play(env, turns)
            return env.final_rewards()["correct"], env._list_files()
        finally:
            env.close()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as threads:
        results = list(threads.map(one, range(8)))
    elapsed = time.perf_counter() - start
    assert [r[0] for r in results] == [1.0] * 8
    for i, (_, files) in enumerate(results):
        assert [f for f in files.split("\n") if f.startswith("scratch")] == ([f"scratch{i}.txt"] if i % 2 else [])
    key = (files_digest(task.metadata["files"]), "runsc")
    assert TEMPLATES._entries[key][1] == 0  # prepared once, every user gone
    close_shared_pools()
    with capsys.disabled():
        print(f"\n8 concurrent code-repair episodes (2-sandbox pool): {elapsed:.2f} s")
