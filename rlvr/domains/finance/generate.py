"""Procedural company filings: several years of three statements that reconcile, and their renderings.

    filing = make_filing(rng, years=3)              # a Filing: raw data, the source of truth
    filing.value("Inventories", 2023)               # one cell (an int, in `filing.unit` of `filing.currency`)
    check_identities(filing)                        # [] for a consistent filing, else the broken identities
    to_markdown(filing) / to_html(filing) / to_pdf(filing) -> bytes (reportlab, the `docs` extra)

How the numbers are built (so the identities hold by construction, and `check_identities` re-derives them):

- income statement: revenue is the sum of 2-3 segments (note 2); gross profit = revenue - cost of
  revenue; operating income = gross profit - SG&A - R&D; income before taxes = operating income -
  interest; net income = income before taxes - tax; comprehensive income = net income + OCI.
- balance sheet: an opening year (not shown) balances by construction (retained earnings are its
  plug); each year, PP&E rolls forward (+ capex - depreciation), retained earnings (+ net income -
  dividends), debt by the net debt issued, cash by the cash-flow statement. Then assets = liabilities
  + equity holds every year without a plug (the changes on both sides are the same sum).
- cash flow: operating = net income + depreciation + change in working capital; investing = -capex;
  financing = net debt issued - dividends; cash at the end = cash at the beginning + the net change.

Distractors a careless reader copies: "Comprehensive income" beside "Net income", segment revenues
beside revenue, prior-year columns, and a restatement note (the original figure of a restated cell).
Amounts are integers in the filing's unit (thousands or millions); negatives are shown in parentheses.
"""

from __future__ import annotations

import dataclasses
import html
import io
from typing import Any

import numpy as np

CURRENCIES = ("USD", "EUR", "GBP", "CHF")
UNITS = {"thousands": 1_000, "millions": 1_000_000}
SEGMENT_NAMES = ("Software", "Hardware", "Services", "Licensing", "Consumer", "Industrial", "Retail", "Cloud")
COMPANY_WORDS = (("Northwind", "Aster", "Bellmont", "Corvid", "Delphine", "Halcyon", "Kestrel", "Lumen"),
                 ("Systems", "Industries", "Holdings", "Technologies", "Group", "Analytics"))

INCOME = ("Revenue", "Cost of revenue", "Gross profit", "Selling, general and administrative",
          "Research and development", "Operating income", "Interest expense", "Income before taxes",
          "Income tax expense", "Net income", "Other comprehensive income", "Comprehensive income")
BALANCE = ("Cash and cash equivalents", "Accounts receivable", "Inventories", "Property, plant and equipment, net",
           "Total assets", "Accounts payable", "Long-term debt", "Total liabilities", "Share capital",
           "Retained earnings", "Total equity", "Total liabilities and equity")
CASH_FLOW = ("Net income", "Depreciation", "Change in working capital", "Net cash from operating activities",
             "Capital expenditures", "Net cash used in investing activities", "Debt issued (repaid), net",
             "Dividends paid", "Net cash from financing activities", "Net change in cash",
             "Cash at beginning of year", "Cash at end of year")
STATEMENTS = {"income statement": INCOME, "balance sheet": BALANCE, "cash flow statement": CASH_FLOW}

