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
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Any

from flask import Flask, Response, request
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from gpuguard.exporter.metrics import event_metrics, inspector_metrics
from gpuguard.host.counters import Counters
from gpuguard.remediator.alertmanager import RESULTS, SKIP_REASONS
from gpuguard.remediator.alerts import PayloadError, parse_notification
from gpuguard.remediator.ledger import LedgerError
from gpuguard.remediator.worker import Remediator
from gpuguard.web.serving import SMALL_BODY_BYTES, BodyPolicy, Refusal, RequestHead

log = logging.getLogger("gpuguard.remediator.http")

MAX_BODY_BYTES = 1024 * 1024
EXTENSION = "gpuguard_remediator"

TokenSource = Callable[[], "bytes | None"]


def private_file_problem(path: str, st: os.stat_result) -> str | None:
    """Why a file holding a secret is not private, or None.

    Private means a regular file that only its owner can read or write (mode 0600 or
    stricter), owned by this daemon's user or by root: a file another user owns is one
    they can rewrite (and so choose the token), a group- or world-readable one leaks it."""
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_mode & 0o077:
        return (f"{path} is mode {stat.S_IMODE(st.st_mode):04o}: a token file must be "
                "readable by its owner only (chmod 600)")
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        return (f"{path} is owned by uid {st.st_uid}: a token file must belong to this "
                f"daemon's user (uid {euid}) or root")
    return None


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode,
            st.st_uid)


