"""Verifiers of the finance kit: every number is checked against the filing's raw data, not against text.

- `parse_amount("(1,234) thousand EUR", filing)`: an exact amount in currency units. Without a scale word
  the filing's unit applies; a scale word (thousand, k, million, m, mn, bn, billion) or a currency code
  that disagrees with the number's true size or currency makes it a different amount, so "right number,
  wrong unit" is wrong. Negatives as "-1,234" or "(1,234)".
- `METRICS`: one table of ratios (inputs as (line item, year offset), a formula); questions, reference
  answers and the recomputation of claims all use it, so there is one implementation per formula.
- `check_ratio`: |answer - exact| <= tolerance (answers asked to one decimal: 0.05); "41.2%" and "41.2" agree.
- `check_cell_fix` (level 3): "item; year; corrected value": the altered cell and its raw value.
- `check_conclusion` (level 4): a JSON conclusion whose claims cite cells. Each cited cell must exist and
  equal the raw data; each claim's value is recomputed from its cited cells with the metric's formula; the
  claims must cover what the conclusion rests on; then the conclusion and its driver are compared with the
  raw data's. Anything short of that scores at most `PARTIAL_CAP` (< 0.5), less for every unsupported
  claim; `process` is the fraction of cited cells that are correct (the cell was located).
"""

from __future__ import annotations

import fractions
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from rlvr.domains.finance.generate import UNITS, Filing

F = fractions.Fraction
SCALES = {"thousand": 1_000, "thousands": 1_000, "k": 1_000, "million": 1_000_000, "millions": 1_000_000,
          "m": 1_000_000, "mn": 1_000_000, "billion": 1_000_000_000, "billions": 1_000_000_000, "bn": 1_000_000_000}
_SYMBOLS = {"$": "USD", "€": "EUR", "£": "GBP"}
_AMOUNT = re.compile(r"(?P<cur1>[A-Z]{3}|[$€£])?\s*(?P<neg>-)?\s*(?P<open>\()?\s*(?P<cur2>[$€£])?"
                     r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)\s*(?P<close>\))?"
                     r"\s*(?P<scale>(?i:thousands?|k|millions?|mn|m|billions?|bn))?\s*(?P<cur3>[A-Z]{3})?")
PARTIAL_CAP = 0.4  # the most a conclusion short of fully supported can score (below the audit's 0.5)
UNSUPPORTED_COST = 0.1  # per claim or citation that the raw data contradicts


def parse_amount(text: str, filing: Filing) -> F | None:
    """The amount in currency units (see the module doc), or None when `text` is not one amount."""
    found = _AMOUNT.fullmatch(text.strip())
    if not found or bool(found["open"]) != bool(found["close"]):
        return None
    scale = UNITS[filing.unit]
    if found["scale"]:
        scale = SCALES[found["scale"].lower()]
    currencies = {_SYMBOLS.get(c, c) for c in (found["cur1"], found["cur2"], found["cur3"]) if c}
    if currencies - {filing.currency}:
        return None
    value = F(found["num"].replace(",", "")) * scale
    return -value if (found["neg"] or found["open"]) else value


def same_amount(text: str, raw: int, filing: Filing) -> bool:
    got = parse_amount(text, filing)
    return got is not None and got == F(raw) * UNITS[filing.unit]


# --- metrics: one table ---------------------------------------------------------------------------------

