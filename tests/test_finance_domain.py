"""The finance domain kit (rlvr.domains.finance): consistent filings, a PDF that round-trips, verifiers that
check against the raw data, scripted solutions at full reward, every audit probe below it, an RL smoke run.

Independent references: the identities are re-derived here from the rendered Markdown (parsing the text,
not reading the generator's values), the PDF's numbers are compared with the raw data, and the verifiers
are checked on hand-written answers.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from rlvr.domains.finance import generate as gen
from rlvr.domains.finance import verify as fv
from rlvr.domains.finance.families import FAMILIES, FinanceDocs, probe_answers
from rlvr.envs import make_env, play
from rlvr.tasks.audit import FP_REWARD


def parse_markdown(text: str) -> dict[str, dict[int, int]]:
    """line item -> year -> amount, read back from the Markdown tables and the segment note."""
    out: dict[str, dict[int, int]] = {}
    years: list[int] = []
    number = lambda s: -int(s[1:-1].replace(",", "")) if s.startswith("(") else int(s.replace(",", ""))  # noqa: E731
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| Line item"):
            years = [int(y) for y in cells[1:]]
        elif line.startswith("| ") and len(cells) == len(years) + 1:
            out[cells[0]] = dict(zip(years, map(number, cells[1:]), strict=True))
        elif line.startswith("Revenue - "):
            name, rest = line.split(": ", 1)
            out[name] = {int(y): number(v) for y, v in re.findall(r"(\d{4}): (\(?[\d,]+\)?)", rest)}
    return out


def test_filings_satisfy_the_accounting_identities_over_thousands_of_seeds():
    for seed in range(3000):
        filing = gen.make_filing(np.random.default_rng(seed), years=3)
        assert gen.check_identities(filing) == [], seed
    for seed in range(200):  # re-derived from the rendered text, with this test's own arithmetic
        filing = gen.make_filing(np.random.default_rng(seed), years=int(2 + seed % 3))
        v = parse_markdown(gen.to_markdown(filing))
        segments = [k for k in v if k.startswith("Revenue - ")]
        for y in filing.years:
            assets = sum(v[k][y] for k in ("Cash and cash equivalents", "Accounts receivable", "Inventories",
                                            "Property, plant and equipment, net"))
            assert assets == v["Total assets"][y] == v["Accounts payable"][y] + v["Long-term debt"][y] + \
                v["Share capital"][y] + v["Retained earnings"][y], (seed, y)
            assert v["Revenue"][y] == sum(v[k][y] for k in segments)
            assert v["Net income"][y] == v["Revenue"][y] - v["Cost of revenue"][y] - sum(v[k][y] for k in (
                "Selling, general and administrative", "Research and development", "Interest expense",
                "Income tax expense"))
            flows = ("Net cash from operating activities", "Net cash used in investing activities",
                     "Net cash from financing activities")
            assert v["Cash at end of year"][y] == v["Cash at beginning of year"][y] + sum(v[k][y] for k in flows)
            assert v["Cash and cash equivalents"][y] == v["Cash at end of year"][y]
            if y - 1 in v["Retained earnings"]:
                assert v["Cash at beginning of year"][y] == v["Cash and cash equivalents"][y - 1]
                assert v["Retained earnings"][y] == v["Retained earnings"][y - 1] + v["Net income"][y] + \
                    v["Dividends paid"][y]


def test_one_altered_cell_breaks_an_identity():
    filing = gen.make_filing(np.random.default_rng(7))
    values = {k: dict(d) for k, d in filing.values.items()}
    values["Inventories"][filing.years[1]] += 10
    assert gen.check_identities(filing, values) == [f"Total assets {filing.years[1]}"]


def test_pdf_tables_round_trip_to_the_raw_data():
    """read_table (pdfplumber on the reportlab PDF) gives back every number of every statement."""
    family = FAMILIES["finance_docs_tools"](seed=0)
    for index in range(3):
        task = family.task(index, level=0)
        filing = gen.Filing.from_json(task.metadata["filing"])
        with make_env(task) as env:
            for statement, items in gen.STATEMENTS.items():
                rows = env._read_table(statement).splitlines()[1:]
                assert rows[0].split(" | ") == ["Line item", *map(str, filing.years)]
                got = {r.split(" | ")[0]: [fv.parse_amount(c, filing) for c in r.split(" | ")[1:]] for r in rows[1:]}
                scale = gen.UNITS[filing.unit]
                assert got == {item: [filing.value(item, y) * scale for y in filing.years] for item in items}


def test_amounts_units_and_hand_checked_answers():
    filing = gen.make_filing(np.random.default_rng(1))  # thousands of GBP (see the generator's draw)
    assert (filing.unit, filing.currency) == ("thousands", "GBP")
    assert fv.parse_amount("(1,234)", filing) == fv.parse_amount("-1234", filing) == -1_234_000
    assert fv.parse_amount("1.234 million GBP", filing) == fv.parse_amount("£1,234", filing) == 1_234_000
    assert fv.parse_amount("1,234 million", filing) == 1_234_000_000  # right number, wrong unit
    assert fv.parse_amount("1,234 EUR", filing) is None and fv.parse_amount("1,234 and 5", filing) is None
    # gross margin 2017: 11,764 / 23,117 (the rendered filing) = 50.889...%
    assert fv.check_ratio("50.9", fv.metric_value("gross_margin", filing, 2017))
    assert fv.check_ratio("50.9%", fv.F(11764 * 100, 23117)) and not fv.check_ratio("51.0", fv.F(11764 * 100, 23117))
    claim = {"metric": "gross_margin", "year": 2017, "value": "50.9",
             "cells": [{"item": "Gross profit", "year": 2017, "value": "11,764"},
                       {"item": "Revenue", "year": 2017, "value": 23117}]}
    assert fv.check_claim(claim, filing) == (True, 2, 2)
    wrong = dict(claim, cells=[dict(claim["cells"][0], value="11,796"), claim["cells"][1]])  # 2018's figure
    assert fv.check_claim(wrong, filing) == (False, 1, 2)


@pytest.mark.parametrize("level", [0, 1, 2, 3, 4])
def test_references_score_one_and_every_probe_scores_below_full(level):
    family, kinds = FinanceDocs(seed=0), set()
    for index in range(12):
        task = family.task(index, level=level)
        assert family.score(task, family.reference_completion(task), False)["reward"] == 1.0
        filing = gen.Filing.from_json(task.metadata["filing"])
        for kind, text in probe_answers(filing, task.metadata["check"]):
            scores = family.score(task, f"<answer>{text}</answer>", False)
            assert scores["correct"] == 0 and scores["reward"] < FP_REWARD, (level, kind, text, scores)
            kinds.add(kind)
    assert {"wrong_unit", "wrong_year", "distractor"} <= kinds


@pytest.mark.parametrize("level", [0, 1, 2, 3, 4])
def test_scripted_episodes_score_one_with_process_credit(level):
    family = FAMILIES["finance_docs_tools"](seed=0)
    task = family.task(level, level=level)
    with make_env(task) as env:
        messages = play(env, family.reference_turns(task))
        rewards = env.final_rewards()
    assert rewards["correct"] == 1.0 and rewards["process.cell_located"] == pytest.approx(0.1), rewards
    assert json.dumps(env.trace()) and messages[-1]["role"] == "assistant"
    with make_env(task) as env:  # the right cell copied without looking: no process credit, same verdict
        play(env, [f"<answer>{task.answer}</answer>"])
        assert env.final_rewards()["process"] == 0.0


@pytest.mark.sandbox
def test_python_calculator_runs_in_the_sandbox():
    """The python tool (python=True) computes a ratio from the filing's cells in gVisor."""
    family = FAMILIES["finance_docs_tools"](seed=0)
    task = family.task(0, level=1)
    filing = gen.Filing.from_json(task.metadata["filing"])
    check = task.metadata["check"]
    (item_a, year_a), (item_b, year_b) = fv.metric_cells(check["metric"], check["year"])[:2]
    a, b = filing.value(item_a, year_a), filing.value(item_b, year_b)
    call = json.dumps({"name": "python", "arguments": {"code": f"print({a} * 7 + {b})"}})
    with make_env(task, python=True, backend="runsc") as env:
        step = env.step(f"<tool_call>{call}</tool_call>")
    assert step.info["calls"][0]["status"] == "ok" and step.observation[0]["content"].strip() == str(a * 7 + b)


def test_rl_smoke_tiny_model_plays_finance_tool_episodes(tmp_path):
    from rlvr import config_lib
    from rlvr.main import run

    config = config_lib.load_config("configs/finance_docs.py:tiny,tools,smoke", {})
    summary = run(config, str(tmp_path))
    assert summary["final_step"] == config.train.num_steps
    episodes = [json.loads(line) for line in open(tmp_path / "episodes.jsonl")]
    assert len(episodes) == config.rl.prompts_per_step * config.rl.group_size * config.train.num_steps
    assert all(e["task"]["family"] == "finance_docs_tools" and e["trace"]["env"]["env"] == "finance_docs"
               for e in episodes)