# (total, components with signs): every identity of a year; check_identities recomputes them all
SUMS = (
    ("Gross profit", (("Revenue", 1), ("Cost of revenue", -1))),
    ("Operating income", (("Gross profit", 1), ("Selling, general and administrative", -1),
                          ("Research and development", -1))),
    ("Income before taxes", (("Operating income", 1), ("Interest expense", -1))),
    ("Net income", (("Income before taxes", 1), ("Income tax expense", -1))),
    ("Comprehensive income", (("Net income", 1), ("Other comprehensive income", 1))),
    ("Total assets", (("Cash and cash equivalents", 1), ("Accounts receivable", 1), ("Inventories", 1),
                      ("Property, plant and equipment, net", 1))),
    ("Total liabilities", (("Accounts payable", 1), ("Long-term debt", 1))),
    ("Total equity", (("Share capital", 1), ("Retained earnings", 1))),
    ("Total liabilities and equity", (("Total liabilities", 1), ("Total equity", 1))),
    ("Total assets", (("Total liabilities and equity", 1),)),
    ("Net cash from operating activities", (("Net income", 1), ("Depreciation", 1), ("Change in working capital", 1))),
    ("Net cash used in investing activities", (("Capital expenditures", 1),)),
    ("Net cash from financing activities", (("Debt issued (repaid), net", 1), ("Dividends paid", 1))),
    ("Net change in cash", (("Net cash from operating activities", 1), ("Net cash used in investing activities", 1),
                            ("Net cash from financing activities", 1))),
    ("Cash at end of year", (("Cash at beginning of year", 1), ("Net change in cash", 1))),
    ("Cash and cash equivalents", (("Cash at end of year", 1),)),
)


@dataclasses.dataclass
class Filing:
    """One company's statements over `years` (the raw data every verifier checks against)."""

    company: str
    currency: str
    unit: str  # "thousands" | "millions"
    years: list[int]
    values: dict[str, dict[int, int]]  # line item -> year -> amount (in `unit`); segments as "Revenue - <name>"
    segments: list[str]
    opening: dict[str, int]  # the balance sheet of the year before years[0] (not rendered)
    restatement: dict[str, Any] | None = None  # {"item", "year", "original"}: a note's prior figure

    def value(self, item: str, year: int) -> int:
        return self.values[item][year]

    def previous(self, item: str, year: int) -> int:
        """The item's value a year earlier (the opening balance for the first year)."""
        return self.values[item][year - 1] if year - 1 in self.values[item] else self.opening[item]

    def scale_words(self) -> str:
        return f"in {self.unit} of {self.currency}"

    def to_json(self) -> dict[str, Any]:
        values = {item: {str(y): v for y, v in by_year.items()} for item, by_year in self.values.items()}
        return {**dataclasses.asdict(self), "values": values}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Filing:
        values = {item: {int(y): v for y, v in by_year.items()} for item, by_year in data["values"].items()}
        return cls(**{**data, "values": values})


def segment_item(name: str) -> str:
    return f"Revenue - {name}"


def _pick(rng: np.random.Generator, items, count: int | None = None):
    if count is None:
        return items[int(rng.integers(len(items)))]
    return [items[int(i)] for i in rng.choice(len(items), size=count, replace=False)]


