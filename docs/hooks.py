"""MkDocs hook: figures written as in the README link to their results on the site.

A figure in a written page is the README's link, `[1.025×](benchmarks/results/layer_layout.json
"speedup_per_layer")`: `benchmarks/figures.py` checks its value against the file, and
`tests/test_docs.py` checks every figure of a page that has one. On the site the results file is
not a page, so each such link is rewritten to the file's section of the generated benchmarks page,
the key path as the link's title (`mkdocs build --strict` fails if that section does not exist).
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import figures  # noqa: E402

BENCHMARKS_PAGE = "benchmarks.md"


def section_anchor(results_file: str) -> str:
    """The anchor MkDocs' toc gives the benchmarks page's `## name.json` heading."""
    return re.sub(r"[^\w\- ]", "", os.path.basename(results_file).lower()).replace(" ", "-")


def link_figures(markdown: str, page_path: str) -> str:
    """`markdown` (of the page at `page_path`, relative to docs/) with each figure link pointed at
    its results file's section of the benchmarks page."""
    page = os.path.relpath(BENCHMARKS_PAGE, os.path.dirname(page_path) or ".")

    def to_section(match: re.Match) -> str:
        text, results_file, key = match.groups()
        return f'[{text}]({page}#{section_anchor(results_file)} "{os.path.basename(results_file)}: {key}")'

    return figures.FIGURE_LINK.sub(to_section, markdown)


def on_page_markdown(markdown: str, page, **_) -> str:
    return link_figures(markdown, page.file.src_uri)
