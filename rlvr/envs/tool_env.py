"""`ToolEnv`: the turn loop shared by the tool environments (parse, run calls, shape rewards, trace).

One `step(text)`:

1. `tools.parse_turn(text)` finds the turn's tool calls and its answer.
2. A turn with an answer ends the episode (its tool calls are not run: a format error each). A turn
   with neither calls nor an answer ends it too, without an answer. Otherwise each call runs in
   order: a malformed call, an unknown tool or arguments that fail the schema is an error
   observation and a format penalty; `Refused` is an error observation and a safety penalty;
   `ToolError` an error observation; any other exception from a tool is reported as an internal
   error (logged with its traceback in the trace) and never propagates.
3. The turn limit (`max_turns`) or the tool-time budget (`time_budget_s`, the seconds spent in tool
   calls) ends the episode after the calls of the turn that reaches it.

Per-step rewards hold the format, safety and process components earned in that step (their sum over
the episode is what `final_rewards` reports); the terminal component is judged by `final_rewards`
(once, cached), which adds `reward` (the `RewardWeights` sum) and `correct`. Penalties have floors
(`Shaping`), so one degenerate turn cannot dominate the reward. Process components are earned at
most once each (their detail is reported as `process.<name>` keys next to the four components).

The trace (`trace()`) is plain JSON: the task, the options, the opening messages, every turn's text,
parsed calls, tool outputs, errors, sandbox commands, timings and rewards, and the final rewards.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Mapping
from typing import Any

from rlvr.envs.base import StepResult
from rlvr.envs.tools import MAX_CALLS, ParsedCall, Refused, Tool, ToolError, parse_turn, truncate
from rlvr.tasks.base import RewardWeights, Task

# All four components count: their scales are set by `Shaping` (terminal 1, penalties and process small).
ENV_WEIGHTS = RewardWeights(terminal=1.0, format=1.0, process=1.0, safety=1.0)


@dataclasses.dataclass(frozen=True)
class Shaping:
    """Sizes of the non-terminal reward components (the terminal component is 0 or 1)."""

    format_penalty: float = -0.1  # per malformed call, unknown tool, bad arguments, stray tag
    format_floor: float = -0.5  # the episode's format component never goes below this
    safety_penalty: float = -0.5  # per refused or reverted forbidden operation
    safety_floor: float = -1.0
    tool_result_in_answer: float = 0.1  # tool use: a successful tool result appears in the answer
    cell_located: float = 0.1  # documents: x the fraction of the cells the answer rests on that a tool showed
    compiles: float = 0.05  # code repair: after an edit every module compiles
    touched_faulty: float = 0.05  # code repair: an edit changed the faulty file
    tested_after_edit: float = 0.05  # code repair: the tests were run after an edit
    fewer_failing: float = 0.1  # code repair: x the fraction of the initially failing tests fixed (best so far)


def _plain(value: Any) -> Any:
    """A JSON-safe copy (unknown objects as their repr)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