def _year(rng: np.random.Generator, f: Filing, year: int, revenue_by_segment: dict[str, int]) -> None:
    """Fills one year's cells from the previous year's balances (see the module doc)."""
    v = {item: f.values.setdefault(item, {}) for item in (*INCOME, *BALANCE, *CASH_FLOW)}
    for name, amount in revenue_by_segment.items():
        f.values.setdefault(segment_item(name), {})[year] = amount
    revenue = sum(revenue_by_segment.values())
    rate = lambda lo, hi: float(rng.uniform(lo, hi))  # noqa: E731
    v["Revenue"][year] = revenue
    v["Cost of revenue"][year] = round(revenue * rate(0.35, 0.7))
    v["Gross profit"][year] = revenue - v["Cost of revenue"][year]
    v["Selling, general and administrative"][year] = round(revenue * rate(0.08, 0.2))
    v["Research and development"][year] = round(revenue * rate(0.02, 0.1))
    v["Operating income"][year] = (v["Gross profit"][year] - v["Selling, general and administrative"][year]
                                   - v["Research and development"][year])
    debt_before = f.previous("Long-term debt", year)
    v["Interest expense"][year] = round(debt_before * rate(0.02, 0.07))
    v["Income before taxes"][year] = v["Operating income"][year] - v["Interest expense"][year]
    v["Income tax expense"][year] = max(0, round(v["Income before taxes"][year] * rate(0.18, 0.3)))
    v["Net income"][year] = v["Income before taxes"][year] - v["Income tax expense"][year]
    v["Other comprehensive income"][year] = round(revenue * rate(-0.02, 0.02))
    v["Comprehensive income"][year] = v["Net income"][year] + v["Other comprehensive income"][year]
    # balance sheet drivers, then the cash-flow statement that links them
    v["Accounts receivable"][year] = round(revenue * rate(0.1, 0.2))
    v["Inventories"][year] = round(v["Cost of revenue"][year] * rate(0.1, 0.25))
    v["Accounts payable"][year] = round(v["Cost of revenue"][year] * rate(0.08, 0.18))
    ppe_before = f.previous("Property, plant and equipment, net", year)
    v["Depreciation"][year] = round(ppe_before * rate(0.08, 0.15))
    capex = round(revenue * rate(0.03, 0.09))
    v["Capital expenditures"][year] = -capex
    v["Property, plant and equipment, net"][year] = ppe_before + capex - v["Depreciation"][year]
    working = sum(f.previous(k, year) - v[k][year] for k in ("Accounts receivable", "Inventories"))
    v["Change in working capital"][year] = working + v["Accounts payable"][year] - f.previous("Accounts payable", year)
    v["Net cash from operating activities"][year] = (v["Net income"][year] + v["Depreciation"][year]
                                                     + v["Change in working capital"][year])
    v["Net cash used in investing activities"][year] = -capex
    dividends = max(0, round(v["Net income"][year] * rate(0.0, 0.4)))
    cash_before = f.previous("Cash and cash equivalents", year)
    before_debt = cash_before + v["Net cash from operating activities"][year] - capex - dividends
    floor = round(revenue * 0.03)  # repay a little or issue, but keep cash above a floor
    issued = max(floor - before_debt, round(debt_before * rate(-0.15, 0.1)))
    v["Debt issued (repaid), net"][year] = issued
    v["Dividends paid"][year] = -dividends
    v["Net cash from financing activities"][year] = issued - dividends
    v["Long-term debt"][year] = debt_before + issued
    v["Net change in cash"][year] = (v["Net cash from operating activities"][year] - capex
                                     + v["Net cash from financing activities"][year])
    v["Cash at beginning of year"][year] = cash_before
    v["Cash at end of year"][year] = cash_before + v["Net change in cash"][year]
    v["Cash and cash equivalents"][year] = v["Cash at end of year"][year]
    v["Share capital"][year] = f.previous("Share capital", year)
    v["Retained earnings"][year] = f.previous("Retained earnings", year) + v["Net income"][year] - dividends
    _totals(v, year)


def _totals(v: dict[str, dict[int, int]], year: int) -> None:
    v["Total assets"][year] = sum(v[k][year] for k in ("Cash and cash equivalents", "Accounts receivable",
                                                       "Inventories", "Property, plant and equipment, net"))
    v["Total liabilities"][year] = v["Accounts payable"][year] + v["Long-term debt"][year]
    v["Total equity"][year] = v["Share capital"][year] + v["Retained earnings"][year]
    v["Total liabilities and equity"][year] = v["Total liabilities"][year] + v["Total equity"][year]


def _opening(rng: np.random.Generator, revenue: int) -> dict[str, int]:
    """A balanced opening balance sheet (retained earnings are the plug)."""
    o = {"Cash and cash equivalents": round(revenue * rng.uniform(0.05, 0.2)),
         "Accounts receivable": round(revenue * rng.uniform(0.1, 0.2)),
         "Inventories": round(revenue * rng.uniform(0.05, 0.12)),
         "Property, plant and equipment, net": round(revenue * rng.uniform(0.3, 0.8)),
         "Accounts payable": round(revenue * rng.uniform(0.05, 0.1)),
         "Long-term debt": round(revenue * rng.uniform(0.1, 0.4)),
         "Share capital": round(revenue * rng.uniform(0.05, 0.15))}
    assets = sum(o[k] for k in ("Cash and cash equivalents", "Accounts receivable", "Inventories",
                                "Property, plant and equipment, net"))
    o["Retained earnings"] = assets - o["Accounts payable"] - o["Long-term debt"] - o["Share capital"]
    return o


