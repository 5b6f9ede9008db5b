"""Ask Alertmanager (v2 API) whether an orphan-tree alert still fires, and for pull mode.

Why ask at all: a webhook delivery is at least once and can be minutes old by the
time a reap would run (group_wait, retries, a deferred or rate-limited reap). In
that window on-call may have silenced the tree, an inhibiting alert may have fired,
or the alert may have resolved. Asking Alertmanager right before the kill closes
the window; "the webhook said so an hour ago" is not enough to kill processes.

The same client serves pull mode: polling this host's active alerts when
Alertmanager cannot reach the remediator's webhook (a central Alertmanager behind
a firewall, say).

Standard library only (urllib.request): the remediator already has enough
dependencies, and these are a handful of GETs. Several URLs are the peers of one
HA cluster: they gossip silences and Prometheus sends every alert to each, so the
first peer that answers well is as good as any.

Every failure (connection refused, timeout, 5xx, 401/403, a body that is not the
JSON Alertmanager sends) makes that peer count as unreachable and the next one is
tried; when all fail the answer is "unreachable", which a caller must treat as
"not confirmed", never as "firing".
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

from gpuguard.config import AlertmanagerConfig
from gpuguard.remediator.alerts import (
    MAX_ALERTS,
    REMEDIATE_LABEL,
    REMEDIATE_VALUE,
    asks_for_remediation,
)

log = logging.getLogger("gpuguard.remediator.alertmanager")

#: Confirmation states.
FIRING = "firing"
SILENCED = "silenced"
INHIBITED = "inhibited"
NOT_FIRING = "not-firing"
UNREACHABLE = "unreachable"
STATES = (FIRING, SILENCED, INHIBITED, NOT_FIRING, UNREACHABLE)

#: Results counted per HTTP request (gpuguard_remediator_alertmanager_requests_total{result}).
OK, ERROR, TIMEOUT, UNAUTHORIZED = "ok", "error", "timeout", "unauthorized"
RESULTS = (OK, ERROR, TIMEOUT, UNAUTHORIZED)

#: The labels that name one orphan tree on one host; all four must be equal.
TREE_LABELS = ("alertname", "hostname", "root_pid", "root_start_time")

#: When peers disagree, the answer that stops a reap wins; "firing" needs every peer that
#: answered to say so.
_PRECEDENCE = {SILENCED: 0, INHIBITED: 1, NOT_FIRING: 2, FIRING: 3}

#: Alertmanager's "not set" time; the webhook sends it as endsAt while an alert fires.
ZERO_TIME = "0001-01-01T00:00:00Z"

#: A filtered alert list for one host is small; anything this big is not Alertmanager.
MAX_BODY_BYTES = 8 * 1024 * 1024
#: Silences looked up for creator and comment per confirmation (each is one request).
MAX_SILENCE_LOOKUPS = 8
#: Alerts one poll hands on at most (as many as one webhook notification may carry); the
#: rest are counted as "over-limit" and the next poll sees them again.
MAX_PULL_ALERTS = MAX_ALERTS

#: Why a pulled alert was not handed on
#: (gpuguard_remediator_pull_alerts_skipped_total{why}): not the shape Alertmanager sends
#: (also a field remediator.alerts refuses), another host, an alertname not in
#: remediate.alerts, no remediate="true", not active (silenced, inhibited, unprocessed),
#: or past MAX_PULL_ALERTS in one poll.
MALFORMED, OTHER_HOST, NOT_LISTED = "malformed", "other-host", "alertname-not-listed"
NOT_REMEDIATE, NOT_ACTIVE, OVER_LIMIT = "not-remediate", "not-active", "over-limit"
SKIP_REASONS = (MALFORMED, OTHER_HOST, NOT_LISTED, NOT_REMEDIATE, NOT_ACTIVE, OVER_LIMIT)

T = TypeVar("T")
TokenSource = Callable[[], "bytes | None"]


@dataclass(frozen=True)
class Confirmation:
    """Alertmanager's view of one tree's alert, as an audit line can state it.

    `silence_creators` holds the `createdBy` of each silence in `silenced_by` that
    could be fetched (deduplicated, in order); a failed lookup leaves the state
    "silenced" and says so in `detail`. `url` is the peer that answered (None when
    none did).
    """

    state: str
    detail: str
    silenced_by: tuple[str, ...] = ()
    silence_creators: tuple[str, ...] = ()
    inhibited_by: tuple[str, ...] = ()
    url: str | None = None

    @property
    def firing(self) -> bool:
        """True only for an active, unsilenced, uninhibited alert: the one case to act on."""
        return self.state == FIRING

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "detail": self.detail,
            "silenced_by": list(self.silenced_by),
            "silence_creators": list(self.silence_creators),
            "inhibited_by": list(self.inhibited_by),
            "url": self.url,
        }


class _Failure(Exception):
    """One request did not give a usable answer; `result` is its counter label."""

    def __init__(self, result: str, detail: str) -> None:
        super().__init__(detail)
        self.result = result
        self.detail = detail


class _ShapeError(ValueError):
    """The body is JSON but not what Alertmanager 0.25 sends."""


@dataclass(frozen=True)
class _ApiAlert:
    labels: dict[str, str]
    annotations: dict[str, str]
    state: str
    silenced_by: tuple[str, ...]
    inhibited_by: tuple[str, ...]
    starts_at: str
    generator_url: str
    fingerprint: str


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: urllib would carry the Authorization header to wherever they point."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> None:
        return None


def matcher(name: str, value: str) -> str:
    """`name="value"` in Alertmanager's matcher syntax, quoting `\\`, `"` and newlines.

    Checked against 0.25's parser: only these three need escaping inside quotes;
    commas, braces, `=` and spaces are literal there.
    """
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'{name}="{escaped}"'


def _strings(where: str, value: Any, *, required: bool = True) -> dict[str, str]:
    if value is None and not required:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _ShapeError(f"{where}: not an object of strings")
    return dict(value)


def _ids(where: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _ShapeError(f"{where}: not a list of strings")
    return tuple(value)


def _optional_str(where: str, value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _ShapeError(f"{where}: not a string")
    return value


def _parse_alert(where: str, raw: Any) -> _ApiAlert:
    if not isinstance(raw, dict):
        raise _ShapeError(f"{where}: not an object")
    status = raw.get("status")
    if not isinstance(status, dict) or not isinstance(status.get("state"), str):
        raise _ShapeError(f"{where}.status: no state")
    return _ApiAlert(
        labels=_strings(f"{where}.labels", raw.get("labels")),
        annotations=_strings(f"{where}.annotations", raw.get("annotations"),
                             required=False),
        state=status["state"],
        silenced_by=_ids(f"{where}.status.silencedBy", status.get("silencedBy")),
        inhibited_by=_ids(f"{where}.status.inhibitedBy", status.get("inhibitedBy")),
        starts_at=_optional_str(f"{where}.startsAt", raw.get("startsAt")),
        generator_url=_optional_str(f"{where}.generatorURL", raw.get("generatorURL")),
        fingerprint=_optional_str(f"{where}.fingerprint", raw.get("fingerprint")),
    )


def _parse_alerts(data: Any) -> list[_ApiAlert]:
    """GET /api/v2/alerts's body -> alerts; _ShapeError names the first thing that is off."""
    if not isinstance(data, list):
        raise _ShapeError("body: not a list")
    return [_parse_alert(f"[{i}]", raw) for i, raw in enumerate(data)]


