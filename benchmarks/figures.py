"""Every figure the README quotes, with the results file and key it comes from.

    python benchmarks/figures.py            # list README.md's figures: value, file, key, date, command, machine, load
    python benchmarks/figures.py FILE.md    # another markdown file

A figure is written as a markdown link to its results file whose title is the key path of the
value inside it, optionally scaled for display:

    [2.19×](benchmarks/results/rollout_vs_tunix.json "runs.34.speedup_vs_tunix")
    [63.6 %](benchmarks/results/rollout_realistic.json "runs_2026_12_04.native_prefill_swiglu_10_08Z.vs_roofline *100")
    [3,942 MiB](benchmarks/results/lora_memory.json "memory_large.lora.peak_bytes /1048576")

The key path is dot-separated (list indices are numbers). The first number in the link text must
equal the value (times or over the scale) to the precision it is printed with. A figure-like number
in the prose (a number with a unit such as ×, %, tokens/s, s, GiB or points, or a decimal fraction)
that is not inside such a link, a code span or a code block is an unsourced figure. Exits 1 when a
figure has no source, its key does not resolve, or its value differs; `tests/test_docs.py` runs
`check` on README.md.

Each figure's provenance (date, command, machine, load) is the nearest value of those keys on the
path from the file's root to the figure; missing ones are printed as "-" (load is missing from many
older records).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "benchmarks/results"
FIGURE_LINK = re.compile(r"\[([^\]]*)\]\((benchmarks/results/[\w.\-]+\.json) \"([^\"]+)\"\)")
NUMBER = re.compile(r"[-+−]?\d[\d,]*(?:\.\d+)?")
UNITS = (r"(?:×(?!\s?\d)|x\b(?!\s?\d)|%|tokens/s|GFLOP/s|GiB|MiB|GB|MB|ms\b|s\b|min\b|minutes\b|seconds\b"
         r"|hours\b|points\b)")  # "8 × 256" is a shape, not a figure
UNSOURCED = re.compile(r"(?<![\w.\-])(?:\d[\d,]*(?:\.\d+)?\s?" + UNITS + r"|\d+\.\d+(?![\w.]))")
PROVENANCE = {"date": ("date", "ran_at"), "command": ("command", "commands"), "machine": ("machine",)}


@dataclass
class Figure:
    """One figure of a markdown file: what it shows and where its value comes from."""
    text: str
    file: str
    key: str
    line: int
    value: Any = None
    provenance: dict | None = None
    error: str = ""


def load_result(path: str) -> Any:
    """A results file, by its path relative to the repository."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return json.load(f)


def resolve(data: Any, key: str) -> tuple[Any, list[Any]]:
    """(the value at a dot-separated key path, the containers walked through, root first)."""
    chain = [data]
    for part in key.split("."):
        if isinstance(data, list):
            if not part.isdigit() or int(part) >= len(data):
                raise KeyError(f"{part!r} is not an index of a list of {len(data)}")
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            near = sorted(data)[:12] if isinstance(data, dict) else type(data).__name__
            raise KeyError(f"no {part!r} (there: {near})")
        chain.append(data)
    return data, chain[:-1]


def provenance(chain: list[Any]) -> dict[str, str]:
    """Date, command, machine and load: the nearest of each on the way to a figure. A load is taken only
    from the record that gives the date or one inside it (a file's load describes its own first run)."""
    found: dict[str, str] = {}
    for node in reversed(chain):
        if not isinstance(node, dict):
            continue
        dated_above = "date" in found
        for name, keys in PROVENANCE.items():
            for key in keys:
                if name not in found and key in node:
                    found[name] = str(node[key])
        if dated_above:
            continue
        for key, value in node.items():
            if "load" not in found and key.startswith("load") and not isinstance(value, (dict, list)):
                found["load"] = str(value)
        said = re.search(r"load[^;,)]*", str(node.get("machine", "")))
        if "load" not in found and said:  # older records say the load in their machine's description
            found["load"] = said.group()
    return found


def _scale(spec: str) -> tuple[str, float]:
    """'key *100' -> ('key', 100.0); 'key /1048576' -> ('key', 1/1048576)."""
    key, _, scale = spec.partition(" ")
    if not scale:
        return key, 1.0
    if scale[0] in "*×":
        return key, float(scale[1:])
    if scale[0] == "/":
        return key, 1.0 / float(scale[1:])
    raise ValueError(f"scale {scale!r}: write *N or /N")


def _matches(text: str, value: Any, scale: float) -> str:
    """'' when the first number of `text` is `value`·scale as printed; else why not."""
    shown = NUMBER.search(text)
    if shown is None:
        return f"no number in {text!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"the key holds {value!r}, not a number"
    number = shown.group().replace(",", "").replace("−", "-")
    decimals = len(number.partition(".")[2])
    expected = value * scale
    if abs(abs(float(number)) - abs(expected)) > 0.5 * 10 ** -decimals + 1e-9:
        return f"shows {number}, the file has {expected:g}"
    return ""


def _prose(markdown: str) -> list[tuple[int, str]]:
    """(line number, text) of lines outside code blocks, with code spans removed."""
    out, fenced = [], False
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"`[^`]*`", "", line)))
    return out


def figures(markdown: str) -> list[Figure]:
    """Every figure link of a markdown text, resolved and checked, and every unsourced figure."""
    out = []
    for number, line in _prose(markdown):
        for match in FIGURE_LINK.finditer(line):
            text, path, spec = match.groups()
            figure = Figure(text, path, spec, number)
            try:
                key, scale = _scale(spec)
                figure.value, chain = resolve(load_result(path), key)
                figure.provenance = provenance(chain)
                figure.error = _matches(text, figure.value, scale)
                missing = [name for name in PROVENANCE if name not in figure.provenance]
                if missing and not figure.error:
                    figure.error = f"the record has no {', '.join(missing)}"
            except (OSError, ValueError, KeyError) as e:
                figure.error = f"{type(e).__name__}: {e}"
            out.append(figure)
        for match in UNSOURCED.finditer(FIGURE_LINK.sub("", line)):
            out.append(Figure(match.group(), "", "", number, error="no source: link it to its results file and key"))
    return out


def check(path: str) -> list[Figure]:
    """The figures of a markdown file (relative to the repository) that fail."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return [figure for figure in figures(f.read()) if figure.error]


def main(argv: list[str]) -> int:
    path = argv[0] if argv else "README.md"
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        found = figures(f.read())
    for figure in found:
        p = figure.provenance or {}
        where = f"{figure.file}:{figure.key}" if figure.file else "(no source)"
        print(f"{path}:{figure.line}  {figure.text!r}  {where}  = {figure.value!r}")
        if figure.file:
            print(f"    date {p.get('date', '-')} | machine {p.get('machine', '-')} | load {p.get('load', '-')}")
            print(f"    command {p.get('command', '-')[:160]}")
        if figure.error:
            print(f"    ERROR: {figure.error}")
    failed = [f for f in found if f.error]
    print(f"{len(found)} figures, {len(failed)} failing")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