class TokenFile:
    """A bearer token read from a file, re-read whenever the file changes (rotation).

    Each call costs one stat(); the file is read again only when its inode, size,
    mtime or ctime (a chmod or chown) moved. A file that is missing, unreadable, empty
    or not private (private_file_problem) yields None, which rejects every request:
    failing closed is the only safe answer for a kill endpoint. `problem` says why;
    start-up refuses on it.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._signature: tuple[int, ...] | None = None
        self._token: bytes | None = None
        self._called = False
        self.problem: str | None = None

    def __call__(self) -> bytes | None:
        try:
            return self._read()
        finally:
            self._called = True

    def _read(self) -> bytes | None:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            self._fail(f"token file {self.path}: {exc.strerror}")
            return None
        with self._lock:
            if _signature(st) != self._signature:
                self._token, self._signature = None, None
                if (private := private_file_problem(self.path, st)) is not None:
                    self._signature = _signature(st)  # (not opened: it may be a FIFO)
                    self._fail(f"token file {private}")
                    return None
                try:
                    with open(self.path, "rb") as fh:
                        st = os.fstat(fh.fileno())  # what is read is what is checked
                        if (private := private_file_problem(self.path, st)) is not None:
                            self._signature = _signature(st)
                            self._fail(f"token file {private}")
                            return None
                        token = fh.read(64 * 1024).strip()
                except OSError as exc:
                    self._fail(f"token file {self.path}: {exc.strerror}")
                    return None
                self._signature = _signature(st)
                if not token:
                    self._fail(f"token file {self.path} is empty")
                    return None
                self._token = token
            if self._token is not None:
                self.problem = None
            return self._token

    def _fail(self, problem: str) -> None:
        # The first call's failure is the caller's to report (start-up refuses on it).
        if problem != self.problem and self._called:
            log.error("%s; no token until that is fixed", problem)
        self.problem = problem


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
        yield CounterMetricFamily("gpuguard_remediator_refusals_repeated",
                                  "Refusals identical to the tree's last one (reason, members),"
                                  " counted instead of audited in full again.",
                                  value=c["refusals_repeated"])
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
        skipped = CounterMetricFamily(
            "gpuguard_remediator_pull_alerts_skipped",
            "Alerts a pull from Alertmanager left out, by why (malformed, other-host, "
            "alertname-not-listed, not-remediate, not-active, over-limit).",
            labels=["why"])
        skips = client.skip_counts() if client is not None else dict.fromkeys(SKIP_REASONS, 0)
        for why in SKIP_REASONS:
            skipped.add_metric([why], skips[why])
        yield skipped
        yield GaugeMetricFamily("gpuguard_remediator_queue_depth",
                                "Accepted alerts not finished yet (queued or deferred).",
                                value=self.service.queue_depth())
        yield from inspector_metrics(self.counters)
        yield from event_metrics(self.service.events)


UNAUTHORIZED = "missing or wrong bearer token"
BEARER_CHALLENGE = 'Bearer realm="gpuguard-remediator"'


def bearer_ok(token: TokenSource | None, header: str) -> bool:
    """Whether an Authorization header carries the bearer token (always, with no token:
    --insecure-no-auth). Constant time in the token; one home for the HTTP layer and
    for AlertsIntake, which asks before a body is read."""
    if token is None:
        return True
    expected = token()
    scheme, _, given = header.partition(" ")
    if expected is None or scheme.lower() != "bearer":
        hmac.compare_digest(b"x", b"y")  # same work on every path
        return False
    return hmac.compare_digest(given.strip().encode("utf-8", "replace"), expected)


class AlertsIntake(BodyPolicy):
    """Request bodies at the remediator (serving.BodyPolicy): only POST /alerts takes
    one, up to MAX_BODY_BYTES, and only with the bearer token, asked from the request's
    head before a byte of body is read. Without the token a body may be SMALL_BODY_BYTES
    (read in memory; the app answers 401 and the connection stays open, as it does for
    Alertmanager with a stale token); a larger one is answered 401 from the head. The
    refusals are the app's own answers (JSON, counted in
    gpuguard_remediator_rejected_requests_total)."""

    ceiling = MAX_BODY_BYTES

    def __init__(self, service: Remediator, token: TokenSource | None) -> None:
        self.service = service
        self.token = token

    def _authorized(self, head: RequestHead) -> bool:
        return bearer_ok(self.token, head.headers.get("AUTHORIZATION", ""))

    def admit(self, head: RequestHead) -> Refusal | int:
        if head.path == "/alerts" and head.method == "POST" and self._authorized(head):
            return MAX_BODY_BYTES
        return SMALL_BODY_BYTES

    def too_large(self, head: RequestHead, limit: int) -> Refusal:
        if head.path != "/alerts" or head.method != "POST":
            return super().too_large(head, limit)
        if not self._authorized(head):
            self.service.reject("unauthorized")
            return _refusal(401, "Unauthorized", UNAUTHORIZED,
                            (("WWW-Authenticate", BEARER_CHALLENGE),))
        self.service.reject("too_large")
        size = f"body of {head.content_length} bytes" if head.content_length else "body"
        return _refusal(413, "Request Entity Too Large",
                        f"{size} is over the {limit}-byte limit")


def _refusal(status: int, reason: str, message: str,
             headers: tuple[tuple[str, str], ...] = ()) -> Refusal:
    return Refusal(status, reason, (json.dumps({"error": message}) + "\n").encode(),
                   content_type="application/json", headers=headers)


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
        return bearer_ok(token, request.headers.get("Authorization", ""))

    def unauthorized() -> Response:
        service.reject("unauthorized")
        return _error(401, UNAUTHORIZED, **{"WWW-Authenticate": BEARER_CHALLENGE})

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

    last_code = ["ok"]

    @app.get("/healthz")
    def healthz() -> Response:
        # Open to anyone (probes carry no credentials): a status and a reason code, no
        # paths, keys or errors. The detail is logged when the code changes, and is in
        # /state (bearer token) as "health".
        ok, code, detail = service.healthy()
        if code != last_code[0]:
            last_code[0] = code
            (log.info if ok else log.warning)("health: %s (%s)", code, detail)
        return Response(code + "\n", status=200 if ok else 503, mimetype="text/plain")

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)

    @app.get("/state")
    def state() -> Response:
        if not authorized():
            return unauthorized()
        ok, code, detail = service.healthy()
        return _json({**service.snapshot(), "health": {"ok": ok, "code": code,
                                                        "detail": detail}})

    return app
