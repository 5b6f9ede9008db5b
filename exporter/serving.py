"""How both daemons serve HTTP: waitress, with limits that keep it answering under abuse.

waitress's defaults (100 connections, 120 s idle timeout) let 100 clients that open
a connection and send nothing, or half a request, stop a server from accepting
anyone for two minutes: Prometheus's scrape and Alertmanager's webhook included.
Incomplete requests never reach a worker thread (waitress buffers them in its
event loop), so the remedy is room and a short fuse: many more connections than a
scraper and an Alertmanager HA pair ever need, and idle ones closed after
IDLE_TIMEOUT_SECONDS; a request that trickles in counts as idle from its first byte.
A flood beyond CONNECTION_LIMIT inside that time still waits in the kernel's accept
queue: an attacker who keeps 512 connections open and renews them every 10 s can
delay answers by up to that long; put such a host behind a firewall rule.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from typing import Any

from gpuguard.exporter.tlsfront import TlsFront
from gpuguard.exporter.webauth import protect
from gpuguard.exporter.webconfig import WebConfigSource

#: Seconds a connection may sit idle (nothing received) before it is closed.
IDLE_TIMEOUT_SECONDS = 10
#: Open connections at most; kept well under the usual 1024 open-file soft limit.
CONNECTION_LIMIT = 512
#: How often waitress looks for idle connections to close.
CLEANUP_INTERVAL_SECONDS = 2


def create_server(app: Any, *, host: str, port: int, ident: str, threads: int,
                  idle_timeout: float = IDLE_TIMEOUT_SECONDS,
                  web: WebConfigSource | None = None,
                  open_paths: Callable[[str], bool] = lambda path: False,
                  **options: Any) -> Any:
    """A waitress server for `app` with the limits above (raises OSError if it cannot bind).

    With a web config, `app` sits behind its basic auth (except `open_paths`) and
    headers, and with TLS configured the public port is a TlsFront relaying to waitress
    on a Unix socket in a private directory."""
    from waitress import create_server as waitress_server

    def bounded(wsgi: Any, **where: Any) -> Any:
        server = waitress_server(
            wsgi, threads=threads, ident=ident, channel_timeout=idle_timeout,
            connection_limit=CONNECTION_LIMIT,
            cleanup_interval=min(CLEANUP_INTERVAL_SECONDS, idle_timeout), **where, **options)
        server.channel_class = _bounded_channel()
        return server

    if web is None:
        return bounded(app, host=host, port=port)
    app = protect(app, lambda: web.current()[0], exempt=open_paths)
    if web.current()[1] is None:
        return bounded(app, host=host, port=port)
    private = tempfile.mkdtemp(prefix="gpuguard-http-")  # mode 0700
    backend = os.path.join(private, "http.sock")
    try:
        front = TlsFront(host=host, port=port, backend=backend,
                         context=lambda: web.current()[1], connection_limit=CONNECTION_LIMIT)
    except OSError:
        os.rmdir(private)
        raise
    return TlsServer(bounded(app, unix_socket=backend, unix_socket_perms="600"), front,
                     private)


class TlsServer:
    """waitress behind a TlsFront, run and closed as one server."""

    def __init__(self, inner: Any, front: TlsFront, private: str) -> None:
        self.inner, self.front, self.private = inner, front, private
        self.effective_port = front.port

    def run(self) -> None:
        self.front.start()
        self.inner.run()

    def close(self) -> None:
        self.front.close()
        self.inner.close()
        shutil.rmtree(self.private, ignore_errors=True)


def _bounded_channel() -> type:
    """waitress's channel, where an incomplete request does not count as activity.

    waitress closes a connection idle for channel_timeout, and any byte received is
    activity: a client trickling one header line every few seconds would hold its
    connection (and with enough of them, every connection) forever. Here a request
    must arrive whole within the idle timeout of its first byte.
    """
    from waitress.channel import HTTPChannel

    class BoundedChannel(HTTPChannel):  # type: ignore[misc]
        _partial_since: float | None = None
        last_activity: float  # waitress's, seconds since the epoch

        def received(self, data: bytes) -> bool:
            result = super().received(data)
            if self.request is not None:  # part of a request is in, the rest is not
                if self._partial_since is None:
                    self._partial_since = self.last_activity
                self.last_activity = self._partial_since
            else:
                self._partial_since = None
            return bool(result)

    return BoundedChannel


def positive_float(value: str) -> float:
    """An argparse type for a number of seconds (or any quantity) that must be > 0."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


def listen_address(default_host: str) -> Callable[[str], tuple[str, int]]:
    """An argparse type for HOST:PORT (IPv6 as [::1]:PORT); an empty host is `default_host`."""

    def parse(value: str) -> tuple[str, int]:
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
        return host.strip("[]") or default_host, int(port)

    return parse


def serve_until_signalled(server: Any, log: logging.Logger, announce: str) -> None:
    """Print `announce` (the `listening on` line supervisors and tests wait for), then
    serve until SIGTERM or SIGINT. The handlers go in before the line is printed, so a
    stop that follows it at once still shuts down cleanly. A handler raises SystemExit,
    which waitress's loop catches (it closes its sockets and returns); the server is
    closed either way."""

    def shutdown(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    try:
        print(announce, flush=True)
        server.run()
    except SystemExit:
        pass  # a signal before or after waitress's loop
    finally:
        server.close()
