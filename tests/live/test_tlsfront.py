"""TlsFront in-process: the first-byte and handshake deadlines, the connection slots (the
limit, an address's share, the quietest giving way) and their accounting."""

from __future__ import annotations

import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.web.tlsfront import TlsFront
from tests.support.certs import Certs, make_certs
from tests.support.proctree import wait_for


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


class Answer(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.rfile.readline()
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")


@pytest.fixture
def front(tmp_path: Path, certs: Certs) -> Iterator[TlsFront]:
    backend = str(tmp_path / "http.sock")
    server = socketserver.ThreadingUnixStreamServer(backend, Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs.path("server.crt"), certs.path("server.key"))
    tls = TlsFront(host="127.0.0.1", port=0, backend=backend, context=lambda: ctx,
                   connection_limit=3, share=2, handshake_timeout=1.5,
                   first_byte_timeout=1.0)
    tls.start()
    yield tls
    tls.close()
    server.shutdown()
    server.server_close()


def fetch(port: int, certs: Certs, source: str = "127.0.0.1") -> bytes:
    ctx = ssl.create_default_context(cafile=certs.path("ca.crt"))
    with socket.create_connection(("127.0.0.1", port), timeout=5,
                                  source_address=(source, 0)) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := tls.recv(4096):
            data += chunk
    return data


def closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_relays_a_request(front: TlsFront, certs: Certs) -> None:
    assert fetch(front.port, certs).endswith(b"\r\n\r\nok")


def test_a_silent_client_is_dropped_at_the_first_byte_deadline_with_no_tls_made(
        front: TlsFront) -> None:
    with socket.create_connection(("127.0.0.1", front.port)) as s:
        began = time.monotonic()
        assert closed_by_server(s, within=5)
        assert time.monotonic() - began < 3
    assert front.tls_started == 0  # no TLS state for a client that sent nothing


def test_a_client_that_stops_mid_handshake_is_dropped_at_the_handshake_deadline(
        front: TlsFront) -> None:
    with socket.create_connection(("127.0.0.1", front.port)) as s:
        s.sendall(b"\x16\x03\x01")  # the start of a ClientHello, then nothing
        began = time.monotonic()
        assert closed_by_server(s, within=5)
        assert time.monotonic() - began < 4
    assert front.tls_started == 1


def test_an_address_over_its_share_gives_its_quietest_slot_to_a_newcomer(
        front: TlsFront, certs: Certs) -> None:
    """Before issue 48, connections beyond the limit were refused: one address holding
    every slot silently shut everyone out until the deadline."""
    first = socket.create_connection(("127.0.0.1", front.port))
    second = socket.create_connection(("127.0.0.1", front.port))
    try:
        wait_for(lambda: front.open_connections == 2, what="two connections held")
        assert fetch(front.port, certs).endswith(b"ok")  # its share is 2: the oldest goes
        assert closed_by_server(first, within=0.5)  # long before the 1 s deadline
        assert not closed_by_server(second, within=0.1)
    finally:
        first.close()
        second.close()
    wait_for(lambda: front.open_connections == 0, what="the slots to come back")


def test_a_full_front_gives_the_quietest_slot_to_a_newcomer(front: TlsFront,
                                                            certs: Certs) -> None:
    held = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(2)]
    other = socket.create_connection(("127.0.0.1", front.port), source_address=("127.0.0.2", 0))
    try:
        wait_for(lambda: front.open_connections == 3, what="three connections held")
        # From a third address (within its share), past the limit of 3.
        assert fetch(front.port, certs, source="127.0.0.3").endswith(b"ok")
        assert closed_by_server(held[0], within=0.5)  # the quietest of all
    finally:
        for s in (*held, other):
            s.close()
    wait_for(lambda: front.open_connections == 0, what="the slots to come back")
    assert fetch(front.port, certs).endswith(b"ok")
    wait_for(lambda: front.open_connections == 0, what="the slot of a finished request")
