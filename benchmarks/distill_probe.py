"""Where a teacher differs from its student, token by token: why distillation helps or not on the quickstart.

    .venv/bin/python benchmarks/distill_probe.py --teacher workdirs/issue22/eval_every10_s0 \
        --student workdirs/issue22/sft_s0 [--problems 200] [--out benchmarks/results/distill_probe.json]

For `--problems` random additions of two numbers below 100 ("48+7="), both models score two fixed
answers through the same path on-policy distillation uses for the teacher (`rlvr.rl.update.
reference_logprobs_fn`, temperature 1): the right answer then the end token ("55<|im_end|>"), and the
right answer in the off-format house style ("55.<|im_end|>"). Prints one JSON line per model: the mean
log-prob per digit of the right answer, of the end token after it, and of the "." after it. The
quickstart's RL teacher differs from its SFT student in the format token, not in the digits.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import jax
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

from rlvr import api, sharding  # noqa: E402
from rlvr.rl.batching import Sample  # noqa: E402
from rlvr.rl.objective import Sampling  # noqa: E402
from rlvr.rl.update import reference_logprobs_fn  # noqa: E402


def answers(tokenizer, problems: int, seed: int = 5) -> list[Sample]:
    """Per problem two samples: the right answer + end token, and the right answer + "." + end token."""
    rng, rows = np.random.default_rng(seed), []
    for _ in range(problems):
        a, b = (int(x) for x in rng.integers(0, 100, 2))
        prompt = tokenizer.encode(f"{a}+{b}=")
        for text in (str(a + b), f"{a + b}."):
            out = tokenizer.encode(text) + [tokenizer.eos_id]
            rows.append(Sample(0, 0, prompt, out, [0.0] * len(out), [0] * len(out), False, {}))
    return rows


def probe(path: str, rows: list[Sample], tokenizer, mesh) -> dict:
    cfg, params = api.load_teacher(path, mesh, tokenizer.vocab_size, "--teacher/--student")
    logp = reference_logprobs_fn(cfg, params, 16, tokenizer.pad_id, Sampling(1.0, -1, 1.0, 0.0))(rows)
    right, dotted = logp[0::2], logp[1::2]
    return {"workdir": path, "logp_per_right_digit": round(float(np.mean([x[:-1].mean() for x in right])), 4),
            "logp_end_after_answer": round(float(np.mean([x[-1] for x in right])), 4),
            "logp_dot_after_answer": round(float(np.mean([x[-2] for x in dotted])), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    tokenizer = api.load_trained(args.teacher).tokenizer
    rows = answers(tokenizer, args.problems)
    record = {"benchmark": "distill_probe", "date": datetime.date.today().isoformat(),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs (shared)",
              "command": " ".join([".venv/bin/python benchmarks/distill_probe.py", *(argv or sys.argv[1:])]),
              "problems": args.problems, "teacher": probe(args.teacher, rows, tokenizer, mesh),
              "student": probe(args.student, rows, tokenizer, mesh)}
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
