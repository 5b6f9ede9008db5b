"""The HTTP and TLS fronts under hostile connections (issue 48): what a client that never
authenticates can make a daemon hold (memory, connection slots, worker threads, the
shared rate-limit bucket). Real daemons (subprocesses) or the real serving stack
in-process; real sockets on 127.0.0.1 only. Each test failed on the code before."""

from __future__ import annotations

import base64
import os
import secrets
import selectors
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
import requests

from gpuguard.web.serving import create_server
from tests.support.certs import Certs, make_certs
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import wait_for
from tests.support.servers import Exporter, child_env

PASSWORD = "scrape-secret"
MIB = 2**20


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def tls_exporter(tmp_path: Path, certs: Certs, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
                 extra: str = "") -> Exporter:
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {certs.path('server.crt')}\n"
                   f"  key_file: {certs.path('server.key')}\n{extra}")
    return Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()),
                    args=["--web-config-file", str(web)], scan_interval=0.5)


def tls_scrape(exp: Exporter, certs: Certs, timeout: float = 5.0) -> int:
    return requests.get(f"https://127.0.0.1:{exp.port}/metrics", verify=certs.path("ca.crt"),
                        timeout=timeout).status_code


def settled_rss(pid: int) -> float:
    """RSS once it has stopped moving (the front closes what it was handed)."""
    readings = [rss_mib(pid)]

    def steady() -> bool:  # three readings over a second within 0.5 MiB
        readings.append(rss_mib(pid))
        return len(readings) >= 3 and max(readings[-3:]) - min(readings[-3:]) < 0.5

    wait_for(steady, timeout=20, interval=0.5, what="RSS to settle")
    return readings[-1]


@pytest.mark.parametrize("send", [b"", b"\x16"], ids=["no-byte", "one-byte"])
def test_tls_connections_closed_early_leave_no_memory(
        tmp_path: Path, certs: Certs, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
        send: bytes) -> None:
    """Before: each connection closed before (or just after) its first byte left asyncio's
    SSL buffers (256 KiB each) in reference cycles and glibc's free lists: 600 of them
    took the exporter from 34 to ~130 MiB (2,000 past the DaemonSet's 256 MiB limit)."""
    exp = tls_exporter(tmp_path, certs, fake_gpu, fake_nvml_lib)
    try:
        wait_for(lambda: tls_scrape(exp, certs) == 200, what="a scrape over TLS")
        before = settled_rss(exp.proc.pid)
        for _ in range(600):
            with socket.create_connection(("127.0.0.1", exp.port), timeout=5) as s:
                if send:
                    s.sendall(send)
        assert tls_scrape(exp, certs) == 200
        grew = settled_rss(exp.proc.pid) - before
        assert grew < 12, f"RSS grew {grew:.1f} MiB over 600 connect-and-close"
    finally:
        exp.stop()


