"""Flask application factory: POST /alerts, GET /healthz, /metrics, /state.

The HTTP layer is deliberately thin and fast: authenticate, bound the body, decode,
validate, hand the notification to the Remediator's intake and answer with one
account per alert; nothing here inspects processes or sends signals. The app binds
to a Remediator built outside it (remediator/service.py), so tests build one service
and one app per case.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Iterable
from typing import Any

from flask import Flask, Response, request
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from gpuguard.base.build import version
from gpuguard.engine.alerting.alerts import Notification, PayloadError, parse_notification
from gpuguard.engine.alerting.tokens import TokenSource
from gpuguard.engine.state.ledger import LedgerError
from gpuguard.engine.state.metrics import RejectCause
from gpuguard.remediator.exposition import RemediatorCollector
from gpuguard.remediator.screening import Intake
from gpuguard.remediator.service import Remediator
from gpuguard.web.landing import landing_page
from gpuguard.web.serving import SMALL_BODY_BYTES, BodyPolicy, Refusal, RequestHead

log = logging.getLogger("gpuguard.remediator.http")

MAX_BODY_BYTES = 1024 * 1024
EXTENSION = "gpuguard_remediator"

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

    def __init__(self, intake: Intake, token: TokenSource | None) -> None:
        self.intake = intake
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
            self.intake.reject(RejectCause.UNAUTHORIZED)
            return _refusal(401, "Unauthorized", UNAUTHORIZED,
                            (("WWW-Authenticate", BEARER_CHALLENGE),))
        self.intake.reject(RejectCause.TOO_LARGE)
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


def _notification(intake: Intake) -> Notification | Response:
    """The current request's body as a notification, or the error answer (counted)."""
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:
        intake.reject(RejectCause.TOO_LARGE)
        return _error(413, f"body of {length} bytes is over the {MAX_BODY_BYTES}-byte limit")
    mimetype = request.mimetype or ""
    if mimetype != "application/json" and not mimetype.endswith("+json"):
        intake.reject(RejectCause.NOT_JSON)
        return _error(415, f"Content-Type must be application/json, got {mimetype or 'none'}")
    body = request.stream.read(MAX_BODY_BYTES + 1)
    if len(body) > MAX_BODY_BYTES:
        intake.reject(RejectCause.TOO_LARGE)
        return _error(413, f"body is over the {MAX_BODY_BYTES}-byte limit")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # the media type was right: 400, not 415
        intake.reject(RejectCause.MALFORMED)
        return _error(400, f"body is not valid JSON: {str(exc)[:120]}")
    try:
        return parse_notification(data)
    except PayloadError as exc:
        intake.reject(RejectCause.MALFORMED)
        return _error(400, str(exc)[:500])


LANDING = landing_page("gpuguard-remediator", "Alertmanager webhook receiver that reaps "
                       "orphaned GPU process trees when policy allows.", version(),
                       [("/metrics", "Metrics"), ("/healthz", "Health")])


def create_app(service: Remediator, *, token: TokenSource | None,
               collectors: Iterable[Collector] = ()) -> Flask:
    """Bind the HTTP routes to a built Remediator (remediator.service.build_remediator).

    `token=None` disables auth (only --insecure-no-auth does that). Nothing is
    created, written or started here; the Remediator stays at
    `app.extensions["gpuguard_remediator"]`, and its owner starts and stops it.
    """
    intake = service.intake
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RemediatorCollector(service))
    for collector in collectors:  # the daemon's own: reload outcome, build, process
        registry.register(collector)

    app = Flask("gpuguard-remediator")
    app.extensions[EXTENSION] = service

    def authorized() -> bool:
        return bearer_ok(token, request.headers.get("Authorization", ""))

    def unauthorized() -> Response:
        intake.reject(RejectCause.UNAUTHORIZED)
        return _error(401, UNAUTHORIZED, **{"WWW-Authenticate": BEARER_CHALLENGE})

    @app.post("/alerts")
    def alerts() -> Response:
        if not authorized():
            return unauthorized()
        notification = _notification(intake)
        if isinstance(notification, Response):
            return notification
        try:
            accounts = intake.submit(notification)
        except LedgerError as exc:  # nothing was kept: Alertmanager retries a 5xx
            intake.reject(RejectCause.STATE_UNWRITABLE)
            log.error("POST /alerts refused: %s", exc)
            return _error(503, f"cannot record the alerts: {exc}"[:500])
        counts: dict[str, int] = {}
        for account in accounts:
            counts[account.status] = counts.get(account.status, 0) + 1
        return _json({"accounts": [a.to_json() for a in accounts], "counts": counts,
                      "mode": service.policy.mode})

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

    @app.get("/")
    def landing() -> Response:
        return Response(LANDING, mimetype="text/html")

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