FORMULAS: dict[str, Callable[..., F]] = {
    "ratio": lambda a, b: 100 * a / b,  # percent
    "growth": lambda a, b: 100 * (a - b) / b,  # percent, a this year, b the year before
    "average_ratio": lambda a, b, c: 100 * a / ((b + c) / 2),  # percent of an average balance
    "days": lambda a, b: 365 * a / b,
}
# name -> (question words, unit words, formula, inputs as (line item, year offset))
METRICS: dict[str, tuple[str, str, str, tuple[tuple[str, int], ...]]] = {
    "gross_margin": ("gross margin", "%", "ratio", (("Gross profit", 0), ("Revenue", 0))),
    "operating_margin": ("operating margin", "%", "ratio", (("Operating income", 0), ("Revenue", 0))),
    "net_margin": ("net margin", "%", "ratio", (("Net income", 0), ("Revenue", 0))),
    "revenue_growth": ("revenue growth over the prior year", "%", "growth", (("Revenue", 0), ("Revenue", -1))),
    "net_income_growth": ("net income growth over the prior year", "%", "growth",
                          (("Net income", 0), ("Net income", -1))),
    "cost_of_revenue_share": ("cost of revenue as a share of revenue", "%", "ratio",
                              (("Cost of revenue", 0), ("Revenue", 0))),
    "sga_share": ("selling, general and administrative expense as a share of revenue", "%", "ratio",
                  (("Selling, general and administrative", 0), ("Revenue", 0))),
    "rnd_share": ("research and development expense as a share of revenue", "%", "ratio",
                  (("Research and development", 0), ("Revenue", 0))),
    # multi-statement
    "return_on_equity": ("return on average equity (net income over the average of this and last year's "
                         "total equity)", "%", "average_ratio",
                         (("Net income", 0), ("Total equity", 0), ("Total equity", -1))),
    "return_on_assets": ("return on average assets (net income over the average of this and last year's "
                         "total assets)", "%", "average_ratio",
                         (("Net income", 0), ("Total assets", 0), ("Total assets", -1))),
    "cash_conversion": ("cash conversion (net cash from operating activities over net income)", "%", "ratio",
                        (("Net cash from operating activities", 0), ("Net income", 0))),
    "receivable_days": ("days sales outstanding (accounts receivable over revenue, times 365)", "days", "days",
                        (("Accounts receivable", 0), ("Revenue", 0))),
    "inventory_days": ("inventory days (inventories over cost of revenue, times 365)", "days", "days",
                       (("Inventories", 0), ("Cost of revenue", 0))),
}
SINGLE_STATEMENT = ("gross_margin", "operating_margin", "net_margin", "revenue_growth", "net_income_growth",
                    "sga_share", "rnd_share")
MULTI_STATEMENT = ("return_on_equity", "return_on_assets", "cash_conversion", "receivable_days", "inventory_days")
COST_SHARES = {"Cost of revenue": "cost_of_revenue_share", "Selling, general and administrative": "sga_share",
               "Research and development": "rnd_share"}


def metric_cells(metric: str, year: int) -> list[tuple[str, int]]:
    """The (line item, year) cells a metric of `year` is computed from."""
    return [(item, year + offset) for item, offset in METRICS[metric][3]]


def compute(metric: str, values: list[F | int]) -> F | None:
    """The metric from its input values (None when a denominator is zero)."""
    try:
        return FORMULAS[METRICS[metric][2]](*map(F, values))
    except ZeroDivisionError:
        return None


def metric_value(metric: str, filing: Filing, year: int) -> F | None:
    return compute(metric, [filing.value(item, y) for item, y in metric_cells(metric, year)])


def one_decimal(value: F) -> str:
    return f"{float(value):.1f}"


def parse_ratio(text: str) -> F | None:
    """A percent or a number of days: "41.2", "41.2%", "-3.4 %", "45.1 days"."""
    found = re.fullmatch(r"\s*([+-]?\d+(?:\.\d+)?)\s*(?:%|percent|days)?\s*", text)
    return F(found.group(1)) if found else None


TOLERANCE = F(1, 20)  # answers to one decimal


def check_ratio(text: str, exact: F, tolerance: F = TOLERANCE) -> bool:
    got = parse_ratio(text)
    return got is not None and abs(got - exact) <= tolerance


# --- level 3: the altered cell ----------------------------------------------------------------------------

def same_item(a: str, b: str) -> bool:
    norm = lambda s: re.sub(r"[^a-z0-9]+", " ", s.lower()).strip()  # noqa: E731
    return norm(a) == norm(b)


def check_cell_fix(text: str, filing: Filing, item: str, year: int) -> float:
    """1 for "item; year; raw value", 0.3 for the right cell with a wrong or missing value, else 0."""
    parts = [p.strip() for p in text.split(";")]
    if len(parts) not in (2, 3) or not same_item(parts[0], item) or parts[1] != str(year):
        return 0.0
    if len(parts) == 3 and same_amount(parts[2], filing.value(item, year), filing):
        return 1.0
    return 0.3


# --- level 4: conclusions with cited cells ------------------------------------------------------------------

def _cell_ok(cell: Any, filing: Filing) -> bool:
    if not isinstance(cell, Mapping) or not isinstance(cell.get("item"), str) or not isinstance(cell.get("year"), int):
        return False
    item, year, value = cell["item"], cell["year"], cell.get("value")
    if item not in filing.values or year not in filing.values[item]:
        return False
    text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    return isinstance(text, str) and same_amount(text, filing.value(item, year), filing)


