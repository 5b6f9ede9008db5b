"""Pull mode takes only remediate="true" alerts, one by one, and a bounded number per poll.

Issue 25: any active alert for this host was acted on, and one bad alert (or 1,001
alerts) dropped the whole poll. Against the local fake Alertmanager of
test_alertmanager_client (the real binary refuses malformed alerts anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from gpuguard.config import load_config
from gpuguard.engine.alerting.alertmanager import MAX_PULL_ALERTS, SkipReason
from gpuguard.engine.alerting.alerts import Notification
from gpuguard.remediator.pull import Puller
from tests.e2e.test_alertmanager_client import (
    ORPHAN,
    FakeAlertmanager,
    Route,
    answer,
    api_alert,
    client,
    tree,
)
from tests.support.remediator_harness import HOST, Harness

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake() -> Iterator[Callable[[Route], FakeAlertmanager]]:
    started: list[FakeAlertmanager] = []

    def start(route: Route) -> FakeAlertmanager:
        started.append(FakeAlertmanager(route))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def mine(root_pid: str = "4242", **extra: str) -> dict[str, str]:
    return {**tree(HOST, root_pid=root_pid), "remediate": "true", **extra}


class Intake:
    """What Puller needs of a Remediator: its host, its alert names, and submit()."""

    def __init__(self) -> None:
        self.hostname = HOST
        self.policy = SimpleNamespace(alerts=(ORPHAN,))
        self.delivered: list[Notification] = []

    def submit(self, notification: Notification, *, source: str) -> list[Any]:
        assert source == "pull"
        self.delivered.append(notification)
        return []


def poll(server: FakeAlertmanager) -> tuple[Intake, Puller, int | None]:
    intake = Intake()
    puller = Puller(intake, client(server.url), interval=60)  # type: ignore[arg-type]
    return intake, puller, puller.poll_once()


def test_pull_takes_only_remediate_true(fake: Callable[[Route], FakeAlertmanager]) -> None:
    # A proxy (or an old Alertmanager) may ignore the filter: the labels decide.
    server = fake(answer(200, [api_alert(mine("1")),
                               api_alert({**mine("2"), "remediate": "false"}),
                               api_alert(tree(HOST, root_pid="3"))]))
    intake, puller, got = poll(server)
    assert got == 1
    (notification,) = intake.delivered
    assert [a.labels["root_pid"] for a in notification.alerts] == ["1"]
    assert puller.client.skip_counts()["not-remediate"] == 2
    assert "filter=remediate%3D%22true%22" in server.requests[0][0]  # asked for, too


def test_a_bad_alert_is_skipped_not_the_poll(fake: Callable[[Route], FakeAlertmanager]) -> None:
    bad_time = {**api_alert(mine("2")), "startsAt": "yesterday"}  # not RFC 3339
    bad_shape = {"labels": {**mine("3"), "root_pid": 3}, "status": {"state": "active"}}
    server = fake(answer(200, [bad_time, bad_shape, "junk", api_alert(mine("1")),
                               api_alert({**mine("4"), "hostname": "other-node"}),
                               api_alert({**mine("5"), "alertname": "Junk"}),
                               api_alert(mine("6"), state="suppressed", silenced_by=["s"])]))
    intake, puller, got = poll(server)
    assert got == 1
    assert [a.labels["root_pid"] for a in intake.delivered[0].alerts] == ["1"]
    skipped = puller.client.skip_counts()
    assert skipped == {"malformed": 3, "other-host": 1, "alertname-not-listed": 1,
                       "not-remediate": 0, "not-active": 1, "over-limit": 0}


def test_very_many_alerts_are_bounded_per_poll(
        fake: Callable[[Route], FakeAlertmanager]) -> None:
    many = [api_alert(mine(str(1000 + i))) for i in range(MAX_PULL_ALERTS + 1)]
    server = fake(answer(200, [api_alert(mine("1")), *many]))
    intake, puller, got = poll(server)
    assert got == MAX_PULL_ALERTS
    (notification,) = intake.delivered
    assert len(notification.alerts) == MAX_PULL_ALERTS
    assert notification.alerts[0].labels["root_pid"] == "1"
    assert puller.client.skip_counts()["over-limit"] == 2
    assert puller.polls == 1 and puller.failed_polls == 0


def test_skips_are_a_metric_with_every_reason(harness: Callable[..., Harness],
                                              fake: Callable[[Route], FakeAlertmanager]
                                              ) -> None:
    server = fake(answer(200, [api_alert(tree(HOST))]))  # no remediate label
    h = harness(alertmanager={"url": server.url})
    assert h.service.alertmanager is not None
    assert h.service.alertmanager.poll(hostname=HOST, alertnames=[ORPHAN]).alerts == []
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert ('gpuguard_remediator_pull_alerts_skipped_total{source="alertmanager",'
            'why="not-remediate"} 1.0') in metrics
    for why in tuple(SkipReason):  # a fixed label set, present before anything is skipped
        assert (f'gpuguard_remediator_pull_alerts_skipped_total{{source="alertmanager",'
                f'why="{why}"}}') in metrics


@pytest.mark.parametrize(("credentials", "warned"), [(False, True), (True, False)])
def test_plain_http_without_credentials_warns_once_at_start(
        harness: Callable[..., Harness], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        credentials: bool, warned: bool) -> None:
    """With credentials over http:// (only with the explicit opt-out, issue 48) the
    warning is the louder one: the token goes in clear."""
    section: dict[str, Any] = {"url": ["https://am-1.invalid:9093", "http://127.0.0.1:1"]}
    if credentials:
        token = tmp_path / "am-token"
        token.write_text("secret\n")
        token.chmod(0o600)
        section["credentials_file"] = str(token)
        section["insecure_credentials_over_http"] = True
    with caplog.at_level(logging.WARNING, logger="gpuguard.remediator"):
        harness(alertmanager=section)
    messages = [r.getMessage() for r in caplog.records]
    hits = [m for m in messages if "without credentials_file" in m]
    assert len(hits) == (1 if warned else 0), hits
    if warned:
        assert "http://127.0.0.1:1" in hits[0] and "https://am-1" not in hits[0]
    loud = [m for m in messages if "insecure_credentials_over_http" in m]
    assert len(loud) == (0 if warned else 1), loud
    if loud:
        assert "in clear to http://127.0.0.1:1" in loud[0] and "https://am-1" not in loud[0]


def test_shipped_pull_config_authenticates_to_alertmanager(tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all((REPO / "deploy/kubernetes/configmap.yaml").read_text()))
    (configmap,) = [d for d in docs if d and d.get("metadata", {}).get("name")
                    == "gpuguard-config"]
    path = tmp_path / "gpuguard.yml"
    path.write_text(configmap["data"]["gpuguard.yml"])
    am = load_config(path).remediate.alertmanager
    assert am is not None and am.pull
    assert am.credentials_file == "/run/secrets/gpuguard/alertmanager-token"
    # Over https with the CA from the same Secret: the token never goes in clear.
    assert am.url[0].startswith("https://") and not am.insecure_credentials_over_http
    assert am.ca_file == "/run/secrets/gpuguard/alertmanager-ca.crt"
    daemonset = (REPO / "deploy/kubernetes/daemonset.yaml").read_text()
    assert "mountPath: /run/secrets/gpuguard" in daemonset
    # The docs say how to create that Secret key, and to put Alertmanager's API behind its
    # own web config.
    assert "alertmanager-token=" in (REPO / "docs/deployment.md").read_text()
    assert "alertmanager-ca.crt=" in (REPO / "docs/deployment.md").read_text()
    assert "--web.config.file" in (REPO / "docs/alerting.md").read_text()