def _parse_alerts_each(data: Any) -> tuple[list[_ApiAlert], int]:
    """Pull mode's parse: (the well-formed alerts, how many were not); the body must be a list.

    One odd alert must not hide the others of a poll, as it may for a confirmation
    (where any doubt refuses the reap).
    """
    if not isinstance(data, list):
        raise _ShapeError("body: not a list")
    out, bad = [], 0
    for i, raw in enumerate(data):
        try:
            out.append(_parse_alert(f"[{i}]", raw))
        except _ShapeError:
            bad += 1
    return out, bad


def _parse_silence(data: Any) -> tuple[str, str]:
    """GET /api/v2/silence/{id}'s body -> (createdBy, comment)."""
    if not isinstance(data, dict):
        raise _ShapeError("body: not an object")
    creator, comment = data.get("createdBy"), data.get("comment")
    if not isinstance(creator, str) or not isinstance(comment, str):
        raise _ShapeError("createdBy/comment: not strings")
    return creator, comment


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class AlertmanagerClient:
    """Read-only v2 API client for one Alertmanager cluster (one or more HA peers).

    Thread-safe: the webhook worker and a pull loop may share one instance.
    `request_counts()` feeds the requests counter metric.
    """

    def __init__(self, config: AlertmanagerConfig) -> None:
        if not config.url:
            raise ValueError("AlertmanagerConfig.url is empty")
        self.urls = tuple(u.rstrip("/") for u in config.url)
        self.timeout = float(config.timeout_seconds)
        self._monotonic = time.monotonic
        self._credentials_file = config.credentials_file
        self._token: TokenSource | None = None
        if config.credentials_file is not None:
            # Imported here, not at the top: remediator.app imports the worker and the
            # rest of the service, so a top-level import would become a cycle as soon as
            # any of those imports this module.
            from gpuguard.remediator.app import TokenFile

            self._token = TokenFile(config.credentials_file)
        # No proxy from the environment (the path to Alertmanager is what is configured)
        # and no redirects (they would carry the bearer token elsewhere).
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                                   _NoRedirect())
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(RESULTS, 0)
        self._skipped = dict.fromkeys(SKIP_REASONS, 0)
        self._flooded = False  # the last poll had more than MAX_PULL_ALERTS: logged once
        self._failing: set[str] = set()

    # -- public API -------------------------------------------------------------------

    def request_counts(self) -> dict[str, int]:
        """Requests so far by result (ok, error, timeout, unauthorized), every key present.

        "unauthorized" also counts a request not sent because credentials_file gave
        no usable token.
        """
        with self._lock:
            return dict(self._counts)

    def skip_counts(self) -> dict[str, int]:
        """Pulled alerts not handed on, by SKIP_REASONS, every key present."""
        with self._lock:
            return dict(self._skipped)

    def count_skipped(self, why: str, n: int = 1) -> None:
        """Count `n` pulled alerts not handed on for `why` (one of SKIP_REASONS)."""
        if n:
            with self._lock:
                self._skipped[why] += n

    def confirm(self, *, alertname: str, hostname: str, root_pid: str | int,
                root_start_time: str | int) -> Confirmation:
        """Is the alert for this tree firing right now, and not silenced or inhibited?

        Peers are asked in order until one gives a well-formed answer; the whole call
        takes at most timeout_seconds per peer. Labels are compared again here: the
        server-side filter narrows the list, equality on all four labels decides.
        Any matching alert that is silenced makes the answer "silenced" (its silences
        are looked up for createdBy and comment), else any inhibited one "inhibited",
        else any active one "firing", else "not-firing".
        """
        want = {"alertname": alertname, "hostname": hostname,
                "root_pid": str(root_pid), "root_start_time": str(root_start_time)}
        params = [("active", "true"), ("silenced", "true"), ("inhibited", "true")]
        params += [("filter", matcher(name, want[name])) for name in TREE_LABELS]
        path = f"/api/v2/alerts?{urlencode(params, quote_via=quote)}"
        deadline = self._monotonic() + self.timeout * len(self.urls)
        answers: list[Confirmation] = []
        failures: list[str] = []
        for base in self.urls:  # every peer: one that has not heard of a silence must not
            try:                 # outvote one that has (a restart, a split, a slow gossip)
                alerts = self._get(base, path, deadline, _parse_alerts)
            except _Failure as exc:
                failures.append(f"{base}: {exc.detail}")
                continue
            answers.append(self._judge(base, alerts, want, deadline))
        if not answers:
            return Confirmation(UNREACHABLE, "unreachable: " + "; ".join(failures))
        answer = min(answers, key=lambda a: _PRECEDENCE[a.state])
        if answer.state == FIRING and len(self.urls) > 1:
            unanswered = f"; no answer from {len(failures)}" if failures else ""
            answer = dataclasses.replace(answer, detail=f"{answer.detail} on all "
                                         f"{len(answers)} peer(s) that answered{unanswered}")
        return answer

    def _judge(self, base: str, alerts: list[_ApiAlert], want: dict[str, str],
               deadline: float) -> Confirmation:
        """One peer's answer about the alert with exactly the labels in `want`."""
        matching = [a for a in alerts if all(a.labels.get(k) == v for k, v in want.items())]
        silenced_by = _unique(s for a in matching for s in a.silenced_by)
        inhibited_by = _unique(i for a in matching for i in a.inhibited_by)
        if silenced_by:
            creators, notes = self._silence_owners(base, silenced_by, deadline)
            return Confirmation(SILENCED, "silenced: " + "; ".join(notes), silenced_by,
                                creators, inhibited_by, base)
        if inhibited_by:
            return Confirmation(INHIBITED, f"inhibited by alert(s) {', '.join(inhibited_by)}",
                                (), (), inhibited_by, base)
        if any(a.state == "active" for a in matching):
            return Confirmation(FIRING, "active, not silenced or inhibited", url=base)
        if matching:
            states = ", ".join(sorted({a.state for a in matching}))
            return Confirmation(NOT_FIRING, f"matching alert is not active ({states})", url=base)
        return Confirmation(NOT_FIRING, "no matching unresolved alert", url=base)

    def active_alerts(self, *, hostname: str,
                      alertnames: Iterable[str]) -> list[dict[str, Any]] | None:
        """This host's active, unsilenced, uninhibited remediate="true" alerts named in
        `alertnames`, at most MAX_PULL_ALERTS.

        Shaped like the alerts of a webhook notification (status "firing", endsAt the
        zero time as Alertmanager sends while firing) so remediator.alerts parses both
        the same way. None when no peer answered well: "no alerts" and "could not ask"
        must stay different answers. An alert that is malformed or not for us is left
        out and counted (skip_counts), never the whole answer.
        """
        names = frozenset(alertnames)
        params = [("active", "true"), ("silenced", "false"), ("inhibited", "false"),
                  ("filter", matcher("hostname", hostname)),
                  ("filter", matcher(REMEDIATE_LABEL, REMEDIATE_VALUE))]
        deadline = self._monotonic() + self.timeout * len(self.urls)
        got = self._first_answer(f"/api/v2/alerts?{urlencode(params, quote_via=quote)}",
                                 deadline, _parse_alerts_each)
        if isinstance(got, str):
            return None
        parsed, malformed = got[1]
        skipped = dict.fromkeys(SKIP_REASONS, 0)
        skipped[MALFORMED] = malformed
        kept: list[_ApiAlert] = []
        for a in parsed:  # the filter narrows; these checks decide (a proxy may drop it)
            why = (OTHER_HOST if a.labels.get("hostname") != hostname
                   else NOT_LISTED if a.labels.get("alertname") not in names
                   else NOT_REMEDIATE if not asks_for_remediation(a.labels)
                   else NOT_ACTIVE if a.state != "active" or a.silenced_by or a.inhibited_by
                   else None)
            if why is not None:
                skipped[why] += 1
            elif len(kept) < MAX_PULL_ALERTS:
                kept.append(a)
            else:
                skipped[OVER_LIMIT] += 1
        for why, n in skipped.items():
            self.count_skipped(why, n)
        if skipped[OVER_LIMIT] and not self._flooded:
            log.warning("pull: %d of this host's alerts past the first %d of a poll are "
                        "skipped (counted as over-limit) while there are that many",
                        skipped[OVER_LIMIT], MAX_PULL_ALERTS)
        self._flooded = bool(skipped[OVER_LIMIT])
        return [
            {
                "status": "firing",
                "labels": dict(a.labels),
                "annotations": dict(a.annotations),
                "startsAt": a.starts_at or None,
                "endsAt": ZERO_TIME,
                "generatorURL": a.generator_url,
                "fingerprint": a.fingerprint,
            }
            for a in kept
        ]

    # -- internals --------------------------------------------------------------------

    def _first_answer(self, path: str, deadline: float,
                      parse: Callable[[Any], T]) -> tuple[str, T] | str:
        """(peer, parsed body) from the first peer that answers well, else why none did."""
        failures = []
        for base in self.urls:
            try:
                return base, self._get(base, path, deadline, parse)
            except _Failure as exc:
                failures.append(f"{base}: {exc.detail}")
        return "unreachable: " + "; ".join(failures)

    def _silence_owners(self, base: str, ids: tuple[str, ...],
                        deadline: float) -> tuple[tuple[str, ...], list[str]]:
        creators, notes = [], []
        for sid in ids[:MAX_SILENCE_LOOKUPS]:
            try:
                creator, comment = self._get(base, f"/api/v2/silence/{quote(sid, safe='')}",
                                             deadline, _parse_silence)
            except _Failure as exc:
                notes.append(f"silence {sid} (creator unknown: {exc.detail})")
                continue
            creators.append(creator)
            notes.append(f"silence {sid} by {_clip(creator, 100)!r}: {_clip(comment)!r}")
        if len(ids) > MAX_SILENCE_LOOKUPS:
            notes.append(f"{len(ids) - MAX_SILENCE_LOOKUPS} more silence(s) not looked up")
        return _unique(creators), notes

    def _get(self, base: str, path: str, deadline: float, parse: Callable[[Any], T]) -> T:
        """GET base+path, decode JSON, `parse` it; count the result; _Failure when unusable."""
        try:
            value = parse(self._fetch_json(base + path, deadline))
        except _ShapeError as exc:
            failure = _Failure(ERROR, f"unexpected answer: {exc}")
        except _Failure as exc:
            failure = exc
        else:
            self._record(base, OK, "")
            return value
        self._record(base, failure.result, failure.detail)
        raise failure

    def _fetch_json(self, url: str, deadline: float) -> Any:
        remaining = deadline - self._monotonic()
        if remaining <= 0:
            raise _Failure(TIMEOUT, "no time left")
        headers = {"Accept": "application/json", "User-Agent": "gpuguard-remediator"}
        authorization = self._authorization()
        if authorization is not None:
            headers["Authorization"] = authorization
        request = urllib.request.Request(url, headers=headers, method="GET")
        try:
            # The timeout bounds connect and each read; the deadline bounds the body as a
            # whole (a server that trickles headers can still stretch one request).
            with self._opener.open(request, timeout=min(self.timeout, remaining)) as resp:
                status = resp.status
                body = self._read(resp, deadline)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code in (401, 403):
                raise _Failure(UNAUTHORIZED, f"HTTP {exc.code}") from None
            raise _Failure(ERROR, f"HTTP {exc.code}") from None
        except TimeoutError:
            raise _Failure(TIMEOUT, f"timed out after {self.timeout:g}s") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise _Failure(TIMEOUT, f"timed out after {self.timeout:g}s") from None
            raise _Failure(ERROR, f"{exc.reason}") from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise _Failure(ERROR, f"{type(exc).__name__}: {exc}") from None
        if status != 200:
            raise _Failure(ERROR, f"HTTP {status}")
        try:
            return json.loads(body)
        except (ValueError, RecursionError):  # UnicodeDecodeError included; deep nesting
            raise _Failure(ERROR, "answer is not JSON Alertmanager would send") from None

    def _read(self, resp: Any, deadline: float) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = resp.read(64 * 1024)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _Failure(ERROR, f"answer larger than {MAX_BODY_BYTES} bytes")
            if self._monotonic() > deadline:
                raise _Failure(TIMEOUT, "answer not complete before the deadline")
            chunks.append(chunk)

    def _authorization(self) -> str | None:
        """`Bearer TOKEN`, None without credentials_file; fails closed on an unusable file.

        Sending no token when one is configured would only turn a readable
        misconfiguration into a stream of 401s, so the request is not sent.
        """
        if self._token is None:
            return None
        token = self._token()
        if token is None:
            why = getattr(self._token, "problem", None)
            raise _Failure(UNAUTHORIZED, f"no token from credentials_file "
                           f"{self._credentials_file}" + (f" ({why})" if why else ""))
        try:
            text = token.decode("ascii")
        except UnicodeDecodeError:
            raise _Failure(UNAUTHORIZED, "token is not ASCII") from None
        if not all(33 <= ord(c) < 127 for c in text):
            raise _Failure(UNAUTHORIZED, "token contains spaces or control characters")
        return f"Bearer {text}"

    def _record(self, base: str, result: str, detail: str) -> None:
        """Count one request; log a peer going bad or coming back once, not every time."""
        with self._lock:
            self._counts[result] += 1
            was_failing = base in self._failing
            if result == OK:
                self._failing.discard(base)
            else:
                self._failing.add(base)
        if result == OK and was_failing:
            log.info("alertmanager %s answers again", base)
        elif result != OK and not was_failing:
            log.warning("alertmanager %s: %s (%s)", base, detail, result)
        elif result != OK:
            log.debug("alertmanager %s: %s (%s)", base, detail, result)
