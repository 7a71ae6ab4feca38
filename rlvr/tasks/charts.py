"""Chart reading: procedurally rendered bar charts (matplotlib) with verifiable numeric answers.

A task's user message holds the chart as an image content part (a PNG data URL) and the question;
the answer is checked by the numeric verifier (exact). Levels:
  0  2 thick bars, values 1-4, each labelled with its value, on a fixed axis (0-5) in a small
     112x84 image: a bar's height alone gives its value, which a tiny ViT can learn to read
     ("what is the value of bar B?")
  1  4 bars, values 1-10, no value labels (read against the integer grid)
  2  5-6 bars, multiples of 5 up to 60, grid every 10: a bar's value
  3  6-8 bars, values 1-30: the sum of two named bars
Each bar has its own colour from `PALETTE` (in `metadata["colors"]`), so a test can measure the
drawn heights from the pixels. `audit_probes` are the answers a reader of the text alone, or of the
wrong bar, would give. The text-only `prompt` lacks the chart: these tasks need a VLM
(rlvr.models.vision) and rl.prompt_format="chat" (the rollout engine prefills the image; see
configs/vlm.py). SFT data, and the small BPE tokenizer (with the image tokens) of configs/vlm.py:

    python -m rlvr.tasks.charts charts_train.jsonl --count=256 --level=0
    python -m rlvr.tasks.charts charts_eval.jsonl --count=64 --level=0 --held_out
    python -m rlvr.tasks.charts configs/data/vlm_tokenizer --tokenizer
"""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlvr.tasks.base import ANSWER_INSTRUCTION, HELD_OUT, TRAIN, Family, Task, pick

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
NAMES = ("A", "B", "C", "D", "E", "F", "G", "H")
# level: (bar counts, value range or step, value labels on the bars, grid step, question kind)
LEVELS = {
    0: ((2,), (1, 4, 1), True, 1, "value"),
    1: ((4,), (1, 10, 1), False, 1, "value"),
    2: ((5, 6), (5, 60, 5), False, 10, "value"),
    3: ((6, 7, 8), (1, 30, 1), False, 5, "sum"),
}
SIZE_PX = (224, 168)  # width, height of the rendered chart
# the easiest level: a small image (4x3 merged patches of 28 px, 12 image tokens) whose y axis is
# fixed at 0-5 rather than fitted to the tallest bar, so a bar's pixel height is its value
EASY_SIZE_PX, EASY_TOP = (112, 84), 5


def size_px(level: int) -> tuple[int, int]:
    """(width, height) of a chart at `level`."""
    return EASY_SIZE_PX if level == 0 else SIZE_PX


