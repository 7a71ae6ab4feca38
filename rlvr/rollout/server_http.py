"""The HTTP transport of the rollout server: stdlib `ThreadingHTTPServer`, HTTP/1.1 keep-alive.

It only moves bytes: it reads the body (Content-Length or chunked, bounded), hands
`(method, path, body, client_gone)` to the app's `dispatch`, and writes the `Reply` back as JSON,
text, or an SSE stream with chunked transfer encoding. Errors never escape: an `ApiError` becomes its
4xx/5xx JSON body, anything else a 500, and a client that went away just closes the connection.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import select
import socket
import threading
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlvr.rollout.server_protocol import ApiError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 2**20


@dataclasses.dataclass
class Reply:
    """A JSON (or text, or empty) answer, or an SSE stream of pre-encoded chunks."""

    status: int = 200
    body: Any = None
    stream: Iterator[bytes] | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rlvr-sglang"
    disable_nagle_algorithm = True  # headers and body go out in separate writes
    timeout = 900  # seconds a keep-alive connection may idle
    server: RolloutHTTPServer

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("GET", head=True)

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_OPTIONS(self) -> None:
        self._handle("OPTIONS")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Protocol-level errors (bad request line, unknown method, huge headers) as JSON too."""
        if code == HTTPStatus.NOT_IMPLEMENTED:  # a method no route has
            code = HTTPStatus.METHOD_NOT_ALLOWED
        data = json.dumps(ApiError(message or HTTPStatus(code).phrase, code).body()).encode()
        self.close_connection = True
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts, size = [], 0
            while True:
                line = self.rfile.readline(1024).split(b";")[0].strip()
                try:
                    n = int(line, 16)
                except ValueError:
                    self.close_connection = True
                    raise ApiError("malformed chunked request body") from None
                if n == 0:
                    while self.rfile.readline(1024).strip():
                        pass  # trailers
                    return b"".join(parts)
                size += n
                if size > MAX_BODY_BYTES:
                    self.close_connection = True
                    raise ApiError(f"request body over {MAX_BODY_BYTES} bytes", 413)
                parts.append(self.rfile.read(n))
                self.rfile.readline(8)
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        if not length.strip().isdigit():
            self.close_connection = True
            raise ApiError(f"bad Content-Length {length!r}")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(f"request body over {MAX_BODY_BYTES} bytes", 413)
        return self.rfile.read(int(length))

    def _client_gone(self) -> bool:
        """True once the peer closed its side (EOF is readable); pipelined bytes mean alive."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _handle(self, method: str, head: bool = False) -> None:
        try:
            raw = self._read_body()
            reply = self.server.app.dispatch(method, self.path.partition("?")[0], raw, self._client_gone)
        except ApiError as e:
            reply = Reply(e.status, e.body())
        except Exception as e:
            logger.exception("internal error on %s %s", method, self.path)
            reply = Reply(500, ApiError(f"internal error: {type(e).__name__}: {e}", 500).body())
        try:
            if reply.stream is not None:
                self._send_stream(reply)
            else:
                self._send(reply, head)
        except OSError:  # the client went away
            self.close_connection = True

    def _send(self, reply: Reply, head: bool) -> None:
        if reply.body is None:
            data, ctype = b"", None
        elif isinstance(reply.body, str):
            data, ctype = reply.body.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(reply.body, ensure_ascii=False).encode(), "application/json"
        self.send_response(reply.status)
        if ctype:
            self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for key, value in reply.headers.items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _send_stream(self, reply: Reply) -> None:
        stream = reply.stream
        assert stream is not None
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in stream:
                self.wfile.write(b"%X\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            stream.close()  # type: ignore[attr-defined]  # on a broken pipe: aborts the requests


class RolloutHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that knows its open connections, so `stop(hard=True)` can cut them
    (a crashed server, for failover tests) instead of letting in-flight requests finish."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 1024  # listen backlog: rollouts open many connections at once

    def __init__(self, address: tuple[str, int], app: Any):  # app.dispatch(method, path, body, gone)
        super().__init__(address, _Handler)
        self.app = app
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self, hard: bool = False) -> None:
        """Stops accepting; with `hard`, also resets every open connection."""
        self.shutdown()
        self.server_close()
        if hard:
            with self._lock:
                connections = list(self._connections)
            for conn in connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
