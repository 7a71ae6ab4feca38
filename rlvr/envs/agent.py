"""Black-box agents: any program that speaks the OpenAI chat API, trained from its recorded calls.

The trainer opens a recording session on the rollout server
(`rlvr.rollout.server_sessions.SessionRecorder`), runs the agent with the session's base URL
(`http://host:port/sessions/<id>/v1`), scores the agent's final answer with the task's verifier, and
turns the session's records into `Trajectory`s:

    trajectories, rewards, trace = run_agent_episode(agent_fn, task, sessions, server_url, score_fn)

`agent_fn(base_url, task) -> str` is any user program (httpx, the `openai` package, a framework):
it only has to send its chat calls to `base_url`. It runs on its own thread; an agent that raises,
returns something other than a string, or outlives `timeout_s` is a recorded failure (reward 0,
the error in the trace), never an exception in the trainer.

Merging (`records_to_trajectories`). Every record holds the exact ids the engine saw (`prompt_ids`,
rendered by the server's chat template) and sampled (`output_ids`). A call whose prompt ids start
with the whole token sequence of an earlier trajectory (its prompt, then everything after it) extends
that trajectory: the ids between the old end and the new prompt's end (the template's tool-result /
user turn and the next generation prompt) are appended with loss_mask 0, logprob 0.0, version -1,
then the call's sampled ids with loss_mask 1 and their behaviour logprobs / versions. The comparison
is exact, on ids:

* the model's turn ends with the end-of-turn token it sampled (`<|im_end|>`); ChatML re-renders that
  same token followed by "\\n", so the old sequence (ending with the sampled stop token) is a prefix of
  the new prompt and the turn merges; the sampled stop token stays a trained token.
* a turn cut by max_tokens has no stop token: the template's `<|im_end|>\\n` becomes observation
  tokens (mask 0) and the turn still merges.
* anything else that differs on any id, the last ones included (a stop *string* the server trimmed
  from the text, a stop token other than the one the template renders, text that does not
  re-tokenise to the sampled ids, tool-call JSON written differently from the template's format, an
  agent that rewrote or summarised its history) is a prefix break: the call starts a new trajectory.
  Nothing is ever patched or re-tokenised, so every trained token is one the engine sampled in that
  exact context.

A call may extend any earlier trajectory (the longest match wins), so an agent that interleaves
independent conversations still merges each. A new trajectory whose prompt equals an earlier call's
prompt (n > 1, a retry) is a fork (`agent/forks`); any other new trajectory after the first is a
prefix break (`agent/prefix_breaks`). All trajectories of an episode share the episode's rewards.

`ReActAgent` / `calculator_agent` are an example agent: a ReAct loop over the chat API with a
calculator tool executed locally.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlvr.envs.base import Trajectory

ScoreFn = Callable[[Any, str], Mapping[str, float]]
AgentFn = Callable[[str, Any], str]

FAILED_REWARDS = {"reward": 0.0, "correct": 0.0}


# --- records -> trajectories ---------------------------------------------------------------


@dataclasses.dataclass
class _Builder:
    prompt_ids: list[int]
    output_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    start: str = "first"  # "first" | "prefix_break" | "fork"

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def is_prefix_of(self, ids: Sequence[int]) -> bool:
        n = len(self.prompt_ids)
        return (self.length <= len(ids) and list(ids[:n]) == self.prompt_ids
                and list(ids[n:self.length]) == self.output_ids)

    def extend(self, record: Mapping[str, Any]) -> None:
        prompt = list(record["prompt_ids"])
        gap = prompt[self.length:]
        out = list(record["output_ids"])
        self.output_ids += gap + out
        self.loss_mask += [0] * len(gap) + [1] * len(out)
        self.logprobs += [0.0] * len(gap) + [float(x) for x in record["output_logprobs"]]
        self.versions += [-1] * len(gap) + [int(v) for v in record["output_versions"]]
        self.calls.append(_call_summary(record, len(gap)))


def _call_summary(record: Mapping[str, Any], gap: int) -> dict[str, Any]:
    keys = ("rid", "endpoint", "session", "call", "choice", "finish_reason", "weight_version", "start_time",
            "end_time", "latency_s")
    summary = {k: record[k] for k in keys if k in record}
    summary.update(prompt_tokens=len(record["prompt_ids"]), output_tokens=len(record["output_ids"]),
                   observation_tokens=gap)
    return summary


def _check_record(i: int, record: Mapping[str, Any]) -> None:
    n = len(record["output_ids"])
    for key in ("output_logprobs", "output_versions"):
        if len(record[key]) != n:
            raise ValueError(f"record {i}: {key} has {len(record[key])} entries for {n} output ids")
    if not record["prompt_ids"]:
        raise ValueError(f"record {i}: empty prompt_ids")


def records_to_trajectories(records: Sequence[Mapping[str, Any]], rewards: Mapping[str, float] | None = None,
                            truncated: bool = False) -> tuple[list[Trajectory], dict[str, float]]:
    """(trajectories, metrics) from a session's records, in call order (see the module docstring).

    `rewards` is copied into every trajectory. A trajectory is `truncated` when its last call did not
    end with a stop (max_tokens, abort), or when `truncated` (the episode was cut) and it is the one
    the last call extended. Each trajectory's `trace` lists its calls (rid, finish reason, token counts,
    timing) and how it started ("first", "prefix_break" or "fork")."""
    builders: list[_Builder] = []
    prompts_seen: set[tuple[int, ...]] = set()
    breaks = forks = 0
    last: _Builder | None = None
    for i, record in enumerate(records):
        _check_record(i, record)
        prompt = record["prompt_ids"]
        parents = [b for b in builders if b.is_prefix_of(prompt)]
        if parents:
            last = max(reversed(parents), key=lambda b: b.length)  # longest; the latest on a tie
            last.extend(record)
        else:
            start = "first"
            if builders:
                start = "fork" if tuple(prompt) in prompts_seen else "prefix_break"
                breaks += start == "prefix_break"
                forks += start == "fork"
            last = _Builder(list(prompt), start=start)
            last.extend(record)
            builders.append(last)
        prompts_seen.add(tuple(prompt))
    rewards = dict(rewards or {})
    trajectories = []
    for b in builders:
        stopped = (b.calls[-1].get("finish_reason") or {}).get("type") == "stop"
        traj = Trajectory(prompt_ids=b.prompt_ids, output_ids=b.output_ids, loss_mask=b.loss_mask,
                          logprobs=b.logprobs, versions=b.versions, rewards=dict(rewards),
                          truncated=not stopped or (truncated and b is last), turns=len(b.calls),
                          trace={"start": b.start, "calls": b.calls})
        traj.validate()
        trajectories.append(traj)
    sampled = sum(sum(t.loss_mask) for t in trajectories)
    metrics = {"agent/calls": float(len(records)), "agent/trajectories": float(len(trajectories)),
               "agent/prefix_breaks": float(breaks), "agent/forks": float(forks),
               "agent/sampled_tokens": float(sampled),
               "agent/observation_tokens": float(sum(len(t.output_ids) for t in trajectories) - sampled)}
    return trajectories, metrics


# --- one episode ---------------------------------------------------------------------------


def family_score_fn(family: Any) -> ScoreFn:
    """`score_fn` from a task family: `family.score(task, answer, truncated=False)`."""
    return lambda task, answer: family.score(task, answer, False)


def _run_thread(agent_fn: AgentFn, base_url: str, task: Any, timeout_s: float) -> tuple[str, Any, str | None]:
    """(status "ok" | "error" | "timeout", answer, error text) of agent_fn on a daemon thread."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["answer"] = agent_fn(base_url, task)
        except BaseException:  # the agent's own SystemExit / KeyboardInterrupt must not escape either
            box["error"] = traceback.format_exc(limit=20)

    thread = threading.Thread(target=target, name="rlvr-agent", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return "timeout", None, f"agent did not finish within {timeout_s:g} s"
    if "error" in box:
        return "error", None, box["error"]
    answer = box.get("answer")
    if not isinstance(answer, str):
        return "error", None, f"agent returned {type(answer).__name__}, not a str answer"
    return "ok", answer, None


def run_agent_episode(agent_fn: AgentFn, task: Any, sessions: Any, server_url: str | None, score_fn: ScoreFn,
                      timeout_s: float = 600.0, metadata: Mapping[str, Any] | None = None,
                      keep_failed: bool = True) -> tuple[list[Trajectory], dict[str, float], dict[str, Any]]:
    """Runs one agent episode in a fresh recording session; never raises for the agent's faults.

    sessions: a `SessionRecorder` attached to the rollout server (anything with `open(metadata=...)`,
        `base_url(sid, server_url)` and `close(sid) -> {"records", "errors", ...}`).
    server_url: the server's root URL (None: the attached server's address).
    score_fn(task, answer) -> reward dict with "reward" (e.g. `family_score_fn(family)`).

    Returns (trajectories, rewards, trace). rewards is score_fn's dict, or `{"reward": 0.0,
    "correct": 0.0}` when the agent crashed, timed out, returned a non-string, or the scorer raised.
    Every trajectory carries the rewards. On a failure the trajectories recorded so far are still
    returned (with reward 0) unless `keep_failed` is False; trace["status"] says what happened.
    A timed-out agent's thread cannot be killed: its session is closed (requests in flight aborted,
    later calls answered 404) and the thread is left to die on its own.
    """
    start = time.monotonic()
    sid = sessions.open(metadata=dict(metadata or {}))
    url = sessions.base_url(sid, server_url)
    status, answer, error = _run_thread(agent_fn, url, task, timeout_s)
    try:
        log = sessions.close(sid)
    except KeyError as e:  # expired or evicted while the agent ran
        log = {"records": [], "errors": [], "calls": 0}
        if status == "ok":
            status, error = "error", f"session lost: {e.args[0]}"
    rewards: dict[str, float] = dict(FAILED_REWARDS)
    if status == "ok":
        try:
            rewards = {k: float(v) for k, v in score_fn(task, answer).items()}
        except Exception:
            status, error = "score_error", traceback.format_exc(limit=20)
            rewards = dict(FAILED_REWARDS)
    failed = status != "ok"
    trajectories, metrics = records_to_trajectories(log["records"], rewards, truncated=status == "timeout")
    metrics.update({"agent/failed": float(failed), "agent/timeout": float(status == "timeout"),
                    "agent/http_errors": float(len(log.get("errors", ()))),
                    "agent/duration_s": time.monotonic() - start})
    for traj in trajectories:
        traj.trace.update(session=sid, status=status)
    trace = {"session": sid, "status": status, "answer": answer, "error": error, "metrics": metrics,
             "calls": [c for t in trajectories for c in t.trace["calls"]], "http_errors": log.get("errors", []),
             "messages": _last_messages(log["records"])}
    if failed and not keep_failed:
        trajectories = []
    return trajectories, rewards, trace


def _last_messages(records: Sequence[Mapping[str, Any]]) -> list[Any] | None:
    """The last chat call's messages plus its reply (the conversation as the agent ended it)."""
    for record in reversed(records):
        request = record.get("request") or {}
        if isinstance(request, dict) and "messages" in request:
            reply = (record.get("response") or {}).get("message")
            return [*request["messages"], *([reply] if reply else [])]
    return None


# --- an example agent: ReAct over the chat API, with a local calculator --------------------

def calculate(expression: str) -> str:
    """The example agent's calculator (rlvr.envs.calculator); errors become text for the model."""
    from rlvr.envs.calculator import CalcError, evaluate, format_number

    try:
        return format_number(evaluate(expression))
    except CalcError as e:
        return f"error: {e}"


def _calculator_tool() -> dict[str, Any]:
    from rlvr.data.synthetic import CALCULATOR_TOOL

    return CALCULATOR_TOOL


def _task_messages(task: Any) -> list[dict[str, Any]]:
    if isinstance(task, str):
        return [{"role": "user", "content": task}]
    if hasattr(task, "chat"):
        return task.chat()
    if isinstance(task, Mapping) and "messages" in task:
        return [dict(m) for m in task["messages"]]
    if isinstance(task, Mapping) and "prompt" in task:
        return [{"role": "user", "content": task["prompt"]}]
    raise TypeError(f"cannot build chat messages from a {type(task).__name__} task")


@dataclasses.dataclass
class ReActAgent:
    """A ReAct loop over the OpenAI chat API: call the model with `tools`, run the tool calls it
    makes locally (`executors[name](**arguments) -> str`), send the results back as `role: tool`
    messages, and stop at the first reply without tool calls (its content is the answer) or after
    `max_turns` model calls (the last content). The assistant message is sent back exactly as the
    server returned it, so the server re-renders the sampled tokens and the calls merge into one
    trajectory. Uses httpx (a dependency of rlvr); `agent_fn`-compatible: `agent(base_url, task)`.
    """

    tools: list[dict[str, Any]]
    executors: Mapping[str, Callable[..., str]]
    max_turns: int = 6
    max_tokens: int = 256
    temperature: float = 1.0
    system: str | None = None
    model: str = "policy"
    http_timeout_s: float = 300.0
    extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __call__(self, base_url: str, task: Any) -> str:
        import httpx

        messages = _task_messages(task)
        if self.system and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system})
        content = ""
        with httpx.Client(base_url=base_url.rstrip("/"), timeout=self.http_timeout_s) as client:
            for _ in range(self.max_turns):
                body = {"model": self.model, "messages": messages, "tools": self.tools,
                        "max_tokens": self.max_tokens, "temperature": self.temperature, **self.extra_body}
                reply = client.post("/chat/completions", json=body)
                reply.raise_for_status()
                message = reply.json()["choices"][0]["message"]
                content = message.get("content") or ""
                calls = message.get("tool_calls") or []
                assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
                if calls:
                    assistant["tool_calls"] = calls
                messages.append(assistant)
                if not calls:
                    return content
                for call in calls:
                    messages.append({"role": "tool", "tool_call_id": call.get("id"),
                                     "content": self.execute(call["function"])})
        return content

    def execute(self, function: Mapping[str, Any]) -> str:
        fn = self.executors.get(function.get("name"))
        if fn is None:
            return f"error: unknown tool {function.get('name')!r}"
        try:
            args = json.loads(function.get("arguments") or "{}")
            if not isinstance(args, dict):
                raise TypeError("arguments must be a JSON object")
            return str(fn(**args))
        except Exception as e:
            return f"error: {type(e).__name__}: {e}"


