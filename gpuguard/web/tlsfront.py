"""TLS termination in front of the waitress server, in the same process.

waitress does not speak TLS, so one asyncio thread accepts on the public port, does
each handshake (within `handshake_timeout`) with the context current at that moment,
and relays the plaintext to waitress on a Unix socket. Each relay binds an abstract
name that carries the client's address, which `client_of` reads back for waitress.
Why: docs/design.md, Cost rules (HTTP under abuse).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import socket
import ssl
import threading
from collections.abc import Callable

from gpuguard.compat import start_tls

log = logging.getLogger("gpuguard.tls")

HANDSHAKE_TIMEOUT_SECONDS = 10.0
RELAY_CHUNK = 65536
#: Seconds a relay may wait for its sink to take data before the connection is closed.
STALL_SECONDS = 20.0


class TlsFront:
    """Listens on host:port (bound at construction: OSError if it cannot), terminates TLS
    with `context()`, and relays each connection to the Unix socket `backend`."""

    def __init__(self, *, host: str, port: int, backend: str,
                 context: Callable[[], ssl.SSLContext | None], connection_limit: int,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_SECONDS,
                 client_allowed: Callable[[dict | None], bool] = lambda cert: True) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._backend = backend
        self._context = context
        self._client_allowed = client_allowed
        self._limit = connection_limit
        self._timeout = handshake_timeout
        self._open = 0
        self._prefix = f"\0gpuguard-front/{secrets.token_hex(8)}/".encode()
        self._serial = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._stopped = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="gpuguard-tls", daemon=True)

    @property
    def open_connections(self) -> int:
        """Connections being handshaken or relayed now (what the limit counts)."""
        return self._open

    def start(self) -> None:
        self._thread.start()

    def client_of(self, addr: object) -> tuple[str, int | None]:
        """The client (host, port) of a connection this front relayed, from the address
        waitress's accept() gave (its abstract name); ("localhost", None) otherwise, as
        waitress says for Unix sockets."""
        if isinstance(addr, bytes) and addr.startswith(self._prefix):
            _, host, port = addr[len(self._prefix):].decode("ascii", "replace").split("/")
            return host, int(port)
        return "localhost", None

    async def _connect_backend(
            self, peer: object) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if isinstance(peer, tuple) and len(peer) >= 2:
                name = self._prefix + f"{next(self._serial)}/{peer[0]}/{peer[1]}".encode()
                try:
                    sock.bind(name)
                except OSError as exc:  # taken (or too long): the client's address is lost
                    log.debug("cannot name the relay for %s: %s", peer, exc)
            sock.setblocking(False)
            await self._loop.sock_connect(sock, self._backend)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_unix_connection(sock=sock)

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(timeout=5)
        else:
            self._sock.close()

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._handle, sock=self._sock)
        async with server:
            await self._stopped.wait()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self._limit:
            writer.close()
            return
        self._open += 1
        try:
            # Small writes (TLS records of a response's head and body) must not wait for
            # the client's delayed ACK: 40 ms a scrape. asyncio sets this only for sockets
            # whose proto is IPPROTO_TCP, and accepted ones carry the listener's 0.
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            context = self._context()
            if context is None:
                return
            try:
                await start_tls(writer, context, ssl_handshake_timeout=self._timeout)
            except (asyncio.TimeoutError, ssl.SSLError, OSError, ConnectionError) as exc:
                log.debug("TLS handshake refused: %s", exc)
                return
            if not self._client_allowed(writer.get_extra_info("peercert")):
                # client_allowed_sans: closed after the handshake, before any answer.
                log.info("TLS client %s refused: no allowed subject alternative name",
                         writer.get_extra_info("peername"))
                writer.close()
                return
            try:
                back_reader, back_writer = await self._connect_backend(
                    writer.get_extra_info("peername"))
            except OSError as exc:
                log.error("cannot reach the HTTP server behind TLS: %s", exc)
                return
            try:
                relays = [asyncio.ensure_future(_relay(reader, back_writer)),
                          asyncio.ensure_future(_relay(back_reader, writer))]
                # The first side to finish ends the connection (waitress closes idle or
                # finished connections; a client that goes away ends its request).
                _, pending = await asyncio.wait(relays, return_when=asyncio.FIRST_COMPLETED)
                for task in pending:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            finally:
                back_writer.close()
        finally:
            self._open -= 1
            writer.close()


async def _relay(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copy until EOF. A sink that takes nothing for STALL_SECONDS (a client that sends
    requests and never reads the answers) ends the connection: it must not hold a slot."""
    with contextlib.suppress(OSError, ConnectionError, ssl.SSLError, asyncio.TimeoutError):
        while data := await source.read(RELAY_CHUNK):
            sink.write(data)
            await asyncio.wait_for(sink.drain(), STALL_SECONDS)
