"""Multi-digit arithmetic with a required answer format: the quickstart's verifiable task.

Prompt `"482+59="`; the only accepted completion is the exact result followed by the end
token (`"541<|im_end|>"`). The verifier is exact string match, so a reward of 1 cannot be
gamed; a wrong number, extra text, or running out of tokens scores 0. `format` (digits only,
terminated) is reported separately and, with `format_weight > 0`, adds a small shaped reward.
"""

from __future__ import annotations

import re

import numpy as np

from rlvr.tasks.base import Family, RewardWeights, Task

OPS = {"add": ("+", lambda a, b: a + b), "sub": ("-", lambda a, b: a - b), "mul": ("*", lambda a, b: a * b)}
_ANSWER = re.compile(r"-?\d+")


class ArithmeticFamily(Family):
    """`a <op> b` with operands of `min_digits`..`max_digits` digits (digit count uniform).

    A raw-format family for completion-style models (no chat template, no answer tag): its
    prompt is the bare expression, which is what the tiny byte-level quickstart model can learn."""

    domain = "arithmetic"
    answer_format = "raw"

    def __init__(self, op: str = "add", min_digits: int = 1, max_digits: int = 3, seed: int = 0,
                 format_weight: float = 0.0, weights: RewardWeights | None = None):
        super().__init__(seed, weights)
        self.name = op
        if op not in OPS:
            raise ValueError(f"rl.task={op!r}: arithmetic ops are {sorted(OPS)}")
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"rl.min_digits={min_digits}, rl.max_digits={max_digits}: need 1 <= min <= max")
        self.op, self.min_digits, self.max_digits, self.seed = op, min_digits, max_digits, seed
        self.format_weight = format_weight

    def levels(self) -> list[int]:
        """Difficulty levels for a curriculum: the operand digit counts."""
        return list(range(self.min_digits, self.max_digits + 1))

    def _operand(self, rng: np.random.Generator, level: int | None = None) -> int:
        digits = int(rng.integers(self.min_digits, self.max_digits + 1)) if level is None else level
        if digits > 18:  # beyond int64: the same uniform draw, digit by digit
            return int("".join(str(d) for d in [rng.integers(1, 10), *rng.integers(0, 10, digits - 1)]))
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return int(rng.integers(low, 10**digits))

    def task(self, index: int, stream: int = 0, level: int | None = None) -> Task:
        """Task `index` of `stream` (0 = training, 1 = held-out, 2 = demonstrations); with `level`,
        both operands have exactly that many digits (a curriculum's difficulty); level None or 0:
        each operand's digit count drawn from the range (such tasks record level 0)."""
        level = level or None
        if level is not None and level not in self.levels():
            raise ValueError(f"arithmetic level {level}: levels are {self.levels()} (rl.min_digits..rl.max_digits)")
        rng = np.random.default_rng([self.seed, stream, index])
        a, b = self._operand(rng, level), self._operand(rng, level)
        symbol, fn = OPS[self.op]
        expression = f"{a}{symbol}{b}="
        return Task(index, expression, str(fn(a, b)), level or 0, family=self.name, stream=stream,
                    verifier={"kind": "exact", "answer": str(fn(a, b))})

    def score(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        """{"reward", "correct", "format", "value"} for the completion text (end token removed).

        correct: exactly the answer (the reward); format: digits only, terminated; value: the
        first number in the text is the answer, whatever the format (a diagnostic that separates
        arithmetic skill from format compliance)."""
        well_formed = not truncated and _ANSWER.fullmatch(completion) is not None
        correct = well_formed and completion == task.answer
        first = _ANSWER.search(completion)
        reward = float(correct) + self.format_weight * float(well_formed)
        return {"reward": reward, "correct": float(correct), "format": float(well_formed),
                "value": float(first is not None and first.group() == task.answer)}

    def demonstration(self, task: Task, off_format: bool = False) -> dict[str, str]:
        """A supervised record for warm-start SFT (the `{"prompt", "completion"}` JSONL form).
        `off_format` writes the answer in a convention the verifier rejects ("541.", as a source
        with a different house style would), to model demonstrations that are right in substance
        but wrong in form."""
        return {"prompt": task.prompt, "completion": task.answer + ("." if off_format else "")}
