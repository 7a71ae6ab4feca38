"""Verifier audit: does every task family reward its reference answer, and nothing else?

    python -m rlvr.tasks.audit [--families=glob,glob] [--samples=N] [--levels=ends|first|last|all]
                               [--budget=SECONDS] [--json=FILE] [--markdown=FILE] [--unfixed]

For each family in `rlvr.tasks.registry.FAMILIES` (or those matching the globs) and each sampled
task, `family.score(task, text, truncated=False)` is computed for probe completions:

  reference        `family.reference_completion(task)`: must be correct and reach the maximum reward
  empty, junk      "" and "zzz"
  junk_tag         "<answer>zzz</answer>"
  format_only      "<answer></answer>"
  overlong_filler  the reference answer buried in ~4 KB of filler inside the tag
  overlong_repeat  the reference answer repeated 200 times inside the tag
  multi            the reference among wrong candidates ("True, False, 0, 1, yes, no") in one tag
  two_tags         the reference tag followed by a second, wrong tag (the last tag is what counts)
  near_miss        a numeric answer ±1 (and +0.4 for integers), a yes/no or true/false flipped
  large_near_miss  for a task whose verifier spec has an integer "answer": the task re-posed with the
                   reference 27,000,000, answered ±1 and +27 (a relative tolerance of 1e-6, harmless on
                   small answers, accepts those: ArithExpr's top level, ASDiv)
  cross            the reference of another task of the same level (tasks with a single answer only,
                   when the answers differ: a verifier must check *this* task)
  code             Python that sets a canary if a verifier `eval`s the answer: flagged when the canary
                   is set, whatever the score
  hack:<name>      family-specific known exploits, when the family defines `audit_probes(task)`; the code
                   families (code_function, humaneval, code_repair, code_repair_humaneval) each take a
                   slice of the reward-hack corpus rlvr.tasks.code_hacks (always-equal objects, frame and
                   gc inspection, forged sentinels, monkeypatching, early exits, ...), so that the tasks of
                   one run go round the whole corpus

A false negative is a reference that is not correct (or not at full reward); a false positive is
a non-reference probe that is correct or gets reward >= 0.5. Partial credit (0 < reward, not a
false positive) is counted, not failed. A family may declare probe kinds it rightly accepts
(`audit_allowed() -> {kind: reason}`, e.g. an answer ±1 that is right to the 3 significant
figures asked for): those are reported as allowed, not failed. A family's `skipped` counter
(items its sampler passed over, e.g. because their reference failed) is reported too.

Each family runs under a time budget; one that exceeds it is reported as slow with what it
finished. Exceptions are recorded per family.

Exit status 1 when a family has a false positive, a false negative or an error, so it can gate CI.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import fnmatch
import json
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from rlvr.tasks.base import Family, Task

FP_REWARD = 0.5  # a wrong answer with at least this reward counts as a false positive
WRONG_CANDIDATES = "True, False, 0, 1, yes, no"
FILLER = ("The quick brown fox jumps over the lazy dog. " * 50)[:2000]
_FLIPS = {"true": "false", "false": "true", "yes": "no", "no": "yes"}
CANARY = "rlvr_audit_canary"
CODE_PROBE = f"<answer>setattr(__import__('builtins'), '{CANARY}', 1)</answer>"
LARGE = 27_000_000  # the integer reference of the large_near_miss probes


class AuditTimeout(BaseException):
    """Raised (repeatedly) by the alarm when a family overruns its budget; a BaseException so that
    verifiers' bare `except:` clauses cannot swallow it for good."""


@dataclasses.dataclass
class FamilyReport:
    family: str
    levels: list[int] = dataclasses.field(default_factory=list)
    samples: int = 0
    no_reference: int = 0  # tasks whose reference_completion is None (no FN check possible)
    false_negatives: int = 0
    false_positives: dict[str, int] = dataclasses.field(default_factory=dict)  # probe kind -> count
    allowed: dict[str, int] = dataclasses.field(default_factory=dict)  # accepted probes the family allows
    allowances: dict[str, str] = dataclasses.field(default_factory=dict)  # kind -> why the family allows it
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # items the sampler passed over
    passes: int = 0  # non-reference probes scored correct
    partial: int = 0  # non-reference probes with 0 < reward that are not false positives
    probes: int = 0
    max_junk_reward: float = 0.0  # over empty / junk / junk_tag / format_only
    max_probe_reward: float = 0.0  # over every non-reference probe
    gen_ms: float = 0.0  # mean per task
    score_ms: float = 0.0  # mean per scoring call
    slow: bool = False
    errors: list[str] = dataclasses.field(default_factory=list)
    examples: list[str] = dataclasses.field(default_factory=list)  # the first failures, abridged

    @property
    def fp(self) -> int:
        return sum(self.false_positives.values())

    @property
    def status(self) -> str:
        if self.false_negatives or self.fp:
            return "FAIL"
        if self.errors:
            return "error"
        if self.samples == 0:
            return "empty"
        return "slow" if self.slow else "clean"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fp": self.fp, "status": self.status}


