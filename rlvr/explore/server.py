"""The explorer's HTTP server: a JSON API over `rlvr.explore.runs` and the static page (no build step).

    GET  /                       the page (static/index.html, app.js, style.css)
    GET  /api/overview           runs, config diff, curves, capability tables
    GET  /api/samples?run=R&...  a page of samples (filters: tag family level task_index step_min
                                 step_max reward_min reward_max; offset limit)
    GET  /api/sample?run=R&i=N   one sample record
    GET  /api/episodes?run=R&... a page of episodes (filters as samples, plus stop and failed=1)
    GET  /api/episode?run=R&i=N  one episode record
    POST /api/replay?run=R&i=N   replays episode N (rlvr.envs.episodes.replay)
    GET  /api/facets?run=R&kind=samples|episodes   the values the filters offer
    GET  /api/compare?a=R:TAG&b=R:TAG              two evaluations on the same prompts
    GET  /api/failures?run=R     failures and failed episodes
"""

from __future__ import annotations

import json
import mimetypes
import os
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlparse

from rlvr.explore import runs as views

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")


class BadRequest(ValueError):
    """A request naming a run, line or field that does not exist (answered 400 with the message)."""


class Explorer:
    """The runs being explored and the API's answers over them."""

    def __init__(self, workdirs: list[str]):
        names = [os.path.basename(os.path.normpath(w)) or w for w in workdirs]
        names = [n if names.count(n) == 1 else f"{n} ({i})" for i, n in enumerate(names)]
        self.runs = [views.RunDir(w, n) for w, n in zip(workdirs, names, strict=True)]

    def run(self, query: dict[str, str]) -> views.RunDir:
        try:
            return self.runs[int(query.get("run", 0))]
        except (ValueError, IndexError):
            raise BadRequest(f"run={query.get('run')!r}: give 0..{len(self.runs) - 1}") from None

    def line(self, index, query: dict[str, str]) -> int:
        i = int(query.get("i", -1))
        if not 0 <= i < index.refresh():
            raise BadRequest(f"i={i}: the file has {len(index)} lines")
        return i

    def answer(self, method: str, path: str, query: dict[str, str]) -> Any:
        if path == "/api/overview":
            return views.overview(self.runs)
        if path == "/api/compare":
            return views.compare(self.runs, self._side(query, "a"), self._side(query, "b"))
        run = self.run(query)
        if path in ("/api/samples", "/api/episodes"):
            return views.page(run.samples if path == "/api/samples" else run.episodes, query)
        if path == "/api/facets":
            return views.index_facets(run.episodes if query.get("kind") == "episodes" else run.samples)
        if path == "/api/sample":
            return run.samples.read(self.line(run.samples, query))
        if path == "/api/episode":
            return run.episodes.read(self.line(run.episodes, query))
        if path == "/api/replay" and method == "POST":
            return views.replay_episode(run, self.line(run.episodes, query))
        if path == "/api/failures":
            return views.failures(run)
        raise BadRequest(f"no such API path {path!r} ({method})")

    def _side(self, query: dict[str, str], key: str) -> tuple[int, str]:
        run, _, tag = query.get(key, "").partition(":")
        self.run({"run": run})
        if not tag:
            raise BadRequest(f"{key}={query.get(key)!r}: give RUN:TAG, e.g. 0:eval-after")
        return int(run), tag


def make_handler(explorer: Explorer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # quiet: one line per error only
            pass

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def _serve(self, method: str) -> None:
            url = urlparse(self.path)
            if not url.path.startswith("/api/"):
                return self._static(url.path)
            query = dict(parse_qsl(url.query))
            try:
                body, status = explorer.answer(method, url.path, query), 200
            except (BadRequest, ValueError) as e:
                body, status = {"error": str(e)}, 400
            except Exception as e:  # reported to the page and the console, the server keeps serving
                traceback.print_exc()
                body, status = {"error": f"{type(e).__name__}: {e}"}, 500
            self._send(status, json.dumps(body).encode(), "application/json")

        def _static(self, path: str) -> None:
            name = "index.html" if path in ("", "/") else path.lstrip("/")
            full = os.path.normpath(os.path.join(STATIC, name))
            if not full.startswith(STATIC + os.sep) or not os.path.isfile(full):
                return self._send(404, b"not found", "text/plain")
            with open(full, "rb") as f:
                self._send(200, f.read(), mimetypes.guess_type(full)[0] or "application/octet-stream")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

    return Handler


def make_server(workdirs: list[str], port: int = 8008, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """The server, bound (port 0 picks a free one: see `server.server_address`), not yet serving."""
    server = ThreadingHTTPServer((host, port), make_handler(Explorer(workdirs)))
    server.daemon_threads = True
    return server


def serve_in_background(workdirs: list[str], port: int = 0, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """For tests and notebooks: the server answering from a daemon thread (`.shutdown()` stops it)."""
    server = make_server(workdirs, port, host)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
