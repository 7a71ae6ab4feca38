"""SFT data: assistant-only masks checked token by token, deterministic resumable streams, TFDS."""

import json

import numpy as np
import pytest

from rlvr.data.chat import encode_record, render_chat
from rlvr.data.sources import tfds_source
from rlvr.data.stream import TokenStream
from rlvr.models.tokenizer import Tokenizer, byte_level_tokenizer

TOK = byte_level_tokenizer()
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Reverse: abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "And xyz?"},
    {"role": "assistant", "content": "zyx"},
]


def _masked_runs(ids, mask):
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(TOK.decode(current))
            current = []
    if current:
        runs.append(TOK.decode(current))
    return runs


def test_mask_covers_exactly_the_assistant_turns():
    ids, mask = render_chat(TOK, CONVERSATION)
    # The ChatML text, written out by hand: the reference for every token's mask.
    expected_text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nReverse: abc<|im_end|>\n"
                     "<|im_start|>assistant\n" + "cba<|im_end|>\n" + "<|im_start|>user\nAnd xyz?<|im_end|>\n"
                     "<|im_start|>assistant\n" + "zyx<|im_end|>\n")
    assert TOK.decode(ids) == expected_text
    assert _masked_runs(ids, mask) == ["cba<|im_end|>\n", "zyx<|im_end|>\n"]
    # Token by token: mask is 1 exactly for tokens inside the two hand-located spans.
    spans = []
    for answer in ("cba<|im_end|>\n", "zyx<|im_end|>\n"):
        start = expected_text.index(answer, spans[-1][1] if spans else 0)
        spans.append((start, start + len(answer)))
    offsets = TOK.tok.encode(expected_text).offsets
    want = [int(any(s <= a and b <= e for s, e in spans)) for a, b in offsets]
    assert mask == want


