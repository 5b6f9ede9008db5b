"""gpuguard.engine.alerting.alertmanager against a real Alertmanager 0.25 (one per module).

Each test uses its own hostname label so tests sharing the Alertmanager never see
each other's alerts. A tiny local HTTP fake stands in only for what the real
binary cannot produce: malformed or wrongly shaped JSON, 5xx, 401, redirects and
an answer slower than the timeout.
"""

from __future__ import annotations

import json
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests

from gpuguard.config.remediate import AlertmanagerConfig
from gpuguard.engine.alerting.alertmanager import (
    AlertmanagerClient,
    matcher,
)
from gpuguard.engine.alerting.alerts import parse_notification
from gpuguard.engine.alerting.confirmation import Confirmation, ConfirmationState
from gpuguard.engine.alerting.polling import peer_order
from tests.support.certs import Certs, make_certs
from tests.support.proctree import wait_for
from tests.support.promstack import ALERTMANAGER, Alertmanager, free_port

ORPHAN = "GPUOrphanTree"
DRAIN = "GPUGuardNodeDrain"  # inhibits GPUOrphanTree on the same host in this config

AM_CONFIG: dict[str, Any] = {
    "route": {"receiver": "null", "group_wait": "1s"},
    "receivers": [{"name": "null"}],  # no webhook: nothing here is about delivery
    "inhibit_rules": [{
        "source_matchers": [f'alertname="{DRAIN}"'],
        "target_matchers": [f'alertname="{ORPHAN}"'],
        "equal": ["hostname"],
    }],
}


# -- real Alertmanager ---------------------------------------------------------------


@pytest.fixture(scope="module")
def am(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Alertmanager]:
    if ALERTMANAGER is None:
        why = "prometheus-alertmanager not found: apt-get install prometheus-alertmanager"
        if os.environ.get("CI") == "true":
            pytest.fail(f"Alertmanager client tests need the binary under CI: {why}")
        pytest.skip(why)
    manager = Alertmanager(tmp_path_factory.mktemp("am"), AM_CONFIG)
    try:
        yield manager
    finally:
        manager.stop()


def now() -> datetime:
    return datetime.now(timezone.utc)


def tree(hostname: str, root_pid: str = "4242", root_start_time: str = "987654") -> dict:
    return {"alertname": ORPHAN, "hostname": hostname, "root_pid": root_pid,
            "root_start_time": root_start_time}


def post_alerts(am: Alertmanager, *alerts: dict) -> None:
    """POST /api/v2/alerts: what Prometheus does, without waiting for a rule to fire."""
    body = [{"annotations": {"summary": "test"}, "generatorURL": "http://prom.invalid/g",
             "startsAt": (now() - timedelta(seconds=30)).isoformat(), **a} for a in alerts]
    requests.post(f"{am.url}/api/v2/alerts", json=body, timeout=5).raise_for_status()


def fire(am: Alertmanager, labels: dict) -> None:
    post_alerts(am, {"labels": labels})


def silence(am: Alertmanager, labels: dict, *, created_by: str, comment: str) -> str:
    body: dict[str, Any] = {
        "matchers": [{"name": k, "value": v, "isRegex": False, "isEqual": True}
                     for k, v in labels.items()],
        "startsAt": now().isoformat(), "endsAt": (now() + timedelta(minutes=30)).isoformat(),
        "createdBy": created_by, "comment": comment,
    }
    resp = requests.post(f"{am.url}/api/v2/silences", json=body, timeout=5)
    resp.raise_for_status()
    return resp.json()["silenceID"]


def client(*urls: str, timeout: float = 2.0, credentials_file: str | None = None,
           ca_file: str | None = None) -> AlertmanagerClient:
    return AlertmanagerClient(AlertmanagerConfig(url=urls, timeout_seconds=timeout,
                                                 credentials_file=credentials_file,
                                                 ca_file=ca_file))


def confirm(c: AlertmanagerClient, labels: dict) -> Confirmation:
    return c.confirm(alertname=labels["alertname"], hostname=labels["hostname"],
                     root_pid=labels["root_pid"], root_start_time=labels["root_start_time"])


def dead_url() -> str:
    """A port nobody listens on (bound to 0 and closed again)."""
    return f"http://127.0.0.1:{free_port()}"