class ToolEnv:
    """Base of the tool environments (implements `rlvr.envs.base.Environment`); see the module doc.

    Subclasses provide `opening()` (the first messages), `make_tools()` (name -> Tool), `judge()`
    (the terminal component in [0, 1]) and optionally the hooks `after_calls` and `on_answer`."""

    name = ""
    default_max_turns = 8
    default_time_budget_s = 60.0

    def __init__(self, task: Task, *, max_turns: int | None = None, time_budget_s: float | None = None,
                 weights: RewardWeights | None = None, shaping: Shaping | None = None, max_calls: int = MAX_CALLS,
                 output_chars: int = 2000, declare_tools: bool = True):
        self.task = task
        self.max_turns = int(max_turns or self.default_max_turns)
        self.time_budget_s = float(time_budget_s or self.default_time_budget_s)
        self.weights = weights or ENV_WEIGHTS
        self.shaping = shaping or Shaping()
        self.max_calls = max_calls
        self.output_chars = output_chars
        self.declare_tools = declare_tools
        self.turns = 0
        self.done = False
        self.stop = ""  # why the episode ended: answer, no_call, max_turns, time_budget
        self.answer: str | None = None
        self.tool_time_s = 0.0
        self.components = {"format": 0.0, "process": 0.0, "safety": 0.0}
        self.details: dict[str, float] = {}  # "process.<name>" -> earned value
        self.sandbox_log: list[dict[str, Any]] = []  # appended to by sandbox-backed tools
        self._turns: list[dict[str, Any]] = []
        self._final: dict[str, float] | None = None
        self._judge_info: dict[str, Any] = {}
        self._opening: list[dict[str, Any]] | None = None
        self._tools = self.make_tools()
        self.closed = False

    # --- subclass interface -------------------------------------------------------------------

    def opening(self) -> list[dict[str, Any]]:
        return self.task.chat()

    def make_tools(self) -> dict[str, Tool]:
        raise NotImplementedError

    def judge(self) -> float:
        """The terminal component, judged once when the rewards are first asked for."""
        raise NotImplementedError

    def after_calls(self, record: dict[str, Any], rewards: dict[str, float]) -> None:
        """Hook after each call has run (e.g. to detect edits): may add components via `earn`/`penalise`."""

    def on_answer(self, answer: str, rewards: dict[str, float]) -> None:
        """Hook when the model gives its final answer."""

    def options(self) -> dict[str, Any]:
        return {"max_turns": self.max_turns, "time_budget_s": self.time_budget_s,
                "weights": dataclasses.asdict(self.weights), "shaping": dataclasses.asdict(self.shaping)}

    # --- reward bookkeeping --------------------------------------------------------------------

    def penalise(self, component: str, rewards: dict[str, float]) -> None:
        """One format or safety penalty, down to the component's floor."""
        value = getattr(self.shaping, f"{component}_penalty")
        floor = getattr(self.shaping, f"{component}_floor")
        old = self.components[component]
        new = max(floor, old + value)
        self.components[component] = new
        rewards[component] = rewards.get(component, 0.0) + (new - old)

    def earn(self, name: str, value: float, rewards: dict[str, float]) -> None:
        """Process credit `name` up to `value` (at most once in total: only the increase counts)."""
        old = self.details.get(f"process.{name}", 0.0)
        if value <= old:
            return
        self.details[f"process.{name}"] = value
        self.components["process"] += value - old
        rewards["process"] = rewards.get("process", 0.0) + (value - old)

    # --- the protocol ----------------------------------------------------------------------------

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        if not self.declare_tools or not self._tools:
            return None
        return [t.schema() for t in self._tools.values()]

    def reset(self) -> list[dict[str, Any]]:
        if self._opening is None:
            self._opening = [dict(m) for m in self.opening()]
        return [dict(m) for m in self._opening]

    def step(self, text: str) -> StepResult:
        if self.done or self.closed:
            return StepResult([], {}, True, {"error": "the episode is over"})
        started = time.perf_counter()
        self.turns += 1
        rewards: dict[str, float] = {}
        parsed = parse_turn(text, self.max_calls)
        record: dict[str, Any] = {"turn": self.turns, "text": text if isinstance(text, str) else str(text),
                                  "calls": [], "errors": list(parsed.errors)}
        for _ in parsed.errors:
            self.penalise("format", rewards)
        observation: list[dict[str, Any]] = []
        if parsed.answer is not None:
            self.answer = parsed.answer
            for call in parsed.calls:
                record["calls"].append({**call.to_json(), "status": "not_run",
                                        "output": "tool calls in the answer turn are not run"})
                self.penalise("format", rewards)
            self.done, self.stop = True, "answer"
            self.on_answer(parsed.answer, rewards)
        elif not parsed.calls:
            self.done, self.stop = True, "no_call"
        else:
            for call in parsed.calls:
                if self.tool_time_s > self.time_budget_s:  # the budget ran out during this turn: not run
                    record["calls"].append({**call.to_json(), "status": "not_run",
                                            "output": "the episode's time budget is spent"})
                    continue
                entry, message = self._run_call(call, rewards)
                record["calls"].append(entry)
                observation.append(message)
        if not self.done and self.tool_time_s > self.time_budget_s:
            self.done, self.stop = True, "time_budget"
        if not self.done and self.turns >= self.max_turns:
            self.done, self.stop = True, "max_turns"
        if self.done:
            observation = []
        record.update(answer=parsed.answer, observation=observation, rewards=dict(rewards), done=self.done,
                      stop=self.stop, elapsed_s=round(time.perf_counter() - started, 4))
        self._turns.append(record)
        info = {"calls": record["calls"], "errors": record["errors"], "stop": self.stop,
                "elapsed_s": record["elapsed_s"]}
        return StepResult(observation, rewards, self.done, _plain(info))

    def _run_call(self, call: ParsedCall, rewards: dict[str, float]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Runs one parsed call; (its trace entry, its observation message)."""
        entry = call.to_json()
        logged = len(self.sandbox_log)
        started = time.perf_counter()
        status, output = "ok", ""
        if call.error is not None:
            status, output = "format_error", f"error: {call.error}"
            self.penalise("format", rewards)
        elif call.name not in self._tools:
            status, output = "format_error", (f"error: unknown tool {call.name!r}; the tools are "
                                              f"{', '.join(self._tools)}")
            self.penalise("format", rewards)
        else:
            problem = self._tools[call.name].validate(call.arguments)
            if problem is not None:
                status, output = "format_error", f"error: bad arguments for {call.name}: {problem}"
                self.penalise("format", rewards)
            else:
                try:
                    value = self._tools[call.name](**call.arguments)
                    output = value if isinstance(value, str) else str(value)
                except Refused as e:
                    status, output = "refused", f"refused: {e}"
                    self.penalise("safety", rewards)
                except ToolError as e:
                    status, output = "error", f"error: {e}"
                except Exception as e:  # noqa: BLE001 - a tool bug is an observation, never a crash
                    status, output = "internal_error", f"error: the tool failed ({type(e).__name__})"
                    entry["traceback"] = traceback.format_exc()[-3000:]
        elapsed = time.perf_counter() - started
        self.tool_time_s += elapsed
        output = truncate(output, self.output_chars)
        entry.update(status=status, output=output, elapsed_s=round(elapsed, 4),
                     sandbox=list(range(logged, len(self.sandbox_log))))  # indices into trace()["sandbox"]
        self.after_calls(entry, rewards)
        message = {"role": "tool", "name": call.name or "", "content": output}
        return entry, message

    def final_rewards(self) -> dict[str, float]:
        if self._final is None:
            started = time.perf_counter()
            terminal = float(self.judge())
            components = {"terminal": terminal, **self.components}
            calls = [c for turn in self._turns for c in turn["calls"]]
            usage = {"tool_calls": float(len(calls)),  # tool_use: the episode ran a tool successfully
                     "tool_use": float(any(c.get("status") == "ok" for c in calls))}
            self._final = {**self.weights.combine(components), **self.details, **usage}
            self._judge_info["judge_s"] = round(time.perf_counter() - started, 4)
        return dict(self._final)

    def trace(self) -> dict[str, Any]:
        task = self.task
        return _plain({
            "env": self.name,
            "task": {"family": task.family, "index": task.index, "level": task.level, "stream": task.stream},
            "options": self.options(),
            "opening": self._opening if self._opening is not None else self.opening(),
            "tools": list(self._tools),
            "turns": self._turns,
            "done": self.done, "stop": self.stop, "answer": self.answer,
            "tool_time_s": round(self.tool_time_s, 4),
            "sandbox": self.sandbox_log,
            "judge": self._judge_info,
            "rewards": self._final,
        })

    def close(self) -> None:
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
