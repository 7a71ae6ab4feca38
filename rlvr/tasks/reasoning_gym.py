"""Reasoning Gym (`pip install -e .[data]`) as task families: one family per generator, `rg/<name>`.

`ReasoningGymFamily(name)` wraps one reasoning-gym dataset. rlvr owns the seeds: each difficulty
level has its own dataset, built with `create_dataset(name, seed=<from the family seed and level>,
size=<large>, **config)` and cached, and `sample` picks the item index with rlvr's generator, so a
task is re-posed exactly from `(family, index, stream, level)`. `verify` fetches the same item
again (an LRU cache avoids regenerating slow ones) and scores the last <answer> tag with the
dataset's own `score_answer` — or with a stricter replacement from `FIXES`.

Levels are reasoning-gym's curriculum global levels (`set_global_level`, INCLUSIVE ranges: level k
mixes levels 0..k of every attribute, reasoning-gym's default); the count is the longest attribute
level list. `LEVEL_RANGE`, `CONFIG_PATCHES` and `SIZES` repair curricula whose configs fail to
validate, hang or are too slow (measured in the verifier audit, `python -m rlvr.tasks.audit`).

What the audit found (see `python -m rlvr.tasks.audit --families='rg/*' --unfixed`) and the remedies:
  * `FIXES`: verifiers that accept wrong answers as correct, parse the answer out of arbitrary
    text, or run the model's text as code (`eval`, `sympy.parse_expr`) get a stricter scorer.
  * Partial credit: reasoning-gym pays for wrong answers — 0.01/0.05 for well-formed ones, and
    len(oracle)/len(answer) (often > 0.5) when the right answer is a substring of a longer one, so
    hedging pays. A score below 1 is capped at `partial_cap` (0.1); `correct` needs terminal == 1.
  * A scorer that raises on a model's answer is a verifier error (`ScorerError`: the RL producer
    records it as a failure with `verifier_error` 1 and does not train on it; the audit reports it),
    not a 0: malformed answers are scored 0 by a `FIXES` format gate before the scorer sees them.
  * `EXCLUDED`: families that cannot be self-checked or whose reward is trivially hackable; they
    are left out of `FAMILIES`.
  * Self-check: `sample` only serves items whose reference answer scores 1 (`skipped` counts the
    rest), and `REFERENCES` builds a known-valid solution for the families without a single
    answer (`answer` None), so those are self-checked too.
`ReasoningGymFamily(name, fixes=False)` is reasoning-gym's own verifier, untouched (for the audit).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import functools
import io
import json
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction
from typing import Any

import numpy as np

from rlvr.sandbox import pyast
from rlvr.tasks.base import ANSWER_INSTRUCTION, Family, RewardWeights, Task, chat_messages, extract_answer, stable_hash

try:
    from reasoning_gym.factory import DATASETS, create_curriculum, create_dataset, has_curriculum
    from reasoning_gym.utils import SYSTEM_PROMPTS

    AVAILABLE, IMPORT_ERROR = True, ""
except ImportError as error:  # the optional `data` extra is not installed
    DATASETS, SYSTEM_PROMPTS = {}, {"default": ""}
    AVAILABLE, IMPORT_ERROR = False, str(error)

INSTALL_HINT = "reasoning-gym task families need the data extra: pip install -e .[data]"
DEFAULT_SIZE = 10**9  # most generators are random access in (seed, index) and ignore the size
SIZES = {  # generators that precompute or validate per item of `size`
    "acre": 5_000,  # builds every item up front (10**6 items: 4 minutes)
    "gsm_symbolic": 10**6, "list_functions": 10**6,  # draw `size` template indices up front
    "word_ladder": 20_000,  # refuses larger sizes
}
LEVEL_RANGE = {  # (first, last) reasoning-gym global level used; default all of them
    "sokoban": (1, 13),  # level 0 (6x6 board, 4-10 boxes) hangs in generation
    "jugs": (0, 1),  # level 2 takes ~5 s per item, level 3 never finishes
    "zebra_puzzles": (0, 4),  # level 5 (7 people) takes > 5 s per item
    "rubiks_cube": (0, 3),  # level 4 (7x7) fails validation; see CONFIG_PATCHES too
}
CONFIG_PATCHES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    # the curriculum starts at 4 nodes, the config requires >= 6
    "knight_swap": lambda c: {**c, "min_nodes": max(6, c["min_nodes"]), "max_nodes": max(6, c["max_nodes"])},
    "caesar_cipher": lambda c: {**c, "max_rotation": min(25, c["max_rotation"])},  # levels 2-3 ask for 50
    "survo": lambda c: {**c, "max_empty": min(c["max_empty"], (c["min_board_size"] - 1) ** 2)},
    "modulo_grid": lambda c: {**c, "max_target": max(1, c["max_target"])},  # level 1 asks for 0
    # the scorer cannot parse the layer moves ("2Rw") of bigger cubes: keep 3x3, levels scale scrambles
    "rubiks_cube": lambda c: {**c, "cube_size": 3},
}
NOISY = {"bf", "codeio", "tower_of_hanoi"}  # generators or scorers that print to stdout
MAX_TRIES = 20  # items tried per sample (some generators fail on some indices)


# --- stricter scorers (FIXES) -----------------------------------------------------------------------

Scorer = Callable[[str, Mapping[str, Any]], float]

_ELEMENTARY = frozenset({"sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "exp", "log",
                         "sqrt", "pi", "E"})
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)


def safe_expression(text: str, names: frozenset[str] = frozenset(), functions: frozenset[str] = frozenset(),
                    max_exponent: int = 1000, max_length: int = 20_000) -> bool:
    """Whether `text` is a plain arithmetic expression over `names` and calls of `functions`.

    Reasoning-gym hands the model's answer to `eval` or `sympy.parse_expr` (which evals): this gate
    admits numbers, + - * / **, parentheses and the listed names only — no attributes, strings,
    subscripts or other calls — and small literal exponents not stacked on numeric powers, so
    neither code nor a 10**10**10 can reach the evaluator."""
    if len(text) > max_length or "__" in text:
        return False
    try:
        tree = pyast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return False
    return _safe_node(tree.body, names, functions, max_exponent)


def _safe_node(node: ast.AST, names: frozenset[str], functions: frozenset[str], max_exponent: int) -> bool:
    def ok(child: ast.AST) -> bool:
        return _safe_node(child, names, functions, max_exponent)

    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float) and len(repr(node.value)) <= 400
    if isinstance(node, ast.Name):
        return node.id in names or node.id in functions
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.UAdd, ast.USub)) and ok(node.operand)
    if isinstance(node, ast.Call):
        return (isinstance(node.func, ast.Name) and node.func.id in functions and not node.keywords
                and len(node.args) == 1 and ok(node.args[0]))
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS):
        if isinstance(node.op, ast.Pow) and not _small_exponent(node, max_exponent):
            return False
        return ok(node.left) and ok(node.right)
    return False


def _small_exponent(node: ast.BinOp, max_exponent: int) -> bool:
    """x ** e with e a literal (or literal fraction) of size <= max_exponent, or a symbol; a numeric
    base must not itself hold a power (towers)."""
    exponent = node.right
    if isinstance(exponent, ast.UnaryOp):
        exponent = exponent.operand
    if isinstance(exponent, ast.BinOp) and isinstance(exponent.op, ast.Div):
        parts = [exponent.left, exponent.right]
    else:
        parts = [exponent]
    parts = [p.operand if isinstance(p, ast.UnaryOp) else p for p in parts]
    if isinstance(exponent, ast.Name):
        literal = True
    else:
        literal = all(isinstance(p, ast.Constant) and isinstance(p.value, (int, float))
                      and abs(p.value) <= max_exponent for p in parts)
    numeric_base = not any(isinstance(n, ast.Name) for n in ast.walk(node.left))
    tower = numeric_base and any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow) for n in ast.walk(node.left))
    return literal and not tower


def arithmetic_value(text: str) -> tuple[Fraction, list[int]] | None:
    """The exact value of an arithmetic expression (+ - * / and parentheses over integers) and the
    integers it uses, or None when it is anything else (or divides by zero)."""
    if not safe_expression(text) or "**" in text:
        return None
    numbers: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if isinstance(node.op, ast.Div):
                return left / right
        raise ValueError("not integer arithmetic")

    try:
        return value(pyast.parse(text.strip(), mode="eval").body), numbers
    except (ValueError, ZeroDivisionError):
        return None


def _exact(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
    """Exact match (ends stripped) only: replaces scorers that `eval` the answer for partial credit."""
    return float(answer.strip() == str(entry["answer"]).strip())


def _bool_answer(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
    """True/False compared after normalisation (reasoning-gym compares `bool(str)`: any text passes)."""
    return float(answer.strip().strip(".").lower() == str(entry["answer"]).strip().lower())


def _n_queens(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
    """One of the valid boards, verbatim (reasoning-gym `eval`s other answers)."""
    return float(answer in entry["metadata"]["valid_answers"])


def _puzzle24(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
    """Exactly 24 from exactly the puzzle's four numbers (reasoning-gym accepts any four in-range
    numbers, truncates the value to an int and parses with sympy)."""
    parsed = arithmetic_value(answer)
    if parsed is None:
        return 0.0
    total, used = parsed
    return float(total == 24 and sorted(used) == sorted(entry["metadata"]["numbers"]))


def _countdown(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
    """The target exactly, from exactly the given numbers, without sympy."""
    parsed = arithmetic_value(answer)
    if parsed is None:
        return 0.0
    total, used = parsed
    metadata = entry["metadata"]
    return float(total == metadata["target"] and sorted(used) == sorted(metadata["numbers"]))


def _integration(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
    """Reasoning-gym's sympy check, for plain expressions in the variable, C and elementary
    functions only (no code, no `integrate(...)`/`Integral(...)` left for sympy to solve)."""
    names = frozenset({entry["metadata"]["variable"], "C"})
    return original(answer, entry) if safe_expression(answer, names, _ELEMENTARY) else 0.0


def _polynomial(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
    """Reasoning-gym's sympy comparison, for plain polynomial expressions only (no `expand(...)`)."""
    names = frozenset(re.findall(r"[A-Za-z_]\w*", str(entry["answer"]))) | {"x", "y", "z"}
    return original(answer, entry) if safe_expression(answer, names) else 0.0