def test_firing(am: Alertmanager) -> None:
    labels = tree("host-firing")
    fire(am, {**labels, "remediate": "true", "severity": "warning"})
    c = client(am.url)
    got = confirm(c, labels)
    assert got.state == ConfirmationState.FIRING and got.firing and got.url == am.url, got
    assert got.silenced_by == () and got.inhibited_by == ()
    # Another tree on the same host (same pid, reused after a reboot) is not this one.
    assert confirm(c, {**labels, "root_start_time": "1"}).state == ConfirmationState.NOT_FIRING
    assert c.request_counts() == {"ok": 2, "error": 0, "timeout": 0, "unauthorized": 0}


def test_label_values_are_quoted_for_the_matcher_syntax(am: Alertmanager) -> None:
    odd = 'gpu "node" \\ 7,{x=y}\nü'
    labels = tree(odd)
    fire(am, labels)
    assert confirm(client(am.url), labels).state == ConfirmationState.FIRING
    assert confirm(client(am.url), tree(odd[:-1])).state == ConfirmationState.NOT_FIRING
    assert matcher("hostname", 'a"b\\c\nd') == 'hostname="a\\"b\\\\c\\nd"'


def test_silenced_names_the_creator(am: Alertmanager) -> None:
    labels = tree("host-silenced")
    fire(am, labels)
    sid = silence(am, {"hostname": "host-silenced", "root_pid": "4242"},
                  created_by="alice@oncall", comment="debugging this tree, do not kill")
    got = confirm(client(am.url), labels)
    assert got.state == ConfirmationState.SILENCED and not got.firing, got
    assert got.silenced_by == (sid,) and got.silence_creators == ("alice@oncall",)
    assert "debugging this tree" in got.detail and sid in got.detail
    assert got.to_json()["silence_creators"] == ["alice@oncall"]


def test_inhibited_then_silenced_wins(am: Alertmanager) -> None:
    labels = tree("host-inhibited")
    fire(am, labels)
    fire(am, {"alertname": DRAIN, "hostname": "host-inhibited"})
    c = client(am.url)
    got = wait_for(lambda: (r := confirm(c, labels)).state == ConfirmationState.INHIBITED and r,
                   timeout=5, what="the drain alert to inhibit the orphan alert")
    assert isinstance(got, Confirmation) and len(got.inhibited_by) == 1
    drain = [a for a in am.alerts(hostname="host-inhibited") if a["labels"]["alertname"] == DRAIN]
    assert got.inhibited_by == (drain[0]["fingerprint"],)

    # Silenced and inhibited at once: the silence (a person's decision) is reported.
    silence(am, labels, created_by="bob", comment="both")
    got = confirm(c, labels)
    assert got.state == ConfirmationState.SILENCED and got.silence_creators == ("bob",)
    assert got.inhibited_by == (drain[0]["fingerprint"],)


def test_absent_and_resolved_are_not_firing(am: Alertmanager) -> None:
    c = client(am.url)
    assert confirm(c, tree("host-never-alerted")).state == ConfirmationState.NOT_FIRING
    labels = tree("host-resolved")
    fire(am, labels)
    assert confirm(c, labels).state == ConfirmationState.FIRING
    post_alerts(am, {"labels": labels, "startsAt": (now() - timedelta(minutes=1)).isoformat(),
                     "endsAt": (now() - timedelta(seconds=1)).isoformat()})
    got = confirm(c, labels)
    assert got.state == ConfirmationState.NOT_FIRING and got.url == am.url, got


def test_ha_first_peer_dead_second_answers(am: Alertmanager) -> None:
    labels = tree("host-ha")
    fire(am, labels)
    c = client(dead_url(), am.url)
    got = confirm(c, labels)
    assert got.state == ConfirmationState.FIRING and got.url == am.url, got
    assert c.request_counts() == {"ok": 1, "error": 1, "timeout": 0, "unauthorized": 0}


def test_all_peers_dead_is_unreachable() -> None:
    first, second = dead_url(), dead_url()
    c = client(first, second)
    got = confirm(c, tree("host-any"))
    assert got.state == ConfirmationState.UNREACHABLE and got.url is None and not got.firing
    assert first in got.detail and second in got.detail
    assert c.request_counts()["error"] == 2
    assert c.poll(hostname="host-any", alertnames=[ORPHAN]).alerts is None