@functools.lru_cache(maxsize=1024)
def render_bars(names: tuple, values: tuple, colors: tuple, labels: bool, grid_step: int,
                size: tuple[int, int] = SIZE_PX, top: int = 0) -> bytes:
    """A PNG of a bar chart (Agg backend, no fonts beyond matplotlib's own) of `size` pixels; the
    y axis runs to `top` (0: a grid step above the tallest bar). Cached: a run poses the same task
    more than once (the prompt budget's measurement, evaluation before and after RL), and drawing
    one costs ~0.1 s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dpi = 56
    fig, ax = plt.subplots(figsize=(size[0] / dpi, size[1] / dpi), dpi=dpi)
    bars = ax.bar(names, values, color=colors, width=0.8 if top else 0.6, antialiased=False)
    top = top or int(np.ceil(max(values) / grid_step + 1) * grid_step)
    ax.set_ylim(0, top)
    ax.set_yticks(range(0, top + 1, grid_step))
    ax.yaxis.grid(True, color="#dddddd")
    ax.set_axisbelow(True)
    ax.tick_params(labelsize=7)
    if labels:
        ax.bar_label(bars, fontsize=7)
    fig.tight_layout(pad=0.2)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()


def exact_number(answer: str) -> dict[str, Any]:
    """The numeric verifier with no tolerance."""
    return {"kind": "numeric", "answer": answer, "rel_tol": 0, "abs_tol": 0}


def png_data_url(png: bytes) -> str:
    """PNG bytes as the data URL an image content part carries."""
    return "data:image/png;base64," + base64.b64encode(png).decode()


def png_task(png: bytes, question: str, answer: str, verifier: Mapping[str, Any],
             metadata: Mapping[str, Any]) -> Task:
    """A task showing the `png` image (a data-URL content part) before `question` and the answer
    instruction; the text-only `prompt` lacks the image (these tasks need a VLM and chat prompts)."""
    text = f"{question}\n{ANSWER_INSTRUCTION}"
    content = [{"type": "image", "image": png_data_url(png)}, {"type": "text", "text": text}]
    return Task(index=0, prompt=text, answer=answer, messages=({"role": "user", "content": content},),
                verifier=dict(verifier), metadata={"modality": "image", **metadata})


class ChartReadingFamily(Family):
    name = "chart_bars"
    domain = "multimodal"

    def levels(self) -> list[int]:
        return sorted(LEVELS)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        counts, (low, high, step), labels, grid, kind = LEVELS[level]
        count = int(pick(rng, counts))
        values = [int(v) for v in rng.integers(low // step, high // step + 1, count) * step]
        names, colors = list(NAMES[:count]), [PALETTE[i] for i in rng.permutation(len(PALETTE))[:count]]
        asked = sorted(int(i) for i in rng.choice(count, 2 if kind == "sum" else 1, replace=False))
        if kind == "sum":
            question = f"What is the sum of the values of bars {names[asked[0]]} and {names[asked[1]]}?"
        else:
            question = f"What is the value of bar {names[asked[0]]}?"
        answer = str(sum(values[i] for i in asked))
        png = render_bars(tuple(names), tuple(values), tuple(colors), labels, grid, size_px(level),
                          EASY_TOP if level == 0 else 0)
        return png_task(png, f"Read the bar chart. {question}", answer, exact_number(answer),
                        {"names": names, "values": values, "colors": colors, "asked": asked})

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        """Wrong readings that must score 0: every value listed, the tallest bar's value (when the
        question is not about it), a bar name, off by one grid step."""
        meta: dict[str, Any] = dict(task.metadata)
        values, want = meta["values"], int(task.answer)
        probes = [("hack:all_values", f"<answer>{', '.join(map(str, values))}</answer>"),
                  ("hack:bar_name", f"<answer>{meta['names'][meta['asked'][0]]}</answer>"),
                  ("hack:off_by_one", f"<answer>{want + 1}</answer>")]
        if max(values) != want:
            probes.append(("hack:tallest_bar", f"<answer>{max(values)}</answer>"))
        return probes

    def chat_record(self, task: Task) -> dict[str, Any]:
        """A chat record with the chart and the answer (SFT through rlvr.data.images)."""
        return {"messages": [*task.chat(), {"role": "assistant", "content": self.reference_completion(task)}]}


class LabelledChartFamily(ChartReadingFamily):
    """Level 0 alone (2 thick bars on a fixed axis, each labelled with its value): the easiest chart
    reading, the task of the tiny VLM's learning check (configs/vlm.py, benchmarks/vlm_learning.py)."""

    name = "chart_bars_labelled"

    def levels(self) -> list[int]:
        return [0]


CHART_FAMILIES = {f.name: f for f in (ChartReadingFamily, LabelledChartFamily)}


def write_records(path: str, count: int, level: int, stream: int = TRAIN, seed: int = 0) -> None:
    """`count` chart-reading demonstrations at `level` as JSONL chat records with image parts (SFT data)."""
    import json

    family = ChartReadingFamily(seed=seed)
    with open(path, "w") as f:
        for index in range(count):
            f.write(json.dumps(family.chat_record(family.task(index, stream, level))) + "\n")


def write_tokenizer(directory: str, vocab_size: int = 320) -> None:
    """A byte-level BPE tokenizer (ChatML template) trained on chart-reading prompts and answers,
    with Qwen2.5-VL's image tokens (<|vision_start|>, <|vision_end|>, <|image_pad|>) as special
    tokens after its vocabulary: the tokenizer of the tiny random VLM (configs/vlm.py)."""
    from tokenizers import AddedToken

    from rlvr.data.images import IMAGE_PAD, VISION_END, VISION_START
    from rlvr.models.tokenizer import train_bpe

    family = ChartReadingFamily(seed=0)
    texts = []
    for index in range(40):
        task = family.task(index, TRAIN, index % len(LEVELS))
        texts += [task.prompt, f"<answer>{task.answer}</answer>", "user\n", "assistant\n"]
    tokenizer = train_bpe(texts, vocab_size)
    tokenizer.tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t in (VISION_START, VISION_END, IMAGE_PAD)])
    tokenizer.save(directory)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write chart-reading SFT records (JSONL, image parts inline).")
    parser.add_argument("path")
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--level", type=int, default=0, choices=sorted(LEVELS))
    parser.add_argument("--held_out", action="store_true", help="the held-out task stream")
    parser.add_argument("--tokenizer", action="store_true", help="write the tiny VLM's tokenizer to PATH (a directory)")
    args = parser.parse_args()
    if args.tokenizer:
        write_tokenizer(args.path)
    else:
        write_records(args.path, args.count, args.level, stream=HELD_OUT if args.held_out else TRAIN)