def test_tool_calls_are_trained_and_tool_results_are_not():
    tools = [{"type": "function", "function": {"name": "calc", "description": "math",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [
        {"role": "user", "content": "2*21?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"e": "2*21"}}}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "It is 42."},
    ]
    ids, mask = render_chat(TOK, messages, tools)
    runs = _masked_runs(ids, mask)
    assert len(runs) == 2
    assert '"name": "calc"' in runs[0] and runs[0].endswith("</tool_call><|im_end|>\n")
    assert runs[1] == "It is 42.<|im_end|>\n"
    unmasked = TOK.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "<tool_response>\n42\n</tool_response>" in unmasked and "It is 42." not in unmasked


def test_prompt_completion_and_text_records():
    ids, mask = encode_record(TOK, {"prompt": "Q: 1+1=", "completion": "2"})
    assert TOK.decode(ids) == "Q: 1+1=2<|im_end|>" and _masked_runs(ids, mask) == ["2<|im_end|>"]
    ids, mask = encode_record(TOK, {"text": "hello"})
    assert all(mask) and TOK.decode(ids) == "hello<|im_end|>"
    with pytest.raises(ValueError, match="needs 'messages'"):
        encode_record(TOK, {"question": "?"})


def test_template_that_rewrites_history_is_refused():
    # A template that drops earlier assistant turns (as reasoning templates do) is not prefix-stable.
    template = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
                "<{{ m.role }}>{{ m.content }}</s>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = Tokenizer(TOK.tok, template, TOK.special_tokens)
    with pytest.raises(ValueError, match="not prefix-stable"):
        render_chat(tok, CONVERSATION)


def _stream(records, seed=0):
    return TokenStream(records, lambda r: encode_record(TOK, r), batch_size=2, seq_len=64, pad_id=TOK.pad_id,
                       seed=seed)


def test_stream_packs_and_resumes_exactly():
    records = [{"prompt": f"q{i}", "completion": "a" * (i % 5 + 1)} for i in range(30)]
    straight = _stream(records)
    batches = [next(straight) for _ in range(6)]
    assert batches[0]["segment_ids"].max() > 1  # several examples per row
    resumed = _stream(records)
    for _ in range(3):
        next(resumed)
    state = json.loads(json.dumps(resumed.get_state()))  # survives a JSON checkpoint
    fresh = _stream(records)
    fresh.set_state(state)
    for want in batches[3:]:
        got = next(fresh)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_every_record_is_seen_once_per_epoch():
    records = [{"text": chr(ord("a") + i)} for i in range(10)]
    stream = TokenStream(records, lambda r: encode_record(TOK, r), 1, 2, TOK.pad_id, seed=3, pack=False)
    seen = [TOK.decode([next(stream)["tokens"][0, 0]]) for _ in range(20)]
    assert sorted(seen[:10]) == sorted(seen[10:]) == [chr(ord("a") + i) for i in range(10)]
    assert seen[:10] != seen[10:]  # reshuffled per epoch


def test_an_evaluation_stream_counts_every_record_once():
    """Held-out loss: rows stop at the epoch's end (padding after), so no record is weighed twice."""
    records = [{"prompt": f"q{i}", "completion": "a" * (i + 1)} for i in range(5)]
    stream = TokenStream(records, lambda r: encode_record(TOK, r), 2, 64, TOK.pad_id, seed=0, shuffle=False,
                         one_epoch=True)
    target_tokens = 0
    while not stream.exhausted():
        target_tokens += int(next(stream)["loss_mask"].sum())
    assert stream.records_read == len(records)
    assert target_tokens == sum(int(np.sum(encode_record(TOK, r)[1])) for r in records)


def test_tfds_data_source_without_tensorflow(tmp_path):
    import tensorflow_datasets as tfds

    class RlvrChatTest(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"messages": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i in range(6):
                yield i, {"messages": json.dumps(CONVERSATION[:2] + [{"role": "assistant", "content": f"r{i}"}])}

    RlvrChatTest(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    source = tfds_source("rlvr_chat_test", "train", str(tmp_path))
    assert len(source) == 6
    ids, mask = encode_record(TOK, source[0])
    runs = _masked_runs(ids, mask)
    assert len(runs) == 1 and runs[0].startswith("r") and runs[0].endswith("<|im_end|>\n")


def test_grain_map_dataset_is_a_source():
    """A grain pipeline (any MapDataset: len + random access) feeds the same stream."""
    import grain

    records = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(12)]
    dataset = grain.MapDataset.source(records).map(lambda r: {**r, "completion": r["completion"].upper()})
    stream = TokenStream(dataset, lambda r: encode_record(TOK, r), 2, 32, TOK.pad_id, seed=0)
    batch = next(stream)
    text = TOK.decode([t for t, m in zip(batch["tokens"].ravel(), batch["loss_mask"].ravel(), strict=True) if m])
    assert "A" in text and "a" not in text.replace("<|im_end|>", "")


class _ReadLog(list):
    """A record source that notes which records were read."""

    def __init__(self, records):
        super().__init__(records)
        self.read: set[int] = set()

    def __getitem__(self, i):
        self.read.add(i)
        return super().__getitem__(i)


def test_rows_built_apart_are_the_batch_and_read_only_their_own_records():
    """Per-host shards (rlvr.data.shards): two streams each building one row of every batch, as two
    processes do, give one stream's batches, read disjoint records (together what it read), and their
    merged cursors resume it exactly."""
    records = [{"prompt": f"q{i}", "completion": "a" * (i % 7 + 1)} for i in range(200)]
    whole_source = _ReadLog(records)
    whole = TokenStream(whole_source, lambda r: encode_record(TOK, r), 2, 64, TOK.pad_id, seed=0)
    batches = [next(whole) for _ in range(5)]
    sources = [_ReadLog(records), _ReadLog(records)]
    halves = [TokenStream(s, lambda r: encode_record(TOK, r), 2, 64, TOK.pad_id, seed=0) for s in sources]
    for want in batches[:4]:
        for row, half in enumerate(halves):
            got = half.next_rows([row])
            for key in want:
                np.testing.assert_array_equal(got[key][0], want[key][row])
    assert not sources[0].read & sources[1].read and sources[0].read and sources[1].read
    assert sources[0].read | sources[1].read <= whole_source.read
    assert halves[0].records_read + halves[1].records_read == len(sources[0].read | sources[1].read)
    resumed = _stream(records)
    resumed.set_state({"cursors": [halves[0].cursors[0], halves[1].cursors[1]]})
    for key, value in next(resumed).items():
        np.testing.assert_array_equal(value, batches[4][key])
