"""`ToolStateEnv`: a stateful tool environment judged by its final state (BFCL / tau-bench style).

The state machines are the tool_bank / tool_files families' (`rlvr.tasks.verifiers.TOOL_SETS`: a plain
dict mutated by pure functions), with query tools added, and the state is *not* shown: goals such as
"move all of alice's money to bob" or "delete every file that mentions 'river'" need the model to look
before it acts.

  bank   list_accounts(), get_balance(account); deposit, withdraw, transfer, open_account
  files  list_files(), read_file(path); write, append, delete, rename

Goals (`state_problem(rng, level)`): level + 1 of them, each an explicit operation (as in tool_bank /
tool_files) or, half the time, one that depends on the hidden state (bank: move everything, withdraw
half, deposit into the richest account; files: append one file to another, rename every .md file,
delete the files that contain a word). The generator simulates them to get the target state and a
scripted solution (query calls, then the actions).

A failing operation (overdraft, unknown account, missing file) is an error observation and leaves the
state unchanged. The episode ends with `<answer>` or a turn without calls; terminal = 1 iff the state
then equals the target exactly (also when the turn limit cut the episode: the state is what counts).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from rlvr.envs.tool_env import ToolEnv
from rlvr.envs.tools import Tool, ToolError, call_text
from rlvr.tasks.base import Task, pick
from rlvr.tasks.procedural import NAMES, WORDS, ToolBank, ToolFiles
from rlvr.tasks.verifiers import TOOL_SETS, _json_same

QUERIES = {"bank": ("list_accounts", "get_balance"), "files": ("list_files", "read_file")}
DESCRIPTIONS = {
    "bank": ("You operate a bank through tools. Each account has a balance in whole units. Look up what you need "
             "with list_accounts and get_balance: the balances are not shown here."),
    "files": ("You manage a small file store through tools. Each file has a text content. Look up what you need "
              "with list_files and read_file: the files are not shown here."),
}
DONE_INSTRUCTION = "When everything is done, reply with <answer>done</answer>."


def query(tools: str, state: dict, name: str, arguments: dict) -> str:
    """A query tool's answer on `state` (ToolError for a missing account or file)."""
    if name == "list_accounts":
        return json.dumps(sorted(state))
    if name == "list_files":
        return json.dumps(sorted(state))
    key = arguments.get("account" if tools == "bank" else "path")
    if not isinstance(key, str) or key not in state:
        raise ToolError(f"no {'account' if tools == 'bank' else 'file'} {key!r}")
    return str(state[key]) if tools == "bank" else state[key]


def apply_calls(tools: str, initial: dict, calls: list[tuple[str, dict]]) -> dict | None:
    """The state after the calls (queries change nothing); None at an unknown tool or a failing call."""
    state = copy.deepcopy(dict(initial))
    actions = TOOL_SETS[tools]
    for name, arguments in calls:
        try:
            if name in QUERIES[tools]:
                query(tools, state, name, arguments)
            elif name in actions:
                actions[name](state, **arguments)
            else:
                return None
        except Exception:  # noqa: BLE001 - model input: any failing call is a wrong answer
            return None
    return state


# ----------------------------------------------------------------------------------------- goals

Goal = tuple[str, list[tuple[str, dict]], list[tuple[str, dict]]]  # (words, query calls, action calls)