def test_active_alerts_for_pull_mode(am: Alertmanager) -> None:
    host = "host-pull"
    mine = tree(host, root_pid="1")
    fire(am, {**mine, "remediate": "true"})
    fire(am, tree("host-pull-other"))                     # another host
    fire(am, tree(host.upper()))                          # label values are case-sensitive
    fire(am, {"alertname": "GPUGuardScanErrors", "hostname": host})  # not asked for
    silenced = tree(host, root_pid="2")
    fire(am, silenced)
    silence(am, silenced, created_by="carol", comment="keep")
    c = client(am.url)
    got = c.poll(hostname=host, alertnames=[ORPHAN, "GPUOrphanTreeOld"]).alerts
    assert got is not None
    assert [a["labels"] for a in got] == [{**mine, "remediate": "true"}]
    alert = got[0]
    assert alert["status"] == "firing" and alert["fingerprint"]
    assert alert["annotations"] == {"summary": "test"}
    assert alert["generatorURL"] == "http://prom.invalid/g"
    # The webhook's shape: gpuguard.engine.alerting.alerts parses it like a delivered
    # notification.
    parsed = parse_notification({"version": "4", "alerts": got}).alerts[0]
    assert parsed.status == "firing" and parsed.ends_at is None
    assert parsed.starts_at is not None and abs(parsed.starts_at - time.time()) < 120
    assert c.poll(hostname="host-without-alerts", alertnames=[ORPHAN]).alerts == []


# -- fakes for what the real binary cannot produce -----------------------------------


Route = Callable[[BaseHTTPRequestHandler], "tuple[int, bytes, dict[str, str]]"]


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the client gave up on a slow answer: expected, not worth a traceback


class FakeAlertmanager:
    """127.0.0.1:0; `route(handler) -> (status, body, headers)` answers every GET."""

    def __init__(self, route: Route, tls: ssl.SSLContext | None = None) -> None:
        """`tls`: serve https with that server context (the handshake at accept)."""
        self.requests: list[tuple[str, str | None]] = []  # (path, Authorization)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                fake.requests.append((self.path, self.headers.get("Authorization")))
                status, body, headers = route(self)
                self.send_response(status)
                for name, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                         daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeAlertmanager]]:
    started: list[FakeAlertmanager] = []

    def start(route: Route, tls: ssl.SSLContext | None = None) -> FakeAlertmanager:
        server = FakeAlertmanager(route, tls)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def answer(status: int, body: Any, **headers: str) -> Route:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return lambda handler: (status, data, headers)


def api_alert(labels: dict, *, state: str = "active", silenced_by: list | None = None,
              inhibited_by: list | None = None) -> dict:
    return {"labels": labels, "annotations": {}, "fingerprint": "f00", "receivers": [],
            "startsAt": "2026-11-30T06:59:46.761Z", "endsAt": "2026-11-30T07:04:46.762Z",
            "updatedAt": "2026-11-30T06:59:46.762Z", "generatorURL": "",
            "status": {"state": state, "silencedBy": silenced_by or [],
                       "inhibitedBy": inhibited_by or []}}


@pytest.mark.parametrize(
    ("route", "result", "problem"),
    [
        (answer(200, b"<html>proxy login</html>"), "error", "not JSON"),
        (answer(200, {"alerts": []}), "error", "not a list"),
        (answer(200, [{"labels": {"hostname": 7}, "status": {"state": "active"}}]), "error",
         "labels: not an object of strings"),
        (answer(200, [{"labels": {}, "status": {"state": "active", "silencedBy": "x"}}]),
         "error", "silencedBy: not a list"),
        (answer(503, {"error": "not ready"}), "error", "HTTP 503"),
        (answer(404, b"404 page not found"), "error", "HTTP 404"),
        (answer(401, b"unauthorized"), "unauthorized", "HTTP 401"),
        (answer(403, b"forbidden"), "unauthorized", "HTTP 403"),
        (answer(302, b"", Location="http://127.0.0.1:1/elsewhere"), "error", "HTTP 302"),
    ],
)
def test_bad_answers_are_unreachable(fake: Callable[[Route], FakeAlertmanager], route: Route,
                                     result: str, problem: str) -> None:
    server = fake(route)
    c = client(server.url)
    got = confirm(c, tree("h"))
    assert got.state == ConfirmationState.UNREACHABLE and problem in got.detail, got
    assert c.request_counts()[result] == 1 and sum(c.request_counts().values()) == 1
    one_bad_alert = problem.startswith(("labels:", "silencedBy:"))
    # Pull mode skips one bad alert (counted), not the whole answer (tests/live/test_pull_bounds).
    assert c.poll(hostname="h", alertnames=[ORPHAN]).alerts == ([] if one_bad_alert else None)
    assert c.skip_counts()["malformed"] == (1 if one_bad_alert else 0)
    assert len(server.requests) == 2  # the redirect was not followed