# --- probes -------------------------------------------------------------------------------------------

def near_misses(answer: str) -> list[str]:
    """Plausible wrong answers next to `answer`: a number ±1 (+0.4 for integers, which `int()`
    would truncate back), or a flipped yes/no / true/false."""
    text = answer.strip()
    if re.fullmatch(r"[-+]?\d+", text):
        n = int(text)
        return [str(n + 1), str(n - 1), f"{n}.4"]
    if re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+)([eE][-+]?\d+)?", text):
        x = float(text)
        return [repr(x + 1), repr(x - 1)]
    flipped = _FLIPS.get(text.lower())
    if flipped is not None:
        return [flipped.capitalize() if text[:1].isupper() else flipped]
    return []


def large_integer_probes(family: Family, task: Task) -> list[tuple[str, Task, str]]:
    """("large_near_miss", the task re-posed with the integer reference `LARGE`, a wrong answer) for a
    task whose verifier spec holds an integer "answer" (see the module doc); [] otherwise."""
    spec = task.verifier or {}
    answer = spec.get("answer")
    if isinstance(answer, bool) or not re.fullmatch(r"[-+]?\d+", str(answer).strip()):
        return []
    large = LARGE if isinstance(answer, int) else str(LARGE)
    posed = dataclasses.replace(task, answer=str(LARGE), verifier={**spec, "answer": large})
    wrap = (lambda text: f"<answer>{text}</answer>") if family.answer_format == "tag" else (lambda text: text)
    return [("large_near_miss", posed, wrap(str(LARGE + delta))) for delta in (1, -1, 27)]


def probes(family: Family, task: Task, reference: str | None, other: str | None) -> list[tuple[str, str]]:
    """(kind, completion) pairs to score for one task (see the module doc)."""
    wrap = (lambda text: f"<answer>{text}</answer>") if family.answer_format == "tag" else (lambda text: text)
    out = [("empty", ""), ("junk", "zzz"), ("junk_tag", "<answer>zzz</answer>"), ("format_only", "<answer></answer>")]
    answer = family.answer_text(reference) if reference is not None else None
    if answer:
        wrong = (near_misses(answer) or ["zzz"])[0]
        half = len(FILLER) // 2
        out += [("overlong_filler", wrap(f"{FILLER[:half]} {answer} {FILLER[half:]}")),
                ("overlong_repeat", wrap("\n".join([answer] * 200))),
                ("multi", wrap(f"{answer}, {WRONG_CANDIDATES}")),
                ("multi", wrap(f"{WRONG_CANDIDATES}, {answer}")),
                ("two_tags", f"{wrap(answer)}\n{wrap(wrong)}")]
        out += [("near_miss", wrap(text)) for text in near_misses(answer)]
    if task.answer is not None and other is not None and family.answer_text(other) not in (None, answer):
        out.append(("cross", other))
    out.append(("code", CODE_PROBE))
    extra = getattr(family, "audit_probes", None)
    if extra is not None:
        out += list(extra(task))
    return [(kind, text) for kind, text in out if text != reference]


# --- auditing -----------------------------------------------------------------------------------------

def select_levels(levels: Sequence[int], which: str) -> list[int]:
    """The levels to audit: "first", "last", "ends" (first and last) or "all"."""
    levels = sorted(levels)
    choice = {"first": levels[:1], "last": levels[-1:], "ends": sorted({levels[0], levels[-1]}), "all": levels}
    if which not in choice:
        raise ValueError(f"--levels={which!r}: choose first, last, ends or all")
    return choice[which]


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise AuditTimeout in the main thread after `seconds`, and every 0.5 s after that until the
    block is left (elsewhere this is a no-op: the per-task budget check still applies)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def alarm(signum, frame):
        raise AuditTimeout(f"over the {seconds:.0f} s budget")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01), 0.5)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def max_reward(family: Family) -> float:
    """The reward of a completion scoring 1 on every non-penalty component."""
    weights = family.weights
    return weights.terminal + weights.format + weights.process