def test_silent_tls_connections_from_one_address_do_not_stop_scrapes(
        tmp_path: Path, certs: Certs, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """Before: 512 connections that never sent a byte took every slot for the handshake
    deadline (10 s), renewed: every scrape, from any address, failed."""
    exp = tls_exporter(tmp_path, certs, fake_gpu, fake_nvml_lib)
    held: list[socket.socket] = []
    try:
        wait_for(lambda: tls_scrape(exp, certs) == 200, what="a scrape over TLS")
        held = [socket.create_connection(("127.0.0.1", exp.port), timeout=5)
                for _ in range(512)]
        codes = []
        for _ in range(5):
            try:
                codes.append(tls_scrape(exp, certs, timeout=3))
            except requests.RequestException as exc:
                codes.append(type(exc).__name__)
        assert codes == [200] * 5
    finally:
        for s in held:
            s.close()
        exp.stop()


def test_idle_tls_connections_past_1024_descriptors_do_not_stop_the_exporter(
        tmp_path: Path, certs: Certs, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """Before: waitress's loop used select(), which takes descriptors below 1024 only;
    each relayed TLS connection holds three (its TCP socket, both ends of the relay), so
    three addresses with 128 handshaken, silent connections each (within their shares)
    made the exporter exit (`filedescriptor out of range in select()`) at ~340."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2048:
        pytest.skip("the hard open-file limit leaves no descriptor numbers past 1024")
    exp = tls_exporter(tmp_path, certs, fake_gpu, fake_nvml_lib)
    ctx = ssl.create_default_context(cafile=certs.path("ca.crt"))
    held: list[socket.socket] = []
    try:
        wait_for(lambda: tls_scrape(exp, certs) == 200, what="a scrape over TLS")
        for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
            for _ in range(128):
                try:
                    raw = socket.create_connection(("127.0.0.1", exp.port), timeout=5,
                                                   source_address=(source, 0))
                    held.append(ctx.wrap_socket(raw, server_hostname="127.0.0.1"))
                except OSError:
                    break  # the exporter is gone
        descriptors = [0]

        def past_1024_or_gone() -> bool:
            if exp.proc.poll() is not None:
                return True
            descriptors[0] = len(os.listdir(f"/proc/{exp.proc.pid}/fd"))
            return descriptors[0] > 1024

        wait_for(past_1024_or_gone, timeout=3, what="the relays to reach waitress")
        assert exp.proc.poll() is None, f"the exporter exited: {exp.stderr()[-400:]}"
        assert tls_scrape(exp, certs) == 200
    finally:
        for s in held:
            s.close()
        exp.stop()


def test_silent_plain_connections_from_one_address_do_not_stop_scrapes(
        fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """Without TLS, waitress stopped accepting at 512 connections: a scrape waited in
    the kernel's queue until the idle timeout (10 s) closed the silent ones."""
    exp = Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()), scan_interval=0.5)
    held: list[socket.socket] = []
    try:
        wait_for(lambda: requests.get(exp.url + "/metrics", timeout=5).ok, what="a scrape")
        held = [socket.create_connection(("127.0.0.1", exp.port), timeout=5)
                for _ in range(520)]
        began = time.monotonic()
        assert requests.get(exp.url + "/metrics", timeout=5).status_code == 200
        assert time.monotonic() - began < 3
    finally:
        for s in held:
            s.close()
        exp.stop()


def test_half_sent_request_heads_are_bounded_in_total(fake_gpu: FakeGpuWorld,
                                                       fake_nvml_lib: Path) -> None:
    """Before: each connection could hold 256 KiB of unfinished request head, so 510 of
    them held 127 MiB; 160 here held ~40 MiB."""
    exp = Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()), scan_interval=0.5)
    held: list[socket.socket] = []
    try:
        wait_for(lambda: requests.get(exp.url + "/metrics", timeout=5).ok, what="a scrape")
        before = settled_rss(exp.proc.pid)
        line = b"X-Pad: " + b"a" * 1000 + b"\r\n"
        head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + line * 250  # ~250 KiB, unfinished
        for _ in range(160):
            s = socket.create_connection(("127.0.0.1", exp.port), timeout=5)
            held.append(s)
            try:
                s.sendall(head)
            except OSError:
                pass  # closed by the server: what a bound does
        grew = settled_rss(exp.proc.pid) - before
        assert grew < 20, f"RSS grew {grew:.1f} MiB for 160 half-sent heads"
        assert requests.get(exp.url + "/metrics", timeout=5).status_code == 200
    finally:
        for s in held:
            s.close()
        exp.stop()


