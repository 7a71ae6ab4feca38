"""Rendering conversations and preference pairs into token ids with loss masks.

The loss covers exactly the assistant turns. Spans are found by rendering growing prefixes
of the conversation with the model's own chat template: the text added by assistant turn i
is `render(messages[:i+1])` minus `render(messages[:i], add_generation_prompt=True)`. That
needs a prefix-stable template (ChatML, Llama 3, Qwen2.5 are); a template that rewrites
earlier turns is reported with a clear error instead of a silently wrong mask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlvr.data.packing import Example
from rlvr.models.tokenizer import Tokenizer


def render_text(tokenizer: Tokenizer, messages, tools, add_generation_prompt: bool) -> str:
    """The conversation as the chat template renders it (text, not ids)."""
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


_PROBE = {"name": "probe_fn_x7", "argument": "probe_arg_y3", "result": "probe_result_z5"}


def check_tool_calls(tokenizer: Tokenizer, why: str) -> None:
    """Raises ValueError (naming tokenizer.chat_template and the fix) when the chat template cannot
    render a tool call and its result: a probe call's name, argument and result must all appear in
    the rendered text. `why` says what in the job uses tools."""
    call = {"type": "function", "function": {"name": _PROBE["name"], "arguments": {"q": _PROBE["argument"]}}}
    messages = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": _PROBE["result"]}]
    tools = [{"type": "function", "function": {"name": _PROBE["name"], "description": "probe", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    try:
        text = render_text(tokenizer, messages, tools, True)
        problem = ", ".join(f"the call's {k}" for k, v in _PROBE.items() if v not in text)
    except Exception as e:  # a template may refuse tool messages outright
        problem = f"rendering failed ({type(e).__name__}: {e})"
    if problem:
        raise ValueError(f"tokenizer.chat_template cannot render tool calls ({problem} missing from the rendered "
                         f"text), but {why} uses tools: set tokenizer.chat_template to a template that renders "
                         "tool_calls and tool messages (e.g. 'chatml').")


def uses_tools(record: Mapping[str, Any]) -> bool:
    """A training record with tool schemas or tool calls."""
    return bool(record.get("tools")) or any(m.get("tool_calls") or m.get("role") == "tool"
                                            for m in record.get("messages", ()) if isinstance(m, Mapping))


def assistant_spans(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans of assistant turns."""
    full = render_text(tokenizer, messages, tools, False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render_text(tokenizer, messages[:i], tools, True) if i else ""
        upto = render_text(tokenizer, messages[: i + 1], tools, False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError(
                f"chat template is not prefix-stable at message {i}: rendering a longer "
                "conversation changed earlier text, so assistant tokens cannot be located. "
                "Use a prefix-stable template (tokenizer.path's chat_template) for SFT.")
        spans.append((len(before), len(upto)))
    return full, spans


def render_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[dict] | None = None) -> Example:
    """(token ids, loss mask) with mask 1 exactly on tokens inside assistant turns."""
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError("conversation has no assistant message to train on")
    text, spans = assistant_spans(tokenizer, messages, tools)
    encoding = tokenizer.tok.encode(text, add_special_tokens=False)
    mask = []
    for start, end in encoding.offsets:
        mask.append(int(any(start < s_end and end > s_start for s_start, s_end in spans)))
    return list(encoding.ids), mask


def render_prompt(tokenizer: Tokenizer, prompt: str | Sequence[Mapping[str, Any]]) -> list[int]:
    """A prompt as ids: chat messages get the template's generation prompt; text is as is."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return tokenizer.encode(render_text(tokenizer, prompt, None, True))


def render_completion(tokenizer: Tokenizer, completion: str | Mapping[str, Any]) -> list[int]:
    """A response's ids followed by the end-of-turn token."""
    text = completion if isinstance(completion, str) else completion.get("content", "")
    return tokenizer.encode(text) + [tokenizer.eos_id]


def encode_record(tokenizer: Tokenizer, record: Mapping[str, Any]) -> Example:
    """One training record: {"messages": [...], "tools"?}, {"text"} or {"prompt", "completion"}."""
    if "messages" in record:
        return render_chat(tokenizer, record["messages"], record.get("tools"))
    if "text" in record:
        ids = tokenizer.encode(_as_str(record["text"])) + [tokenizer.eos_id]
        return ids, [1] * len(ids)
    if "prompt" in record and "completion" in record:
        prompt = render_prompt(tokenizer, _as_str(record["prompt"]))
        completion = render_completion(tokenizer, _as_str(record["completion"]))
        return prompt + completion, [0] * len(prompt) + [1] * len(completion)
    raise ValueError(f"record needs 'messages', 'text', or 'prompt' and 'completion'; got keys {sorted(record)}")


def _as_str(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value
