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
