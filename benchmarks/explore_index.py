"""Run explorer on a large run: index and page 100k synthetic episodes (`rlvr.explore`).

    .venv/bin/python benchmarks/explore_index.py [--episodes=100000] [--out=DIR]

Writes DIR/episodes.jsonl (synthetic multi-turn episodes shaped like the agentic runs' records: task,
rewards, trace with turns, tool calls and sandbox runs, ~3 KB each), then measures, in one process:
  index_s            JsonlIndex.refresh on the cold file (the newline scan: what opening a run costs)
  read_s             a plain sequential read of the file (the disk/page-cache bound of any scan)
  parse_all_s        json.loads of every line (what a reader that parses everything pays to open)
  page_ms            GET /api/episodes (first and last page, 50 rows) through the HTTP server, median
  episode_ms         GET /api/episode?i=N (one full record), median
  first_filter_s     the first filtered page (parses every line once into summaries)
  filter_ms          later filtered pages, median
  browser_*_s        (--browser) headless Chromium on a fresh server: page up, episodes listed
Ratios: index_s / read_s (how close the index is to the read bound) and parse_all_s / index_s.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import emit  # noqa: E402
from rlvr.explore.jsonl import JsonlIndex  # noqa: E402
from rlvr.explore.runs import episode_summary  # noqa: E402
from rlvr.explore.server import serve_in_background  # noqa: E402


def synthetic_episode(i: int) -> dict:
    a, b = i % 997, (i * 7) % 991
    call = {"name": "calc", "arguments": {"expr": f"{a}+{b}"}, "status": "ok", "output": str(a + b),
            "elapsed_s": 0.001, "sandbox": [0]}
    run = {"what": "python", "backend": "runsc", "exit_code": 0, "signal": None,
           "limit_hit": "wall_time" if i % 1000 == 0 else None, "stdout": f"{a + b}\n" * 20, "stderr": "",
           "code": f"print({a}+{b})\n" * 10, "timings": {"queue_s": 0.001, "start_s": 0.05, "run_s": 0.02}}
    correct = float(i % 3 == 0)
    turns = [{"turn": 0, "tokens": 40, "text": f"<tool_call>{json.dumps(call['arguments'])}</tool_call>" + "x" * 200,
              "observation": [{"role": "tool", "name": "calc", "content": str(a + b)}], "rewards": {},
              "info": {"calls": [call], "errors": [], "stop": "call"}},
             {"turn": 1, "tokens": 12, "text": f"<answer>{a + b if correct else 0}</answer>", "observation": [],
              "rewards": {"terminal": correct}, "info": {"calls": [], "errors": [], "stop": "answer"}}]
    rewards = {"terminal": correct, "format": 0.0, "reward": correct, "correct": correct, "tool_calls": 1.0}
    return {"step": i // 64, "task": {"index": i % 500, "family": f"fam{i % 4}", "level": i % 3,
                                      "prompt": f"Compute {a}+{b}. " + "Use the calculator tool. " * 20},
            "rewards": rewards, "truncated": False, "turns": 2,
            "trace": {"rid": f"s{i // 64}-t{i % 500}-k{i % 8}", "stop": "answer", "messages": [],
                      "turns": turns, "env": {"env": "tool_calc", "sandbox": [run], "turns": []}}}


def write_file(path: str, count: int) -> None:
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps(synthetic_episode(i)) + "\n")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def get(url: str) -> dict:
    with urllib.request.urlopen(url) as response:
        return json.loads(response.read())


def median_ms(fn, repeats: int = 20) -> float:
    return round(1000 * statistics.median(timed(fn) for _ in range(repeats)), 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=100_000)
    parser.add_argument("--out", default=None, help="the run's directory (default: a temporary one)")
    parser.add_argument("--browser", action="store_true", help="also time opening the page in headless Chromium")
    args = parser.parse_args()
    workdir = args.out or tempfile.mkdtemp(prefix="explore-bench-")
    path = os.path.join(workdir, "episodes.jsonl")
    write_s = timed(lambda: write_file(path, args.episodes))
    size = os.path.getsize(path)

    def read_all():
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass

    def parse_all():
        with open(path, "rb") as f:
            for line in f:
                json.loads(line)

    read_s = min(timed(read_all) for _ in range(3))  # warm page cache, as the index below sees it
    index = JsonlIndex(path, episode_summary)
    index_s = timed(index.refresh)
    parse_all_s = timed(parse_all)
    assert len(index) == args.episodes
    server = serve_in_background([workdir])
    base = f"http://127.0.0.1:{server.server_address[1]}"
    first_page_ms = median_ms(lambda: get(f"{base}/api/episodes?run=0&offset=0&limit=50"))
    last = get(f"{base}/api/episodes?run=0&offset={args.episodes - 50}&limit=50")
    assert last["total"] == args.episodes and last["rows"][-1]["i"] == args.episodes - 1
    last_page_ms = median_ms(lambda: get(f"{base}/api/episodes?run=0&offset={args.episodes - 50}&limit=50"))
    episode_ms = median_ms(lambda: get(f"{base}/api/episode?run=0&i={args.episodes // 2}"))
    first_filter_s = timed(lambda: get(f"{base}/api/episodes?run=0&family=fam1&level=2&limit=50"))
    filtered = get(f"{base}/api/episodes?run=0&family=fam1&level=2&limit=50")
    expected = sum(1 for i in range(args.episodes) if i % 4 == 1 and i % 3 == 2)
    assert filtered["total"] == expected, (filtered["total"], expected)
    filter_ms = median_ms(lambda: get(f"{base}/api/episodes?run=0&family=fam2&reward_min=1&offset=100&limit=50"), 5)
    server.shutdown()
    browser = browser_open_s(workdir) if args.browser else {}
    emit({"benchmark": "explore_index", "episodes": args.episodes, "file_mb": round(size / 2**20, 1),
          "write_s": round(write_s, 2), "read_s": round(read_s, 3), "index_s": round(index_s, 3),
          "parse_all_s": round(parse_all_s, 2), "index_over_read": round(index_s / read_s, 2),
          "parse_all_over_index": round(parse_all_s / index_s, 1), "first_page_ms": first_page_ms,
          "last_page_ms": last_page_ms, "episode_ms": episode_ms, "first_filter_s": round(first_filter_s, 2),
          "filter_ms": filter_ms, "cpus": os.cpu_count(), "python": platform.python_version(),
          "load_average": [round(x, 1) for x in os.getloadavg()], **browser})


def browser_open_s(workdir: str) -> dict:
    """A fresh server (nothing parsed yet) and headless Chromium: seconds until the page is up, and
    until the episodes view lists its first page (the filters' choices still loading)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    server = serve_in_background([workdir])
    try:
        t0 = time.perf_counter()
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/#episodes")
        while not driver.execute_script("return document.body.dataset.ready === '1'"):
            time.sleep(0.01)
        ready = time.perf_counter() - t0
        while not driver.execute_script("return document.querySelectorAll('#episodes-table tr[data-i]').length"):
            time.sleep(0.01)
        listed = time.perf_counter() - t0
    finally:
        driver.quit()
        server.shutdown()
    return {"browser_ready_s": round(ready, 2), "browser_episodes_listed_s": round(listed, 2)}


if __name__ == "__main__":
    main()
