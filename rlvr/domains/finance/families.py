"""Task families of the finance kit: questions on a generated filing, at five levels.

  level 0  lookup          "What was Inventories at the end of 2023?"           an amount, in the filing's unit
  level 1  ratio / growth  gross margin, revenue growth, ... (one statement)    a percent, one decimal
  level 2  reconciliation  return on average equity, cash conversion, days      a percent or days, one decimal
           (multi-statement: the inputs come from two statements)
  level 3  inconsistency   one figure was altered so a total breaks: "item; year; corrected value"
                           (kept only when exactly one cell's correction makes every checkable identity hold)
  level 4  conclusion      did the operating margin expand, and which cost line drove it: JSON claims
                           citing cells, every cited number checked, the arithmetic recomputed

Families (rlvr.tasks.registry merges `FAMILIES`):

  finance_docs           the filing in the prompt as Markdown (single turn)
  finance_docs_html      the same as HTML
  finance_docs_tools     an episode of `FinanceDocsEnv`: the filing is behind tools (search, read a
                         table from the PDF, calculator); the answer-only form scores like finance_docs
  finance_lookup_compact level 0 only, raw format for tiny byte-level models ("net23=041 net24=060" then
                         "net24=" -> "060"): the easiest level's learning check, configs/finance_docs.py:tiny

The task keeps the raw filing (`metadata["filing"]`) and what the check needs (`metadata["check"]`), so a
task re-poses and re-verifies from its JSON alone. Audit probes (`audit_probes`): the right number in the
wrong unit, the right number from the wrong year, a distractor's number (comprehensive income for net
income, a restatement's original figure, a neighbouring line), and for conclusions wrong-year, distractor,
wrong-unit and fabricated citations, and a right conclusion without support.
"""

from __future__ import annotations

import json

import numpy as np

from rlvr.domains.finance import generate as gen
from rlvr.domains.finance import verify as fv
from rlvr.envs.families import EnvFamily
from rlvr.tasks.base import ANSWER_INSTRUCTION, Family, Task, pick

LEVELS = [0, 1, 2, 3, 4]
BALANCE_ITEMS = set(gen.BALANCE)
DISTRACTORS = {"Net income": "Comprehensive income", "Comprehensive income": "Net income",
               "Revenue": "Gross profit", "Gross profit": "Revenue", "Operating income": "Income before taxes",
               "Income before taxes": "Operating income", "Cash and cash equivalents": "Cash at beginning of year",
               "Net cash from operating activities": "Net income", "Capital expenditures": "Depreciation",
               "Depreciation": "Capital expenditures", "Total assets": "Total liabilities",
               "Total equity": "Total liabilities", "Cost of revenue": "Selling, general and administrative"}


def distractor_value(filing: gen.Filing, item: str, year: int) -> int | None:
    """A confusable figure: a restatement's original, the distractor line, else the line below it."""
    r = filing.restatement
    if r and (r["item"], r["year"]) == (item, year):
        return r["original"]
    other = DISTRACTORS.get(item)
    if other is None:
        lines = next(s for s in gen.STATEMENTS.values() if item in s) if not item.startswith("Revenue - ") else None
        other = lines[(lines.index(item) + 1) % len(lines)] if lines else "Revenue"
    value = filing.value(other, year)
    return value if value != filing.value(item, year) else None


def when(item: str, year: int) -> str:
    return f"at the end of {year}" if item in BALANCE_ITEMS else f"in {year}"


# --- questions: (question, reference answer, check) ------------------------------------------------------

def lookup(rng: np.random.Generator, filing: gen.Filing) -> tuple[str, str, dict]:
    items = [i for s in gen.STATEMENTS.values() for i in s] + [gen.segment_item(s) for s in filing.segments]
    item, year = pick(rng, items), pick(rng, filing.years)
    question = (f"What was {item} {when(item, year)}? Give the amount as the filing states it "
                f"({filing.scale_words()}), e.g. 1,234 or -1,234.")
    return question, fv.amount_str(filing.value(item, year)), {"type": "amount", "item": item, "year": year}


def ratio(rng: np.random.Generator, filing: gen.Filing, metrics) -> tuple[str, str, dict]:
    metric, year = pick(rng, metrics), pick(rng, filing.years[1:])
    words, unit = fv.METRICS[metric][:2]
    value = fv.metric_value(metric, filing, year)
    if value is None:
        metric = "gross_margin"  # revenue is never zero
        words, unit = fv.METRICS[metric][:2]
        value = fv.metric_value(metric, filing, year)
    question = f"What was the {words} in {year}? Give it in {'percent' if unit == '%' else unit}, to one decimal."
    return question, fv.one_decimal(value), {"type": "ratio", "metric": metric, "year": year,
                                             "exact": f"{value.numerator}/{value.denominator}"}


