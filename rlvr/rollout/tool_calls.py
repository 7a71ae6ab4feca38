"""Tool calls in model output: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

This is the Qwen / Hermes convention the ChatML templates ask for. `parse_tool_calls` turns a
finished text into OpenAI `tool_calls`; `ToolCallStream` does the same on streamed text deltas
(content is passed through as it comes, a call is emitted once its block is closed);
`tool_call_regex` is the grammar of one or more such blocks, for `tool_choice="required"` or a
named function (constrained decoding makes the model write exactly that).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ARGUMENTS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _raw_arguments(block: str, args: Any) -> str:
    """The arguments' JSON text exactly as the model wrote it in `block` (so an agent that sends the
    call back gets the same tokens from the chat template), else `json.dumps(args)`."""
    decoder = json.JSONDecoder()
    for key in _ARGUMENTS_KEY.finditer(block):
        try:
            value, end = decoder.raw_decode(block, key.end())
        except ValueError:
            continue
        if value == args and type(value) is type(args):
            return block[key.end():end]
    return json.dumps(args, ensure_ascii=False)


def _call(body: str) -> dict[str, Any] | None:
    """The OpenAI tool call of one block's JSON body, or None if it is not a well-formed call."""
    try:
        obj = json.loads(body)
        name = obj["name"]
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(name, str):
            raise TypeError(name)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    arguments = args if isinstance(args, str) else _raw_arguments(body, args)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content without the parsed blocks, OpenAI tool_calls) from `<tool_call>{json}</tool_call>`.
    A call's `arguments` string is the model's own JSON text of the arguments object (valid JSON,
    whitespace and key order as sampled), so the chat template re-renders it token for token.
    Malformed blocks stay in the content."""
    calls, kept, last = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    content = ("".join(kept) + text[last:]).strip() if calls else text
    return content or None, calls


class ToolCallStream:
    """Splits streamed text into content deltas and complete tool calls (each with its `index`).

    Text that might begin a `<tool_call>` tag is held back until it is known not to; a block is
    parsed once its closing tag arrives (a malformed one is passed on as content)."""

    def __init__(self) -> None:
        self.pending = ""
        self.count = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.pending += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while self.pending:
            start = self.pending.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.pending, OPEN)
                content.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            content.append(self.pending[:start])
            self.pending = self.pending[start:]
            end = self.pending.find(CLOSE)
            if end < 0:
                break  # inside a block: wait for its end
            block, self.pending = self.pending[: end + len(CLOSE)], self.pending[end + len(CLOSE):]
            call = _call(block[len(OPEN): -len(CLOSE)].strip())
            if call is None:
                content.append(block)
            else:
                calls.append({"index": self.count, **call})
                self.count += 1
        if final:
            content.append(self.pending)
            self.pending = ""
        return "".join(content), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of a partial output to hold back from a stream: an incomplete
    UTF-8 character (decoded as U+FFFD) and any suffix that could begin a stop string (it is cut
    off if the stop completes)."""
    keep = len(text) - len(text.rstrip("\ufffd"))
    return max([keep, *(_partial_suffix(text, stop) for stop in stops)])


def tool_call_regex(tools: list[dict[str, Any]], name: str | None = None) -> str:
    """The grammar of forced tool calls: with `name`, exactly one block calling that function; else
    one or more blocks (newline-separated) calling any of `tools`. Each block is
    `<tool_call>\\n{"name": "<name>", "arguments": <JSON of the function's parameters schema>}\\n</tool_call>`."""
    from rlvr.rollout.grammar import escape, schema_regex

    calls = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        parameters = fn.get("parameters") or {"type": "object", "properties": {}}
        calls.append(escape(OPEN + '\n{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": ')
                     + schema_regex(parameters) + escape("}\n" + CLOSE))
    one = "(" + "|".join(calls) + ")"
    return one if name is not None else f"{one}(\\n{one})*"
