"""Incremental stop-string matching (rlvr.rollout.stops) against a full re-decode of the output
after every token, on a byte-level BPE tokenizer with multi-byte characters split across tokens,
fed in chunks of random sizes."""

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlvr.models.tokenizer import Tokenizer
from rlvr.rollout.stops import StopStrings

CORPUS = ["The answer is 42. Ünïcödé wörds — and émojis 🙂🙃 — mix with code: def f(x): return x**2\n",
          "Stop here. <answer>7</answer> then more text; naïve café, 日本語のテキスト, done.\n"] * 20


def _tokenizer() -> Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Tokenizer(tok)


def _full_redecode(tokenizer, output, stops):
    """The definition: after each token, decode everything; the first stop string found ends the
    output at the first token whose prefix's text covers it."""
    for n in range(1, len(output) + 1):
        text = tokenizer.decode(output[:n])
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            index, stop = min(hits)
            keep = next(k for k in range(1, n + 1) if len(tokenizer.decode(output[:k])) >= index + len(stop))
            return stop, keep
    return None


def test_incremental_matches_full_redecode():
    tokenizer = _tokenizer()
    rng = np.random.default_rng(0)
    texts = ["naïve café, 日本語のテキスト, done. The answer is 42.", "émojis 🙂🙃 — mix </answer> with",
             "Ünïcödé wörds <answer>7</answer> then", "no stop in this one at all, é"]
    stop_sets = [["42."], ["🙃"], ["</answer>", "wörds"], ["日本"], ["テキ", "café"], ["zzz"], ["\n", "é"]]
    checked = 0
    for text in texts:
        output = tokenizer.encode(text)
        assert tokenizer.decode(output) == text
        for stops in stop_sets:
            want = _full_redecode(tokenizer, output, stops)
            matcher, got, fed = StopStrings(tokenizer, stops), None, 0
            while got is None and fed < len(output):
                fed = min(fed + int(rng.integers(1, 5)), len(output))
                got = matcher.feed(output[:fed])
            assert got == want, (text, stops)
            checked += want is not None
    assert checked >= 10