def fixers(filing: gen.Filing, values: dict, delta: int) -> list[tuple[str, int]]:
    """The cells whose change by ±delta makes every identity a reader can check hold again."""
    out = []
    for item in (i for s in gen.STATEMENTS.values() for i in s):
        for year in filing.years:
            for sign in (1, -1):
                trial = {k: dict(v) for k, v in values.items()}
                trial[item][year] += sign * delta
                if not gen.check_identities(filing, trial, visible=True):
                    out.append((item, year))
    return sorted(set(out))


def inconsistency(rng: np.random.Generator, filing: gen.Filing) -> tuple[str, str, dict] | None:
    """An altered cell that exactly one cell's correction explains (None when this draw is ambiguous)."""
    totals = {total for total, _ in gen.SUMS}
    candidates = [i for s in gen.STATEMENTS.values() for i in s if i not in totals]
    item, year = pick(rng, candidates), pick(rng, filing.years)
    raw = filing.value(item, year)
    delta = max(7, round(abs(raw) * float(rng.uniform(0.05, 0.3))))
    values = {k: dict(v) for k, v in filing.values.items()}
    values[item][year] = raw + delta * (1 if rng.random() < 0.5 else -1)
    if fixers(filing, values, delta) != [(item, year)]:
        return None
    question = ("One figure in this filing was altered after the statements were prepared, so that a total or a "
                "roll-forward no longer reconciles. Which line item and year, and what value makes everything "
                f"reconcile? Answer as: line item; year; corrected value ({filing.scale_words()}).")
    shown = {"item": item, "year": year, "value": values[item][year]}
    return question, f"{item}; {year}; {fv.amount_str(raw)}", {"type": "fix", "item": item, "year": year,
                                                                "shown": shown}


def conclusion(rng: np.random.Generator, filing: gen.Filing) -> tuple[str, str, dict] | None:
    """Operating margin direction and driver, for a year where both are clear (None if no year is)."""
    for year in rng.permutation(filing.years[1:]).tolist():
        truth = fv.conclusion_truth(filing, year)
        moves = sorted(abs(v) for v in truth["moves"].values())
        if abs(truth["change"]) >= 0.3 and moves[-1] - moves[-2] >= 0.2:
            break
    else:
        return None
    question = (f"Did the operating margin expand or contract from {year - 1} to {year}, and which cost line "
                "(Cost of revenue; Selling, general and administrative; Research and development) drove it, i.e. "
                "moved most as a share of revenue in that direction? Answer with JSON only: "
                '{"conclusion": "expanded" or "contracted", "driver": "<cost line>", "claims": [{"metric": '
                '"operating_margin" | "cost_of_revenue_share" | "sga_share" | "rnd_share", "year": <year>, '
                '"value": "<percent, one decimal>", "cells": [{"item": "<line item>", "year": <year>, '
                '"value": "<amount as in the filing>"}]}]}. Give the claims for the operating margin and the '
                "driver's share in both years; each claim cites the cells it is computed from (numerator, then "
                "revenue). Every cited number is checked against the filing.")
    reference = {"conclusion": truth["conclusion"], "driver": truth["driver"],
                 "claims": [fv.claim(m, filing, y) for m, y in truth["required"]]}
    return question, json.dumps(reference), {"type": "conclusion", "truth": truth}


def question_at(rng: np.random.Generator, filing: gen.Filing, level: int) -> tuple[str, str, dict] | None:
    if level in (1, 2):
        return ratio(rng, filing, fv.SINGLE_STATEMENT if level == 1 else fv.MULTI_STATEMENT)
    return {0: lookup, 3: inconsistency, 4: conclusion}[level](rng, filing)


def make_question(rng: np.random.Generator, level: int) -> tuple[gen.Filing, str, str, dict]:
    """A filing and a question at `level` (redrawn until the level's question is unambiguous)."""
    for _ in range(50):
        filing = gen.make_filing(rng, years=3)
        made = question_at(rng, filing, level)
        if made is not None:
            return (filing, *made)
    raise RuntimeError(f"finance level {level}: no unambiguous question in 50 filings")


# --- scoring and probes ----------------------------------------------------------------------------------