def test_5xx_peer_then_real_alertmanager(fake: Callable[[Route], FakeAlertmanager],
                                         am: Alertmanager) -> None:
    labels = tree("host-5xx")
    fire(am, labels)
    broken = fake(answer(500, b"internal error"))
    got = confirm(client(broken.url, am.url), labels)
    assert got.state == ConfirmationState.FIRING and got.url == am.url
    assert len(broken.requests) == 1


def test_labels_are_compared_not_trusted_to_the_filter(
        fake: Callable[[Route], FakeAlertmanager]) -> None:
    labels = tree("h")
    # A proxy or a broken version that ignores `filter` returns other trees too.
    server = fake(answer(200, [api_alert({**labels, "root_pid": "1"}),
                               api_alert({**labels, "hostname": "other"}),
                               api_alert({k: v for k, v in labels.items() if k != "root_pid"})]))
    got = confirm(client(server.url), labels)
    assert got.state == ConfirmationState.NOT_FIRING and got.url == server.url, got
    # The query carries all four matchers, URL-encoded, plus the suppressed alerts.
    path = server.requests[0][0]
    assert path.startswith("/api/v2/alerts?active=true&silenced=true&inhibited=true&")
    assert "filter=root_start_time%3D%22987654%22" in path and path.count("filter=") == 4
    # Only a non-active state left (e.g. "unprocessed"): not firing either.
    other = fake(answer(200, [api_alert(labels, state="unprocessed")]))
    got = confirm(client(other.url), labels)
    assert got.state == ConfirmationState.NOT_FIRING and "unprocessed" in got.detail


def test_silenced_even_when_the_silence_lookup_fails(
        fake: Callable[[Route], FakeAlertmanager]) -> None:
    labels = tree("h")
    alerts = json.dumps([api_alert(labels, state="suppressed", silenced_by=["s-1"])]).encode()

    def route(handler: BaseHTTPRequestHandler) -> tuple[int, bytes, dict[str, str]]:
        if handler.path.startswith("/api/v2/alerts"):
            return 200, alerts, {}
        return 500, b"boom", {}

    server = fake(route)
    c = client(server.url)
    got = confirm(c, labels)
    assert got.state == ConfirmationState.SILENCED and got.silenced_by == ("s-1",)
    assert got.silence_creators == ()
    assert "creator unknown: HTTP 500" in got.detail
    assert server.requests[1][0] == "/api/v2/silence/s-1"
    assert c.request_counts() == {"ok": 1, "error": 1, "timeout": 0, "unauthorized": 0}