def test_anonymous_requests_do_not_drain_the_rate_limit_of_authenticated_ones(
        tmp_path: Path, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """Before: the shared bucket was spent before authentication, so anyone without a
    password could keep Prometheus at 429."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f'rate_limit:\n  interval: "1h"\n  burst: 3\n'
                   f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    exp = Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()),
                   args=["--web-config-file", str(web)], scan_interval=0.5)
    try:
        anonymous = [requests.get(exp.url + "/metrics", timeout=5).status_code
                     for _ in range(6)]
        assert anonymous == [401] * 6
        authed = [requests.get(exp.url + "/metrics", auth=("prometheus", PASSWORD),
                               timeout=5).status_code for _ in range(4)]
        assert authed == [200, 200, 200, 429]  # the bucket still binds who passed
    finally:
        exp.stop()


def wrong_password_flood(port: int, sources: list[str], stop: threading.Event,
                         answers: Counter[str]) -> None:
    """One keep-alive connection from each of `sources`, each sending `GET /metrics` with
    a fresh wrong password as soon as its last one is answered (reconnecting when
    closed), until `stop`."""
    sel = selectors.DefaultSelector()

    def request() -> bytes:
        token = base64.b64encode(f"prometheus:{secrets.token_hex(8)}".encode()).decode()
        return (f"GET /metrics HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Basic {token}\r\n\r\n").encode()

    def connect(source: str) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.bind((source, 0))
        s.connect_ex(("127.0.0.1", port))
        sel.register(s, selectors.EVENT_WRITE, [source, b""])

    for source in sources:
        connect(source)
    while not stop.is_set():
        for key, events in sel.select(0.2):
            s, state = key.fileobj, key.data
            assert isinstance(s, socket.socket)
            try:
                if events & selectors.EVENT_WRITE:
                    s.sendall(request())
                    sel.modify(s, selectors.EVENT_READ, state)
                    continue
                chunk = s.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:  # closed: back at once, from the same address
                answers["closed"] += 1
                sel.unregister(s)
                s.close()
                connect(state[0])
                continue
            state[1] += chunk
            head, sep, body = state[1].partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            if sep and len(body) >= length:
                answers[head.split(b" ", 2)[1].decode()] += 1
                state[1] = b""
                s.sendall(request())
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    sel.close()


def test_wrong_passwords_from_many_addresses_do_not_lock_out_a_known_scraper(
        tmp_path: Path, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """Before: a connection whose request waited for a login counted as being served,
    so it never gave its slot up; with bcrypt one check at a time and a failure budget
    per address, 512 addresses each keeping one wrong password waiting held all 512
    slots, and a scrape whose password was known good failed (connection closed)."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    exp = Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()),
                   args=["--web-config-file", str(web)], scan_interval=0.5)
    stop = threading.Event()
    answers: Counter[str] = Counter()
    sources = [f"127.0.{1 + n // 256}.{n % 256}" for n in range(512)]
    flood = threading.Thread(target=wrong_password_flood,
                             args=(exp.port, sources, stop, answers), daemon=True)
    try:
        auth = ("prometheus", PASSWORD)
        assert requests.get(exp.url + "/metrics", auth=auth, timeout=10).status_code == 200
        flood.start()
        # Answers come one bcrypt check at a time: by the 8th, every connection is in.
        wait_for(lambda: sum(answers.values()) >= 8, timeout=20, what="the flood to start")
        codes = []
        for _ in range(10):
            try:
                codes.append(requests.get(exp.url + "/metrics", auth=auth,
                                          timeout=5).status_code)
            except requests.RequestException as exc:
                codes.append(type(exc).__name__)
        print(f"\nscrapes under a 512-address wrong-password flood: {codes}; "
              f"flood answers {dict(answers)}")
        assert codes == [200] * 10
        assert exp.proc.poll() is None
    finally:
        stop.set()
        flood.join(timeout=10)
        exp.stop()


# -- pipelining, on the real serving stack in-process ----------------------------------------

BIG = b"x" * (200 * 1024)  # a large /metrics: 300 of them pass waitress's 16 MiB mark


@pytest.fixture
def big_server() -> Iterator[int]:
    def app(environ: dict, start_response) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain"),
                                  ("Content-Length", str(len(BIG)))])
        return [BIG]

    server = create_server(app, host="127.0.0.1", port=0, threads=2, ident="test")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    yield server.effective_port
    server.close()
    thread.join(timeout=10)


def test_pipelined_requests_never_read_do_not_stall_other_clients(big_server: int) -> None:
    """Before: one read of pipelined `GET /` (290 requests) queued 290 answers; past
    waitress's 16 MiB mark each worker thread waited for a client that never reads,
    until the idle timeout (10 s): every other request waited with it."""
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    hostile = []
    try:
        for _ in range(4):  # more than the worker threads
            s = socket.create_connection(("127.0.0.1", big_server), timeout=5)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(request * 2000)
            hostile.append(s)
        # Requests for 1.5 s: the stall begins once the hostile answers pass the mark.
        until = time.monotonic() + 1.5
        slowest = 0.0
        while time.monotonic() < until:
            began = time.monotonic()
            assert requests.get(f"http://127.0.0.1:{big_server}/", timeout=8).ok
            slowest = max(slowest, time.monotonic() - began)
        assert slowest < 2, f"a request waited {slowest:.1f} s"
    finally:
        for s in hostile:
            s.close()
