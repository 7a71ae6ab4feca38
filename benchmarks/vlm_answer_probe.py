"""What RL did to a VLM run's answers: the trainer's probability of each answer value on every
held-out chart, under the run's SFT warm start and under its RL checkpoint.

    .venv/bin/python benchmarks/vlm_answer_probe.py RUN_DIR [RUN_DIR ...] [--out FILE]

RUN_DIR: a kept run of configs/vlm.py (benchmarks/vlm_learning.py --root DIR: DIR/vlm_full_s0, ...),
holding sft/ and checkpoints/. For each: greedy accuracy (the argmax over the answer values, as the
held-out evaluation's greedy decoding picks, given the format tokens), the mean probability of the
right value, how many greedy answers RL changed, how many distinct answer distributions the 128
charts give (a collapsed encoder gives a few), the median top-1/top-2 log-prob margin, and how often
each value is the greedy answer (a drift of the answer prior shows there), and RL's gain in greedy
accuracy and in the probability of the right value with its paired standard error (points; the
same charts before and after). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402
from rlvr.kernels.chunked_logprob.reference import RAW_POLICY  # noqa: E402

from rlvr import api  # noqa: E402
from rlvr.models.vision import batch_images  # noqa: E402
from rlvr.rl.batching import Sample, build_batch  # noqa: E402
from rlvr.rl.producer import prompt_ids, task_images  # noqa: E402
from rlvr.rl.update import logprobs_pass  # noqa: E402
from rlvr.tasks import build_tasks  # noqa: E402

VALUES = ("1", "2", "3", "4")  # chart_bars_labelled's values


def value_logprobs(model, tokenizer, tasks, seq_len: int) -> np.ndarray:
    """[tasks, values] log-prob of the value token after `<answer>` (the format the SFT taught)."""
    samples = []
    for t in tasks:
        ids = prompt_ids(tokenizer, t, "chat", model.cfg.vision)
        for v in VALUES:
            out = tokenizer.encode(f"<answer>{v}</answer>")
            samples.append(Sample(0, t.index, ids, out, [0.0] * len(out), [0] * len(out), False, {},
                                  images=task_images(t)))
    b = build_batch(samples, seq_len, 0, vision=model.cfg.vision)
    lp = jax.jit(lambda p, *a: logprobs_pass(model.cfg, RAW_POLICY, 0, p, *a))(
        model.params, b["tokens"], b["positions"], b["segment_ids"], batch_images(b))
    at = len(tokenizer.encode("<answer>"))
    lp = np.asarray(lp)
    return np.array([lp[i, len(s.prompt_ids) + at] for i, s in enumerate(samples)]).reshape(len(tasks), len(VALUES))


def figures(lp: np.ndarray, answers: np.ndarray) -> dict:
    top2 = np.sort(lp, axis=1)[:, -2:]
    return {"greedy_accuracy": round(float(np.mean(lp.argmax(1) == answers)), 4),
            "p_correct": round(float(np.exp(lp[np.arange(len(answers)), answers]).mean()), 4),
            "distinct_distributions": len({tuple(np.exp(row).round(3)) for row in lp}),
            "median_top_margin": round(float(np.median(top2[:, 1] - top2[:, 0])), 3),
            "greedy_value_counts": np.bincount(lp.argmax(1), minlength=len(VALUES)).tolist()}


def paired_gain(before: np.ndarray, after: np.ndarray) -> list[float]:
    """[gain, standard error] in points of a per-chart score (0/1 or a probability) on the same charts:
    the SE of the mean per-chart difference, so chart-to-chart spread common to both cancels."""
    diff = 100 * (np.asarray(after, float) - np.asarray(before, float))
    return [round(float(diff.mean()), 2), round(float(diff.std(ddof=1) / np.sqrt(len(diff))), 2)]


def probe(workdir: str) -> dict:
    config = api.load_run_config(workdir)
    tokenizer = api.build_tokenizer(config)
    held = build_tasks(config.rl, config.seed).held_out(config.rl.eval_examples)
    answers = np.array([VALUES.index(t.answer) for t in held])
    sft, rl = (value_logprobs(api.load_trained(d), tokenizer, held, config.rl.seq_len)
               for d in (os.path.join(workdir, "sft"), workdir))
    rows = np.arange(len(answers))
    return {"run": workdir, "seed": config.seed, "charts": len(held), "sft": figures(sft, answers),
            "rl": figures(rl, answers), "greedy_answers_changed": int(np.sum(sft.argmax(1) != rl.argmax(1))),
            "greedy_gain_se": paired_gain(sft.argmax(1) == answers, rl.argmax(1) == answers),
            "p_correct_gain_se": paired_gain(np.exp(sft[rows, answers]), np.exp(rl[rows, answers])),
            "mean_abs_logprob_change": round(float(np.abs(rl - sft).mean()), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    record = {"benchmark": "vlm_answer_probe", "date": datetime.date.today().isoformat(),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs (shared)",
              "command": " ".join([".venv/bin/python benchmarks/vlm_answer_probe.py", *(argv or sys.argv[1:])]),
              "runs": [probe(r) for r in args.runs]}
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