def wrong_unit_word(filing: gen.Filing) -> str:
    return "million" if filing.unit == "thousands" else "thousand"


def probe_answers(filing: gen.Filing, check: dict) -> list[tuple[str, str]]:
    """(probe kind, answer text) that must score below full reward (see the module doc)."""
    kind, out = check["type"], []
    if kind in ("amount", "fix"):
        item, year = check["item"], check["year"]
        other_year = next(y for y in filing.years if y != year)
        prefix = f"{item}; {year}; " if kind == "fix" else ""
        out.append(("wrong_unit", f"{prefix}{fv.amount_str(filing.value(item, year))} {wrong_unit_word(filing)}"))
        if filing.value(item, other_year) != filing.value(item, year):
            wrong_year = fv.amount_str(filing.value(item, other_year))
            out.append(("wrong_year", f"{item}; {other_year}; {wrong_year}" if kind == "fix" else wrong_year))
        distractor = distractor_value(filing, item, year)
        if distractor is not None:
            out.append(("distractor", f"{prefix}{fv.amount_str(distractor)}"))
        if kind == "fix":
            out.append(("printed_value", f"{prefix}{fv.amount_str(check['shown']['value'])}"))
    elif kind == "ratio":
        metric, year, exact = check["metric"], check["year"], fv.F(check["exact"])
        out.append(("wrong_unit", f"{float(exact) / 100:.4f}"))
        for y in filing.years[1:]:
            value = fv.metric_value(metric, filing, y)
            if y != year and value is not None and not fv.check_ratio(fv.one_decimal(value), exact):
                out.append(("wrong_year", fv.one_decimal(value)))
        cells = fv.metric_cells(metric, year)
        swapped = [distractor_value(filing, i, y) if n == 0 else filing.value(i, y) for n, (i, y) in enumerate(cells)]
        value = None if swapped[0] is None else fv.compute(metric, swapped)
        if value is not None and not fv.check_ratio(fv.one_decimal(value), exact):
            out.append(("distractor", fv.one_decimal(value)))
    else:
        out += conclusion_probes(filing, check["truth"])
    return out


def conclusion_probes(filing: gen.Filing, truth: dict) -> list[tuple[str, str]]:
    required = [tuple(r) for r in truth["required"]]
    right = {"conclusion": truth["conclusion"], "driver": truth["driver"]}
    claims = [fv.claim(m, filing, y) for m, y in required]
    (m0, y0) = required[0]
    wrong_year = fv.claim(m0, filing, y0 - 1 if y0 - 1 in filing.years else y0 + 1)
    wrong_year["year"] = y0
    inflated = {cell: round(filing.value(*cell) * 1.1) for m, y in required for cell in fv.metric_cells(m, y)}
    bad_unit = [dict(c, cells=[dict(x, value=f"{x['value']} {wrong_unit_word(filing)}") for x in c["cells"]])
                for c in claims]
    distractor = dict(claims[0], cells=[dict(claims[0]["cells"][0], item="Gross profit",
                                             value=fv.amount_str(filing.value("Gross profit", y0))),
                                        claims[0]["cells"][1]])
    flipped = {"conclusion": "contracted" if truth["conclusion"] == "expanded" else "expanded"}
    dump = json.dumps
    return [("wrong_year", dump({**right, "claims": [wrong_year, *claims[1:]]})),
            ("distractor", dump({**right, "claims": [distractor, *claims[1:]]})),
            ("wrong_unit", dump({**right, "claims": bad_unit})),
            ("fabricated", dump({**right, "claims": [fv.claim(m, filing, y, inflated) for m, y in required]})),
            ("unsupported", dump({**right, "claims": []})),
            ("wrong_conclusion", dump({**right, **flipped, "claims": claims}))]


# --- the families ----------------------------------------------------------------------------------------