def calculator_agent(**kwargs: Any) -> ReActAgent:
    """The example agent: ReAct with a `calculator(expression)` tool (`rlvr.data.synthetic`'s schema)."""
    kwargs.setdefault("system", "Use the calculator tool for arithmetic. Give your final answer inside "
                                "<answer></answer> tags.")
    return ReActAgent(tools=[_calculator_tool()], executors={"calculator": calculate}, **kwargs)


# ------------------------------------------------------------------------------ training black-box agents


def load_agent(spec: str, options: Mapping[str, Any] | None = None) -> AgentFn:
    """`"module:factory"` (e.g. `rlvr.envs.agent:calculator_agent`) -> `factory(**options)`, the agent
    program."""
    import importlib

    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"rl.agent={spec!r}: expected 'module:factory', e.g. 'rlvr.envs.agent:calculator_agent'")
    factory = getattr(importlib.import_module(module), name, None)
    if factory is None:
        raise ValueError(f"rl.agent={spec!r}: {module} has no {name!r}")
    return factory(**dict(options or {}))


def _fit(traj: Trajectory, max_tokens: int) -> Trajectory:
    """The trajectory cut to `max_tokens` (prompt + output); truncated when cut."""
    room = max_tokens - len(traj.prompt_ids)
    if room >= len(traj.output_ids):
        return traj
    room = max(room, 0)
    cut = dataclasses.replace(traj, output_ids=traj.output_ids[:room], loss_mask=traj.loss_mask[:room],
                              logprobs=traj.logprobs[:room], versions=traj.versions[:room], truncated=True)
    if len(cut.prompt_ids) > max_tokens:
        cut.prompt_ids = cut.prompt_ids[:max_tokens]
    return cut


