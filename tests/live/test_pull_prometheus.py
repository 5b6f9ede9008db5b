"""Pull mode from Prometheus (issue 54), against a real HTTP peer on 127.0.0.1 that
answers as Prometheus's query API does (or sheds with 503, or is gone): the real client,
the real poller thread, the real /healthz and /metrics. The loop with the real binaries
is tests/e2e/test_e2e_prometheus_pull.py."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from gpuguard.config.remediate import PrometheusConfig
from gpuguard.engine.alerting.polling import FAILED_POLLS_UNHEALTHY, PollResult
from gpuguard.engine.alerting.prometheus import PrometheusClient, firing_query
from gpuguard.engine.alerting.pulled import SkipReason
from gpuguard.remediator.pull import Puller
from gpuguard.remediator.status import HealthCode
from tests.live.test_pull_bounds import Intake
from tests.support.proctree import wait_for
from tests.support.remediator_harness import HOST, Harness
from tests.support.slowpeer import Reply, SlowPeer

ORPHAN = "GPUOrphanTree"


def series(since: str = "1700000000", **labels: str) -> dict[str, Any]:
    metric = {"__name__": "ALERTS_FOR_STATE", "alertname": ORPHAN, "hostname": HOST,
              "root_pid": "4242", "root_start_time": "777", "remediate": "true", **labels}
    return {"metric": metric, "value": [1700000100.5, since]}


def vector(*results: dict[str, Any]) -> bytes:
    return json.dumps({"status": "success",
                       "data": {"resultType": "vector", "result": list(results)}}).encode()


def client(url: str, **kw: Any) -> PrometheusClient:
    return PrometheusClient(PrometheusConfig(url=(url,), **kw))


def test_a_poll_asks_the_one_query_and_hands_on_this_hosts_firing_alerts(
        peer: Callable[..., SlowPeer]) -> None:
    server = peer(lambda n: Reply(body=vector(
        series(),
        series(root_pid="1", hostname="other-node"),  # a proxy may not filter: we do
        series(root_pid="2", remediate="false"),
        series(root_pid="3", alertname="GPUIdleHolder"),
        series(since="NaN", root_pid="4"),  # one odd series hides nothing else
    )))
    intake = Intake()
    prometheus = client(server.url, timeout_seconds=2)
    puller = Puller(intake, prometheus, interval=15)  # type: ignore[arg-type]
    assert puller.poll_once() == 1
    (path,) = server.paths
    parts = urlsplit(path)
    assert parts.path == "/api/v1/query"
    assert parse_qs(parts.query)["query"] == [firing_query([ORPHAN], HOST)]
    (notification,) = intake.delivered
    (alert,) = notification.alerts
    assert alert.status == "firing" and alert.label("root_pid") == "4242"
    assert "__name__" not in alert.labels
    assert alert.starts_at == 1700000000.0  # ALERTS_FOR_STATE's value: active since
    skips = prometheus.skip_counts()
    assert (skips[SkipReason.OTHER_HOST], skips[SkipReason.NOT_REMEDIATE],
            skips[SkipReason.NOT_LISTED], skips[SkipReason.MALFORMED]) == (1, 1, 1, 1)
    assert prometheus.polls.view().counts[PollResult.OK] == 1


def test_an_error_answer_is_a_failed_poll_not_an_empty_one(
        peer: Callable[..., SlowPeer]) -> None:
    """Prometheus answers 422 or a non-success envelope for a query it cannot run:
    "could not ask", never "nothing fires"."""
    bodies = [Reply(status=422, body=b'{"status":"error","errorType":"execution"}'),
              Reply(body=b'{"status":"error","error":"query timed out"}'),
              Reply(body=b'{"status":"success","data":{"resultType":"matrix","result":[]}}')]
    server = peer(lambda n: bodies[n])
    puller = Puller(Intake(), client(server.url, timeout_seconds=2),  # type: ignore[arg-type]
                    interval=15)
    for _ in bodies:
        assert puller.poll_once() is None
        assert puller.last is not None and puller.last.result == PollResult.ERROR
    assert puller.failed_polls == 3


def test_a_busy_prometheus_is_retried_sooner_honouring_retry_after(
        peer: Callable[..., SlowPeer]) -> None:
    server = peer(lambda n: Reply(status=503, body=b"busy", headers={"Retry-After": "4"}))
    puller = Puller(Intake(), client(server.url, timeout_seconds=2),  # type: ignore[arg-type]
                    interval=20)
    assert puller.poll_once() is None
    assert puller.last is not None and puller.last.result == PollResult.BUSY
    assert 4.0 <= puller.next_delay() < 20 * 0.9  # Retry-After, not a whole interval


def test_basic_auth_is_sent_and_a_token_over_http_is_refused(
        peer: Callable[..., SlowPeer], tmp_path: Any) -> None:
    password = tmp_path / "password"
    password.write_text("s3cret:with-colon\n")
    password.chmod(0o600)
    server = peer(lambda n: Reply(body=vector()))
    from gpuguard.config.remediate import BasicAuth

    prometheus = client(server.url, basic_auth=BasicAuth("gpuguard", str(password)),
                        insecure_credentials_over_http=True)
    assert prometheus.poll(hostname=HOST, alertnames=[ORPHAN]).alerts == []
    assert "authorization: basic z3b1z3vhcmq6cznjcmv0ondpdggty29sb24=" in \
        server.requests[0].lower()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on return: nothing listens there


def test_healthz_is_honest_while_prometheus_sheds_or_is_gone(
        harness: Callable[..., Harness], peer: Callable[..., SlowPeer]) -> None:
    mode = ["busy"]

    def plan(n: int) -> Reply:
        return Reply(status=503, body=b"busy") if mode[0] == "busy" else Reply(body=vector())

    server = peer(plan)
    confirm = peer(lambda n: Reply(body=b"[]"))  # Alertmanager, for the confirmation
    h = harness(alertmanager={"url": confirm.url},
                prometheus={"url": server.url, "pull_interval_seconds": 1,
                            "timeout_seconds": 1})
    wait_for(lambda: len(server.paths) >= FAILED_POLLS_UNHEALTHY, timeout=15,
             what=f"{FAILED_POLLS_UNHEALTHY} polls")
    wait_for(lambda: h.client.get("/healthz").status_code == 503, timeout=5,
             what="/healthz degraded")
    assert h.client.get("/healthz").get_data(as_text=True) == f"{HealthCode.POLLER_FAILING}\n"
    _ok, _code, detail = h.service.healthy()
    assert "polls of Prometheus in a row failed" in detail and "HTTP 503" in detail
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert 'gpuguard_remediator_alertmanager_polls_total{result="busy",source="prometheus"}' \
        in metrics
    assert confirm.paths == []  # the polls went to Prometheus, not Alertmanager
    mode[0] = "ok"
    wait_for(lambda: h.client.get("/healthz").status_code == 200, timeout=10,
             what="/healthz ok again")
    assert 'gpuguard_remediator_alertmanager_polls_total{result="ok",source="prometheus"}' \
        in h.client.get("/metrics").get_data(as_text=True)


def test_healthz_says_failing_when_nothing_listens(harness: Callable[..., Harness],
                                                  peer: Callable[..., SlowPeer]) -> None:
    confirm = peer(lambda n: Reply(body=b"[]"))
    h = harness(alertmanager={"url": confirm.url},
                prometheus={"url": f"http://127.0.0.1:{closed_port()}",
                            "pull_interval_seconds": 1, "timeout_seconds": 1})
    wait_for(lambda: h.client.get("/healthz").status_code == 503, timeout=20,
             what="/healthz degraded")
    assert h.client.get("/healthz").get_data(as_text=True) == f"{HealthCode.POLLER_FAILING}\n"