def check_claim(claim: Any, filing: Filing) -> tuple[bool, int, int]:
    """(supported, cited cells correct, cited cells): a claim is supported when it names a known metric
    and year, cites exactly that metric's cells with their raw values, and states the value recomputed
    from them (to one decimal)."""
    if not isinstance(claim, Mapping):
        return False, 0, 0
    cells = claim.get("cells") if isinstance(claim.get("cells"), list) else []
    correct = sum(_cell_ok(c, filing) for c in cells)
    metric, year = claim.get("metric"), claim.get("year")
    if metric not in METRICS or not isinstance(year, int) or correct != len(cells):
        return False, correct, len(cells)
    want = metric_cells(metric, year)
    if [(c["item"], c["year"]) for c in cells] != want:
        return False, correct, len(cells)
    value = compute(metric, [filing.value(i, y) for i, y in want])
    stated = claim.get("value")
    stated = str(stated) if isinstance(stated, (int, float)) and not isinstance(stated, bool) else stated
    ok = value is not None and isinstance(stated, str) and check_ratio(stated, value)
    return ok, correct, len(cells)


def check_conclusion(text: str, filing: Filing, truth: Mapping[str, Any]) -> dict[str, float]:
    """{"terminal", "process"} of a conclusion (see the module doc). `truth`: {"conclusion", "driver",
    "required": [[metric, year], ...]} derived from the raw data when the task was made."""
    try:
        answer = json.loads(text)
    except ValueError:
        return {"terminal": 0.0, "process": 0.0}
    if not isinstance(answer, Mapping) or not isinstance(answer.get("claims"), list):
        return {"terminal": 0.0, "process": 0.0}
    checked = [(c, *check_claim(c, filing)) for c in answer["claims"][:20]]
    cells = sum(n for *_, n in checked)
    process = sum(k for _, _, k, _ in checked) / cells if cells else 0.0
    supported = {(c["metric"], c["year"]) for c, ok, *_ in checked if ok}
    unsupported = sum(not ok for _, ok, *_ in checked)
    required = {(m, y) for m, y in truth["required"]}
    right = (answer.get("conclusion") == truth["conclusion"] and isinstance(answer.get("driver"), str)
             and same_item(answer["driver"], truth["driver"]))
    if right and required <= supported and not unsupported:
        return {"terminal": 1.0, "process": process}
    partial = PARTIAL_CAP * len(required & supported) / len(required) * (1.0 if right else 0.5)
    return {"terminal": max(0.0, partial - UNSUPPORTED_COST * unsupported), "process": process}


def conclusion_truth(filing: Filing, year: int) -> dict[str, Any]:
    """What the operating margin did from `year - 1` to `year`, the cost line that moved most in that
    direction, and the claims a conclusion must support."""
    change = metric_value("operating_margin", filing, year) - metric_value("operating_margin", filing, year - 1)
    direction = "expanded" if change > 0 else "contracted"
    moves = {item: metric_value(m, filing, year) - metric_value(m, filing, year - 1) for item, m in COST_SHARES.items()}
    driver = (min if change > 0 else max)(moves, key=moves.get)
    required = [[m, y] for m in ("operating_margin", COST_SHARES[driver]) for y in (year - 1, year)]
    return {"conclusion": direction, "driver": driver, "required": required, "change": float(change),
            "moves": {k: float(v) for k, v in moves.items()}}


def claim(metric: str, filing: Filing, year: int, values: Mapping[tuple[str, int], int] | None = None) -> dict:
    """A claim citing the metric's cells (their raw values, or `values` overrides) with the value they give."""
    cells = [{"item": i, "year": y, "value": amount_str((values or {}).get((i, y), filing.value(i, y)))}
             for i, y in metric_cells(metric, year)]
    value = compute(metric, [F(c["value"].replace(",", "").replace("(", "-").rstrip(")")) for c in cells])
    return {"metric": metric, "year": year, "value": one_decimal(value) if value is not None else "0", "cells": cells}


def amount_str(value: int) -> str:
    return f"{value:,}"


def score_answer(answer: str, filing: Filing, check: dict) -> dict[str, float]:
    """{"terminal", "process"?} of an answer text against the raw data."""
    kind = check["type"]
    if kind == "amount":
        return {"terminal": float(same_amount(answer, filing.value(check["item"], check["year"]), filing))}
    if kind == "ratio":
        return {"terminal": float(check_ratio(answer, F(check["exact"])))}
    if kind == "fix":
        return {"terminal": check_cell_fix(answer, filing, check["item"], check["year"])}
    return check_conclusion(answer, filing, check["truth"])
