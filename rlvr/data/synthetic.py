"""Small synthetic datasets for learning checks and tiny configs, deterministic by seed.

    python -m rlvr.data.synthetic configs/data   # (re)writes the JSONL files the tiny configs use

- chat SFT: short instructions with one right answer (reverse / uppercase / count letters),
  plus calculator tool-call conversations, in OpenAI message format.
- preferences: a learnable preference. The chosen reply opens politely ("Sure! ...") and
  the rejected reply is curt ("No. ..."), over random topics, so held-out pairs test
  whether the preference generalised rather than being memorised.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}


def random_word(rng: np.random.Generator, low: int = 3, high: int = 6) -> str:
    return "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=int(rng.integers(low, high + 1))))


def chat_example(rng: np.random.Generator) -> dict:
    kind = int(rng.integers(0, 3))
    word = random_word(rng)
    if kind == 0:
        prompt, answer = f"Reverse: {word}", word[::-1]
    elif kind == 1:
        prompt, answer = f"Uppercase: {word}", word.upper()
    else:
        prompt, answer = f"Length of {word}?", str(len(word))
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def tool_example(rng: np.random.Generator) -> dict:
    a, b = (int(x) for x in rng.integers(10, 100, size=2))
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}}
    return {"tools": [CALCULATOR_TOOL], "messages": [
        {"role": "user", "content": f"What is {a}*{b}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]}


def chat_dataset(count: int, seed: int, tool_every: int = 16) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [tool_example(rng) if tool_every and i % tool_every == tool_every - 1 else chat_example(rng)
            for i in range(count)]


def preference_dataset(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        topic = random_word(rng)
        rows.append({
            "prompt": [{"role": "user", "content": f"Tell me about {topic}."}],
            "chosen": f"Sure! {topic} is a fine topic.",
            "rejected": f"No. {topic} is a dull topic.",
        })
    return rows


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_all(directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    write_jsonl(os.path.join(directory, "sft_chat_train.jsonl"), chat_dataset(64, seed=0))
    write_jsonl(os.path.join(directory, "sft_chat_eval.jsonl"), chat_dataset(16, seed=1))
    write_jsonl(os.path.join(directory, "pref_train.jsonl"), preference_dataset(256, seed=0))
    write_jsonl(os.path.join(directory, "pref_eval.jsonl"), preference_dataset(64, seed=1))


if __name__ == "__main__":
    write_all(sys.argv[1] if len(sys.argv) > 1 else "configs/data")
