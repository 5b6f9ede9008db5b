"""What an HTTP client can make the daemons spend (issue 25): request bodies, failed
logins, a reload that would drop client certificates, token files, and what the open
/healthz tells. Real servers (subprocesses, or waitress in-process), 127.0.0.1 only."""

from __future__ import annotations

import base64
import http.client
import json
import os
import select
import shutil
import socket
import ssl
import stat
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests
import yaml

from gpuguard.web import webauth
from gpuguard.web.webauth import DUMMY_HASH, THROTTLE, BasicAuth, client_key
from gpuguard.web.webconfig import load_web_config
from tests.support.certs import Certs, make_certs
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, wait_for
from tests.support.remediator_harness import (
    HOST,
    TOKEN,
    Harness,
    alert,
    payload,
    spawn_orphan,
    write_config,
)
from tests.support.servers import REPO, Exporter, ServerProcess, child_env

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PASSWORD = "scrape-secret"
MIB = 2**20


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def cost10() -> str:
    """A cost-10 bcrypt hash of PASSWORD: what `htpasswd -nBC 10` makes."""
    return bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def private_token(tmp_path: Path, name: str = "token", text: str = TOKEN) -> Path:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def remediator(tmp_path: Path, env: dict[str, str], *extra: str) -> ServerProcess:
    return ServerProcess("gpuguard.remediator", [
        "--config", str(write_config(tmp_path, mode="dry-run")), "--token-file",
        str(private_token(tmp_path)), "--hostname", HOST, "--allow-pid-namespace",
        "--log-level", "WARNING", *extra], env=env)


# -- 1. request bodies: refused from the head, before auth, never spooled -----------------


def spooled_bytes(pid: int) -> int:
    """Bytes in the unlinked regular files `pid` holds open: waitress's body spool
    (tempfile.TemporaryFile) and nothing else in these daemons."""
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 0:
            total += st.st_size
    return total


def push_body(port: int, head: str, *, total: int, pid: int, chunked: bool = False,
              stop_after: int | None = None, wait: float = 10.0) -> tuple[bytes, int, int]:
    """Send `head` and up to `total` bytes of body (64 KiB pieces, chunked or not), stop
    early once the server answers or fails the connection (or after `stop_after` bytes);
    then wait up to `wait` s for the answer. Returns (answer, body bytes sent, the most
    bytes `pid` had spooled at any sample)."""
    piece = b"x" * 65536
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n" if chunked else piece
    answer, sent, peak = b"", 0, 0
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(head.encode() + b"\r\n")
        try:
            while sent < min(total, stop_after if stop_after is not None else total):
                if select.select([s], [], [], 0)[0]:
                    break  # an answer (or a close) while the body was still coming
                s.sendall(frame)
                sent += len(piece)
                peak = max(peak, spooled_bytes(pid))
        except OSError:
            pass  # refused and closed: what the rest of the body meets
        try:
            while not _complete(answer):
                data = s.recv(65536)
                if not data:
                    break
                answer += data
            peak = max(peak, spooled_bytes(pid))
        except OSError:
            pass  # reset after the answer (the unread body), or no answer in time
    return answer, sent, peak


def _complete(answer: bytes) -> bool:
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return True


def status_of(answer: bytes) -> int | None:
    line = answer.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) >= 2 and line[1].isdigit() else None


def test_the_exporter_refuses_a_body_before_auth_and_spools_nothing(
        tmp_path: Path, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path, cost10: str) -> None:
    """Yesterday: a 32 MiB anonymous body was read whole (29 MiB of it spooled to a
    temporary file) before basic auth answered 401."""
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{cost10}'\n")
    exporter = Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()),
                        args=["--web-config-file", str(web)])
    pid = exporter.proc.pid
    try:
        for chunked in (False, True):
            length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {32 * MIB}"
            answer, sent, peak = push_body(
                exporter.port, f"POST /metrics HTTP/1.1\r\nHost: x\r\n{length}\r\n",
                total=32 * MIB, pid=pid, chunked=chunked)
            print(f"\nexporter, {'chunked' if chunked else 'Content-Length'} 32 MiB body: "
                  f"{status_of(answer)} after {sent / MIB:.1f} MiB sent, {peak} bytes spooled")
            assert status_of(answer) == 413, answer[:200]
            assert peak == 0 and sent < 32 * MIB
        # A request with a few bytes of body (some clients send an empty form) still works.
        small = requests.get(f"{exporter.url}/metrics", data=b"x" * 100, timeout=10,
                             auth=("prometheus", PASSWORD))
        assert small.status_code == 200 and b"gpuguard_gpu_info" in small.content
    finally:
        exporter.stop()


