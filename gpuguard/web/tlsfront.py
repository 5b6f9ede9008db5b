"""TLS termination in front of the waitress server, in the same process.

waitress does not speak TLS, so one asyncio thread accepts on the public port, does
each handshake (within `handshake_timeout`) with the context current at that moment,
and relays the plaintext to waitress on a Unix socket. Each relay binds an abstract
name that carries the client's address, which `client_of` reads back for waitress.

What a client that never authenticates can make it hold is bounded (issue 48): nothing
of TLS exists before a connection's first byte (asyncio's TLS protocol holds 256 KiB of
buffers), which must come within `first_byte_timeout`; connections share `Slots` (one
address a quarter of them, the quietest giving way to a newcomer); a failed handshake
leaves no reference cycle behind; and glibc is asked to hand the memory of ended TLS
connections back, which it keeps for reuse otherwise.
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
import time
from collections.abc import Callable

from gpuguard.web.freed import FreedMemory
from gpuguard.web.slots import Slots, client_key

log = logging.getLogger("gpuguard.tls")

#: Seconds a connection may take to send its first byte (a TLS client's ClientHello
#: follows its connect at once); nothing of TLS is made before it.
FIRST_BYTE_SECONDS = 5.0
HANDSHAKE_TIMEOUT_SECONDS = 10.0
RELAY_CHUNK = 65536
#: Seconds a relay may wait for its sink to take data before the connection is closed.
STALL_SECONDS = 20.0
#: A relayed connection quiet (no byte either way) this long may give its slot up.
RELAY_QUIET_SECONDS = 1.0
#: Seconds after a TLS connection ends before freed memory is handed back (freed.py): at
#: most four trims a second while connections end, not one a connection.
TRIM_DELAY_SECONDS = 0.25


class _Conn:
    """One accepted connection: when it came, whether it relays, when it last moved."""

    __slots__ = ("since", "last", "relaying", "task")

    def __init__(self, now: float) -> None:
        self.since = self.last = now
        self.relaying = False
        self.task: asyncio.Task[None] | None = None


class TlsFront:
    """Listens on host:port (bound at construction: OSError if it cannot), terminates TLS
    with `context()`, and relays each connection to the Unix socket `backend`. At most
    `connection_limit` connections, `share` of them (a quarter by default) from one
    client address (slots.Slots)."""

    def __init__(self, *, host: str, port: int, backend: str,
                 context: Callable[[], ssl.SSLContext | None], connection_limit: int,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_SECONDS,
                 first_byte_timeout: float = FIRST_BYTE_SECONDS,
                 share: int | None = None,
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
        self._slots: Slots[_Conn] = Slots(connection_limit, share)
        self._timeout = handshake_timeout
        self._first_byte = first_byte_timeout
        self._prefix = f"\0gpuguard-front/{secrets.token_hex(8)}/".encode()
        self._serial = itertools.count()
        self._freed = FreedMemory()
        self._settling: asyncio.TimerHandle | None = None
        #: Connections that got as far as TLS (their first byte came).
        self.tls_started = 0
        self._loop = asyncio.new_event_loop()
        self._stopped = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="gpuguard-tls", daemon=True)

    @property
    def open_connections(self) -> int:
        """Connections waiting for a first byte, being handshaken or relayed now (what the
        limit counts)."""
        return len(self._slots)

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
            self._sock.close()
            self._loop.close()

    async def _serve(self) -> None:
        accepting = asyncio.ensure_future(self._accept())
        await self._stopped.wait()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(accepting, *tasks, return_exceptions=True)

    async def _accept(self) -> None:
        while True:
            try:
                sock, peer = await self._loop.sock_accept(self._sock)
            except OSError as exc:  # out of descriptors, say: the backlog waits a little
                log.warning("cannot accept a TLS connection: %s", exc)
                await asyncio.sleep(0.5)
                continue
            asyncio.ensure_future(self._handle(sock, peer))

    def _quiet(self, conn: _Conn) -> float | None:
        """Seconds `conn` has asked nothing: since it came, until its handshake is done;
        since its last byte either way, relaying (None while that is recent)."""
        now = time.monotonic()
        if not conn.relaying:
            return now - conn.since
        quiet = now - conn.last
        return quiet if quiet >= RELAY_QUIET_SECONDS else None

    async def _handle(self, sock: socket.socket, peer: object) -> None:
        conn = _Conn(time.monotonic())
        conn.task = asyncio.current_task()
        writer: asyncio.StreamWriter | None = None
        try:
            # Admitted in its own task: one cancelled to give way has begun, so it
            # closes its socket on the way out (a task cancelled before it ran would not).
            host = peer[0] if isinstance(peer, tuple) and peer else "localhost"
            admitted, victim = self._slots.admit(conn, client_key(host), self._quiet)
            if victim is not None and victim.task is not None:
                victim.task.cancel()
            if not admitted:
                return
            sock.setblocking(False)
            # Small writes (TLS records of a response's head and body) must not wait for
            # the client's delayed ACK: 40 ms a scrape.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not await self._first_byte_of(sock):
                return  # silent, or gone: nothing of TLS was made for it
            context = self._context()
            if context is None:
                return
            self.tls_started += 1
            try:
                reader, writer = await self._handshake(sock, context)
            except (asyncio.TimeoutError, ssl.SSLError, OSError, ConnectionError) as exc:
                log.debug("TLS handshake refused: %s", exc)
                _forget(exc)
                self._trim_soon()
                return
            if not self._client_allowed(writer.get_extra_info("peercert")):
                # client_allowed_sans: closed after the handshake, before any answer.
                log.info("TLS client %s refused: no allowed subject alternative name", peer)
                return
            try:
                back_reader, back_writer = await self._connect_backend(peer)
            except OSError as exc:
                log.error("cannot reach the HTTP server behind TLS: %s", exc)
                return
            conn.relaying, conn.last = True, time.monotonic()
            await self._relay_both(conn, reader, writer, back_reader, back_writer)
        except asyncio.CancelledError as exc:  # it gave way to a newcomer, or the front stops
            _forget(exc)  # mid-handshake, its traceback holds the TLS protocol in a cycle
        finally:
            self._slots.release(conn)
            if writer is not None:
                writer.close()
                self._trim_soon()
            else:
                sock.close()

    async def _first_byte_of(self, sock: socket.socket) -> bool:
        """Whether a byte came within the deadline (peeked: it stays for the handshake)."""
        ready: asyncio.Future[None] = self._loop.create_future()
        fd = sock.fileno()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        self._loop.add_reader(fd, readable)
        try:
            await asyncio.wait_for(ready, self._first_byte)
        except asyncio.TimeoutError:
            return False
        finally:
            self._loop.remove_reader(fd)
        try:
            return bool(sock.recv(1, socket.MSG_PEEK))
        except OSError:
            return False

    async def _handshake(self, sock: socket.socket, context: ssl.SSLContext
                         ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader = asyncio.StreamReader(limit=RELAY_CHUNK)
        transport, protocol = await self._loop.connect_accepted_socket(
            lambda: asyncio.StreamReaderProtocol(reader), sock,
            ssl=context, ssl_handshake_timeout=self._timeout)
        return reader, asyncio.StreamWriter(transport, protocol, reader, self._loop)

    async def _relay_both(self, conn: _Conn, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter, back_reader: asyncio.StreamReader,
                          back_writer: asyncio.StreamWriter) -> None:
        def touch() -> None:
            conn.last = time.monotonic()

        relays = [asyncio.ensure_future(_relay(reader, back_writer, touch)),
                  asyncio.ensure_future(_relay(back_reader, writer, touch))]
        try:
            # The first side to finish ends the connection (waitress closes idle or
            # finished connections; a client that goes away ends its request).
            await asyncio.wait(relays, return_when=asyncio.FIRST_COMPLETED)
        finally:  # or cancelled: it gave way to a newcomer, or the front stops
            for task in relays:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            back_writer.close()

    def _trim_soon(self) -> None:
        """Hand the memory of ended TLS connections back once a burst is over."""
        self._freed.note()
        if self._settling is None:
            self._settling = self._loop.call_later(TRIM_DELAY_SECONDS, self._settle)

    def _settle(self) -> None:
        self._settling = None
        self._freed.settle()


def _forget(exc: BaseException) -> None:
    """Drop the tracebacks of `exc` and what caused it: a failed handshake's error reaches
    frames that reach its transport and the error again, a cycle that only the collector
    frees, late (1,100 handshakes' buffers, 280 MiB, were waiting for it)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__


async def _relay(source: asyncio.StreamReader, sink: asyncio.StreamWriter,
                 touch: Callable[[], None]) -> None:
    """Copy until EOF, calling `touch` on each chunk. A sink that takes nothing for
    STALL_SECONDS (a client that sends requests and never reads the answers) ends the
    connection: it must not hold a slot."""
    with contextlib.suppress(OSError, ConnectionError, ssl.SSLError, asyncio.TimeoutError):
        while data := await source.read(RELAY_CHUNK):
            touch()
            sink.write(data)
            await asyncio.wait_for(sink.drain(), STALL_SECONDS)