class AgentRunner:
    """Plays RL episodes with a black-box agent program (`rl.agent`) against the embedded engine's
    OpenAI-compatible endpoint, served in-process: each episode opens a recording session, the
    agent's calls become token-level trajectories, its final answer is scored by the task's verifier.

    An episode whose calls do not extend one token history (the agent rewrote it) yields several
    trajectories; the one with the most sampled tokens is trained and the others are counted
    (`agent/dropped_trajectories` in the trace metrics) — they share its reward.
    """

    def __init__(self, driver: Any, agent_fn: AgentFn, score: Callable[[Any, str], Mapping[str, float]],
                 timeout_s: float = 600.0):
        from rlvr.rollout.server import serve
        from rlvr.rollout.server_sessions import SessionRecorder

        self.server, _ = serve(driver)
        self.sessions = SessionRecorder().attach(self.server)
        self.agent_fn, self.score, self.timeout_s = agent_fn, score, timeout_s

    def episode(self, task: Any, max_tokens: int, rid: str) -> Trajectory:
        trajectories, rewards, trace = run_agent_episode(self.agent_fn, task, self.sessions, self.server.url,
                                                         self.score, self.timeout_s, metadata={"rid": rid})
        trace["metrics"]["agent/dropped_trajectories"] = float(max(len(trajectories) - 1, 0))
        if not trajectories:
            traj = Trajectory([], [], [], [], [], dict(rewards), trace["status"] == "timeout")
        else:
            traj = _fit(max(trajectories, key=lambda t: sum(t.loss_mask)), max_tokens)
        traj.rewards = {**rewards, "agent_failed": trace["metrics"]["agent/failed"]}
        traj.turns = int(trace["metrics"].get("agent/calls", 0))
        traj.trace = {"rid": rid, "stop": trace["status"], **trace}
        if trace["status"] != "ok":
            traj.trace["error"] = trace.get("error") or trace["status"]
        return traj

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
