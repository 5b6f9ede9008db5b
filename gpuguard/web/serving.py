"""How both daemons serve HTTP: waitress, with limits that keep it answering under abuse.

waitress's defaults (100 connections, 120 s idle timeout) let 100 clients that open
a connection and send nothing, or half a request, stop a server from accepting
anyone for two minutes: Prometheus's scrape and Alertmanager's webhook included.
Incomplete requests never reach a worker thread (waitress buffers them in its
event loop), so the remedy is room and a short fuse: many more connections than a
scraper and an Alertmanager HA pair ever need, and idle ones closed after
IDLE_TIMEOUT_SECONDS; a request that trickles in counts as idle from its first byte.
One client address holds at most a quarter of CONNECTION_LIMIT, and a newcomer over
a bound takes the slot of the quietest connection not being served; pipelined
requests and unfinished request heads are bounded too (channels.py).

Two more things a client could make large are bounded here. Request bodies: waitress
reads a body whole (spooling it to a temporary file past 512 KiB) before any
application code, authentication included, runs; a BodyPolicy decides from the
request's head how much body it may send, and refuses the rest before reading it
(the exporter takes none; the remediator's /alerts up to 1 MiB, only with its token).
Logins: a bcrypt check is slow on purpose, so requests whose credentials are not
known good run on a pool of their own (Dispatcher), and webauth.py bounds what each
costs.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuguard.base import logformat

if TYPE_CHECKING:
    from gpuguard.web.tlsfront import TlsFront
    from gpuguard.web.webauth import BasicAuth
    from gpuguard.web.webconfig import WebConfigSource

log = logging.getLogger("gpuguard.http")

#: Seconds a connection may sit idle (nothing received) before it is closed.
IDLE_TIMEOUT_SECONDS = 10
#: Open connections at most. Not bounded by descriptors: a relayed TLS connection takes
#: three (its TCP socket, both ends of the relay), so 512 of them pass 1024, which the
#: daemons' raised open-file limit allows; waitress's loop therefore polls (poll(), not
#: select(), which takes descriptors below 1024 only), as the TLS front's asyncio loop
#: does (epoll).
CONNECTION_LIMIT = 512
#: How often waitress looks for idle connections to close.
CLEANUP_INTERVAL_SECONDS = 2
#: The most body a request may carry unless a BodyPolicy allows more. The exporter's
#: endpoints take none; this leaves room for a client that sends an empty form anyway.
SMALL_BODY_BYTES = 4096
#: Threads that serve requests whose credentials are not known good (logins: see
#: webauth.py); the paths with their own credentials, /healthz and known-good
#: requests are served by the other `threads`, which no login can occupy.
LOGIN_THREADS = 2
#: Requests that may wait for a login thread; past it, a request that needs a login is
#: answered 503 at once, with no bcrypt check (a check takes tens of milliseconds, so
#: 512 waiting made a login wait half a minute). A request waiting counts as quiet
#: (channels.py): its connection may give its slot up to a newcomer.
LOGIN_QUEUE_LIMIT = 8 * LOGIN_THREADS


@dataclass(frozen=True)
class Refusal:
    """An answer given without the application: from a request's head, before any of its
    body is read, or at once when too many logins wait (LOGINS_BUSY)."""

    status: int
    reason: str
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


#: What a request over LOGIN_QUEUE_LIMIT gets; its connection is closed after it.
LOGINS_BUSY = Refusal(503, "Service Unavailable",
                      b"too many logins waiting; retry in a second\n",
                      headers=(("Retry-After", "1"),))


@dataclass(frozen=True)
class RequestHead:
    method: str
    path: str
    headers: Mapping[str, str]  # waitress's keys: upper case, "-" as "_" (AUTHORIZATION)
    content_length: int | None  # None: chunked


class BodyPolicy:
    """How much body a request may send, decided from its head alone.

    waitress reads a whole request, body included, before any application code (and so
    any authentication) runs, and spools bodies over its `inbuf_overflow` to a temporary
    file: with its defaults an anonymous client could make it write a gigabyte. Here
    `admit` runs when the headers are complete, in waitress's event loop (so it must be
    cheap: no bcrypt, nothing slower than a stat): it answers the body limit for this
    request, or a Refusal sent at once, without reading the body. A declared length over
    the limit is refused the same way (`too_large`); a chunked body as soon as it
    passes the limit. Bodies up to `ceiling` (the largest limit admit gives) are kept in
    memory, never spooled. The default: every request may send SMALL_BODY_BYTES.
    """

    ceiling = SMALL_BODY_BYTES

    def admit(self, head: RequestHead) -> Refusal | int:
        return SMALL_BODY_BYTES

    def too_large(self, head: RequestHead, limit: int) -> Refusal:
        return Refusal(413, "Request Entity Too Large",
                       f"request body over the {limit}-byte limit of this endpoint\n".encode())


def create_server(app: Any, *, host: str, port: int, ident: str, threads: int,
                  idle_timeout: float = IDLE_TIMEOUT_SECONDS,
                  web: WebConfigSource | None = None,
                  open_paths: Callable[[str], bool] = lambda path: False,
                  body: BodyPolicy | None = None,
                  **options: Any) -> Any:
    """A waitress server for `app` with the limits above (raises OSError if it cannot bind).

    Request bodies follow `body` (BodyPolicy() when None). With a web config, `app` sits
    behind its basic auth (except `open_paths`) and headers; requests whose credentials
    are not known good run on LOGIN_THREADS of their own. With TLS configured the public
    port is a TlsFront relaying to waitress on a Unix socket in a private directory.
    HEAD is answered wherever GET is (answer_head_as_get)."""
    from waitress import create_server as waitress_server

    policy = body if body is not None else BodyPolicy()
    auth: BasicAuth | None = None
    if web is not None:  # basic auth and its cache only with a web config (0.4 MiB)
        from gpuguard.web.webauth import BasicAuth

        auth = BasicAuth()

    def extra_headers() -> tuple[tuple[str, str], ...]:
        return web.current()[0].headers if web is not None else ()

    def needs_login(channel: Any) -> bool:
        """Whether the request `channel` is about to serve may cost a login."""
        request = channel.requests[0] if channel.requests else None
        if web is None or auth is None or request is None or request.error is not None:
            return False
        if open_paths(request.path):
            return False
        return not auth.known(web.current()[0], request.headers.get("AUTHORIZATION"))

    def bounded(wsgi: Any, **where: Any) -> Any:
        from gpuguard.web.channels import ACCEPT_SLACK, bounded_channel
        from gpuguard.web.freed import FreedMemory

        server = waitress_server(
            answer_head_as_get(wsgi), ident=ident, channel_timeout=idle_timeout,
            # select() raises ValueError on a descriptor of 1024 or more, ending the
            # loop and the daemon: ~340 idle TLS connections did (issue 48).
            asyncore_use_poll=True,
            # The slots (channels.py) hold CONNECTION_LIMIT; waitress accepts a little
            # beyond, so that a newcomer can still take the slot of a quiet connection.
            connection_limit=CONNECTION_LIMIT + ACCEPT_SLACK,
            cleanup_interval=min(CLEANUP_INTERVAL_SECONDS, idle_timeout),
            # Backstops behind the policy's own checks: waitress counts a chunked body's
            # framing too. Bodies stay in memory up to the policy's ceiling.
            max_request_body_size=2 * policy.ceiling + 65536,
            inbuf_overflow=policy.ceiling + 65536,
            _dispatcher=Dispatcher(threads, needs_login if web is not None else None,
                                   refuse=_refusal_error(extra_headers)),
            **where, **options)
        freed = FreedMemory()
        server.channel_class = bounded_channel(_admitting_parser(policy, _refusal_error(
                                                   extra_headers)),
                                               connection_limit=CONNECTION_LIMIT, freed=freed)
        maintain = server.maintenance

        def maintenance(now: float) -> None:  # every CLEANUP_INTERVAL_SECONDS
            maintain(now)
            freed.settle()  # what large unfinished heads held, once they are gone

        server.maintenance = maintenance
        return server

    if web is None:
        return bounded(app, host=host, port=port)
    from gpuguard.web.webauth import protect
    from gpuguard.web.webconfig import san_allowed

    app = protect(app, lambda: web.current()[0], exempt=open_paths, auth=auth)
    if web.current()[1] is None:
        return bounded(app, host=host, port=port)
    private = tempfile.mkdtemp(prefix="gpuguard-http-")  # mode 0700
    backend = os.path.join(private, "http.sock")
    try:
        # asyncio and the TLS front only where TLS is on (docs/exporter.md, Memory).
        from gpuguard.web.tlsfront import TlsFront

        front = TlsFront(host=host, port=port, backend=backend,
                         context=lambda: web.current()[1], connection_limit=CONNECTION_LIMIT,
                         client_allowed=lambda cert: san_allowed(
                             cert, tls.allowed_sans if (tls := web.current()[0].tls) else ()))
    except OSError:
        os.rmdir(private)
        raise
    inner = bounded(app, unix_socket=backend, unix_socket_perms="600")
    inner.fix_addr = front.client_of  # the TLS client's address, not "localhost"
    return TlsServer(inner, front, private)


def answer_head_as_get(app: Any) -> Any:
    """HEAD wherever GET is served: the request goes in as GET (authentication, routes and
    status as for GET), the answer comes out with GET's headers (its Content-Length
    included) and no body. waitress sends whatever body an app returns, HEAD or not."""

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("REQUEST_METHOD") != "HEAD":
            return app(environ, start_response)
        answer: list[Any] = []
        written = [0]

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            answer[:] = [status, list(headers), exc_info]
            return lambda data: written.__setitem__(0, written[0] + len(data))

        body = app({**environ, "REQUEST_METHOD": "GET"}, start)
        try:
            length = written[0] + sum(len(chunk) for chunk in body)
        finally:
            if hasattr(body, "close"):
                body.close()
        status, headers, exc_info = answer
        if not any(name.lower() == "content-length" for name, _ in headers):
            headers.append(("Content-Length", str(length)))
        start_response(status, headers, exc_info)
        return []

    return wsgi


class Dispatcher:
    """waitress's thread pool, split in two when `needs_login` is given: requests for
    which it is true run on LOGIN_THREADS threads of their own, all others on `threads`.

    waitress hands a connection (its channel) to the pool once its next request has
    been read whole; `needs_login` looks at that request, in the event loop, cheaply
    (a cache lookup). A flood of wrong passwords then queues behind its own threads
    (where webauth.py bounds what each costs), never in front of /alerts or /healthz.
    The queue holds LOGIN_QUEUE_LIMIT: past it a request gets LOGINS_BUSY (`refuse`
    makes waitress's error of it) without a check; a request in the queue is marked
    `waiting_since`, so that its connection counts as quiet (issue 48: 512 addresses
    each with one wrong password waiting held every slot, and a known scraper got none).
    """

    def __init__(self, threads: int, needs_login: Callable[[Any], bool] | None,
                 refuse: Callable[[Refusal], Any] | None = None) -> None:
        from waitress.task import ThreadedTaskDispatcher

        class LoginPool(ThreadedTaskDispatcher):  # type: ignore[misc]
            # Queueing is what a login flood does here: not worth a warning per request.
            queue_logger = logging.getLogger("gpuguard.http.logins")

            def start_new_thread(self, target: Any, thread_no: int) -> None:
                threading.Thread(target=target, name=f"gpuguard-login-{thread_no}",
                                 args=(thread_no,), daemon=True).start()

        self.main = ThreadedTaskDispatcher()
        self.main.set_thread_count(threads)
        self.needs_login = needs_login
        self.refuse = refuse
        self.logins = None
        if needs_login is not None:
            self.logins = LoginPool()
            self.logins.set_thread_count(LOGIN_THREADS)

    def add_task(self, channel: Any) -> None:
        pool = self.main
        if self.logins is not None and self.needs_login is not None:
            try:
                if self.needs_login(channel):
                    pool = self.logins
            except Exception:  # noqa: BLE001 - a bug here must not drop the request
                log.exception("cannot tell whether a request needs a login")
                pool = self.logins
        if pool is self.logins and channel.requests:
            request = channel.requests[0]
            if len(self.logins.queue) >= LOGIN_QUEUE_LIMIT and self.refuse is not None:
                request.error = self.refuse(LOGINS_BUSY)  # answered (cheaply) in the main pool
                self.main.add_task(channel)
                return
            request.waiting_since = time.time()
            self.logins.add_task(_LoginTurn(channel))
            return
        pool.add_task(channel)

    def set_thread_count(self, count: int) -> None:
        self.main.set_thread_count(count)

    def shutdown(self, cancel_pending: bool = True, timeout: float = 5) -> bool:
        done = bool(self.main.shutdown(cancel_pending, timeout))
        if self.logins is not None:
            done = bool(self.logins.shutdown(cancel_pending, timeout)) and done
        return done


logging.getLogger("gpuguard.http.logins").setLevel(logging.ERROR)


class _LoginTurn:
    """A channel in the login queue: once a login thread takes it, its request is
    being served (no longer quiet)."""

    __slots__ = ("channel",)

    def __init__(self, channel: Any) -> None:
        self.channel = channel

    def service(self) -> None:
        if self.channel.requests:
            self.channel.requests[0].waiting_since = None
        self.channel.service()

    def cancel(self) -> None:  # waitress's shutdown(cancel_pending=True)
        self.channel.cancel()


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


def _refusal_error(extra_headers: Callable[[], tuple[tuple[str, str], ...]]
                   ) -> Callable[[Refusal], Any]:
    """A Refusal as waitress's error for a request (waitress answers it, then closes the
    connection), with the web config's headers."""
    from waitress.utilities import Error

    class Refused(Error):  # type: ignore[misc]
        def __init__(self, refusal: Refusal) -> None:
            super().__init__("")
            self.refusal = refusal
            self.code, self.reason = refusal.status, refusal.reason

        def to_response(self, ident: str | None = None) -> tuple[str, list, bytes]:
            r = self.refusal
            return (f"{r.status} {r.reason}",
                    [("Content-Type", r.content_type), *r.headers, *extra_headers()], r.body)

    return Refused