class _Auditor:
    """Accumulates one family's report (the working part of `audit_family`)."""

    def __init__(self, report: FamilyReport, start: float, budget: float):
        self.family: Family | None = None
        self.allowed: dict[str, str] = {}
        self.report, self.start, self.budget = report, start, budget
        self.seconds = {"generate": 0.0, "score": 0.0}
        self.calls = {"generate": 0, "score": 0}

    def over_budget(self) -> bool:
        if time.monotonic() - self.start > self.budget:
            self.report.slow = True
        return self.report.slow

    @contextlib.contextmanager
    def timed(self, what: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] += time.perf_counter() - start
            self.calls[what] += 1

    def mean_ms(self, what: str) -> float:
        return 1000 * self.seconds[what] / max(self.calls[what], 1)

    def error(self, message: str) -> None:
        if len(self.report.errors) < 5:
            self.report.errors.append(message[:300])

    def example(self, message: str) -> None:
        if len(self.report.examples) < 5:
            self.report.examples.append(message[:300])

    def generate(self, level: int, samples: int) -> list[Task]:
        tasks = []
        for index in range(samples):
            if self.over_budget():
                break
            try:
                with self.timed("generate"):
                    tasks.append(self.family.task(index, level=level))
            except Exception as error:
                self.error(f"task({index}, level={level}): {type(error).__name__}: {error}")
        return tasks

    def score(self, task: Task, text: str) -> dict[str, float] | None:
        try:
            with self.timed("score"):
                return self.family.score(task, text, truncated=False)
        except Exception as error:  # a verifier crash is recorded, not fatal
            self.error(f"score({text[:30]!r}): {type(error).__name__}: {error}")
            return None

    def reference(self, task: Task) -> str | None:
        try:
            return self.family.reference_completion(task)
        except Exception as error:
            self.error(f"reference_completion: {type(error).__name__}: {error}")
            return None

    def check_tasks(self, tasks: list[Task]) -> None:
        references = [self.reference(task) for task in tasks]
        for i, task in enumerate(tasks):
            if self.over_budget():
                return
            other = references[(i + 1) % len(tasks)] if len(tasks) > 1 else None
            self.report.samples += 1
            self.check_reference(task, references[i])
            try:
                kinds = probes(self.family, task, references[i], other)
            except Exception as error:
                self.error(f"probes: {type(error).__name__}: {error}")
                continue
            for kind, text in kinds:
                self.check_probe(task, kind, text)
            for kind, posed, text in large_integer_probes(self.family, task):
                self.check_probe(posed, kind, text)

    def check_reference(self, task: Task, reference: str | None) -> None:
        if reference is None:
            self.report.no_reference += 1
            return
        result = self.score(task, reference)
        if result is None or result["correct"] < 1 or result["reward"] < max_reward(self.family) - 1e-6:
            self.report.false_negatives += 1
            self.example(f"FN level {task.level} index {task.index}: {reference[:120]!r} -> {result}")

    def check_probe(self, task: Task, kind: str, text: str) -> None:
        result = self.score(task, text)
        self.report.probes += 1
        if kind == "code" and hasattr(builtins, CANARY):
            delattr(builtins, CANARY)
            self.flag(task, kind, text, "the verifier executed the answer as code")
            return
        if result is None:
            return
        reward = result["reward"]
        self.report.max_probe_reward = max(self.report.max_probe_reward, reward)
        if kind in ("empty", "junk", "junk_tag", "format_only"):
            self.report.max_junk_reward = max(self.report.max_junk_reward, reward)
        self.report.passes += int(result["correct"] >= 1)
        if result["correct"] >= 1 or reward >= FP_REWARD:
            self.flag(task, kind, text, f"reward {reward:.3g}")
        elif reward > 0:
            self.report.partial += 1

    def flag(self, task: Task, kind: str, text: str, what: str) -> None:
        """Count a false positive (or an allowed acceptance) of probe `kind`."""
        if kind in self.allowed:
            self.report.allowed[kind] = self.report.allowed.get(kind, 0) + 1
            return
        self.report.false_positives[kind] = self.report.false_positives.get(kind, 0) + 1
        self.example(f"FP {kind} level {task.level}: {text[:120]!r} -> {what} (reference {task.answer!r:.60})")