def test_slow_peers_time_out_within_the_bound(fake: Callable[[Route], FakeAlertmanager]) -> None:
    release = threading.Event()  # the fakes answer once the test is over, not on a clock

    def slow(handler: BaseHTTPRequestHandler) -> tuple[int, bytes, dict[str, str]]:
        release.wait(30)
        return 200, b"[]", {}

    servers = [fake(slow), fake(slow)]
    c = client(*(s.url for s in servers), timeout=0.3)
    started = time.monotonic()
    try:
        got = confirm(c, tree("h"))
    finally:
        release.set()
    elapsed = time.monotonic() - started
    assert got.state == ConfirmationState.UNREACHABLE and "timed out" in got.detail, got
    assert c.request_counts()["timeout"] == 2
    assert 0.5 <= elapsed < 0.6 + 0.5, elapsed  # timeout_seconds per peer, whole call bounded


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def serving(certs: Certs, name: str = "server") -> ssl.SSLContext:
    """A server context with `name`'s certificate (127.0.0.1, signed by ca or other-ca)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.path(f"{name}.crt"), certs.path(f"{name}.key"))
    return context


def private_token(tmp_path: Path, text: str = "right-token") -> Path:
    token = tmp_path / "token"
    token.write_text(f"{text}\n")
    token.chmod(0o600)  # a token file must be private
    return token


def test_bearer_token_from_credentials_file(fake: Callable[..., FakeAlertmanager],
                                            tmp_path: Path, certs: Certs) -> None:
    """Over https to a server whose certificate a private CA signed: ca_file trusts it."""
    def route(handler: BaseHTTPRequestHandler) -> tuple[int, bytes, dict[str, str]]:
        if handler.headers.get("Authorization") != "Bearer right-token":
            return 401, b"unauthorized", {}
        return 200, json.dumps([api_alert(tree("h"))]).encode(), {}

    server = fake(route, serving(certs))
    token = private_token(tmp_path, "wrong-token")
    c = client(server.url, credentials_file=str(token), ca_file=certs.path("ca.crt"))
    got = confirm(c, tree("h"))
    assert got.state == ConfirmationState.UNREACHABLE and "HTTP 401" in got.detail
    assert c.request_counts()["unauthorized"] == 1

    rotated = tmp_path / "token.new"
    rotated.write_text("right-token\n")
    rotated.chmod(0o600)  # a token file must be private
    rotated.replace(token)  # re-read on change, no restart
    assert confirm(c, tree("h")).state == ConfirmationState.FIRING
    assert server.requests[-1][1] == "Bearer right-token"


@pytest.mark.parametrize("case", ["other-ca", "system-cas"])
def test_a_server_the_ca_file_did_not_sign_gets_no_token(
        fake: Callable[..., FakeAlertmanager], tmp_path: Path, certs: Certs,
        case: str) -> None:
    """A certificate from another CA (ca_file set), or a private CA's without ca_file
    (the system's CAs): the handshake fails before any request, so no Authorization."""
    server = fake(answer(200, []), serving(certs, "other-server" if case == "other-ca"
                                           else "server"))
    c = client(server.url, credentials_file=str(private_token(tmp_path)),
               ca_file=certs.path("ca.crt") if case == "other-ca" else None)
    got = confirm(c, tree("h"))
    assert got.state == ConfirmationState.UNREACHABLE and "CERTIFICATE_VERIFY_FAILED" in \
        got.detail, got
    assert server.requests == []


def test_a_ca_file_that_cannot_be_loaded_sends_nothing(
        fake: Callable[..., FakeAlertmanager], tmp_path: Path, certs: Certs) -> None:
    server = fake(answer(200, []), serving(certs))
    (tmp_path / "not-a-ca.crt").write_text("not PEM\n")
    for ca_file in (str(tmp_path / "missing.crt"), str(tmp_path / "not-a-ca.crt")):
        got = confirm(client(server.url, credentials_file=str(private_token(tmp_path)),
                             ca_file=ca_file), tree("h"))
        assert got.state == ConfirmationState.UNREACHABLE, got
        assert f"ca_file: cannot load {ca_file}" in got.detail, got
    assert server.requests == []


def test_a_token_is_never_sent_in_clear_to_whoever_holds_the_port(
        fake: Callable[..., FakeAlertmanager], tmp_path: Path) -> None:
    """Issue 48: the shipped example was http://127.0.0.1:9093 with a credentials_file;
    any local user who bound 9093 while Alertmanager was not listening got the token on
    every poll (and could answer the confirmation). Without the explicit opt-out no
    client is made; with it (insecure_credentials_over_http), it is the operator's word."""
    squatter = fake(answer(200, []))
    token = str(private_token(tmp_path))
    with pytest.raises(ValueError, match="credentials_file: would be sent in clear"):
        client_in_clear = AlertmanagerClient(AlertmanagerConfig(
            url=(squatter.url,), credentials_file=token, timeout_seconds=2.0))
        confirm(client_in_clear, tree("h"))  # what the old code did: the token sent
    assert squatter.requests == []
    opted = AlertmanagerClient(AlertmanagerConfig(
        url=(squatter.url,), credentials_file=token, insecure_credentials_over_http=True))
    assert confirm(opted, tree("h")).state == ConfirmationState.NOT_FIRING
    assert squatter.requests[0][1] == "Bearer right-token"


def test_unusable_credentials_file_sends_nothing(fake: Callable[..., FakeAlertmanager],
                                                 tmp_path: Path, certs: Certs) -> None:
    server = fake(answer(200, []), serving(certs))
    ca = certs.path("ca.crt")
    c = client(server.url, credentials_file=str(tmp_path / "missing"), ca_file=ca)
    got = confirm(c, tree("h"))
    assert got.state == ConfirmationState.UNREACHABLE
    assert "no token from credentials_file" in got.detail
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert confirm(client(server.url, credentials_file=str(empty), ca_file=ca),
                   tree("h")).state == ConfirmationState.UNREACHABLE
    assert c.request_counts()["unauthorized"] == 1
    assert server.requests == []


def test_without_credentials_file_no_authorization_header(
        fake: Callable[[Route], FakeAlertmanager]) -> None:
    server = fake(answer(200, []))
    assert confirm(client(server.url + "/"), tree("h")).state == ConfirmationState.NOT_FIRING
    assert server.requests[0][0].startswith("/api/v2/alerts?")  # no double slash
    assert server.requests[0][1] is None


def test_ha_a_peer_that_missed_the_silence_does_not_outvote_one_that_has_it(
        am: Alertmanager, tmp_path: Path) -> None:
    """Two real, unclustered peers: one restarted without its silences, say."""
    labels = tree("ha-split-host")
    other = Alertmanager(tmp_path / "am2", AM_CONFIG)
    try:
        fire(am, labels)
        fire(other, labels)
        sid = silence(am, labels, created_by="oncall", comment="keep it")
        for urls in ((other.url, am.url), (am.url, other.url)):
            answer = confirm(client(*urls), labels)
            assert (answer.state, answer.silenced_by) == (ConfirmationState.SILENCED, (sid,)), \
                (urls, answer)
        # alone, it would say so
        assert confirm(client(other.url), labels).state == ConfirmationState.FIRING
    finally:
        other.stop()


def test_a_deeply_nested_answer_is_a_failed_peer(fake: Callable[[Route], FakeAlertmanager],
                                                 am: Alertmanager) -> None:
    deep = fake(lambda h: (200, b"[" * 100_000 + b"]" * 100_000, {}))
    labels = tree("nested-host")
    fire(am, labels)
    answer = confirm(client(deep.url, am.url), labels)
    assert answer.state == ConfirmationState.FIRING  # the next peer was asked
    assert confirm(client(deep.url), labels).state == ConfirmationState.UNREACHABLE


def test_a_slow_peer_cannot_spend_the_time_of_the_peer_holding_the_silence(
        fake: Callable[[Route], FakeAlertmanager]) -> None:
    """A reap's kill-time question, with what is left of its deadline (`within`): the
    first peer answers "firing" slowly, the second holds a silence. Each peer gets a fair
    share, so the slow one times out and the silence is heard; before, the first spent
    nearly all of it and the silence went unheard: firing, and the tree was reaped."""
    labels = tree("h")
    firing = json.dumps([api_alert(labels)]).encode()
    silenced = json.dumps([api_alert(labels, state="suppressed",
                                     silenced_by=["s-1"])]).encode()
    gate = threading.Event()  # never set: each wait below is a peer's latency, not a sync

    def slow(handler: BaseHTTPRequestHandler) -> tuple[int, bytes, dict[str, str]]:
        gate.wait(1.8)
        return 200, firing, {}

    def holds_silence(handler: BaseHTTPRequestHandler) -> tuple[int, bytes, dict[str, str]]:
        gate.wait(0.3)
        if handler.path.startswith("/api/v2/alerts"):
            return 200, silenced, {}
        return 500, b"no silence lookup here", {}  # silenced all the same

    first, second = fake(slow), fake(holds_silence)
    urls = [first.url, second.url]
    if peer_order(urls, "h")[0] != first.url:
        urls.reverse()
    got = client(*urls, timeout=30).confirm(
        alertname=labels["alertname"], hostname="h", root_pid=labels["root_pid"],
        root_start_time=labels["root_start_time"], within=2.0)
    assert got.state == ConfirmationState.SILENCED, got
