"""Tools an environment offers the model, and the parser of the model's tool calls.

A `Tool` is a plain function plus its JSON schema, declared in the OpenAI/Qwen "function" format
(`Tool.schema()`, the list passed as `tools=` to the chat template):

    @tool
    def calc(expr: str) -> str:
        "Evaluate an arithmetic expression."
        return format_number(evaluate(expr))

    Tool(fn, name="calculator", description="...", parameters={...JSON schema...})  # explicit schema

`@tool` infers the parameters from the signature (str/int/float/bool/list/dict annotations; a
parameter without a default is required); pass `parameters=` for anything richer. Arguments are
validated against the schema with `jsonschema` (a dependency of rlvr's data extra; without it a
minimal check of required names, unknown names and JSON types runs instead, and a RuntimeWarning
says so once per process). A tool signals:

  ToolError  a legitimate failure (file not found, no unique match): an error observation only
  Refused    a forbidden operation (a path outside the workspace, writing the tests): an error
             observation and a safety penalty

Model text is parsed by `parse_turn`: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
block becomes a `ParsedCall` (whitespace and a ```json fence around the JSON are fine; `arguments`
may be a JSON string, OpenAI style). Malformed blocks never raise: they become calls with an
`error` (bad JSON, not an object, no name, arguments not an object, unknown keys, a missing closing
tag before the next block, a stray `</tool_call>`), which the environment answers with an error
observation and a format penalty. A block left open at the very end of the turn is accepted (a
rollout that stops on `</tool_call>` strips the stop string). At most `max_calls` calls per turn
are kept; further ones are errors.

Final answers: the content of the last `<answer>...</answer>` (an `<answer>` left open at the end of
the turn counts, up to the end). The episode rule (rlvr.envs.tool_env): a turn with an answer ends the
episode (tool calls in the same turn are not run, and are a format error); a turn with neither a
tool call nor an answer ends it too, without an answer; otherwise the calls run and the episode
goes on.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import types
import typing
import warnings
from collections.abc import Callable, Mapping
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
MAX_CALLS = 8
MAX_CALL_CHARS = 100_000  # a call's JSON text beyond this is refused unparsed


class ToolError(Exception):
    """A tool call that failed legitimately: the model gets the message as an error observation."""


class Refused(ToolError):
    """A forbidden operation: an error observation and a safety penalty."""


# ----------------------------------------------------------------------------------------- Tool

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _annotation_schema(annotation: Any) -> dict[str, Any]:
    """The JSON schema of a simple annotation (str, int, float, bool, list[...], dict[...], X | None)."""
    if isinstance(annotation, str):
        annotation = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}.get(
            annotation.split("[")[0].strip(), annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _annotation_schema(options[0]) if len(options) == 1 else {}
    base = origin or annotation
    if base in _JSON_TYPES:
        return {"type": _JSON_TYPES[base]}
    return {}


def infer_parameters(fn: Callable[..., Any]) -> dict[str, Any]:
    """A JSON object schema for `fn`'s keyword parameters (see the module doc)."""
    properties, required = {}, []
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to the raw ones
        hints = {}
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        properties[name] = _annotation_schema(hints.get(name, param.annotation))
        if param.default is param.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@dataclasses.dataclass
class Tool:
    """A function the model may call: `fn(**arguments) -> str` (or any value, shown with `str`)."""

    fn: Callable[..., Any]
    name: str = ""
    description: str = ""
    parameters: dict[str, Any] | None = None

    def __post_init__(self):
        self.name = self.name or self.fn.__name__
        self.description = self.description or (inspect.getdoc(self.fn) or "").split("\n\n")[0]
        if self.parameters is None:
            self.parameters = infer_parameters(self.fn)
        self._validator = _validator(self.parameters)

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Qwen function declaration."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def validate(self, arguments: Any) -> str | None:
        """None when `arguments` fit the schema, else what is wrong (one short message)."""
        if not isinstance(arguments, dict):
            return "arguments must be a JSON object"
        return self._validator(arguments)

    def __call__(self, **arguments: Any) -> Any:
        return self.fn(**arguments)


def tool(fn: Callable[..., Any] | None = None, *, name: str = "", description: str = "",
         parameters: dict[str, Any] | None = None) -> Any:
    """Decorator: `@tool` or `@tool(name=..., description=..., parameters=...)` makes a `Tool`."""
    def make(f: Callable[..., Any]) -> Tool:
        return Tool(f, name, description, parameters)

    return make(fn) if fn is not None else make


_warned: set[str] = set()


def _validator(schema: Mapping[str, Any]) -> Callable[[dict], str | None]:
    try:
        import jsonschema
    except ImportError:  # the minimal fallback (rlvr's data extra brings jsonschema), said once
        if "jsonschema" not in _warned:
            _warned.add("jsonschema")
            warnings.warn("jsonschema is not installed: tool arguments are checked for required names, unknown "
                          "names and JSON types only (not enums, ranges, patterns or nested schemas); "
                          "pip install jsonschema (rlvr's data extra) for full validation", RuntimeWarning,
                          stacklevel=2)
        return lambda arguments: _minimal_check(schema, arguments)
    validator = jsonschema.Draft202012Validator(schema)

    def check(arguments: dict) -> str | None:
        error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return f"{where}: {error.message}" if where else error.message

    return check


_PY_TYPES = {"string": (str,), "boolean": (bool,), "array": (list,), "object": (dict,), "null": (type(None),),
             "integer": (int,), "number": (int, float)}


