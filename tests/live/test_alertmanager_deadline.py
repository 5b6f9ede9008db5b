"""One absolute deadline over every exchange with Alertmanager, and the confirmation made
while a tree is frozen bounded by what is left of the reap's own deadline (issue 43).

A peer that answers one byte every 0.5 s stays under any per-read timeout: before, it
held the confirmation (and a frozen tree: state T) for as long as it liked. Real trees,
a real raw-socket peer on 127.0.0.1 (tests/support/slowpeer.py), the fake NVML.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuguard.engine.alerting.confirmation import ConfirmationState
from tests.e2e.test_alertmanager_client import api_alert, client, confirm, tree
from tests.support.certs import Certs, make_certs
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, stat_fields, wait_for
from tests.support.remediator_harness import (
    HOST,
    TOKEN,
    Harness,
    Orphan,
    Run,
    payload,
    spawn_orphan,
    write_config,
)
from tests.support.slowpeer import Plan, Reply, SlowPeer

#: Headroom for a loaded 2-core machine on top of each bound below.
SLACK = 1.0


@pytest.mark.parametrize("drip", ["headers", "body"])
def test_a_dripping_peer_is_cut_at_the_deadline(peer: Callable[[Plan], SlowPeer],
                                                drip: str) -> None:
    body = json.dumps([api_alert(tree("h"))]).encode()
    server = peer(lambda n: Reply(body=body, drip=drip, every=0.3))
    c = client(server.url, timeout=1.5)
    started = time.monotonic()
    got = confirm(c, tree("h"))
    elapsed = time.monotonic() - started
    assert got.state == ConfirmationState.UNREACHABLE and "timed out" in got.detail, got
    assert c.request_counts()["timeout"] == 1
    assert 1.4 <= elapsed < 1.5 + SLACK, elapsed  # one deadline, whatever the peer drips


def test_each_peer_has_its_own_bound_and_the_call_their_sum(
        peer: Callable[[Plan], SlowPeer]) -> None:
    servers = [peer(lambda n: Reply(drip="headers", every=0.3)) for _ in range(2)]
    c = client(*(s.url for s in servers), timeout=1.0)
    started = time.monotonic()
    got = confirm(c, tree("h"))
    elapsed = time.monotonic() - started
    assert got.state == ConfirmationState.UNREACHABLE, got
    assert c.request_counts()["timeout"] == 2
    assert elapsed < 2 * 1.0 + SLACK, elapsed


def test_a_confirmation_within_a_shorter_budget_stops_there(
        peer: Callable[[Plan], SlowPeer]) -> None:
    body = json.dumps([api_alert(tree("h"))]).encode()
    server = peer(lambda n: Reply(body=body, drip="body", every=0.3))
    c = client(server.url, timeout=30)
    started = time.monotonic()
    labels = tree("h")
    got = c.confirm(alertname=labels["alertname"], hostname="h", root_pid="4242",
                    root_start_time="987654", within=1.0)
    elapsed = time.monotonic() - started
    assert got.state == ConfirmationState.UNREACHABLE and "timed out" in got.detail, got
    assert elapsed < 1.0 + SLACK, elapsed
    # Nothing left: nothing is asked, and the answer says so.
    got = c.confirm(alertname=labels["alertname"], hostname="h", root_pid="4242",
                    root_start_time="987654", within=0.0)
    assert got.state == ConfirmationState.UNREACHABLE and "no time left" in got.detail, got
    assert len(server.paths) == 1


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.mark.parametrize("drip", ["", "body", "handshake"])
def test_https_is_verified_and_bounded_the_same(peer: Callable[..., SlowPeer], certs: Certs,
                                                monkeypatch: pytest.MonkeyPatch,
                                                drip: str) -> None:
    """The same client over TLS: the CA comes from the system store (SSL_CERT_FILE here),
    and a handshake or body that drips is cut at the same one deadline."""
    monkeypatch.setenv("SSL_CERT_FILE", certs.path("ca.crt"))
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(certs.path("server.crt"), certs.path("server.key"))
    body = json.dumps([api_alert(tree("h"))]).encode()
    # A TLS record header promising 16 KiB of handshake, then its bytes one by one.
    hello = b"\x16\x03\x03\x40\x00" + b"\x00" * 200
    if drip == "handshake":
        server = peer(lambda n: Reply(body=hello, every=0.3), raw=True)
    else:
        server = peer(lambda n: Reply(body=body, drip=drip, every=0.3), tls=server_tls)
    c = client(server.url.replace("http://", "https://"), timeout=1.5)
    started = time.monotonic()
    got = confirm(c, tree("h"))
    elapsed = time.monotonic() - started
    if not drip:
        assert got.state == ConfirmationState.FIRING, got
        return
    assert got.state == ConfirmationState.UNREACHABLE and "timed out" in got.detail, got
    assert elapsed < 1.5 + SLACK, elapsed


def _state(pid: int) -> str | None:
    fields = stat_fields(pid)
    return None if fields is None else str(fields["state"])


def test_a_tree_frozen_under_a_dripping_confirmation_is_continued_by_the_deadline(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        peer: Callable[[Plan], SlowPeer]) -> None:
    """The first confirmation (before SIGSTOP) answers at once; the one made with the
    tree frozen drips. The per-request timeout (30 s) is far past the reap's deadline
    (2 s): the deadline must bound it, then every member is continued, nothing else."""
    orphan = spawn_orphan(trees, fake_gpu)
    labels = {"alertname": "GPUOrphanTree", "hostname": HOST, "root_pid": str(orphan.root),
              "root_start_time": str(orphan.root_start)}
    body = json.dumps([api_alert(labels)]).encode()
    server = peer(lambda n: Reply(body=body, drip="body" if n else "", every=0.5))
    h = harness(alertmanager={"url": server.url, "timeout_seconds": 30},
                worker_timeout_seconds=2)
    assert h.post(payload(orphan.alert())).status_code == 200
    wait_for(lambda: _state(orphan.holder) == "T", timeout=10, interval=0.01,
             what="the tree frozen")
    frozen = time.monotonic()
    wait_for(lambda: _state(orphan.holder) not in ("T", None), timeout=20, interval=0.01,
             what="the tree continued")
    held = time.monotonic() - frozen
    assert held < 2 + SLACK, f"held stopped for {held:.1f}s"
    h.settle()
    assert orphan.all_alive()
    assert len(server.paths) == 2
    final = h.audit()[-1]
    assert (final["outcome"], final["outcome_reason"]) == ("aborted",
                                                           "alertmanager-unreachable"), final
    assert "timed out" in final["outcome_detail"] or "no time left" in final["outcome_detail"]
    sent = {s["signal"] for s in final["signals"]}
    assert "SIGSTOP" in sent and "SIGCONT" in sent and not sent & {"SIGTERM", "SIGKILL"}, sent
    assert h.client.get("/healthz").status_code == 200


class Clock:
    """The remediator's monotonic clock, moved by the test (the boot and wall clocks run)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def _gauge(metrics: str, name: str) -> float:
    line = next(ln for ln in metrics.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


#: Each NVML call's delay while a test holds the worker: the worker sees the moved clock
#: (and gives the item up) only once its call returns, so this is how long the test has
#: to read "stuck" after moving it (300 ms left a starved test thread too little).
HOLD_MS = 1500


def hold_past_its_bound(h: Harness, clock: Clock, orphan: Orphan) -> float:
    """The worker on `orphan`'s alert (held there by a slow NVML), and the clock moved past
    the most one item may take, which it returns."""
    assert h.post(payload(orphan.alert())).status_code == 200
    auth = {"Authorization": f"Bearer {TOKEN}"}
    wait_for(lambda: h.client.get("/state", headers=auth).get_json()["in_flight"],
             timeout=10, what="the worker on the item")
    _busy, limit = h.service.status.worker_busy()
    clock.now += limit + 1
    return limit


def test_a_worker_on_one_item_past_its_bound_is_stuck_on_healthz_and_metrics(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """The bounds above keep this from happening; if something still holds the worker
    (here a slow NVML, with the clock moved past the bound), it is said, not hidden."""
    clock = Clock()
    h = harness(monotonic=clock)
    orphan = spawn_orphan(trees, fake_gpu)
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert _gauge(metrics, "gpuguard_remediator_worker_stuck") == 0
    assert _gauge(metrics, "gpuguard_remediator_worker_busy_seconds") == 0
    fake_gpu.set_delay_ms(HOLD_MS)
    try:
        limit = hold_past_its_bound(h, clock, orphan)
        metrics = h.client.get("/metrics").get_data(as_text=True)
        assert _gauge(metrics, "gpuguard_remediator_worker_stuck") == 1
        assert _gauge(metrics, "gpuguard_remediator_worker_busy_seconds") > limit
        health = h.client.get("/healthz")
        assert (health.status_code, health.get_data(as_text=True)) == (503, "worker-stuck\n")
    finally:
        fake_gpu.set_delay_ms(0)
    h.settle()  # past its deadline on the moved clock: no signal
    assert orphan.all_alive()
    assert h.client.get("/healthz").status_code == 200
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert _gauge(metrics, "gpuguard_remediator_worker_stuck") == 0


def test_pull_mode_a_frozen_confirmation_is_bounded_too(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        peer: Callable[..., SlowPeer]) -> None:
    """Pull mode: the polls answer at once and deliver the tree, every confirmation after
    the first drips. Each time the tree is frozen it is continued within the reap's
    deadline, whatever the later polls deliver again; nothing is terminated."""
    orphan = spawn_orphan(trees, fake_gpu)
    labels = {"alertname": "GPUOrphanTree", "hostname": HOST, "root_pid": str(orphan.root),
              "root_start_time": str(orphan.root_start), "remediate": "true"}
    body = json.dumps([api_alert(labels)]).encode()
    confirmations: list[int] = []
    servers: list[SlowPeer] = []

    def plan(n: int) -> Reply:
        if "silenced=false" in servers[0].paths[n]:  # a poll
            return Reply(body=body)
        confirmations.append(n)
        return Reply(body=body, drip="body" if len(confirmations) > 1 else "", every=0.5)

    servers.append(peer(plan))
    h = harness(alertmanager={"url": servers[0].url, "timeout_seconds": 30, "pull": True,
                              "pull_interval_seconds": 1}, worker_timeout_seconds=2)
    runs: list[float] = []  # each stretch of state T, in seconds
    since: float | None = None
    ends = time.monotonic() + 8
    while time.monotonic() < ends:
        state, now = _state(orphan.holder), time.monotonic()
        if state == "T" and since is None:
            since = now
        elif state != "T" and since is not None:
            runs.append(now - since)
            since = None
        time.sleep(0.01)  # sampling the state, not waiting for it
    assert since is None or time.monotonic() - since < 2 + SLACK, "held stopped at the end"
    assert runs and max(runs) < 2 + SLACK, runs
    assert len(confirmations) >= 2, confirmations
    h.service.stop()
    assert orphan.all_alive()
    for record in h.audit():
        sent = {s["signal"] for s in record.get("signals", [])}
        assert not sent & {"SIGTERM", "SIGKILL"}, record


def test_gpuguard_reap_apply_bounds_its_frozen_confirmation_by_its_deadline(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run,
        peer: Callable[[Plan], SlowPeer]) -> None:
    """`gpuguard reap --apply` asks Alertmanager with the tree frozen too: the answer it
    waits for ends within what is left of worker_timeout_seconds (2 s here, against a
    30 s per-request timeout), then the tree is continued and nothing else is sent."""
    orphan = spawn_orphan(trees, fake_gpu)
    labels = {"alertname": "GPUOrphanTree", "hostname": HOST, "root_pid": str(orphan.root),
              "root_start_time": str(orphan.root_start)}
    body = json.dumps([api_alert(labels)]).encode()
    server = peer(lambda n: Reply(body=body, drip="body" if n else "", every=0.5))
    config = write_config(tmp_path, alertmanager={"url": server.url, "timeout_seconds": 30},
                          worker_timeout_seconds=2)
    stopped: list[float] = []  # when the holder was seen stopped
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if _state(orphan.holder) == "T":
                stopped.append(time.monotonic())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        proc = gpuguard("reap", str(orphan.root), "--config", str(config), "--json",
                        "--allow-pid-namespace", "--hostname", HOST, "--apply",
                        "--start-time", str(orphan.root_start))
    finally:
        done.set()
        watcher.join(timeout=5)
    doc = json.loads(proc.stdout)
    assert doc["reason"] == "alertmanager-unreachable", doc
    assert stopped, "the tree was never frozen: the frozen confirmation was not reached"
    held = stopped[-1] - stopped[0]
    assert held < 2 + SLACK, f"held stopped for {held:.1f}s"
    assert orphan.all_alive() and _state(orphan.holder) != "T"
    sent = {s["signal"] for s in doc["signals"]}
    assert "SIGSTOP" in sent and not sent & {"SIGTERM", "SIGKILL"}, sent


def test_an_ipv6_url_without_a_port_reaches_its_peer() -> None:
    """`http://[::1]/`: http.client parsed a port out of the bare IPv6 host, so the
    peer was never reached (unreachable: fail closed, but no Alertmanager on [::1]:80
    could ever confirm a reap)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from gpuguard.engine.alerting.bounded_http import get

    class V6(ThreadingHTTPServer):
        address_family = socket.AF_INET6

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"[]")

        def log_message(self, *args: Any) -> None:
            pass

    try:
        server = V6(("::1", 80), Handler)
    except OSError as exc:  # not root, no IPv6 loopback, or the port is taken
        pytest.skip(f"cannot listen on [::1]:80: {exc.strerror}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        answer = get("http://[::1]/api/v2/alerts", {}, deadline=time.monotonic() + 5,
                     max_body=1024)
    finally:
        server.shutdown()
        server.server_close()
    assert answer.status == 200 and answer.body == b"[]"


def test_a_stuck_worker_fails_the_liveness_probe_behind_an_unwritable_audit_log(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        full_disk: Path) -> None:
    """/healthz answers one code, the first of several: a full disk's comes before a stuck
    worker's. /-/healthy (the liveness probe) must still fail for the stuck worker, which
    a restart mends; it used to look at /healthz's one code and answer 200."""
    from gpuguard.remediator.cli import remediator_lifecycle
    from gpuguard.remediator.status import HealthCode

    clock = Clock()
    h = harness(monotonic=clock, audit_log=str(full_disk / "audit.jsonl"))
    probe = remediator_lifecycle(h.service, None, False)  # type: ignore[arg-type]
    first = spawn_orphan(trees, fake_gpu)
    assert h.post(payload(first.alert())).status_code == 200
    h.settle()
    assert h.client.get("/healthz").get_data(as_text=True) == "audit-log-unwritable\n"
    assert probe.healthy() == (True, "gpuguard-remediator is Healthy. (/healthz: "
                                     "audit-log-unwritable)")
    second = spawn_orphan(trees, fake_gpu)
    fake_gpu.set_delay_ms(HOLD_MS)
    try:
        hold_past_its_bound(h, clock, second)
        assert h.client.get("/healthz").get_data(as_text=True) == "audit-log-unwritable\n"
        assert probe.healthy() == (False, HealthCode.WORKER_STUCK)
    finally:
        fake_gpu.set_delay_ms(0)
    h.settle()
    assert first.all_alive() and second.all_alive()