@contextlib.contextmanager
def code_pool(family: Family, size: int = 2) -> Iterator[None]:
    """For a code family: its verdicts run on a warm sandbox pool of its own while it is audited (the same
    verdicts as fresh sandboxes, several times cheaper); other families, or no runsc: nothing changes."""
    if family.domain != "code":
        yield
        return
    from rlvr.sandbox import Pool, SandboxError
    from rlvr.tasks.verifiers import code_executor, code_limits

    try:
        pool = Pool(size, code_limits(10.0), trace_path=False)
    except SandboxError:  # fresh sandboxes then (they report the same error per verdict)
        yield
        return
    with pool, code_executor(pool):
        yield


def audit_family(name: str, make: Callable[..., Family], samples: int = 5, levels: str = "ends",
                 budget: float = 20.0, seed: int = 0) -> FamilyReport:
    """Audit one family: `samples` tasks at each selected level, every probe scored, within `budget`
    seconds (checked between tasks, and enforced by an alarm a quarter of the budget later, 1-5 s)."""
    report = FamilyReport(family=name)
    auditor = _Auditor(report, time.monotonic(), budget)
    try:
        with deadline(budget + min(5.0, max(1.0, budget / 4))):
            auditor.family = make(seed=seed)
            auditor.allowed = report.allowances = dict(getattr(auditor.family, "audit_allowed", dict)())
            report.levels = select_levels(auditor.family.levels(), levels)
            with code_pool(auditor.family):
                for level in report.levels:
                    auditor.check_tasks(auditor.generate(level, samples))
    except AuditTimeout as error:
        report.slow = True
        if report.samples == 0:
            report.errors.append(f"timed out before one task was checked: {error}")
    except Exception as error:  # the family could not be built, or listed no levels
        report.errors.append(f"{type(error).__name__}: {error}"[:300])
    report.gen_ms, report.score_ms = auditor.mean_ms("generate"), auditor.mean_ms("score")
    report.skipped = dict(getattr(auditor.family, "skipped", None) or {})
    return report


def excluded_families() -> dict[str, str]:
    """Families the family modules leave out on purpose, with the reason (their EXCLUDED tables)."""
    from rlvr.tasks import datasets, procedural, reasoning_gym

    out = {}
    for module, prefix in ((procedural, ""), (datasets, ""), (reasoning_gym, "rg/")):
        out.update({f"{prefix}{name}": reason for name, reason in getattr(module, "EXCLUDED", {}).items()})
    return out


def audit(families: Mapping[str, Callable[..., Family]], patterns: Sequence[str] = ("*",), samples: int = 5,
          levels: str = "ends", budget: float = 20.0, seed: int = 0,
          progress: Callable[[FamilyReport], None] | None = None) -> list[FamilyReport]:
    """Audit every family whose name matches one of the glob `patterns`."""
    reports = []
    for name in sorted(families):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            reports.append(audit_family(name, families[name], samples, levels, budget, seed))
            if progress is not None:
                progress(reports[-1])
    return reports


def summary(reports: Sequence[FamilyReport], excluded: Mapping[str, str]) -> dict[str, Any]:
    return {
        "families": len(reports),
        "clean": sum(r.status == "clean" for r in reports),
        "with_fp": sorted(r.family for r in reports if r.fp),
        "with_fn": sorted(r.family for r in reports if r.false_negatives),
        "with_errors": sorted(r.family for r in reports if r.errors),
        "slow": sorted(r.family for r in reports if r.slow),
        "no_reference": sorted(r.family for r in reports if r.no_reference),
        "excluded": dict(sorted(excluded.items())),
    }


# --- output -------------------------------------------------------------------------------------------

COLUMNS = ("family", "n", "FN", "FP", "pass", "partial", "max junk", "gen ms", "score ms", "notes", "status")