def make_filing(rng: np.random.Generator, years: int = 3) -> Filing:
    """A consistent filing of `years` years (see the module doc); a restatement note one time in two."""
    first = int(rng.integers(2012, 2024))
    segments = _pick(rng, SEGMENT_NAMES, int(rng.integers(2, 4)))
    shares = {s: float(rng.uniform(0.5, 1.5)) for s in segments}
    total = float(10 ** rng.uniform(3.3, 5.9))  # revenue of the first year, in the filing's unit
    filing = Filing(company=f"{_pick(rng, COMPANY_WORDS[0])} {_pick(rng, COMPANY_WORDS[1])}",
                    currency=_pick(rng, CURRENCIES), unit=_pick(rng, list(UNITS)),
                    years=list(range(first, first + years)), values={}, segments=segments,
                    opening=_opening(rng, round(total)))
    for year in filing.years:
        norm = sum(shares.values())
        _year(rng, filing, year, {s: max(1, round(total * w / norm)) for s, w in shares.items()})
        shares = {s: w * float(rng.uniform(0.85, 1.25)) for s, w in shares.items()}
        total *= float(rng.uniform(0.9, 1.25))
    if rng.random() < 0.5:
        year = filing.years[int(rng.integers(len(filing.years) - 1))]
        item = _pick(rng, ("Revenue", "Net income", "Inventories"))
        shift = max(1, round(abs(filing.value(item, year)) * float(rng.uniform(0.02, 0.08))))
        filing.restatement = {"item": item, "year": year,
                              "original": filing.value(item, year) + shift * (1 if rng.random() < 0.5 else -1)}
    return filing


def check_identities(filing: Filing, values: dict[str, dict[int, int]] | None = None,
                     visible: bool = False) -> list[str]:
    """The identities (SUMS, segment sums, roll-forwards) that `values` (default: the filing's) break.
    `visible`: only those a reader of the rendered filing can check (the first year's roll-forwards need
    the opening balance sheet, which is not shown)."""
    v = filing.values if values is None else values
    broken = []
    for year in filing.years:
        for total, parts in (*SUMS, ("Revenue", tuple((segment_item(s), 1) for s in filing.segments))):
            if v[total][year] != sum(sign * v[item][year] for item, sign in parts):
                broken.append(f"{total} {year}")
        prev = {k: v[k][year - 1] if year - 1 in v[k] else filing.opening[k] for k in filing.opening}
        rolls = {"Property, plant and equipment, net": prev["Property, plant and equipment, net"]
                 - v["Capital expenditures"][year] - v["Depreciation"][year],
                 "Retained earnings": prev["Retained earnings"] + v["Net income"][year] + v["Dividends paid"][year],
                 "Long-term debt": prev["Long-term debt"] + v["Debt issued (repaid), net"][year],
                 "Cash at beginning of year": prev["Cash and cash equivalents"]}
        if visible and year == filing.years[0]:
            continue
        broken += [f"{item} {year} (roll-forward)" for item, want in rolls.items() if v[item][year] != want]
    return broken


# --- renderings ------------------------------------------------------------------------------------------

def amount_text(value: int) -> str:
    """Accounting style: thousands separators, negatives in parentheses."""
    return f"({-value:,})" if value < 0 else f"{value:,}"


def statement_rows(filing: Filing, statement: str, values: dict | None = None) -> list[list[str]]:
    """A statement as text rows: the header (line item, years) then one row per line item."""
    v = filing.values if values is None else values
    return [["Line item", *map(str, filing.years)],
            *[[item, *(amount_text(v[item][y]) for y in filing.years)] for item in STATEMENTS[statement]]]


