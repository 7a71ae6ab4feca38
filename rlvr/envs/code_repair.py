"""`CodeRepairEnv`: fix a bug in a small repository whose tests fail, working in a sandboxed workspace.

The workspace is an `rlvr.sandbox.Episode` over a template holding the task's files (the repository
spec of rlvr.envs.repos, in `task.metadata`). Tools:

  list_files()                       the workspace's files (links are shown, never followed)
  read_file(path)                    a file's text (head and tail kept past READ_CHARS)
  write_file(path, content)          create or replace a file
  str_replace(path, old, new)        replace the one occurrence of `old` (0 or several: an error saying so)
  run_tests()                        `python -m unittest`-style run of every test file in the sandbox: the
                                     passed/failed counts, the failing tests' names and the first failure's
                                     traceback, truncated
  python(code)                       a Python program run in the sandbox with /workspace as its directory

File tools act from the host on the workspace directory without following symlinks. Refused (safety
penalty): a path outside the workspace (absolute, `..`, through a symlink), writing or editing a test
file. A program (python tool, or the code under test during run_tests) that changes a test file is
reverted right after the run (the test files are restored from the task) and penalised the same way.
With a warm pool (`sandbox_workers` or `pool`) and `tests_on_pool` (default), run_tests runs on a copy
of the workspace's regular files in a warm sandbox, whose changes are discarded; without one, and for
the python tool always, steps run as `Episode` steps over the workspace itself (a snapshot replays them).

The episode ends with `<answer>...</answer>` (its content is not judged: the repository is) or a turn
without tool calls, or at the turn / time limit. The terminal verdict (`judge`) never trusts the
workspace's tests or anything printed in the sandbox: the current module sources answer the task's
calls (visible and hidden) in the sandbox (`rlvr.sandbox.verify_program`), and the returned values are
compared on the host, or, for HumanEval tests that are not literal calls, checked by the problem's test
code in a host process (rlvr.envs.repos). Process credit (each at most once, `Shaping`): every module compiles after
an edit; an edit touched the faulty file; the tests were run after an edit; fewer visible calls fail
than at the start (host-judged after each test run, in proportion to the fraction fixed).

Costs (2-core machine, runsc, measured by tests/test_envs_sandbox.py): an Episode step (run_tests, python)
~0.35-0.5 s (a fresh sandbox over the workspace); run_tests on a warm pool ~0.1-0.25 s; a host-judged
verdict ~0.3 s in a fresh sandbox, ~0.05 s on a warm pool; file tools ~1 ms. Verdicts are cached per
module sources (the task's initial state is known without a run). A scripted level-2 repair (5 turns, 2
test runs): ~1.3 s with fresh sandboxes, ~0.4 s with a warm pool.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import time
from typing import Any

from rlvr.envs import repos
from rlvr.envs.sandboxes import TEMPLATES, SandboxOptions, record
from rlvr.envs.tool_env import ToolEnv
from rlvr.envs.tools import Refused, Tool, ToolError, call_text, truncate
from rlvr.tasks.base import Task

RUNNER = r'''
import sys, unittest
sys.dont_write_bytecode = True
sys.path.insert(0, "/workspace")
suite = unittest.defaultTestLoader.discover("/workspace", pattern="test*.py", top_level_dir="/workspace")
result = unittest.TestResult()
suite.run(result)
problems = result.failures + result.errors
print(f"{result.testsRun - len(problems)} passed, {len(problems)} failed")
if problems:
    print("failing: " + ", ".join(test.id() for test, _ in problems[:20]) + (" ..." if len(problems) > 20 else ""))
    test, text = problems[0]
    print(f"\nFAIL: {test.id()}\n{text}")
'''
READ_CHARS = 12_000
POOL_FILES_BYTES = 8 << 20
WRITE_CHARS = 200_000
LIST_MAX = 200

INSTRUCTIONS = (
    "The Python repository in your workspace has a bug: some of its tests fail. Find the bug and fix it. "
    "Use the tools to look at the files, edit the code and run the tests. Do not change the test files. "
    "When the tests pass, reply with <answer>done</answer>.")


def opening_messages(spec: dict[str, Any]) -> list[dict[str, str]]:
    files = ", ".join(sorted(spec["files"]))
    return [{"role": "user", "content": f"{INSTRUCTIONS}\n\nFiles: {files}"}]


def reference_turns(task: Task) -> list[str]:
    """The scripted repair: (run the tests when there are several modules,) read the faulty file, edit
    it, run the tests, answer."""
    spec = task.metadata
    fix = spec["fix"]
    turns = [call_text("run_tests", {})] if len(spec["modules"]) > 1 else []
    turns += [call_text("read_file", {"path": fix["path"]}),
              call_text("str_replace", {"path": fix["path"], "old": fix["old"], "new": fix["new"]}),
              call_text("run_tests", {}),
              "The tests pass now.\n<answer>done</answer>"]
    return turns


def _schema(properties: dict[str, str], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": {k: {"type": "string", "description": v} for k, v in properties.items()},
            "required": list(properties) if required is None else required, "additionalProperties": False}


class CodeRepairEnv(ToolEnv):
    """See the module doc. Options: sandbox (SandboxOptions), python_tool (offer `python`, default True),
    snapshot_dir (save an episode snapshot there when the repair fails, for `rlvr.sandbox.replay`)."""

    name = "code_repair"
    default_max_turns = 12
    default_time_budget_s = 300.0

    def __init__(self, task: Task, *, sandbox: SandboxOptions | None = None, python_tool: bool = True,
                 tests_on_pool: bool = True, snapshot_dir: str | None = None, **options: Any):
        from rlvr.sandbox import Episode

        spec = task.metadata
        self.spec = spec
        self.sandbox = sandbox or SandboxOptions()
        self.python_tool = python_tool
        self.tests_on_pool = tests_on_pool
        self.snapshot_dir = snapshot_dir
        self.protected = {path: text for path, text in spec["files"].items() if path in set(spec["tests"])}
        self.module_paths = {name: f"{name}.py" for name in spec["modules"]}
        self.sources: dict[str, str | None] = {m: spec["files"].get(p) for m, p in self.module_paths.items()}
        self.edited_since_test = False
        self.edits = 0
        self.test_runs = 0
        self.best_failing = int(spec["initial_failing"])
        self.verdicts: dict[str, dict[str, Any]] = {  # sources digest -> judge result; the task's own is known
            _digest(self.sources): {"passed": False, "visible_failing": int(spec["initial_failing"]),
                                    "hidden_failing": None, "n_tests": len(spec["judge"].get("calls", [None])),
                                    "reason": "the task's initial state", "outcomes": [], "run": None,
                                    "elapsed_s": 0.0}}
        self.snapshot: str | None = None
        self._template_key, template = TEMPLATES.acquire(spec["files"], self.sandbox.backend)
        try:
            self.ep = Episode(self.sandbox.limits, self.sandbox.backend, template=template,
                              trace_path=self.sandbox.trace_path)
        except BaseException:
            TEMPLATES.release(self._template_key)
            raise
        super().__init__(task, **options)

    def opening(self) -> list[dict[str, Any]]:
        return opening_messages(self.spec)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "sandbox": self.sandbox.to_json(), "python_tool": self.python_tool,
                "tests_on_pool": self.tests_on_pool, "snapshot_dir": self.snapshot_dir}

    # --- tools ------------------------------------------------------------------------------------

    def make_tools(self) -> dict[str, Tool]:
        tools = [
            Tool(self._list_files, "list_files", "List the files of the repository (paths relative to its root).",
                 _schema({})),
            Tool(self._read_file, "read_file", "Read a file of the repository.",
                 _schema({"path": "path relative to the repository root"})),
            Tool(self._write_file, "write_file", "Create a file or replace its whole content.",
                 _schema({"path": "path relative to the repository root", "content": "the new content"})),
            Tool(self._str_replace, "str_replace", "Replace exactly one occurrence of `old` in a file with `new` "
                 "(`old` must occur exactly once: include enough surrounding lines).",
                 _schema({"path": "path relative to the repository root", "old": "the exact text to replace",
                          "new": "the replacement text"})),
            Tool(self._run_tests, "run_tests", "Run the repository's tests; shows the counts, the failing tests "
                 "and the first failure's traceback.", _schema({})),
        ]
        if self.python_tool:
            tools.append(Tool(self._python, "python", "Run a Python program in the repository's directory (in a "
                              "sandbox) and show what it prints.", _schema({"code": "the program"})))
        return {t.name: t for t in tools}

    def _path(self, path: Any, allow_root: bool = False) -> str:
        """A normalised path relative to the workspace; Refused for anything outside it."""
        if not isinstance(path, str) or not path.strip():
            raise ToolError("give a file path relative to the repository root")
        text = path.strip()
        if "\x00" in text:
            raise Refused("a path with a NUL character")
        if text.startswith("/workspace/") or text == "/workspace":
            text = text[len("/workspace"):].lstrip("/") or "."
        norm = os.path.normpath(text)
        if os.path.isabs(norm) or norm == ".." or norm.startswith("../"):
            raise Refused(f"{path!r} is outside the repository: paths are relative to its root")
        if norm == "." and not allow_root:
            raise ToolError("give a file path, not the repository root")
        if self._through_link(norm):
            raise Refused(f"{path!r} goes through a symbolic link: links are not followed")
        return norm

    def _through_link(self, norm: str) -> bool:
        current = self.ep.ws.path
        for part in norm.split("/"):
            current = os.path.join(current, part)
            try:
                if stat.S_ISLNK(os.lstat(current).st_mode):
                    return True
            except OSError:
                return False
        return False

    def _io_error(self, error: OSError, path: str) -> ToolError:
        if error.errno in (errno.ELOOP, errno.EMLINK):
            return Refused(f"{path!r} goes through a symbolic link: links are not followed")
        if isinstance(error, FileNotFoundError):
            return ToolError(f"no such file: {path}")
        if isinstance(error, (IsADirectoryError, NotADirectoryError)) or error.errno in (errno.EISDIR, errno.ENOTDIR):
            return ToolError(f"{path} is a directory or not a file")
        return ToolError(f"cannot access {path}: {os.strerror(error.errno or 0)}")

    def _read_text(self, norm: str, limit: int) -> str:
        try:
            data = self.ep.read(norm, limit + 1)
        except OSError as e:
            raise self._io_error(e, norm) from None
        except ValueError:  # not a regular file
            raise ToolError(f"{norm} is not a regular file") from None
        return data.decode("utf-8", "replace")

    def _list_files(self) -> str:
        top = self.ep.ws.path
        entries = []
        for directory, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(directory, d))]:
                full = os.path.join(directory, name)
                rel = os.path.relpath(full, top)
                entries.append(f"{rel} -> (link, not followed)" if os.path.islink(full) else rel)
        if not entries:
            return "(no files)"
        more = f"\n... and {len(entries) - LIST_MAX} more" if len(entries) > LIST_MAX else ""
        return "\n".join(entries[:LIST_MAX]) + more

    def _read_file(self, path: str) -> str:
        norm = self._path(path)
        text = self._read_text(norm, READ_CHARS * 4)
        return truncate(text, READ_CHARS, "the file") if text else "(empty file)"

    def _check_writable(self, norm: str) -> None:
        if norm in self.protected:
            raise Refused(f"{norm} is a test file: the tests are read-only (fix the code, not the tests)")

    def _write(self, norm: str, text: str) -> None:
        try:
            self.ep.write({norm: text})
        except OSError as e:
            raise self._io_error(e, norm) from None

    def _write_file(self, path: str, content: str) -> str:
        norm = self._path(path)
        self._check_writable(norm)
        if len(content) > WRITE_CHARS:
            raise ToolError(f"content longer than {WRITE_CHARS} characters")
        self._write(norm, content)
        return f"wrote {norm} ({content.count(chr(10)) + (not content.endswith(chr(10)) and bool(content))} lines)"

    def _str_replace(self, path: str, old: str, new: str) -> str:
        norm = self._path(path)
        self._check_writable(norm)
        if not old:
            raise ToolError("`old` is empty: give the exact text to replace")
        text = self._read_text(norm, WRITE_CHARS)
        count = text.count(old)
        if count == 0:
            hint = " (check whitespace and indentation)" if old.strip() and old.strip() in text else ""
            raise ToolError(f"`old` does not occur in {norm}{hint}; the file was not changed")
        if count > 1:
            raise ToolError(f"`old` occurs {count} times in {norm}: include more surrounding lines so it occurs "
                            "once; the file was not changed")
        start = text.index(old)
        updated = text[:start] + new + text[start + len(old):]
        if len(updated) > WRITE_CHARS:
            raise ToolError(f"the file would be longer than {WRITE_CHARS} characters")
        self._write(norm, updated)
        first = text[:start].count("\n") + 1
        return f"edited {norm}: replaced lines {first}-{first + old.count(chr(10))}"

    def _workspace_files(self) -> dict[str, bytes]:
        """The workspace's regular files (links and special files left out), read without following links."""
        top, out, total = self.ep.ws.path, {}, 0
        for directory, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not os.path.islink(os.path.join(directory, d))]
            for name in filenames:
                rel = os.path.relpath(os.path.join(directory, name), top)
                try:
                    data = self.ep.read(rel, POOL_FILES_BYTES + 1)
                except (OSError, ValueError):
                    continue
                total += len(data)
                if total > POOL_FILES_BYTES:
                    raise ToolError(f"the workspace holds more than {POOL_FILES_BYTES >> 20} MiB of files")
                out[rel] = data
        return out

    def _run_tests(self) -> str:
        from rlvr.sandbox import WALL_TIME

        argv = [repos.PYTHON, "-I", "-B", "-c", RUNNER]
        executor = self.sandbox.executor() if self.tests_on_pool else None
        if executor is not None:  # a copy of the workspace in a warm sandbox: ~10x cheaper, changes discarded
            result = executor.run(argv, files=self._workspace_files(), limits=self.sandbox.limits,
                                  tag=f"{self.ep.id} run_tests")
        else:
            result = self.ep.run(argv, tag=f"{self.ep.id} run_tests")
        self.sandbox_log.append({**record(result, "run_tests"), "on_pool": executor is not None})
        self.test_runs += 1
        out = result.text().strip()
        if result.limit_hit == WALL_TIME:
            return f"the test run timed out after {self.sandbox.limits.wall_s:g} s\n{out}".strip()
        if result.limit_hit:
            return f"the test run was stopped: {result.limit_hit} limit\n{out}".strip()
        if not out:
            return f"the test run failed (exit code {result.exit_code}):\n{result.text('stderr')[-1500:]}"
        return out

    def _python(self, code: str) -> str:
        from rlvr.envs.tool_use import python_output

        if len(code) > 64_000:
            raise ToolError("the program is longer than 64000 characters")
        result = self.ep.run([repos.PYTHON, "-B", "-"], stdin=code.encode(), tag=f"{self.ep.id} python")
        self.sandbox_log.append({**record(result, "python"), "code": truncate(code, 4000)})
        return python_output(result)

    # --- after each call: tampering, edits, process credit -------------------------------------------

    def _restore_tests(self) -> list[str]:
        """Restores every test file a program changed; the paths that were changed."""
        changed = []
        for path, text in self.protected.items():
            try:
                same = self.ep.read(path, len(text.encode()) + 1) == text.encode()
            except (OSError, ValueError):
                same = False
            if not same:
                changed.append(path)
                try:
                    self.ep.write({path: text})
                except OSError:  # a directory or a link now stands there: leave it (the verdict ignores it)
                    pass
        return changed

    def _read_sources(self) -> dict[str, str | None]:
        out = {}
        for module, path in self.module_paths.items():
            try:
                out[module] = self.ep.read(path, 4 * WRITE_CHARS).decode("utf-8", "replace")
            except (OSError, ValueError):
                out[module] = None
        return out

    def after_calls(self, entry: dict[str, Any], rewards: dict[str, float]) -> None:
        if entry["status"] != "ok" and entry.get("name") not in ("python", "run_tests"):
            return
        if entry.get("name") in ("python", "run_tests"):
            tampered = self._restore_tests()
            if tampered:
                entry["tampered"] = tampered
                entry["output"] += f"\n[the test files are read-only: changes to {', '.join(tampered)} were reverted]"
                self.penalise("safety", rewards)
        sources = self._read_sources()
        changed = [m for m in sources if sources[m] != self.sources[m]]
        if changed:
            self.sources = sources
            self.edits += 1
            self.edited_since_test = True
            entry["edited"] = changed
            if any(self.module_paths[m] == self.spec["faulty"] for m in changed):
                self.earn("touched_faulty", self.shaping.touched_faulty, rewards)
            if all(_compiles(text) for text in sources.values()):
                self.earn("compiles", self.shaping.compiles, rewards)
        if entry.get("name") == "run_tests" and entry["status"] == "ok":
            if self.edited_since_test:
                self.earn("tested_after_edit", self.shaping.tested_after_edit, rewards)
            self.edited_since_test = False
            verdict = self.evaluate()
            entry["verdict"] = {k: verdict[k] for k in ("passed", "visible_failing", "hidden_failing", "reason",
                                                        "elapsed_s")}
            self.best_failing = min(self.best_failing, verdict["visible_failing"])
            fixed = repos.fraction_fixed(int(self.spec["initial_failing"]), self.best_failing)
            self.earn("fewer_failing", self.shaping.fewer_failing * fixed, rewards)

    def evaluate(self) -> dict[str, Any]:
        """The host-judged verdict on the current module sources (cached per sources)."""
        key = _digest(self.sources)
        if key not in self.verdicts:
            started = time.perf_counter()
            verdict = repos.judge_sources(self.spec["judge"], self.sources, self.sandbox)
            elapsed = time.perf_counter() - started
            self.tool_time_s += elapsed
            verdict["elapsed_s"] = round(elapsed, 4)
            if verdict.get("run") is not None:
                self.sandbox_log.append(verdict["run"])
            self.verdicts[key] = verdict
        return self.verdicts[key]

    def judge(self) -> float:
        if self.closed:
            raise RuntimeError("code repair: final_rewards after close() (the workspace is gone)")
        self._restore_tests()
        self.sources = self._read_sources()
        verdict = self.evaluate()
        self._judge_info.update({k: verdict[k] for k in ("passed", "visible_failing", "hidden_failing", "n_tests",
                                                         "reason")})
        if not verdict["passed"] and self.snapshot_dir:
            os.makedirs(self.snapshot_dir, exist_ok=True)
            self.snapshot = self.ep.snapshot(os.path.join(self.snapshot_dir, f"{self.ep.id}.tar.gz"))
            self._judge_info["snapshot"] = self.snapshot
        return float(verdict["passed"])

    def trace(self) -> dict[str, Any]:
        out = super().trace()
        out["repo"] = {"files": sorted(self.spec["files"]), "faulty": self.spec["faulty"], "bug": self.spec["bug"],
                       "function": self.spec.get("function"), "initial_failing": self.spec["initial_failing"]}
        out["edits"], out["test_runs"] = self.edits, self.test_runs
        if not self.closed:
            out["changes"] = self.ep.changes()
        return out

    def close(self) -> None:
        if not self.closed:
            super().close()
            try:
                self.ep.close()
            finally:
                TEMPLATES.release(self._template_key)


def _digest(sources: dict[str, str | None]) -> str:
    return hashlib.sha256(json.dumps(sources, sort_keys=True).encode()).hexdigest()


def _compiles(text: str | None) -> bool:
    if text is None:
        return False
    try:
        compile(text, "<module>", "exec", dont_inherit=True)  # compiles only: nothing of it runs on the host
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