class FinanceDocs(Family):
    """The filing in the prompt (Markdown; `render = "html"` in finance_docs_html), one question."""

    name, domain = "finance_docs", "finance"
    render = "markdown"

    def levels(self) -> list[int]:
        return list(LEVELS)

    def document(self, filing: gen.Filing, check: dict) -> str:
        values = gen.shown_values(filing, check)
        return gen.to_html(filing, values) if self.render == "html" else gen.to_markdown(filing, values)

    def question_task(self, rng: np.random.Generator, level: int) -> tuple[gen.Filing, str, str, dict, dict]:
        filing, question, answer, check = make_question(rng, level)
        metadata = {"filing": filing.to_json(), "check": check, "question": question}
        return filing, question, answer, check, metadata

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        filing, question, answer, check, metadata = self.question_task(rng, level)
        prompt = f"{self.document(filing, check)}\n{question}\n\n{ANSWER_INSTRUCTION}"
        return Task(index=0, prompt=prompt, answer=answer, verifier={"kind": "finance", "check": check},
                    metadata=metadata)

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        answer = self.answer_text(completion)
        if answer is None or truncated:
            return {"terminal": 0.0, "format": 0.0}
        filing = gen.Filing.from_json(task.metadata["filing"])
        return {**fv.score_answer(answer, filing, task.metadata["check"]), "format": 1.0}

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        filing = gen.Filing.from_json(task.metadata["filing"])
        return [(f"hack:{kind}", f"<answer>{text}</answer>") for kind, text in
                probe_answers(filing, task.metadata["check"])]


class FinanceDocsHtml(FinanceDocs):
    name, render = "finance_docs_html", "html"


class FinanceDocsTools(EnvFamily, FinanceDocs):
    """Episodes of `FinanceDocsEnv` (rlvr.domains.finance.env): the question only; the filing is behind tools."""

    name, env = "finance_docs_tools", "finance_docs"

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        from rlvr.domains.finance import env

        filing, question, answer, check, metadata = self.question_task(rng, level)
        messages = env.opening_messages(filing, question)
        return Task(index=0, prompt="\n\n".join(m["content"] for m in messages), answer=answer,
                    messages=tuple(messages), verifier={"kind": "finance", "check": check},
                    metadata={"env": self.env, **metadata})

    def reference_turns(self, task: Task) -> list[str]:
        from rlvr.domains.finance import env

        return env.reference_turns(task)


# the compact form's line items: three-letter keys, always in this order
COMPACT_ITEMS = {"rev": "Revenue", "gro": "Gross profit", "net": "Net income", "csh": "Cash and cash equivalents"}


class FinanceLookupCompact(Family):
    """Level 0 in a form a 2-layer byte model can read: one line item of a generated filing over two years,
    in a fixed layout (amounts rescaled to a 3-digit field), and the year asked:

        net23=041 net24=060
        net24=                                           -> "060"

    The verifier is exact (the field as shown); the other year's figure, or the right field with a trailing
    ".", is wrong. (Four cells, two items by two years, were not learnt by the 2-layer model in 400 SFT
    steps: held-out accuracy 0 at the start of RL, seed 0.)"""

    name, domain, answer_format = "finance_lookup_compact", "finance", "raw"

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        filing = gen.make_filing(rng, years=2)
        keys = [str(pick(rng, list(COMPACT_ITEMS)))]
        top = int(rng.integers(100, 1000))  # the largest figure shown
        scale = max(abs(filing.value(COMPACT_ITEMS[k], y)) for k in keys for y in filing.years) / top
        cells = {f"{k}{y % 100:02d}": f"{round(abs(filing.value(COMPACT_ITEMS[k], y)) / scale):03d}"
                 for k in keys for y in filing.years}
        asked = pick(rng, list(cells))
        prompt = " ".join(f"{k}={v}" for k, v in cells.items()) + f"\n{asked}="
        return Task(index=0, prompt=prompt, answer=cells[asked], verifier={"kind": "exact", "answer": cells[asked]},
                    metadata={"cells": cells, "asked": asked})

    def score(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        """{"reward", "correct", "format", "value"}: correct is exactly the field; value: the field whatever
        the format (a diagnostic that separates reading the right cell from the answer format)."""
        correct = float(not truncated and completion == task.answer)
        value = float(completion.rstrip(".") == task.answer)
        return {"reward": correct, "correct": correct, "format": float(completion.isdigit()), "value": value}

    def demonstration(self, task: Task, off_format: bool = False) -> dict[str, str]:
        """Off-format: the right field with a trailing "." the verifier rejects (as the quickstart's)."""
        return {"prompt": task.prompt, "completion": task.answer + ("." if off_format else "")}

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        others = [v for k, v in task.metadata["cells"].items() if k != task.metadata["asked"] and v != task.answer]
        return [("hack:wrong_year", v) for v in others] + [("hack:off_format", task.answer + ".")]


FAMILIES: dict[str, type[Family]] = {
    "finance_docs": FinanceDocs,
    "finance_docs_html": FinanceDocsHtml,
    "finance_docs_tools": FinanceDocsTools,
    "finance_lookup_compact": FinanceLookupCompact,
}