def _bank_goal(rng: np.random.Generator, state: dict) -> Goal:
    kind = pick(rng, ("explicit", "all", "half", "richest"))
    funded = [a for a in state if state[a] > 0]
    if kind == "all" and funded and len(state) > 1:
        source = pick(rng, funded)
        target = pick(rng, [a for a in state if a != source])
        return (f"Move all of {source}'s money to {target}.", [("get_balance", {"account": source})],
                [("transfer", {"source": source, "target": target, "amount": state[source]})])
    even = [a for a in funded if state[a] % 2 == 0]
    if kind == "half" and even:
        account = pick(rng, even)
        return (f"{account} withdraws half of their balance.", [("get_balance", {"account": account})],
                [("withdraw", {"account": account, "amount": state[account] // 2})])
    top = max(state.values()) if state else 0
    richest = [a for a in state if state[a] == top]
    if kind == "richest" and len(richest) == 1:
        amount = 5 * int(rng.integers(1, 21))
        queries = [("list_accounts", {})] + [("get_balance", {"account": a}) for a in sorted(state)]
        return (f"Deposit {amount} into the account with the largest balance.", queries,
                [("deposit", {"account": richest[0], "amount": amount})])
    name, arguments, words = ToolBank().operation(rng, state)
    return words, [], [(name, arguments)]


def _files_goal(rng: np.random.Generator, state: dict) -> Goal:
    kind = pick(rng, ("explicit", "append_file", "rename_md", "delete_word"))
    if kind == "append_file" and len(state) >= 2:
        source, target = (str(p) for p in rng.choice(sorted(state), 2, replace=False))
        return (f"Append the content of {json.dumps(source)} to the end of {json.dumps(target)}.",
                [("read_file", {"path": source})], [("append", {"path": target, "content": state[source]})])
    markdown = sorted(p for p in state if p.endswith(".md") and p[:-3] + ".txt" not in state)
    if kind == "rename_md" and markdown:
        return ("Rename every .md file to a .txt file of the same name.", [("list_files", {})],
                [("rename", {"source": p, "target": p[:-3] + ".txt"}) for p in markdown])
    words = sorted({w for text in state.values() for w in text.split()})
    if kind == "delete_word" and words and len(state) >= 2:
        word = pick(rng, words)
        doomed = sorted(p for p in state if word in state[p].split())
        if len(doomed) < len(state):
            queries = [("list_files", {})] + [("read_file", {"path": p}) for p in sorted(state)]
            return (f"Delete every file whose content contains the word {json.dumps(word)}.", queries,
                    [("delete", {"path": p}) for p in doomed])
    name, arguments, words_ = ToolFiles().operation(rng, state)
    return words_, [], [(name, arguments)]


def _files_initial(rng: np.random.Generator) -> dict:
    """Like tool_files', with a .md file now and then (for the rename goal)."""
    names = [str(w) for w in rng.choice(WORDS, int(rng.integers(2, 5)), replace=False)]
    return {f"{w}.{'md' if rng.random() < 0.35 else 'txt'}": " ".join(pick(rng, WORDS)
                                                                     for _ in range(int(rng.integers(1, 4))))
            for w in names}


def _bank_initial(rng: np.random.Generator) -> dict:
    names = [str(n) for n in rng.choice(NAMES, int(rng.integers(2, 5)), replace=False)]
    return {n: 10 * int(rng.integers(0, 21)) for n in names}


GOALS: dict[str, tuple[Callable[[np.random.Generator], dict], Callable[[np.random.Generator, dict], Goal]]] = {
    "bank": (_bank_initial, _bank_goal), "files": (_files_initial, _files_goal)}


def state_problem(rng: np.random.Generator, level: int, tools: str | None = None) -> dict[str, Any]:
    """{"tools", "initial", "target", "goals" (words), "script" (per goal: [query calls, action calls])}."""
    tools = tools or pick(rng, ("bank", "files"))
    make_initial, make_goal = GOALS[tools]
    initial = make_initial(rng)
    state = copy.deepcopy(initial)
    goals, script = [], []
    for _ in range(level + 1):
        words, queries, actions = make_goal(rng, state)
        for name, arguments in actions:
            TOOL_SETS[tools][name](state, **arguments)
        goals.append(words)
        script.append([[[n, a] for n, a in queries], [[n, a] for n, a in actions]])
    flat = [(n, a) for queries, actions in script for n, a in queries + actions]
    assert _json_same(apply_calls(tools, initial, flat), state)
    return {"tools": tools, "initial": initial, "target": state, "goals": goals, "script": script}


def opening_messages(problem: dict[str, Any]) -> list[dict[str, str]]:
    steps = "\n".join(f"{i}. {g}" for i, g in enumerate(problem["goals"], 1))
    return [{"role": "user", "content": f"{DESCRIPTIONS[problem['tools']]}\n\nDo the following, in order:\n{steps}"
                                        f"\n\n{DONE_INSTRUCTION}"}]


def reference_turns(task: Task) -> list[str]:
    """Per goal: a turn with its queries (when it has any), then a turn with its actions; then the answer."""
    turns = []
    for queries, actions in task.metadata["script"]:
        for calls in (queries, actions):
            if calls:
                turns.append("\n".join(call_text(n, a) for n, a in calls))
    return turns + ["<answer>done</answer>"]


# ----------------------------------------------------------------------------------------- the environment

_ACTION_SCHEMAS = {
    "bank": {
        "deposit": ({"account": "string", "amount": "integer"}, "Add amount to an existing account."),
        "withdraw": ({"account": "string", "amount": "integer"}, "Take amount from an account (not below 0)."),
        "transfer": ({"source": "string", "target": "string", "amount": "integer"},
                     "Move amount from one existing account to another."),
        "open_account": ({"name": "string"}, "Open a new account with balance 0."),
        "list_accounts": ({}, "The names of all accounts (JSON list)."),
        "get_balance": ({"account": "string"}, "The balance of an account."),
    },
    "files": {
        "write": ({"path": "string", "content": "string"}, "Create a file or replace its content."),
        "append": ({"path": "string", "content": "string"}, "Add content to the end of an existing file."),
        "delete": ({"path": "string"}, "Remove an existing file."),
        "rename": ({"source": "string", "target": "string"}, "Rename a file to a path that does not exist yet."),
        "list_files": ({}, "The paths of all files (JSON list)."),
        "read_file": ({"path": "string"}, "The content of a file."),
    },
}


def _schema(properties: dict[str, str]) -> dict[str, Any]:
    return {"type": "object", "properties": {k: {"type": v} for k, v in properties.items()},
            "required": list(properties), "additionalProperties": False}


class ToolStateEnv(ToolEnv):
    """See the module doc."""

    name = "tool_state"
    default_max_turns = 12
    default_time_budget_s = 60.0

    def __init__(self, task: Task, **options: Any):
        self.kind = task.metadata["tools"]
        self.state = copy.deepcopy(dict(task.metadata["initial"]))
        super().__init__(task, **options)

    def opening(self) -> list[dict[str, Any]]:
        return opening_messages(self.task.metadata)

    def make_tools(self) -> dict[str, Tool]:
        tools = {}
        for name, (properties, description) in _ACTION_SCHEMAS[self.kind].items():
            tools[name] = Tool(self._caller(name), name, description, _schema(properties))
        return tools

    def _caller(self, name: str) -> Callable[..., str]:
        def call(**arguments: Any) -> str:
            if name in QUERIES[self.kind]:
                return query(self.kind, self.state, name, arguments)
            state = copy.deepcopy(self.state)
            try:
                TOOL_SETS[self.kind][name](state, **arguments)
            except Exception as e:  # noqa: BLE001 - the state machine's refusal, as an observation
                raise ToolError(str(e)) from None
            self.state = state
            return "ok"

        return call

    def judge(self) -> float:
        return float(_json_same(self.state, dict(self.task.metadata["target"])))

    def trace(self) -> dict[str, Any]:
        out = super().trace()
        out["state"] = {"initial": self.task.metadata["initial"], "final": self.state,
                        "target": self.task.metadata["target"]}
        return out