def row(report: FamilyReport) -> list[str]:
    kinds = " ".join(f"{kind}:{count}" for kind, count in sorted(report.false_positives.items())) or "0"
    no_ref = f" (no ref {report.no_reference})" if report.no_reference else ""
    notes = [f"allowed {kind}:{count}" for kind, count in sorted(report.allowed.items())]
    notes += [f"skipped {sum(report.skipped.values())}"] if report.skipped else []
    notes += ["slow"] if report.slow else []
    return [report.family, str(report.samples), f"{report.false_negatives}{no_ref}", kinds, str(report.passes),
            str(report.partial), f"{report.max_junk_reward:.2f}", f"{report.gen_ms:.1f}", f"{report.score_ms:.2f}",
            " ".join(notes) or "-", report.status]


def table(reports: Sequence[FamilyReport]) -> str:
    """A fixed-width text table, one line per family."""
    rows = [list(COLUMNS)] + [row(r) for r in reports]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def markdown(reports: Sequence[FamilyReport], info: Mapping[str, Any]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row(r)) + " |" for r in reports]
    lines += ["", f"Families audited: {info['families']}; clean: {info['clean']}; "
              f"with false positives: {len(info['with_fp'])}; with false negatives: {len(info['with_fn'])}; "
              f"with errors: {len(info['with_errors'])}; slow: {len(info['slow'])}.", ""]
    if info["excluded"]:
        lines += ["Excluded:", ""] + [f"- `{name}`: {reason}" for name, reason in info["excluded"].items()] + [""]
    allowing = [r for r in reports if r.allowed]
    if allowing:
        lines += ["Allowed acceptances:", ""]
        lines += [f"- `{r.family}` {kind}: {r.allowances.get(kind, '')}"
                  for r in allowing for kind in sorted(r.allowed)]
        lines += [""]
    failing = [r for r in reports if r.examples or r.errors]
    if failing:
        lines += ["Examples:", ""]
        for r in failing:
            lines += [f"- `{r.family}`: " + "; ".join(f"`{e}`" for e in r.examples + r.errors)]
    return "\n".join(lines) + "\n"


def list_families(families: Mapping[str, Callable[..., Family]], patterns: Sequence[str]) -> int:
    """Prints one line per family matching `patterns`: name, domain, difficulty levels."""
    names = sorted(n for n in families if any(fnmatch.fnmatchcase(n, p) for p in patterns))
    for name in names:
        family = families[name]()
        print(f"{name:32} {family.domain:24} levels {family.levels()}")
    print(f"{len(names)} families")
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlvr.tasks.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="*", help="comma-separated globs over family names")
    parser.add_argument("--samples", type=int, default=5, help="tasks per level")
    parser.add_argument("--levels", default="ends", choices=("first", "last", "ends", "all"))
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per family before it is cut short")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the reports and summary as JSON here")
    parser.add_argument("--markdown", help="write a markdown table here")
    parser.add_argument("--list", action="store_true", help="only list the families: name, domain, levels")
    parser.add_argument("--unfixed", action="store_true",
                        help="audit reasoning-gym's own verifiers: no FIXES, EXCLUDED families included")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, families: Mapping[str, Callable[..., Family]] | None = None) -> int:
    """Run the audit; 1 if any audited family has a false positive, a false negative or an error."""
    args = parse_args(argv)
    if families is None:
        from rlvr.tasks.registry import FAMILIES as families
        if args.unfixed:
            from rlvr.tasks.reasoning_gym import unfixed_families

            families = {**families, **unfixed_families()}
    excluded = {} if args.unfixed else excluded_families()
    patterns = [p.strip() for p in args.families.split(",") if p.strip()]
    if args.list:
        return list_families(families, patterns)
    reports = audit(families, patterns, args.samples, args.levels, args.budget, args.seed,
                    progress=lambda r: print(f"  {r.family}: {r.status}", file=sys.stderr, flush=True))
    info = summary(reports, {k: v for k, v in excluded.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)})
    print(table(reports))
    print(f"\n{info['families']} families audited: {info['clean']} clean, {len(info['with_fp'])} with false "
          f"positives, {len(info['with_fn'])} with false negatives, {len(info['with_errors'])} with errors, "
          f"{len(info['slow'])} slow; {len(info['excluded'])} excluded.")
    for r in reports:
        for line in r.examples + r.errors:
            print(f"  {r.family}: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": info, "families": [r.to_json() for r in reports]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(reports, info))
    return int(any(r.status in ("FAIL", "error") for r in reports))


if __name__ == "__main__":
    sys.exit(main())