def _json_type_ok(value: Any, kind: str) -> bool:
    if kind not in _PY_TYPES:
        return True
    if isinstance(value, bool) and kind != "boolean":
        return False
    return isinstance(value, _PY_TYPES[kind])


def _minimal_check(schema: Mapping[str, Any], arguments: dict) -> str | None:
    properties = schema.get("properties", {})
    for name in schema.get("required", []):
        if name not in arguments:
            return f"'{name}' is a required property"
    for name, value in arguments.items():
        if name not in properties:
            if schema.get("additionalProperties", True) is False:
                return f"unknown argument '{name}'"
            continue
        kind = properties[name].get("type")
        if kind and not _json_type_ok(value, kind):
            return f"{name}: {json.dumps(value)[:40]} is not of type '{kind}'"
    return None


# ----------------------------------------------------------------------------------------- parsing


@dataclasses.dataclass
class ParsedCall:
    """One tool call block of a turn: `name` and `arguments`, or `error` (malformed; not run)."""

    raw: str
    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"raw": self.raw[:2000], "name": self.name, "arguments": self.arguments, "error": self.error}


@dataclasses.dataclass
class ParsedTurn:
    """A model turn: its tool calls (well-formed or not), its final answer (None: none given),
    and format errors that belong to no call (a stray closing tag, text after an answer...)."""

    calls: list[ParsedCall]
    answer: str | None
    errors: list[str]

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)


_FENCE = re.compile(r"^```[A-Za-z]*\s*\n?(.*?)\n?```$", re.DOTALL)
_ALLOWED_KEYS = {"name", "arguments", "id", "type"}


def parse_call(body: str) -> ParsedCall:
    """One block's content (between the tags) as a call; never raises."""
    raw = body
    text = body.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if not text:
        return ParsedCall(raw, error="empty tool call")
    if len(text) > MAX_CALL_CHARS:
        return ParsedCall(raw, error=f"tool call longer than {MAX_CALL_CHARS} characters")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        return ParsedCall(raw, error=f"the tool call is not valid JSON ({str(e)[:80]})")
    if not isinstance(value, dict):
        return ParsedCall(raw, error='a tool call is a JSON object {"name": ..., "arguments": {...}}')
    if "function" in value and isinstance(value["function"], dict) and "name" not in value:
        value = {**value["function"], **{k: v for k, v in value.items() if k != "function"}}
    unknown = sorted(set(value) - _ALLOWED_KEYS)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(raw, error='the tool call has no "name" (a non-empty string)')
    if unknown:
        return ParsedCall(raw, name=name, error=f"unknown keys {unknown} in the tool call: use \"name\" and "
                                                "\"arguments\"")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return ParsedCall(raw, name=name, error="\"arguments\" is a string that is not valid JSON")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ParsedCall(raw, name=name, error='"arguments" must be a JSON object')
    return ParsedCall(raw, name=name, arguments=arguments)


def parse_turn(text: str, max_calls: int = MAX_CALLS) -> ParsedTurn:
    """The calls and the answer of one model turn (see the module doc); never raises."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    calls: list[ParsedCall] = []
    errors: list[str] = []
    outside: list[str] = []  # text outside the call blocks (where answers and stray tags are looked for)
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        body_start = start + len(OPEN)
        close = text.find(CLOSE, body_start)
        following = text.find(OPEN, body_start)
        if close >= 0 and (following < 0 or close < following):
            calls.append(parse_call(text[body_start:close]))
            pos = close + len(CLOSE)
        elif following >= 0:  # the next block starts before this one is closed
            calls.append(ParsedCall(text[body_start:following], error=f"{OPEN} without {CLOSE}"))
            pos = following
        else:  # open at the very end of the turn: accepted (a stop string may have cut the closing tag)
            calls.append(parse_call(text[body_start:]))
            pos = len(text)
            outside.append("")
            break
    rest = "".join(outside)
    if CLOSE in rest:
        errors.append(f"{CLOSE} without {OPEN}")
    for extra in calls[max_calls:]:
        extra.error = extra.error or f"more than {max_calls} tool calls in one turn"
    return ParsedTurn(calls, find_answer(rest), errors)


_ANSWER = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)


def find_answer(text: str) -> str | None:
    """The last `<answer>...</answer>` content (stripped); an answer left open at the end counts."""
    found = _ANSWER.findall(text)
    tail_open = text.rfind(ANSWER_OPEN)
    if tail_open >= 0 and text.find(ANSWER_CLOSE, tail_open) < 0:
        return text[tail_open + len(ANSWER_OPEN):].strip()
    return found[-1].strip() if found else None


# ----------------------------------------------------------------------------------------- formatting


def call_text(name: str, arguments: Mapping[str, Any], compact: bool = False) -> str:
    """A well-formed call block: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen puts the
    JSON on its own line; `compact` writes it on one line without spaces)."""
    if compact:
        return f'{OPEN}{json.dumps({"name": name, "arguments": dict(arguments)}, separators=(",", ":"))}{CLOSE}'
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n{CLOSE}"


def truncate(text: str, limit: int, what: str = "output") -> str:
    """`text` cut to `limit` characters, keeping its head and tail, with a note of how much was cut."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = max(limit - head - 60, 0)
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters of {what} cut ...]\n{text[len(text) - tail:] if tail else ''}"
