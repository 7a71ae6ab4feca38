"""The grammar a task's answers follow, for constrained decoding in RL (`rl.constrained_decoding`).

With the switch on, a task whose verifier checks a JSON schema samples under that schema, and a
tool-call task (verifier "tool_state") under the tool-call format with its tool set's argument
schemas, so every sample is well-formed and the reward measures what it says rather than syntax.
Other tasks are sampled freely. For families whose answer goes in `<answer>...</answer>` tags
(answer_format "tag") the grammar includes the tags. The result is the `SamplingParams`
keyword(s) to add.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Mapping
from typing import Any


def sampling_constraint(verifier: Mapping[str, Any], answer_format: str = "raw") -> dict[str, str]:
    """{"json_schema": ...} or {"regex": ...} for the verifier's kind, or {} when it has none."""
    from rlvr.rollout.grammar import escape, schema_regex

    kind = verifier.get("kind")
    if kind == "json_schema" and answer_format != "tag":
        return {"json_schema": json.dumps(verifier["schema"], sort_keys=True)}
    if kind == "json_schema":
        regex = schema_regex(verifier["schema"])
    elif kind == "tool_state":
        regex = _tool_regex(verifier["tools"])
    else:
        return {}
    return {"regex": escape("<answer>") + f"({regex})" + escape("</answer>") if answer_format == "tag" else regex}


@functools.lru_cache(maxsize=16)
def _tool_regex(tool_set: str) -> str:
    from rlvr.envs.tools import infer_parameters
    from rlvr.rollout.tool_calls import tool_call_regex
    from rlvr.tasks.verifiers import TOOL_SETS

    if tool_set not in TOOL_SETS:
        raise ValueError(f"tool_state verifier: unknown tool set {tool_set!r}; known: {sorted(TOOL_SETS)}")
    tools = []
    for name, fn in TOOL_SETS[tool_set].items():
        parameters = infer_parameters(_without_state(fn))
        tools.append({"type": "function", "function": {"name": name, "parameters": parameters}})
    return tool_call_regex(tools)


def _without_state(fn):
    """`fn(state, **arguments)` as a signature of its arguments only (what a call writes)."""
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())[1:]

    def arguments(*args, **kwargs):
        raise NotImplementedError

    arguments.__signature__ = signature.replace(parameters=params)
    arguments.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k != "state"}
    return arguments
