"""A raw HTTP/1.1 peer on 127.0.0.1 that answers as slowly as a test tells it to.

http.server cannot send a status line one byte at a time; this can. Each request gets
`plan(n)` (n counts the requests from 0): a Reply sent at once, or dripped one byte
every `every` seconds (the headers, or only the body), the way a slow or hostile
Alertmanager or proxy answers just inside a per-read timeout (issue 43). A drip ends
after `cap` seconds (the connection is closed), so old code fails instead of hanging.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: bytes = b"[]"
    headers: dict[str, str] = field(default_factory=dict)
    drip: str = ""  # "", "headers" (the whole answer) or "body" (headers at once); a raw
    #                 SlowPeer drips the body alone, no HTTP at all (a TLS handshake, say)
    every: float = 0.5
    cap: float = 12.0

    def head(self) -> bytes:
        reason = {200: "OK", 429: "Too Many Requests", 503: "Service Unavailable"}.get(
            self.status, "Whatever")
        lines = [f"HTTP/1.1 {self.status} {reason}", "Content-Type: application/json",
                 f"Content-Length: {len(self.body)}", "Connection: close",
                 *(f"{k}: {v}" for k, v in self.headers.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()


Plan = Callable[[int], Reply]


class SlowPeer:
    """Serves `plan` until stop(); `paths` and `times` record each request's path and
    monotonic arrival, in order (a raw peer records "(raw)"), before `plan` is asked.
    `tls`: a server context to speak HTTPS with; `raw`: read nothing, drip each reply's
    body on the bare connection."""

    def __init__(self, plan: Plan, *, tls: ssl.SSLContext | None = None,
                 raw: bool = False) -> None:
        self.plan = plan
        self._tls = tls
        self._raw_mode = raw
        self.paths: list[str] = []
        self.requests: list[str] = []  # each request's line and headers, as received
        self.times: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, plain: socket.socket) -> None:
        with plain:
            plain.settimeout(5)
            if self._raw_mode:
                self._raw(plain)
                return
            try:
                conn = (plain if self._tls is None
                        else self._tls.wrap_socket(plain, server_side=True))
            except OSError:
                return
            with conn:
                self._serve_one(conn)

    def _serve_one(self, conn: socket.socket) -> None:
        """Read one request, answer it as `plan` says."""
        request = b""
        try:
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                request += chunk
        except OSError:
            return
        path = request.split(b" ", 2)[1].decode()
        with self._lock:
            index = len(self.paths)
            self.paths.append(path)
            self.requests.append(request.decode("latin-1"))
            self.times.append(time.monotonic())
        reply = self.plan(index)
        head, body = reply.head(), reply.body
        try:
            if not reply.drip:
                conn.sendall(head + body)
                return
            if reply.drip == "body":
                conn.sendall(head)
                self._drip(conn, body, reply)
            else:
                self._drip(conn, head + body, reply)
        except OSError:  # the client gave up: what the test wants
            return

    def _raw(self, conn: socket.socket) -> None:
        with self._lock:
            index = len(self.paths)
            self.paths.append("(raw)")
            self.times.append(time.monotonic())
        reply = self.plan(index)
        try:
            self._drip(conn, reply.body, reply)
        except OSError:
            return

    def _drip(self, conn: socket.socket, data: bytes, reply: Reply) -> None:
        ends = time.monotonic() + reply.cap
        for i in range(len(data)):
            if self._stop.is_set() or time.monotonic() > ends:
                return
            conn.sendall(data[i:i + 1])
            self._stop.wait(reply.every)


@pytest.fixture
def peer() -> Iterator[Callable[..., SlowPeer]]:
    """Start SlowPeers with `peer(plan, ...)`; each is stopped after the test."""
    started: list[SlowPeer] = []

    def start(plan: Plan, **kw: Any) -> SlowPeer:
        started.append(SlowPeer(plan, **kw))
        return started[-1]

    yield start
    for server in started:
        server.stop()
