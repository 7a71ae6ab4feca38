"""Tokenizers without transformers: `tokenizers` for ids, jinja2 for chat templates.

`Tokenizer` reads a Hugging Face tokenizer directory (tokenizer.json plus the optional
tokenizer_config.json / generation_config.json / config.json / chat_template.jinja) and renders
chat templates exactly as transformers does (same jinja environment, filters and globals), so
prompts built here tokenize to the same ids as in transformers and SGLang.

`byte_level_tokenizer()` builds a deterministic byte tokenizer (one token per byte, ChatML
special tokens and template) for tiny test / quickstart models: no training data, no download.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Qwen2.5-style ChatML with tools (<tools> in the system turn, <tool_call> / <tool_response>).
CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}\n"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}\n"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}\n"
    "{%- elif messages[0].role == 'system' %}\n"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'system' and loop.first %}\n"
    "{%- elif message.role == 'tool' %}\n"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\n"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message.role }}\n"
    "{%- if message.content or not message.tool_calls %}{{- '\\n' + (message.content or '') }}{%- endif %}\n"
    "{%- for call in message.tool_calls or [] %}\n"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}\n"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}\n"
    "{{- call.arguments if call.arguments is string else call.arguments | tojson }}\n"
    "{{- '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

# A tokenizer directory's files: what `Tokenizer.from_dir`, transformers and SGLang read.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")

# Chat templates a config can name (`tokenizer.chat_template="chatml"`), e.g. for a base model without one.
BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE}

_EOS_FALLBACKS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<|end_of_text|>")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some HF templates): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """HF's `tojson`: plain json.dumps (no HTML escaping), non-ASCII kept."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """The template compiled in the same sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def with_system_prompt(template: str | dict[str, str], system_prompt: str) -> str | dict[str, str]:
    """`template` that puts `system_prompt` first when a conversation has no system message of its own.

    The system prompt lives in the template itself, so every renderer (SFT, RL, evaluation, the
    OpenAI endpoint, and transformers or SGLang loading an export) sees the same prompt."""
    if not system_prompt:
        return template
    if isinstance(template, dict):
        return {name: with_system_prompt(t, system_prompt) for name, t in template.items()}
    literal = json.dumps(system_prompt)  # a valid jinja string literal (json escapes, ASCII only)
    return ("{%- if messages and messages[0]['role'] != 'system' %}"
            f"{{%- set messages = [{{'role': 'system', 'content': {literal}}}] + messages %}}"
            "{%- endif %}\n" + template)


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """As transformers: drop None-valued keys; alias `reasoning_content` / `thinking`."""
    out = []
    for message in messages:
        message = {k: v for k, v in dict(message).items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _read_json(directory: str, name: str) -> dict[str, Any]:
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_str(value: Any) -> str | None:
    """A special token from tokenizer_config: a string or a serialised AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value if isinstance(value, int) else None


class Tokenizer:
    """A `tokenizers.Tokenizer` plus special tokens and a chat template."""

    def __init__(self, tok: tokenizers.Tokenizer, chat_template: str | dict[str, str] | None = None,
                 special_tokens: Mapping[str, str | None] | None = None, model_max_length: int | None = None):
        self.tok = tok
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in dict(special_tokens or {}).items() if v is not None}
        self.model_max_length = model_max_length

    # --- loading -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, directory: str) -> Tokenizer:
        """Loads tokenizer.json and the special tokens / chat template stored next to it."""
        tok = tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        tok_cfg = _read_json(directory, "tokenizer_config.json")
        template: str | dict[str, str] | None = tok_cfg.get("chat_template")
        if isinstance(template, list):  # old multi-template form: [{name, template}, ...]
            template = {t["name"]: t["template"] for t in template}
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        special = {k: _token_str(tok_cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        id_sources = (_read_json(directory, "generation_config.json"), _read_json(directory, "config.json"))
        for key in ("bos_token", "eos_token", "pad_token"):
            for source in id_sources:
                token_id = _first_id(source.get(f"{key}_id"))
                if special[key] is None and token_id is not None:
                    special[key] = tok.id_to_token(token_id)
        if special["eos_token"] is None:
            special["eos_token"] = next((t for t in _EOS_FALLBACKS if tok.token_to_id(t) is not None), None)
        return cls(tok, template, special, tok_cfg.get("model_max_length"))

    def with_chat(self, template: str | dict[str, str] | None = None, system_prompt: str = "") -> Tokenizer:
        """A copy with `template` (None: this one's) and `system_prompt` (see `with_system_prompt`)."""
        base = self.chat_template if template is None else template
        if system_prompt and not base:
            raise ValueError("tokenizer.system_prompt needs a chat template, and this tokenizer has none: set "
                             "tokenizer.chat_template (a template, a .jinja file, or 'chatml').")
        chat = with_system_prompt(base, system_prompt) if base else base
        return Tokenizer(self.tok, chat, self.special_tokens, self.model_max_length)

    # --- ids ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added special tokens included (a model's vocab may be larger)."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self.tok.token_to_id(token)

    @property
    def eos_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_id(self) -> int | None:
        """The pad token's id, falling back to eos (as most causal LMs do)."""
        pad = self._special_id("pad_token")
        return self.eos_id if pad is None else pad

    @property
    def bos_id(self) -> int | None:
        return self._special_id("bos_token")

    # --- chat ---------------------------------------------------------------------------

    def _template(self, tools: Any) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            template = template.get("tool_use") if tools and "tool_use" in template else template.get("default")
        if not template:
            raise ValueError("this tokenizer has no chat template (chat_template.jinja or "
                             "tokenizer_config.json's chat_template); pass one to Tokenizer(...).")
        return template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[dict] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs: Any) -> str | list[int]:
        """Renders `messages` like transformers' `apply_chat_template`; ids when `tokenize`.

        `tools` are JSON-schema dicts (transformers also accepts Python functions; we do not).
        Extra `kwargs` (e.g. `enable_thinking=False`) are template variables, as in transformers.
        """
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        documents = kwargs.pop("documents", None)
        variables = {**self.special_tokens, **kwargs}
        text = compile_chat_template(self._template(tools)).render(
            messages=_normalize_messages(messages), tools=list(tools) if tools is not None else None,
            documents=documents, add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text) if tokenize else text

    # --- saving -------------------------------------------------------------------------

    def save(self, directory: str) -> None:
        """tokenizer.json, tokenizer_config.json and chat_template.jinja (transformers loads it)."""
        os.makedirs(directory, exist_ok=True)
        self.tok.save(os.path.join(directory, "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "clean_up_tokenization_spaces": False, **self.special_tokens}
        if self.model_max_length:
            config["model_max_length"] = self.model_max_length
        if isinstance(self.chat_template, str):
            config["chat_template"] = self.chat_template
            with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as f:
                f.write(self.chat_template)
        elif self.chat_template:
            config["chat_template"] = [{"name": k, "template": v} for k, v in self.chat_template.items()]
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)


def write_chat_template(directory: str, template: str) -> None:
    """Makes `template` a tokenizer directory's chat template: chat_template.jinja (which transformers
    prefers) and, when there is one, tokenizer_config.json's copy (read by older transformers)."""
    with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
        values["chat_template"] = template
        with open(path, "w", encoding="utf-8") as f:
            json.dump(values, f, indent=2, ensure_ascii=False)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


BYTE_LEVEL_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_level_tokenizer() -> Tokenizer:
    """One token per byte (ids 0-255 = byte values) + ChatML specials 256-258; ChatML template."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_LEVEL_SPECIAL_TOKENS])
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return Tokenizer(tok, CHATML_TEMPLATE, special, model_max_length=32768)


# GPT-2/Qwen-style pre-tokenizer split: words, single digits, punctuation runs, newlines, spaces.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_bpe(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `texts` (up to `vocab_size` ids, the ChatML specials
    included) with the ChatML template: for models trained from scratch, and realistic test models."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BYTE_LEVEL_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_LEVEL_SPECIAL_TOKENS])
    return Tokenizer(tok, CHATML_TEMPLATE, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                     model_max_length=32768)