def _coin_flip(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
    """Full credit only within 1e-4 of the probability (reasoning-gym's prefix-match partial
    credit gives 1.0 to "1.4" when the answer is "1")."""
    try:
        close = abs(float(Fraction(answer.replace(",", ""))) - float(Fraction(str(entry["answer"])))) <= 1e-4
    except (ValueError, ZeroDivisionError):
        return 0.0
    return 1.0 if close else min(original(answer, entry), 0.99)


def _word_sorting(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
    """The sorted list exactly (reasoning-gym gives 1.0 when extra words follow the right ones)."""
    words = [word.strip() for word in re.split(r",\s*", answer)]
    return float(words == entry["metadata"]["sorted_words"])


def _same_text(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
    """The answer text exactly, case aside: reasoning-gym's per-word or per-letter credit adds up
    to 1.0 for the right answer followed by anything (letter_jumble, spell_backward — there through
    float rounding of 9 × 1/9)."""
    return float(answer.strip().lower() == str(entry["answer"]).strip().lower())


def _figlet(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
    """The word exactly, case and spaces aside (reasoning-gym gives 0.1 a matching letter, capped at
    1.0: a 10-letter word followed by anything scores 1)."""
    return float(answer.replace(" ", "").strip().lower() == str(entry["answer"]).strip().lower())


def _format(pattern: str, why: str) -> Callable[[str, Mapping[str, Any], Scorer], float]:
    """Reasoning-gym's score, for answers in the format the question asks for only: its parser
    would find the answer inside arbitrary text (`why`)."""
    regex = re.compile(pattern, re.IGNORECASE)

    def fix(answer: str, entry: Mapping[str, Any], original: Scorer) -> float:
        return original(answer, entry) if regex.fullmatch(answer.strip()) else 0.0

    fix.__doc__ = f"Only answers matching {pattern!r}: {why}."
    return fix


_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)"
_ROLE = r"[A-Za-z]+ is an? [A-Za-z]+"
FIXES: dict[str, Callable[[str, Mapping[str, Any], Scorer], float]] = {
    "game_of_life_halting": _bool_answer,  # bool("False") is True: every non-empty answer scored 1
    "string_insertion": _exact, "spiral_matrix": _exact, "binary_matrix": _exact,  # eval(answer)
    "n_queens": _n_queens,  # eval(answer)
    "puzzle24": _puzzle24, "countdown": _countdown,  # parse_expr(answer); puzzle24 ignores the numbers
    "simple_integration": _integration, "intermediate_integration": _integration,  # parse_expr(answer)
    "polynomial_multiplication": _polynomial,  # parse_expr(answer)
    "coin_flip": _coin_flip, "word_sorting": _word_sorting, "figlet_font": _figlet,
    "letter_jumble": _same_text, "spell_backward": _same_text,
    "gsm_symbolic": _format(_NUM, "the first number anywhere in the text was taken"),
    "advanced_geometry": _format(rf"\(\s*{_NUM}\s*,\s*{_NUM}\s*\)|{_NUM}\s*°?",
                                 "only the first two comma-separated fields were read"),
    "fraction_simplification": _format(r"\$?\s*(?:\\d?frac\s*\{\s*\d+\s*\}\s*\{\s*\d+\s*\}|\d+\s*/\s*\d+)\s*\$?",
                                       "the first fraction in the text was taken"),
    "polynomial_equations": _format(rf"(?:{_NUM}(?:\s*,\s*{_NUM})*)?", "text that is not a number was skipped"),
    "time_intervals": _format(r"(?:\d+ days?)?(?:,?\s*\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?)?",
                              "only the first word was read"),
    "knights_knaves": _format(rf"{_ROLE}(?:\s*(?:,|;|and|, and)\s*{_ROLE})*\s*\.?",
                              "name/role pairs were picked out of any text"),
    "kakurasu": _format(r"[01](?:\s+[01])*", "lines that are not grid rows were skipped"),
    "survo": _format(r"\d+(?:\s+\d+)*", "lines that are not matrix rows were skipped"),
    "sokoban": _format(r"[LRUD]+", "characters that are not moves were skipped"),
    "rush_hour": _format(r"[A-Z][+-]\d+(?:[\s,]+[A-Z][+-]\d+)*", "text that is not a move was skipped"),
    "prime_factorization": _format(r"\d+(?:\s*×\s*\d+)*", "it int()s every ×-separated field: other text raised"),
}
AUDIT_ALLOWED = {  # probe kinds a family rightly accepts, with the reason (reported, not failed)
    "power_function": {"near_miss": "the question asks for 3 significant figures: ±1 on a 6-digit value is right",
                       "two_tags": "the last tag holds the answer ±1, right to 3 significant figures"},
    "n_queens": {"cross": "the other task's board (same size) can complete this one too: answers are checked "
                          "against every valid completion of this task's queens"},
    "rush_hour": {"overlong_repeat": "moves are simulated and the board must end solved: the solution repeated "
                                     "re-solves it each time, so it is a (long) valid solution"},
}
EXCLUDED = {
    "composite": "a mixture of the other datasets, not a generator (rlvr's curriculum mixes families)",
    "propositional_logic": "any valid conclusion counts: restating a premise, or weakening one with ∨, "
                           "scores 1.0, and inconsistent premises make every answer valid — trivially hackable",
}
ITEM_FILTERS: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    # sympy could not integrate these: the 'answer' is an unevaluated Integral(...)
    "intermediate_integration": lambda entry: "Integral" not in str(entry["answer"]),
}


# --- reference solutions for families without a single answer --------------------------------------

def _graph_color_reference(entry: Mapping[str, Any]) -> str:
    return json.dumps({str(k): v for k, v in entry["metadata"]["possible_answer"].items()})


def _rubiks_reference(entry: Mapping[str, Any]) -> str | None:
    return entry["metadata"].get("example_correct_answer") or None


def _boxnet_reference(entry: Mapping[str, Any]) -> str:
    """A plan moving one box at a time along a Manhattan path onto a target of its colour."""
    state = {cell: list(items) for cell, items in entry["metadata"]["initial_state"].items()}
    plan = []
    for cell in list(state):
        for box in [item for item in state[cell] if item.startswith("box_")]:
            target = "target_" + box[4:]
            goal = next(c for c, items in state.items() if target in items)
            plan.extend(_boxnet_path(cell, goal, box))
            state[cell].remove(box)
            state[goal].remove(target)
    return json.dumps(plan)


def _boxnet_path(start: str, goal: str, box: str) -> list[dict[str, str]]:
    (r, c), (gr, gc) = (tuple(map(float, start.split("_"))), tuple(map(float, goal.split("_"))))
    steps = []
    while (r, c) != (gr, gc):
        nr, nc = (r + np.sign(gr - r), c) if r != gr else (r, c + np.sign(gc - c))
        steps.append({f"Agent[{r}, {c}]": f"move({box}, square[{nr}, {nc}])"})
        r, c = float(nr), float(nc)
    steps.append({f"Agent[{r}, {c}]": f"move({box}, target_{box[4:]})"})
    return steps


def _rush_hour_reference(entry: Mapping[str, Any]) -> str | None:
    """A shortest solution by breadth-first search over piece positions ("A+2 C-1 ..." moves)."""
    from reasoning_gym.games.rush_hour import BOARD_SIZE, TARGET, Board

    pieces = [(p.position, p.size, p.stride) for p in Board(entry["metadata"]["board_config"])._pieces]
    movable = [i for i, (_, size, _) in enumerate(pieces) if size > 1]
    start = tuple(p[0] for p in pieces)
    parents: dict[tuple[int, ...], tuple[tuple[int, ...], str] | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        state = queue.popleft()
        if state[0] == TARGET:
            moves = []
            while parents[state] is not None:
                state, move = parents[state]
                moves.append(move)
            return " ".join(reversed(moves))
        for child, move in _rush_hour_moves(state, pieces, movable, BOARD_SIZE):
            if child not in parents:
                parents[child] = (state, move)
                queue.append(child)
    return None


def _rush_hour_moves(state, pieces, movable, n):
    occupied = set()
    for (_, size, stride), position in zip(pieces, state, strict=True):
        occupied.update(position + k * stride for k in range(size))
    for i in movable:
        _, size, stride = pieces[i]
        position = state[i]
        for direction in (-1, 1):
            for steps in range(1, n):
                head = position + (size - 1) * stride if direction > 0 else position
                cell = head + direction * steps * stride
                row_ok = stride != 1 or (0 <= cell < n * n and cell // n == position // n)
                if not (row_ok and 0 <= cell < n * n) or cell in occupied:
                    break
                child = list(state)
                child[i] = position + direction * steps * stride
                yield tuple(child), f"{chr(ord('A') + i)}{'+' if direction > 0 else '-'}{steps}"


REFERENCES: dict[str, Callable[[Mapping[str, Any]], str | None]] = {
    "graph_color": _graph_color_reference,  # metadata possible_answer
    "rubiks_cube": _rubiks_reference,  # metadata example_correct_answer (3x3 solver)
    "boxnet": _boxnet_reference,  # planned here
    "rush_hour": _rush_hour_reference,  # solved here
}


# --- the family -------------------------------------------------------------------------------------

def require() -> None:
    """Raise a clear error when reasoning-gym is not installed."""
    if not AVAILABLE:
        raise ImportError(f"{INSTALL_HINT} ({IMPORT_ERROR})")


def category(dataset: str) -> str:
    """Reasoning-gym's category of a dataset: the package of its class (reasoning_gym.<category>.x)."""
    parts = DATASETS[dataset][0].__module__.split(".")
    return parts[1] if len(parts) >= 3 else "other"


def global_levels(dataset: str) -> int:
    """How many curriculum global levels a dataset has (1 without a curriculum)."""
    if not has_curriculum(dataset):
        return 1
    attributes = create_curriculum(dataset).attributes.values()
    return max((len(a.levels) for a in attributes), default=1)


def _json_or_none(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return None


class ScorerError(RuntimeError):
    """A reasoning-gym scorer raised on an answer: a verifier error, not a wrong answer."""


class ReasoningGymFamily(Family):
    """One reasoning-gym dataset as an rlvr task family (see the module doc).

    `fixes=False` scores with reasoning-gym's own verifier as it is (no FIXES, no partial-credit
    cap, no self-check of items, scorer exceptions raised): the baseline the audit compares with."""

    def __init__(self, dataset: str, seed: int = 0, weights: RewardWeights | None = None, fixes: bool = True,
                 partial_cap: float | None = 0.1):
        require()
        if dataset not in DATASETS:
            raise ValueError(f"reasoning-gym has no dataset {dataset!r}")
        super().__init__(seed, weights)
        self.dataset = dataset
        self.name = f"rg/{dataset}"
        self.domain = f"rg/{category(dataset)}"
        self.fixes = fixes
        self.partial_cap = partial_cap if fixes else None
        self.size = SIZES.get(dataset, DEFAULT_SIZE)
        first, last = LEVEL_RANGE.get(dataset, (0, global_levels(dataset) - 1))
        self.rg_levels = list(range(first, last + 1))  # our level k is reasoning-gym level rg_levels[k]
        self.skipped: collections.Counter[str] = collections.Counter()  # items `sample` passed over, by why
        self._datasets: dict[int, Any] = {}
        self._entries: collections.OrderedDict[tuple[int, int], dict] = collections.OrderedDict()
        self._lock = threading.Lock()

    def levels(self) -> list[int]:
        return list(range(len(self.rg_levels)))

    # --- datasets and items ---

    def config(self, level: int) -> dict[str, Any]:
        """The dataset config (seed and size included) for one of our levels."""
        seed = stable_hash(f"{self.name}/{self.seed}/{level}") % 2**31  # seed + index < 2**32 (numpy seeds)
        if has_curriculum(self.dataset):
            curriculum = create_curriculum(self.dataset)
            curriculum.set_global_level(self.rg_levels[level])
            config = curriculum.generate_configuration({"seed": seed, "size": self.size})
            values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        else:
            values = {"seed": seed, "size": self.size}
        return CONFIG_PATCHES.get(self.dataset, dict)(values)

    def dataset_at(self, level: int) -> Any:
        """The (cached) reasoning-gym dataset of a level."""
        with self._lock:
            if level not in self._datasets:
                self._datasets[level] = create_dataset(self.dataset, **self.config(level))
            return self._datasets[level]

    def entry(self, level: int, item: int) -> dict:
        """Item `item` of a level's dataset (LRU-cached: verifying a group re-fetches it)."""
        key = (level, item)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        dataset = self.dataset_at(level)
        try:
            with self._quiet():
                entry = dataset[item]
        finally:
            dataset.size = self.size  # word_ladder shrinks its size when an index fails
        with self._lock:
            self._entries[key] = entry
            while len(self._entries) > 4096:
                self._entries.popitem(last=False)
        return entry

    _print_lock = threading.Lock()

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Swallow what noisy generators and scorers print (serialised: redirect_stdout is process-wide)."""
        if self.dataset not in NOISY:
            yield
            return
        with self._print_lock, contextlib.redirect_stdout(io.StringIO()):
            yield

    # --- sampling ---

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        errors = []
        for _ in range(MAX_TRIES):
            item = int(rng.integers(self.size))
            try:
                entry = self.entry(level, item)
            except Exception as error:  # some generators fail on some indices: draw another
                self.skipped["generation failed"] += 1
                errors.append(f"{type(error).__name__}: {error}")
                continue
            reason = self._unusable(entry, level)
            if reason is None:
                return self._task(entry, level, item)
            self.skipped[reason] += 1
            errors.append(reason)
        raise RuntimeError(f"{self.name} level {level}: no usable item in {MAX_TRIES} tries: {errors[-3:]}")

    def _unusable(self, entry: Mapping[str, Any], level: int) -> str | None:
        """Why an item is not served (None: it is): an item filter, or its reference fails."""
        if not ITEM_FILTERS.get(self.dataset, lambda e: True)(entry):
            return "item filter"
        if entry["answer"] is None:
            reference = REFERENCES[self.dataset](entry) if self.dataset in REFERENCES else None
            if reference is None:
                return None if self.dataset not in REFERENCES else "no reference solution"
        elif not self.fixes:
            return None
        else:
            reference = str(entry["answer"])
        try:
            return None if self.score_answer(reference, entry, level) >= 1.0 else "reference scored below 1"
        except ScorerError:
            return "the scorer raised on the reference"

    def _task(self, entry: Mapping[str, Any], level: int, item: int) -> Task:
        question = entry["question"]
        answer = entry["answer"]
        metadata = {"dataset": self.dataset, "source_index": item, "rg_level": self.rg_levels[level]}
        difficulty = _json_or_none(entry["metadata"].get("difficulty"))
        if difficulty is not None:
            metadata["difficulty"] = difficulty
        return Task(index=0, prompt=f"{question}\n{ANSWER_INSTRUCTION}",
                    answer=None if answer is None else str(answer), level=level,
                    messages=chat_messages(question, SYSTEM_PROMPTS["default"]),
                    verifier={"kind": "reasoning_gym", "dataset": self.dataset, "level": level, "item": item},
                    metadata=metadata)

    # --- scoring ---

    def task_entry(self, task: Task) -> dict:
        """The reasoning-gym item a task was made from (checked to be the same question)."""
        spec = task.verifier
        if spec.get("dataset") != self.dataset:
            raise ValueError(f"{self.name}: task is from {spec.get('dataset')!r}")
        entry = self.entry(int(spec["level"]), int(spec["item"]))
        if not task.prompt.startswith(entry["question"]):
            raise RuntimeError(f"{self.name}: item {spec['item']} regenerated differently (non-deterministic?)")
        return entry

    def score_answer(self, answer: str, entry: Mapping[str, Any], level: int) -> float:
        """The score in [0, 1] of an extracted answer to an item of `level`: the fixed verifier,
        wrong answers capped at `partial_cap` (see the module doc)."""
        original = self.dataset_at(level).score_answer
        if not self.fixes:
            return min(1.0, max(0.0, float(original(answer, entry))))
        fix = FIXES.get(self.dataset)
        try:
            with self._quiet():
                score = float(fix(answer, entry, original) if fix else original(answer, entry))
        except Exception as error:  # a verifier error, recorded as one (FIXES gate malformed answers)
            raise ScorerError(f"{self.name}: the scorer raised {type(error).__name__}: {error} on the answer "
                              f"{answer[:80]!r}") from error
        if score >= 1.0:
            return 1.0
        return max(0.0, score if self.partial_cap is None else min(score, self.partial_cap))

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        answer = extract_answer(completion)
        if answer is None or truncated:
            return {"terminal": 0.0, "format": 0.0}
        level = int(task.verifier["level"])
        return {"terminal": self.score_answer(answer, self.task_entry(task), level), "format": 1.0}

    def reference_completion(self, task: Task) -> str | None:
        if task.answer is not None:
            return f"<answer>{task.answer}</answer>"
        if self.dataset not in REFERENCES:
            return None
        reference = REFERENCES[self.dataset](self.task_entry(task))
        return None if reference is None else f"<answer>{reference}</answer>"

    # --- audit hooks (used by rlvr.tasks.audit when a family has them) ---

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        """Known exploits of particular verifiers, tried on top of the audit's generic probes."""
        hacks = HACKS.get(self.dataset)
        return [] if hacks is None else [("hack", f"<answer>{text}</answer>") for text in hacks(self.task_entry(task))]

    def audit_allowed(self) -> dict[str, str]:
        """Probe kinds this family rightly scores correct, with the reason."""
        return dict(AUDIT_ALLOWED.get(self.dataset, {})) if self.fixes else {}


# Known exploits of the unfixed verifiers (answers, put in tags by `audit_probes`): each must score below 1.
HACKS: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    # a constant 24 from four in-range numbers, and a non-integer value that truncates to 24
    "puzzle24": lambda e: ["4*3*2*1", "(6/4)*(2*8)", "1*2*3*4", "49/2 + 0*1*1"],
    "countdown": lambda e: [f"{e['metadata']['target']}"],
    "simple_integration": lambda e: [f"integrate({e['metadata']['integrand']}, {e['metadata']['variable']})",
                                     f"Integral({e['metadata']['integrand']}, {e['metadata']['variable']})"],
    "intermediate_integration": lambda e: [
        f"integrate({e['metadata']['integrand']}, {e['metadata']['variable']})",
        f"Integral({e['metadata']['integrand']}, {e['metadata']['variable']})"],
    "polynomial_multiplication": lambda e: [f"expand({e['question'].split('Calculate the following: ')[-1]})"],
    "string_insertion": lambda e: ["list(entry['answer'])"],
    "spiral_matrix": lambda e: ["entry['answer'].split()"],
    "binary_matrix": lambda e: ["[[int(v) for v in r.split()] for r in entry['answer'].split(chr(10))]"],
    "n_queens": lambda e: ["[r.split() for r in entry['metadata']['valid_answers'][0].split(chr(10))]"],
    "game_of_life_halting": lambda e: ["True" if str(e["answer"]) == "False" else "False"],
    "rubiks_cube": lambda e: ["U U U U", e["metadata"]["scramble_moves"]],
}

FAMILIES: dict[str, Callable[..., Family]] = {
    f"rg/{name}": functools.partial(ReasoningGymFamily, name) for name in sorted(DATASETS) if name not in EXCLUDED
}


def unfixed_families() -> dict[str, Callable[..., Family]]:
    """Every reasoning-gym generator with its own verifier (no FIXES, EXCLUDED ones too but composite):
    what the audit runs with --unfixed to show which fixes are still needed."""
    return {f"rg/{name}": functools.partial(ReasoningGymFamily, name, fixes=False)
            for name in sorted(DATASETS) if name != "composite"}
