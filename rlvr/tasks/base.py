"""The task-family interface: `(rng, difficulty) -> Task`, and a layered, component-wise reward.

A family turns a random generator and a difficulty level into a `Task`: the prompt (as chat
messages and as raw text), a reference answer when one exists, a verifier spec (a plain dict:
`{"kind": "exact" | "numeric" | "math" | "json_schema" | "code" | "tool_state" | ..., **params}`)
and metadata. rlvr owns the seeds: `Family.task(index, stream, level)` derives the generator
from `(seed, stream, family name, index)`, so a run's data position is one integer per stream
and a task can be re-posed exactly from `(family, index, stream, level)`.

Scoring is layered. `Family.verify` returns reward components in [0, 1] (or a penalty <= 0):

  terminal  the task is solved (the verifier's verdict; partial credit allowed)
  format    the answer is where and how the family asks for it (e.g. inside <answer></answer>)
  process   intermediate credit a family can give (e.g. the code compiles, some tests pass)
  safety    a penalty (<= 0) for forbidden behaviour a verifier detected

`Family.score` adds `reward = Σ weight · component` with `RewardWeights`, plus `correct`
(terminal >= pass_threshold), which is what pass rates and curricula count. A verifier that
crashes or times out raises; the RL producer records the failure instead of dying.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

TRAIN, HELD_OUT, DEMONSTRATIONS = 0, 1, 2  # task streams

ANSWER_INSTRUCTION = "Give your final answer inside <answer></answer> tags."
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Task:
    index: int  # position in its stream: the data cursor of a run
    prompt: str  # raw text a completion-style model sees (the user message plus the instruction)
    answer: str | None  # a reference answer; None when any verified solution counts (see metadata)
    level: int = 0  # difficulty level it was drawn at
    family: str = ""
    messages: tuple[Mapping[str, str], ...] = ()  # chat form; () means one user message with `prompt`
    verifier: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    stream: int = TRAIN

    def chat(self) -> list[dict[str, str]]:
        """The prompt as chat messages (for models with a chat template)."""
        return [dict(m) for m in self.messages] or [{"role": "user", "content": self.prompt}]

    def to_json(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["messages"] = [dict(m) for m in self.messages]
        return values

    @classmethod
    def from_json(cls, values: Mapping[str, Any]) -> Task:
        values = dict(values)
        values["messages"] = tuple(values.get("messages", ()))
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class RewardWeights:
    """reward = terminal·t + format·f + process·p + safety·s (components as returned by verify)."""

    terminal: float = 1.0
    format: float = 0.0
    process: float = 0.0
    safety: float = 1.0
    pass_threshold: float = 1.0  # terminal at or above this counts as solved ("correct")

    def combine(self, components: Mapping[str, float]) -> dict[str, float]:
        out = dict(components)
        out["reward"] = sum(getattr(self, k) * float(components.get(k, 0.0))
                            for k in ("terminal", "format", "process", "safety"))
        out["correct"] = float(components.get("terminal", 0.0) >= self.pass_threshold - 1e-9)
        return out


def extract_answer(text: str) -> str | None:
    """The content of the last <answer>…</answer> tag (stripped), or None without one."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def stable_hash(name: str) -> int:
    """A process-independent 32-bit hash (Python's `hash` of a str is salted per process)."""
    return zlib.crc32(name.encode())


def chat_messages(question: str, system: str | None = None) -> tuple[dict[str, str], ...]:
    messages = [{"role": "system", "content": system}] if system else []
    return (*messages, {"role": "user", "content": question})


class Family:
    """Base class of task families. Subclasses set `name`, `domain` and implement `sample`
    (and `verify` unless the default — the answer tag checked by the verifier spec — fits).

    `levels()` are the difficulty levels a curriculum moves through (0 = easiest)."""

    name: str = ""
    domain: str = ""
    answer_format: str = "tag"  # "tag": the answer goes in <answer></answer>; "raw": the whole completion

    def __init__(self, seed: int = 0, weights: RewardWeights | None = None):
        self.seed = seed
        self.weights = weights or RewardWeights()

    def levels(self) -> list[int]:
        return [0]

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        """A task drawn with `rng` at difficulty `level` (its `index` is set by `task`)."""
        raise NotImplementedError

    def task(self, index: int, stream: int = TRAIN, level: int | None = None) -> Task:
        """Task `index` of `stream` at `level` (None: a level drawn uniformly from `levels()`)."""
        levels = self.levels()
        if level is not None and level not in levels:
            raise ValueError(f"task family {self.name!r}: level {level} not in its levels {levels}")
        rng = np.random.default_rng([self.seed, stream, stable_hash(self.name), index])
        if level is None:
            level = int(levels[int(rng.integers(len(levels)))])
        task = self.sample_stream(rng, level, stream)
        return dataclasses.replace(task, index=index, level=level, family=self.name, stream=stream)

    def sample_stream(self, rng: np.random.Generator, level: int, stream: int) -> Task:
        """`sample` for a given stream: dataset families override it to draw held-out tasks from
        their held-out split; procedural families ignore the stream (the seed separates them)."""
        return self.sample(rng, level)

    def tasks(self, start: int, count: int, stream: int = TRAIN) -> list[Task]:
        return [self.task(i, stream) for i in range(start, start + count)]

    def answer_text(self, completion: str) -> str | None:
        """The part of the completion the verifier judges (None: no answer given)."""
        return extract_answer(completion) if self.answer_format == "tag" else completion.strip()

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        """Reward components (see module doc). Default: the verifier spec on the extracted answer."""
        from rlvr.tasks.verifiers import run_verifier

        answer = self.answer_text(completion)
        if answer is None or truncated:
            return {"terminal": 0.0, "format": 0.0}
        return {"terminal": run_verifier(task.verifier, answer), "format": 1.0}

    def score(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        """`verify`'s components plus `reward` (weighted sum) and `correct` (solved or not)."""
        return self.weights.combine(self.verify(task, completion, truncated))

    def reference_completion(self, task: Task) -> str | None:
        """A completion that must score full reward (the self-check); None if the family has none."""
        if task.answer is None:
            return None
        return f"<answer>{task.answer}</answer>" if self.answer_format == "tag" else task.answer

    # --- hooks of the verifier audit (rlvr.tasks.audit) ---

    def audit_allowed(self) -> dict[str, str]:
        """Audit probe kinds this family rightly scores correct, with the reason (reported as
        allowed, not as false positives). Default: none."""
        return {}

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        """Family-specific known exploits, as (probe kind, completion), that the audit checks score below
        full (the code families: a slice of rlvr.tasks.code_hacks per task)."""
        return []

    def demonstration(self, task: Task, off_format: bool = False) -> dict[str, str]:
        """A supervised record (`{"prompt", "completion"}`) for warm-start SFT."""
        completion = self.reference_completion(task)
        if completion is None:
            raise ValueError(f"task family {self.name!r} has no reference answers to demonstrate")
        return {"prompt": task.prompt, "completion": completion}


def uniform_levels(count: int) -> list[int]:
    return list(range(count))


def pick(rng: np.random.Generator, items: Sequence[Any]) -> Any:
    return items[int(rng.integers(len(items)))]
