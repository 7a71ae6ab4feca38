"""What each token id stands for in bytes: for constrained decoding and lossless log-prob texts.

Byte-level BPE vocabularies (GPT-2, Qwen, Llama 3) spell bytes with GPT-2's printable alphabet;
SentencePiece-style ones (Llama 2, Mistral) write a space as "▁" and fall back to "<0xAB>" byte
tokens. Special tokens stand for no text (None). The table is built once per tokenizer.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

from rlvr.models.tokenizer import bytes_to_unicode

_CACHE: weakref.WeakKeyDictionary[Any, list[bytes | None]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_BYTE_OF = {char: byte for byte, char in bytes_to_unicode().items()}


def _decoder_types(spec: dict[str, Any] | None) -> set[str]:
    if not spec:
        return set()
    found = {spec.get("type", "")}
    for inner in spec.get("decoders") or ():
        found |= _decoder_types(inner)
    return found


def _piece_bytes(piece: str, byte_level: bool) -> bytes | None:
    if byte_level:
        if all(ch in _BYTE_OF for ch in piece):
            return bytes(_BYTE_OF[ch] for ch in piece)
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    return piece.replace("\u2581", " ").encode("utf-8")


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """bytes per id for ids [0, tokenizer.vocab_size); None for special tokens."""
    with _LOCK:
        cached = _CACHE.get(tokenizer)
    if cached is not None:
        return cached
    tok = tokenizer.tok
    spec = json.loads(tok.to_str())
    byte_level = "ByteLevel" in _decoder_types(spec.get("decoder"))
    added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    table: list[bytes | None] = []
    for token_id in range(tokenizer.vocab_size):
        piece = tok.id_to_token(token_id)
        if piece is None or added.get(piece):
            table.append(None)
        elif piece in added:  # a non-special added token: its text as written
            table.append(piece.encode("utf-8"))
        else:
            table.append(_piece_bytes(piece, byte_level))
    with _LOCK:
        _CACHE[tokenizer] = table
    return table


def token_text(tokenizer: Any, token_id: int) -> str:
    """The token's text; a fragment of a multi-byte character (which decodes to U+FFFD) is shown
    with one latin-1 character per raw byte instead, so distinct tokens keep distinct texts."""
    if tokenizer is None:
        return str(token_id)
    text = tokenizer.decode([token_id])
    if "\ufffd" in text:
        table = token_bytes(tokenizer)
        raw = table[token_id] if 0 <= token_id < len(table) else None
        if raw is not None:
            return raw.decode("latin-1")
    return text