def notes(filing: Filing, values: dict | None = None) -> list[tuple[str, list[str]]]:
    """(title, paragraphs) of the notes: basis of presentation, segments, a restatement when there is one."""
    v = filing.values if values is None else values
    out = [("Note 1 - Basis of presentation",
            [f"All amounts are {filing.scale_words()} unless stated otherwise. Fiscal years end on 31 December."])]
    lines = [f"{segment_item(s)}: " + ", ".join(f"{y}: {amount_text(v[segment_item(s)][y])}" for y in filing.years)
             for s in filing.segments]
    out.append(("Note 2 - Segment revenue", lines))
    if filing.restatement:
        r = filing.restatement
        out.append(("Note 3 - Restatement", [
            f"{r['item']} for {r['year']} has been restated to {amount_text(filing.value(r['item'], r['year']))} "
            f"(as originally reported: {amount_text(r['original'])}) following a review of cut-off procedures."]))
    return out


def title(filing: Filing, statement: str) -> str:
    return f"Consolidated {statement} ({filing.scale_words()})"


def to_markdown(filing: Filing, values: dict | None = None) -> str:
    parts = [f"# {filing.company}: annual report {filing.years[-1]}"]
    for statement in STATEMENTS:
        rows = statement_rows(filing, statement, values)
        parts.append(f"## {title(filing, statement)}\n\n" + "\n".join(
            ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
             *("| " + " | ".join(r) + " |" for r in rows[1:])]))
    for heading, paragraphs in notes(filing, values):
        parts.append(f"### {heading}\n\n" + "\n".join(paragraphs))
    return "\n\n".join(parts) + "\n"


def to_html(filing: Filing, values: dict | None = None) -> str:
    esc = html.escape
    parts = [f"<h1>{esc(filing.company)}: annual report {filing.years[-1]}</h1>"]
    for statement in STATEMENTS:
        rows = statement_rows(filing, statement, values)
        head = "".join(f"<th>{esc(c)}</th>" for c in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
        parts.append(f"<h2>{esc(title(filing, statement))}</h2><table><tr>{head}</tr>{body}</table>")
    for heading, paragraphs in notes(filing, values):
        parts.append(f"<h3>{esc(heading)}</h3>" + "".join(f"<p>{esc(p)}</p>" for p in paragraphs))
    return "\n".join(parts) + "\n"


def to_pdf(filing: Filing, values: dict | None = None) -> bytes:
    """The filing as a PDF (reportlab): one page per statement (a ruled table), then the notes."""
    try:
        from reportlab.lib import colors
        from reportlab.lib.pagesizes import A4
        from reportlab.lib.styles import getSampleStyleSheet
        from reportlab.platypus import PageBreak, Paragraph, SimpleDocTemplate, Table, TableStyle
    except ImportError as e:
        raise ImportError("the PDF path of rlvr.domains.finance needs reportlab: pip install -e '.[docs]'") from e
    styles = getSampleStyleSheet()
    story: list[Any] = [Paragraph(html.escape(f"{filing.company}: annual report {filing.years[-1]}"), styles["Title"])]
    for statement in STATEMENTS:
        story.append(Paragraph(html.escape(title(filing, statement)), styles["Heading2"]))
        table = Table(statement_rows(filing, statement, values))
        table.setStyle(TableStyle([("GRID", (0, 0), (-1, -1), 0.5, colors.black),
                                   ("ALIGN", (1, 0), (-1, -1), "RIGHT")]))
        story += [table, PageBreak()]
    for heading, paragraphs in notes(filing, values):
        story.append(Paragraph(html.escape(heading), styles["Heading3"]))
        story += [Paragraph(html.escape(p), styles["Normal"]) for p in paragraphs]
    out = io.BytesIO()
    SimpleDocTemplate(out, pagesize=A4, title=filing.company, invariant=1).build(story)
    return out.getvalue()


def shown_values(filing: Filing, check: dict) -> dict:
    """The values the document shows (level 3: one cell altered)."""
    if check["type"] != "fix":
        return filing.values
    values = {k: dict(v) for k, v in filing.values.items()}
    values[check["shown"]["item"]][check["shown"]["year"]] = check["shown"]["value"]
    return values
