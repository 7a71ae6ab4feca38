"""rlvr.models.tokenizer: the byte-level test tokenizer and chat templates equal to transformers'."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jinja2  # noqa: E402
import pytest  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402

from rlvr.models.tokenizer import CHATML_TEMPLATE, Tokenizer, byte_level_tokenizer, train_bpe  # noqa: E402

TEXTS = ["héllo wörld — ünïcödé 🎉👍🏽 中文", "  leading spaces\n\ttabs\r\nand 'quotes' it's",
         "x = [1, 2, 3]  # code\n", "<|im_start|>user\nhi<|im_end|>\n", ""]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city (°C).",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS = {
    "system_user_assistant": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi — ça va?"},
        {"role": "assistant", "content": "Oui 🎉"},
        {"role": "user", "content": "And now?"},
    ],
    "user_only": [{"role": "user", "content": "2+2?"}],
    "no_system_multi_turn": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": ""},
    ],
    "tool_calls": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Zürich and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "name": "get_weather", "content": "21°C"},
        {"role": "tool", "name": "get_weather", "content": "12°C"},
        {"role": "assistant", "content": "Zürich 21°C, Oslo 12°C."},
    ],
    "tool_call_with_text": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"role": "tool", "content": "{\"temp\": 18}"},
    ],
}


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("byte_tok"))
    byte_level_tokenizer().save(directory)
    return directory


def test_byte_level_round_trip():
    tok = byte_level_tokenizer()
    for text in TEXTS[:3]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))  # one token per byte, id = byte value
        assert tok.decode(ids) == text
    assert tok.vocab_size == 259


def test_byte_level_special_tokens():
    tok = byte_level_tokenizer()
    assert [tok.encode(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [[256], [257], [258]]
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (258, 256, None)
    ids = tok.encode("<|im_start|>hé<|im_end|>")
    assert ids == [257, 104, 195, 169, 258]
    assert tok.decode(ids, skip_special_tokens=True) == "hé"
    reloaded_ids = byte_level_tokenizer().encode("<|im_start|>hé<|im_end|>")
    assert reloaded_ids == ids  # deterministic


def test_save_and_reload(byte_dir):
    tok = Tokenizer.from_dir(byte_dir)
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (258, 256, 259)
    assert tok.chat_template == CHATML_TEMPLATE
    assert set(os.listdir(byte_dir)) >= {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def test_chatml_rendering_golden():
    tok = byte_level_tokenizer()
    text = tok.apply_chat_template(CONVERSATIONS["tool_call_with_text"], tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    tool_json = json.dumps(TOOLS[0], ensure_ascii=False)
    assert text == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{tool_json}\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\nLet me check.\n<tool_call>\n"
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 18}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.mark.hf
@pytest.mark.parametrize("loader", ["auto", "fast_file"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_chat_template_matches_transformers(byte_dir, loader, name, generation_prompt):
    ours = Tokenizer.from_dir(byte_dir)
    if loader == "auto":
        theirs = transformers.AutoTokenizer.from_pretrained(byte_dir)
    else:
        theirs = transformers.PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(byte_dir, "tokenizer.json"), eos_token="<|im_end|>",
            pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE)
    messages = CONVERSATIONS[name]
    tools = TOOLS if name.startswith("tool") else None
    kwargs = dict(tools=tools, add_generation_prompt=generation_prompt)
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ours.apply_chat_template(messages, tokenize=True, **kwargs)
    assert ids == theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert ids.count(257) == text.count("<|im_start|>")


EXOTIC_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'bad' %}{{ raise_exception('bad role: ' + m.role) }}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}/{{ m.reasoning_content }}{% endgeneration %}"
    "{% else %}{{ m | tojson(indent=2, sort_keys=True) }}{% endif %}\n"
    "  {{ eos_token }}\n{% endfor %}{{ strftime_now('%Y') }}|{{ extra_var | default('none') }}"
)


@pytest.mark.hf
def test_template_environment_matches_transformers(tmp_path):
    """bos/eos variables, raise_exception, tojson options, loop controls, generation tags, kwargs."""
    base = byte_level_tokenizer()
    ours = Tokenizer(base.tok, EXOTIC_TEMPLATE, {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    ours.save(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "<b>é</b>"}, {"role": "assistant", "content": "ok", "thinking": "hm"},
                {"role": "user", "content": "x", "name": None}, {"role": "user", "content": "dropped"}]
    for kwargs in ({}, {"extra_var": "E"}):
        text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
        assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
    assert "<b>é</b>" in text and "ok/hm" in text and "dropped" not in text and '"name"' not in text
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        ours.apply_chat_template([{"role": "bad", "content": ""}], tokenize=False)


def _train_bpe() -> tokenizers.Tokenizer:
    corpus = [open(transformers.__file__, encoding="utf-8").read(), *TEXTS] * 3
    return train_bpe(corpus, 400).tok


@pytest.mark.hf
def test_loads_tokenizer_saved_by_transformers(tmp_path):
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE)
    theirs.save_pretrained(tmp_path)
    ours = Tokenizer.from_dir(str(tmp_path))
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False) == reloaded.encode(
            text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == text
    assert (ours.eos_id, ours.pad_id) == (theirs.eos_token_id, theirs.pad_token_id)
    assert ours.vocab_size == len(theirs)
    messages = CONVERSATIONS["tool_calls"]
    assert ours.apply_chat_template(messages, tools=TOOLS) == reloaded.apply_chat_template(
        messages, tools=TOOLS, return_dict=False)


def test_special_ids_fall_back_to_generation_and_model_config(tmp_path):
    byte_level_tokenizer().tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 258]}))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 256}))
    tok = Tokenizer.from_dir(str(tmp_path))
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (257, 256, 257)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.hf
def test_a_system_prompt_in_the_template_renders_the_same_in_transformers(tmp_path):
    system = 'Answer in "one" line.\nÜbung macht den Meister.'
    ours = byte_level_tokenizer().with_chat(system_prompt=system)
    ours.save(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for name, messages in CONVERSATIONS.items():
        explicit = messages if messages[0]["role"] == "system" else [{"role": "system", "content": system}, *messages]
        expected = byte_level_tokenizer().apply_chat_template(explicit, tools=TOOLS, add_generation_prompt=True,
                                                              tokenize=False)
        rendered = ours.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert rendered == expected == theirs.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                                                  tokenize=False), name
