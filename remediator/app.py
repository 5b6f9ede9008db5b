"""Flask application factory: POST /alerts, GET /healthz, /metrics, /state.

The HTTP layer is deliberately thin and fast: authenticate, bound the body,
decode, validate, hand the notification to the Remediator's intake and answer
with one account per alert. Nothing here inspects processes or sends signals,
so the answer comes back in milliseconds whatever the policy ends up doing.
The app binds to a Remediator built outside it (remediator/service.py, where
the ledger, the audit log and every injected dependency are set up), so tests
build one service and one app per case.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from flask import Flask, Response, request
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from gpuguard.exporter.counters import Counters
from gpuguard.exporter.metrics import event_metrics, inspector_metrics
from gpuguard.remediator.alertmanager import RESULTS
from gpuguard.remediator.alerts import PayloadError, parse_notification
from gpuguard.remediator.ledger import LedgerError
from gpuguard.remediator.worker import Remediator

log = logging.getLogger("gpuguard.remediator.http")

MAX_BODY_BYTES = 1024 * 1024
EXTENSION = "gpuguard_remediator"

TokenSource = Callable[[], "bytes | None"]


class TokenFile:
    """A bearer token read from a file, re-read whenever the file changes (rotation).

    Each call costs one stat(); the file is read again only when its inode,
    size or mtime moved. An unreadable or empty file yields None, which rejects
    every request: failing closed is the only safe answer for a kill endpoint.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._signature: tuple[int, ...] | None = None
        self._token: bytes | None = None
        self._warned = False

    def __call__(self) -> bytes | None:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            self._warn(f"token file {self.path}: {exc.strerror}; rejecting every request")
            return None
        signature = (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with self._lock:
            if signature != self._signature:
                try:
                    with open(self.path, "rb") as fh:
                        token = fh.read(64 * 1024).strip()
                except OSError as exc:
                    self._warn(f"token file {self.path}: {exc.strerror}; rejecting every request")
                    return None
                self._token = token or None
                self._signature = signature
                if self._token is None:
                    self._warn(f"token file {self.path} is empty; rejecting every request")
                else:
                    self._warned = False
                    if st.st_mode & 0o077:
                        log.warning("token file %s is readable by group or others", self.path)
            return self._token

    def _warn(self, message: str) -> None:
        if not self._warned:
            log.error(message)
            self._warned = True


class RemediatorCollector(Collector):
    """Fresh families on every scrape from the Remediator's counters."""

    def __init__(self, service: Remediator, counters: Counters) -> None:
        self.service = service
        self.counters = counters

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so `/metrics?name[]=...` can find them."""
        for family in self.collect():
            family.samples = []
            yield family

    def collect(self) -> Iterator[Metric]:
        c = self.service.counts()
        decisions = CounterMetricFamily("gpuguard_remediator_decisions",
                                        "Decisions by action and reason code.",
                                        labels=["action", "reason"])
        for (action, reason), count in sorted(c["decisions"].items()):
            decisions.add_metric([action, reason], count)
        yield decisions
        yield CounterMetricFamily("gpuguard_remediator_reaped_processes",
                                  "Processes a reap in enforce mode left gone or zombie.",
                                  value=c["reaped_processes"])
        yield CounterMetricFamily("gpuguard_remediator_reclaimed_bytes",
                                  "GPU memory freed by reaps, as NVML reported after each.",
                                  value=c["reclaimed_bytes"])
        yield CounterMetricFamily("gpuguard_remediator_reap_failures",
                                  "Reaps that left survivors, raised, or were interrupted.",
                                  value=c["reap_failures"])
        yield CounterMetricFamily("gpuguard_remediator_audit_write_failures",
                                  "Audit records that could not be written; no reap signals "
                                  "anything without its record.",
                                  value=c["audit_failures"])
        yield GaugeMetricFamily("gpuguard_remediator_audit_ok",
                                "1 while the last audit write succeeded (0: reaps are refused).",
                                value=1 if c["audit_ok"] else 0)
        rejected = CounterMetricFamily("gpuguard_remediator_rejected_requests",
                                       "POST /alerts requests refused, by cause.",
                                       labels=["cause"])
        for cause, count in c["rejected"].items():
            rejected.add_metric([cause], count)
        yield rejected
        requests = CounterMetricFamily(
            "gpuguard_remediator_alertmanager_requests",
            "Requests to Alertmanager's API (kill-time confirmation, pull), by result.",
            labels=["result"])
        client = self.service.alertmanager
        counts = client.request_counts() if client is not None else dict.fromkeys(RESULTS, 0)
        for result, count in sorted(counts.items()):
            requests.add_metric([result], count)
        yield requests
        yield GaugeMetricFamily("gpuguard_remediator_queue_depth",
                                "Accepted alerts not finished yet (queued or deferred).",
                                value=self.service.queue_depth())
        yield from inspector_metrics(self.counters)
        yield from event_metrics(self.service.events)


def _error(status: int, message: str, **headers: str) -> Response:
    return Response(json.dumps({"error": message}) + "\n", status=status,
                    mimetype="application/json", headers=headers)


def _json(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body) + "\n", status=status, mimetype="application/json")


def create_app(service: Remediator, *, token: TokenSource | None) -> Flask:
    """Bind the HTTP routes to a built Remediator (remediator.service.build_remediator).

    `token=None` disables auth (only --insecure-no-auth does that). Nothing is
    created, written or started here; the Remediator stays at
    `app.extensions["gpuguard_remediator"]`, and its owner starts and stops it.
    """
    policy = service.policy
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RemediatorCollector(service, service.counters))

    app = Flask("gpuguard-remediator")
    app.extensions[EXTENSION] = service

    def authorized() -> bool:
        if token is None:
            return True
        expected = token()
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if expected is None or scheme.lower() != "bearer":
            hmac.compare_digest(b"x", b"y")  # same work on every path
            return False
        return hmac.compare_digest(given.strip().encode("utf-8", "replace"), expected)

    def unauthorized() -> Response:
        service.reject("unauthorized")
        return _error(401, "missing or wrong bearer token",
                      **{"WWW-Authenticate": 'Bearer realm="gpuguard-remediator"'})

    @app.post("/alerts")
    def alerts() -> Response:
        if not authorized():
            return unauthorized()
        length = request.content_length
        if length is not None and length > MAX_BODY_BYTES:
            service.reject("too_large")
            return _error(413, f"body of {length} bytes is over the {MAX_BODY_BYTES}-byte limit")
        mimetype = request.mimetype or ""
        if mimetype != "application/json" and not mimetype.endswith("+json"):
            service.reject("not_json")
            return _error(415, f"Content-Type must be application/json, got {mimetype or 'none'}")
        body = request.stream.read(MAX_BODY_BYTES + 1)
        if len(body) > MAX_BODY_BYTES:
            service.reject("too_large")
            return _error(413, f"body is over the {MAX_BODY_BYTES}-byte limit")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:  # the media type was right: 400, not 415
            service.reject("malformed")
            return _error(400, f"body is not valid JSON: {str(exc)[:120]}")
        try:
            notification = parse_notification(data)
        except PayloadError as exc:
            service.reject("malformed")
            return _error(400, str(exc)[:500])
        try:
            accounts = service.submit(notification)
        except LedgerError as exc:  # nothing was kept: Alertmanager retries a 5xx
            service.reject("state_unwritable")
            log.error("POST /alerts refused: %s", exc)
            return _error(503, f"cannot record the alerts: {exc}"[:500])
        counts: dict[str, int] = {}
        for account in accounts:
            counts[account.status] = counts.get(account.status, 0) + 1
        return _json({"accounts": [a.to_json() for a in accounts], "counts": counts,
                      "mode": policy.mode})

    @app.get("/healthz")
    def healthz() -> Response:
        ok, why = service.healthy()
        return Response(why + "\n", status=200 if ok else 503, mimetype="text/plain")

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)

    @app.get("/state")
    def state() -> Response:
        if not authorized():
            return unauthorized()
        return _json(service.snapshot())

    return app