def _admitting_parser(policy: BodyPolicy, refused: Callable[[Refusal], Any]) -> type:
    """waitress's request parser, asking `policy` about each request once its head is in.

    waitress's parser returns as soon as the head is complete (the body comes in later
    calls), so the answer is known before a byte of body is taken; a refused request is
    marked complete with an error, which waitress answers (and then closes the
    connection, so the unread body is never parsed). `Expect: 100-continue` is not
    answered for a refused request."""
    from waitress.parser import HTTPRequestParser
    from waitress.utilities import RequestEntityTooLarge as TooLarge

    class AdmittingParser(HTTPRequestParser):  # type: ignore[misc]
        error: Any  # waitress's: None or an Error
        completed: bool
        _head: RequestHead | None = None
        _limit = 0

        def received(self, data: bytes) -> int:
            if self.completed:
                return 0
            in_head = not self.headers_finished
            consumed = int(super().received(data))
            if isinstance(self.error, TooLarge):  # past waitress's backstop: ours answers
                if not in_head and self._head is not None:
                    self._refuse(policy.too_large(self._head, self._limit))
                    return consumed
                self.error = None  # a declared length: admitted (or not) below, refused
            if self.error is not None or self.empty:
                return consumed  # waitress's own refusal (bad request, 431)
            if in_head:
                if self.headers_finished:
                    self._admit()
            elif self._head is not None and self.body_rcv is not None and (
                    len(self.body_rcv) > self._limit):
                self._refuse(policy.too_large(self._head, self._limit))
            return consumed

        def _admit(self) -> None:
            head = RequestHead(method=self.command, path=self.path, headers=self.headers,
                               content_length=None if self.chunked else self.content_length)
            try:
                verdict = policy.admit(head)
            except Exception:  # noqa: BLE001 - the event loop must go on
                log.exception("admitting %s %s", self.command, self.path)
                verdict = Refusal(500, "Internal Server Error", b"cannot admit the request\n")
            if isinstance(verdict, Refusal):
                self._refuse(verdict)
                return
            self._head, self._limit = head, min(verdict, policy.ceiling)
            if head.content_length is not None and head.content_length > self._limit:
                self._refuse(policy.too_large(head, self._limit))

        def _refuse(self, refusal: Refusal) -> None:
            self.error = refused(refusal)
            self.completed = True
            self.expect_continue = False

    return AdmittingParser


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


def serve_until_signalled(server: Any, log: logging.Logger, announce: str,
                          on_hup: Callable[[int, Any], None] | None = None) -> None:
    """Print `announce` (the `listening on` line supervisors and tests wait for), then
    serve until SIGTERM or SIGINT; SIGHUP calls `on_hup` (a reload), never stops. The
    handlers go in before the line is printed, so a signal that follows it at once is
    handled. A stop handler raises SystemExit, which waitress's loop catches (it closes
    its sockets and returns); the server is closed either way."""

    def shutdown(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    if on_hup is not None and hasattr(signal, "SIGHUP"):  # Windows has none
        signal.signal(signal.SIGHUP, on_hup)
    try:
        # Under --log.format json a JSON record like every other line (its msg the text).
        print(logformat.announce(log.name, announce), flush=True)
        server.run()
    except SystemExit:
        pass  # a signal before or after waitress's loop
    finally:
        server.close()
