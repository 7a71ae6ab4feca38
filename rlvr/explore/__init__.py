"""The run explorer: a local web page over one or more workdirs (runs, samples, episodes, compare, failures).

    python -m rlvr.explore WORKDIR [WORKDIR ...] --port=8008

Reading order: `jsonl` (the lazy byte-offset index of a JSONL file), `runs` (what each view shows,
as JSON), `server` (the HTTP API and static files), `static/` (the page: plain JS, SVG charts, no
build step and nothing fetched from elsewhere).
"""
