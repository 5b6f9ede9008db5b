"""One HTTP GET under one absolute deadline: connect, TLS handshake, request, headers, body.

A per-read timeout bounds nothing against a peer that answers one byte at a time just
inside it: such an Alertmanager (or proxy) held a kill-time confirmation, and the tree
frozen under it, for as long as it liked (issue 43). Here the deadline is computed once;
every socket operation is given what is left of it (CPython's TLS handshake and reads
treat a socket timeout as a deadline for that call), and when nothing is left the
exchange fails with TimeoutError. The one wait it cannot bound is a DNS lookup, which
the system resolver bounds (resolv.conf `timeout`/`attempts`); URLs with an IP address
have none.

No proxy from the environment and no redirects: the path to the peer is what is
configured, and a redirect would carry the Authorization header elsewhere.
"""

from __future__ import annotations

import functools
import http.client
import io
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

Clock = Callable[[], float]


class TooLarge(Exception):
    """The answer's body is over the caller's limit (its size is in the message)."""


@dataclass(frozen=True)
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes  # empty unless status is 200


class _Left:
    """Seconds left before the deadline; TimeoutError once none are."""

    def __init__(self, deadline: float, monotonic: Clock) -> None:
        self.deadline = deadline
        self._monotonic = monotonic

    def __call__(self) -> float:
        left = self.deadline - self._monotonic()
        if left <= 0:
            raise TimeoutError("no time left before the deadline")
        return left


class _Reader(io.RawIOBase):
    """The response's bytes; each recv is given what is left of the deadline."""

    def __init__(self, sock: socket.socket, left: _Left) -> None:
        self._sock = sock
        self._raw = sock.makefile("rb", buffering=0)  # holds the socket open until closed
        self._left = left

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(self._left())
        got = self._raw.readinto(buffer)
        return 0 if got is None else got

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _Response(http.client.HTTPResponse):
    """http.client's response over a _Reader: the status line and headers included."""

    def __init__(self, sock: socket.socket, debuglevel: int = 0, method: str | None = None,
                 url: str | None = None, *, left: _Left) -> None:
        super().__init__(sock, debuglevel, method, url)
        self.fp.close()
        self.fp = io.BufferedReader(_Reader(sock, left))


class _Bounded(http.client.HTTPConnection):
    """Connect within what is left, then hand the socket what is left again (the TLS
    handshake of the subclass and the request's send run on it)."""

    def __init__(self, host: str, port: int | None, left: _Left, **kw: Any) -> None:
        super().__init__(host, port, timeout=left(), **kw)
        self._left = left
        self._create_connection = self._connect_within
        self.response_class = functools.partial(_Response, left=left)  # type: ignore[assignment]

    def _connect_within(self, address: tuple[str, int], _timeout: float,
                        source: tuple[str, int] | None = None) -> socket.socket:
        sock = socket.create_connection(address, self._left(), source)
        sock.settimeout(self._left())
        return sock

    def send(self, data: Any) -> None:
        if self.sock is None:
            self.connect()
        assert self.sock is not None
        self.sock.settimeout(self._left())
        super().send(data)


class _BoundedTls(_Bounded, http.client.HTTPSConnection):
    pass


def tls_context(ca_file: str | None = None) -> ssl.SSLContext:
    """What urllib would use: the system's CAs (SSL_CERT_FILE honoured), hostnames checked;
    with `ca_file`, that file's CAs only (a private CA), as Prometheus's tls_config.ca_file.
    Raises OSError (ssl.SSLError included) for a CA file it cannot load."""
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["http/1.1"])
    return context


def get(url: str, headers: Mapping[str, str], *, deadline: float, max_body: int,
        monotonic: Clock = time.monotonic, context: ssl.SSLContext | None = None) -> Answer:
    """GET `url` and read the whole answer by monotonic time `deadline`.

    Raises TimeoutError past the deadline, TooLarge for a body over `max_body`, and
    OSError, http.client.HTTPException or ValueError for anything else that went wrong.
    A status other than 200 is returned without its body.
    """
    left = _Left(deadline, monotonic)
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"not an http(s) URL: {url!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn: _Bounded
    # The port always given: http.client would parse one out of an IPv6 host ("::1").
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if parts.scheme == "https":
        conn = _BoundedTls(host, port, left,
                           context=context if context is not None else tls_context())
    else:
        conn = _Bounded(host, port, left)
    try:
        conn.request("GET", target, headers=dict(headers))
        with conn.getresponse() as resp:  # closed here: `conn` forgets one that will close
            if resp.status != 200:
                return Answer(resp.status, resp.headers, b"")
            length = resp.getheader("Content-Length")
            if length is not None and length.isascii() and length.isdigit() \
                    and (len(length) > 19 or int(length) > max_body):
                raise TooLarge(f"answer of {length[:20]} bytes is larger than {max_body} bytes")
            return Answer(resp.status, resp.headers, _body(resp, max_body))
    finally:
        conn.close()


def _body(resp: http.client.HTTPResponse, max_body: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := resp.read(64 * 1024):
        size += len(chunk)
        if size > max_body:
            raise TooLarge(f"answer larger than {max_body} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