def test_the_remediator_reads_no_body_without_its_token(
        tmp_path: Path, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """Only POST /alerts takes a body, and only with the token, up to 1 MiB: the answer
    comes from the head, while the body is still on its way. Yesterday each of these
    waited for (and spooled) the whole body first."""
    server = remediator(tmp_path, fake_gpu.subprocess_env(fake_nvml_lib, child_env()))
    pid = server.proc.pid
    json_head = "Content-Type: application/json\r\n"
    cases = [
        # (what, head, declared size, chunked, expected status, words in the JSON error)
        ("no token, 1000 KiB", f"POST /alerts HTTP/1.1\r\nHost: x\r\n{json_head}"
         f"Content-Length: {1000 * 1024}\r\n", 1000 * 1024, False, 401, "bearer token"),
        ("no token, Expect: 100-continue", f"POST /alerts HTTP/1.1\r\nHost: x\r\n{json_head}"
         f"Expect: 100-continue\r\nContent-Length: {1000 * 1024}\r\n", 1000 * 1024, False, 401,
         "bearer token"),
        ("wrong token, chunked", f"POST /alerts HTTP/1.1\r\nHost: x\r\n{json_head}"
         "Authorization: Bearer nope\r\nTransfer-Encoding: chunked\r\n", 32 * MIB, True, 401,
         "bearer token"),
        ("token, 2 MiB", f"POST /alerts HTTP/1.1\r\nHost: x\r\n{json_head}"
         f"Authorization: Bearer {TOKEN}\r\nContent-Length: {2 * MIB}\r\n", 2 * MIB, False,
         413, "limit"),
        ("token, chunked past 1 MiB", f"POST /alerts HTTP/1.1\r\nHost: x\r\n{json_head}"
         f"Authorization: Bearer {TOKEN}\r\nTransfer-Encoding: chunked\r\n", 32 * MIB, True,
         413, "limit"),
    ]
    try:
        for what, head, size, chunked, want, words in cases:
            # Otherwise only 128 KiB of the body go out before the answer is awaited: a
            # server that reads the whole body first would never answer.
            # A chunked body past 1 MiB with the token is pushed until refused (and must
            # not be spooled on its way there).
            past = "past" in what
            answer, sent, peak = push_body(server.port, head, total=size, pid=pid,
                                           chunked=chunked, wait=5.0,
                                           stop_after=None if past else 128 * 1024)
            print(f"\nremediator, {what}: {status_of(answer)} after {sent // 1024} KiB, "
                  f"{peak} bytes spooled")
            assert status_of(answer) == want, (what, answer[:300])
            assert words in json.loads(answer.split(b"\r\n\r\n", 1)[1] or b"{}").get(
                "error", ""), (what, answer)
            assert peak == 0, what
        # /state and /metrics take no body either.
        answer, _, _ = push_body(server.port, f"GET /state HTTP/1.1\r\nHost: x\r\n"
                                 f"Authorization: Bearer {TOKEN}\r\nContent-Length: {MIB}\r\n",
                                 total=MIB, pid=pid, stop_after=64 * 1024, wait=5.0)
        assert status_of(answer) == 413
        # A payload of almost 1 MiB with the token is read (in memory) and answered.
        pad = " " * (1000 * 1024)
        body = json.dumps(payload(alert(999999, 1)))[:-1] + pad + "}"
        got = requests.post(f"{server.url}/alerts", data=body, timeout=10,
                            headers={**AUTH, "Content-Type": "application/json"})
        assert got.status_code == 200, got.text
        metrics = requests.get(f"{server.url}/metrics", timeout=5).text
        assert 'gpuguard_remediator_rejected_requests_total{cause="unauthorized"} 3.0' in metrics
        assert 'gpuguard_remediator_rejected_requests_total{cause="too_large"} 2.0' in metrics
    finally:
        server.stop()


# -- 2. logins: bounded bcrypt, a pool of their own, the client's address over TLS --------


class CountingCheck:
    """bcrypt.checkpw, counting calls and how many ran at once."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        with self._lock:
            self.calls.append(hashed)
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            return bcrypt.checkpw(password, hashed)
        finally:
            with self._lock:
                self.running -= 1


def auth_config(tmp_path: Path, hashed: str) -> Any:
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    return load_web_config(str(path))


def test_bcrypt_checks_are_bounded(tmp_path: Path) -> None:
    cheap = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    config = auth_config(tmp_path, cheap)
    now = [0.0]
    check = CountingCheck()
    auth = BasicAuth(clock=lambda: now[0], checkpw=check)

    # An unknown user is checked against the fixed cost-10 dummy, not the file's cost 4.
    assert not auth.allows(config, basic("nobody", "x"), "192.0.2.1")
    assert check.calls == [DUMMY_HASH] and DUMMY_HASH.split(b"$")[2] == b"10"

    # The same wrong password again: remembered, no second check (until it is forgotten).
    assert not auth.allows(config, basic("prometheus", "wrong"), "192.0.2.1")
    assert not auth.allows(config, basic("prometheus", "wrong"), "192.0.2.1")
    assert len(check.calls) == 2
    now[0] += webauth.NEGATIVE_TTL_SECONDS + 1
    assert not auth.allows(config, basic("prometheus", "wrong"), "192.0.2.1")
    assert len(check.calls) == 3

    # Per address: a burst of failures, then 429 without a check; another address (and
    # a known-good password from the throttled one) is not affected.
    assert auth.allows(config, basic("prometheus", PASSWORD), "192.0.2.1")  # cached now
    calls = len(check.calls)
    verdicts = [auth.check(config, basic("prometheus", f"guess-{i}"), "192.0.2.1")
                for i in range(webauth.FAILURE_BURST + 5)]
    throttled = [v for v in verdicts if v.outcome == THROTTLE]
    # The 60 s that passed earned the allowance back; one failure was spent since (a
    # success costs none).
    assert len(check.calls) - calls == webauth.FAILURE_BURST - 1
    assert len(throttled) == 6 and all(v.retry_after >= 1 for v in throttled)
    assert auth.allows(config, basic("prometheus", PASSWORD), "192.0.2.1")
    assert auth.check(config, basic("prometheus", "other"), "198.51.100.7").outcome != THROTTLE
    now[0] += webauth.FAILURE_REFILL_SECONDS  # one more attempt earned
    assert auth.check(config, basic("prometheus", "again"), "192.0.2.1").outcome != THROTTLE
    assert auth.check(config, basic("prometheus", "again2"), "192.0.2.1").outcome == THROTTLE
    # One host is one IPv6 /64.
    assert client_key("2001:db8::1") == client_key("2001:db8::ffff") == "2001:db8::/64"
    assert client_key("::ffff:192.0.2.1") == "192.0.2.1"
    # Any local user holds all of 127.0.0.0/8: one budget, not 16 million (issue 48).
    assert client_key("127.0.0.2") == client_key("127.0.1.7") == client_key(
        "::ffff:127.0.0.1") == "127.0.0.0/8"
    assert client_key("192.0.2.1") != client_key("192.0.2.2")  # no /24 grouping

    # Many addresses at once: one bcrypt check at a time.
    check.most = 0
    threads = [threading.Thread(target=auth.allows, args=(
        config, basic("prometheus", f"t{i}"), f"203.0.113.{i}")) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert check.most == 1


def test_a_cached_failure_costs_the_same_whatever_the_user_name(tmp_path: Path) -> None:
    """Review finding: the failure cache kept each user name whole (up to the header
    limit, ~190 KiB each, 4,096 entries: ~764 MiB). Its keys are digests now."""
    cheap = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    config = auth_config(tmp_path, cheap)
    auth = BasicAuth(checkpw=CountingCheck())
    huge = "u" * 190_000
    assert not auth.allows(config, basic(huge, "x"), "192.0.2.1")
    assert not auth.allows(config, basic(huge, "x"), "192.0.2.1")  # cached: no check
    (key,) = auth._bad
    assert sum(len(part) for part in key) <= 64


def flood(port: int, clients: int, stop: threading.Event, answers: Counter[int]) -> list[
        threading.Thread]:
    """`clients` threads sending GET /metrics with wrong passwords (each one new: no cache
    helps), back to back on keep-alive connections, until `stop` (or 2,000 each)."""
    lock = threading.Lock()

    def run(n: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for i in range(2000):
            if stop.is_set():
                break
            try:
                conn.request("GET", "/metrics",
                             headers={"Authorization": basic("prometheus", f"wrong-{n}-{i}")})
                resp = conn.getresponse()
                resp.read()
                code = resp.status
            except (OSError, http.client.HTTPException):
                conn.close()
                code = -1
            with lock:
                answers[code] += 1
        conn.close()

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(clients)]
    for t in threads:
        t.start()
    return threads


def test_a_wrong_password_flood_cannot_slow_the_webhook_or_healthz(
        tmp_path: Path, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path, cost10: str) -> None:
    """16 clients sending wrong passwords to the remediator's /metrics: yesterday every
    one cost a bcrypt check on the 4 threads that also serve /alerts (webhook p50 419 ms
    here). Now they run on threads of their own, throttled, one check at a time."""
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{cost10}'\n")
    server = remediator(tmp_path, fake_gpu.subprocess_env(fake_nvml_lib, child_env()),
                        "--web-config-file", str(web))
    stop = threading.Event()
    answers: Counter[int] = Counter()
    threads: list[threading.Thread] = []
    try:
        session = requests.Session()
        body = json.dumps(payload(alert(999999, 1)))
        headers = {**AUTH, "Content-Type": "application/json"}
        scrape = session.get(f"{server.url}/metrics", auth=("prometheus", PASSWORD), timeout=10)
        assert scrape.status_code == 200  # checked once: known good from now on
        threads = flood(server.port, 16, stop, answers)
        wait_for(lambda: sum(answers.values()) >= 32, timeout=30, what="the flood to start")
        webhook, health, scrapes = [], [], []
        for _ in range(40):
            began = time.perf_counter()
            assert session.post(f"{server.url}/alerts", data=body, headers=headers,
                                timeout=10).status_code == 200
            webhook.append(time.perf_counter() - began)
            began = time.perf_counter()
            assert session.get(f"{server.url}/healthz", timeout=10).status_code == 200
            health.append(time.perf_counter() - began)
            began = time.perf_counter()
            # From the flooding address too: a known-good password is never throttled.
            assert session.get(f"{server.url}/metrics", auth=("prometheus", PASSWORD),
                               timeout=10).status_code == 200
            scrapes.append(time.perf_counter() - began)
        stop.set()
        for t in threads:
            t.join(timeout=15)
        p50, hp50 = statistics.median(webhook), statistics.median(health)
        sp50 = statistics.median(scrapes)
        print(f"\nunder a 16-client wrong-password flood: webhook p50 {p50 * 1000:.1f} ms "
              f"(max {max(webhook) * 1000:.1f} ms), /healthz p50 {hp50 * 1000:.1f} ms, "
              f"known-good scrape p50 {sp50 * 1000:.1f} ms; flood answers {dict(answers)}")
        assert p50 < 0.1 and hp50 < 0.1 and sp50 < 0.1
        assert set(answers) <= {401, 429} and answers[429] > answers[401]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=15)
        server.stop()


def test_behind_tls_the_client_address_reaches_the_app(tmp_path: Path, certs: Certs) -> None:
    """Failed logins are throttled per address; behind the TLS front waitress sees a Unix
    socket, and used to call every client "localhost"."""
    from gpuguard.web.serving import create_server
    from gpuguard.web.webconfig import WebConfigSource

    for name in ("server.crt", "server.key"):
        shutil.copy(certs.path(name), tmp_path / name)
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [f"{environ['REMOTE_ADDR']} {environ['REMOTE_PORT']}".encode()]

    server = create_server(app, host="127.0.0.1", port=0, ident="test", threads=1,
                           web=WebConfigSource(str(web)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        ctx = ssl.create_default_context(cafile=certs.path("ca.crt"))
        with socket.create_connection(("127.0.0.1", server.effective_port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            port = tls.getsockname()[1]
            tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while data := tls.recv(4096):
                answer += data
        assert answer.endswith(f"127.0.0.1 {port}".encode()), answer
    finally:
        server.inner.trigger.pull_trigger(
            lambda: [d.close() for d in list(server.inner._map.values())])
        thread.join(timeout=5)
        server.close()
        # Its task threads too: left idle they outlived every later test of the run.
        server.inner.task_dispatcher.shutdown()


# -- 5. token files: private or no start ----------------------------------------------------


def start_remediator(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuguard.remediator", "--allow-pid-namespace",
                           "--listen", "127.0.0.1:0", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.parametrize("case", ["group-readable", "world-readable", "other-owner",
                                  "credentials-file"])
def test_a_token_file_that_is_not_private_stops_start_up(tmp_path: Path, case: str) -> None:
    token = private_token(tmp_path)
    config = write_config(tmp_path, mode="dry-run")
    expected = "mode 0640"
    if case == "group-readable":
        token.chmod(0o640)
    elif case == "world-readable":
        token.chmod(0o604)
        expected = "mode 0604"
    elif case == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(token, 65534, 65534)
        expected = "owned by uid 65534"
    else:
        am_token = tmp_path / "am-token"
        am_token.write_text("am-secret\n")
        am_token.chmod(0o644)
        doc = yaml.safe_load(config.read_text())
        doc["remediate"]["alertmanager"] = {"url": "https://127.0.0.1:9",
                                            "credentials_file": str(am_token)}
        config.write_text(yaml.safe_dump(doc))
        expected = "credentials_file"
    try:
        done = start_remediator("--config", str(config), "--token-file", str(token))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: the remediator started with a token file that is not private")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuguard-remediator: "), done.stderr
    assert expected in lines[0], lines[0]


def test_a_token_file_rotated_to_a_readable_one_is_refused(tmp_path: Path) -> None:
    from gpuguard.engine.alerting.tokens import TokenFile

    path = private_token(tmp_path, text="first")
    token = TokenFile(str(path))
    assert token() == b"first"
    fresh = tmp_path / "token.new"
    fresh.write_text("second\n")
    fresh.chmod(0o644)
    fresh.replace(path)
    assert token() is None and "mode 0644" in (token.problem or "")
    path.chmod(0o600)
    assert token() == b"second" and token.problem is None


# -- 6. /healthz: a status and a reason code -------------------------------------------------


def test_healthz_tells_a_code_and_state_the_detail(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        full_disk: Path) -> None:
    h = harness(audit_log=str(full_disk / "audit.jsonl"))
    assert h.client.get("/healthz").get_data(as_text=True) == "ok\n"
    orphan = spawn_orphan(trees, fake_gpu)
    h.post(payload(orphan.alert()))
    h.settle()
    health = h.client.get("/healthz")
    assert health.status_code == 503
    assert health.get_data(as_text=True) == "audit-log-unwritable\n"  # no path, no errno
    state = h.client.get("/state", headers=AUTH).get_json()
    assert state["health"]["code"] == "audit-log-unwritable"
    assert str(full_disk) in state["health"]["detail"]
