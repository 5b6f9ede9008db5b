"""Pull mode from Prometheus: this host's firing alerts read off the ALERTS series.

Alertmanager's `GET /api/v2/alerts` walks every alert it holds (and the routing tree) to
answer one host's poll, so its cost grows with the fleet's alerts (issue 54: about 10 us
of CPU per alert held, per poll). Prometheus answers `/api/v1/query` for one host's
series from its label index: the cost follows the series that match. What Prometheus
cannot say (silences, inhibitions) the kill-time confirmation still asks Alertmanager,
which this mode requires (config/remediate.py).

The one query (`firing_query`) joins each firing `ALERTS` series to its
`ALERTS_FOR_STATE`, whose value is when the alert became active (pending): the series
that comes back carries the alert's labels, and its value stands for `startsAt`, which
only ever makes a tree younger (policy.decide). Annotations are not in the TSDB.
"""

from __future__ import annotations

import logging
import math
import ssl
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, urlencode

from gpuguard.base.validation import JSON_TYPES, At, Format, Invalid, of_type, string_map
from gpuguard.config.remediate import PrometheusConfig
from gpuguard.engine.alerting import peers
from gpuguard.engine.alerting.alerts import REMEDIATE_LABEL, REMEDIATE_VALUE
from gpuguard.engine.alerting.peers import (
    Credentials,
    JsonPeers,
    RequestFailure,
    basic_credentials,
    bearer_credentials,
    poll_result,
)
from gpuguard.engine.alerting.polling import PollResult, PollStats, peer_order
from gpuguard.engine.alerting.pulled import PollAnswer, Pulled, SkipCounts, SkipReason

log = logging.getLogger("gpuguard.remediator.prometheus")

#: One host's firing alerts are a few series; anything this big is not that answer.
MAX_BODY_BYTES = 8 * 1024 * 1024
#: RE2's metacharacters: escaped in an alert name matched by `=~`.
_RE2_SPECIAL = frozenset("\\.+*?()|[]{}^$")


class _ShapeError(Invalid, ValueError):
    """The body is JSON but not what Prometheus's query API sends."""


_ANSWER = Format(_ShapeError, JSON_TYPES, terse=True)


def promql_string(value: str) -> str:
    """`value` as a double-quoted PromQL string: `\\`, `"` and line breaks escaped (Go's
    string-literal rules, which PromQL's lexer follows)."""
    escaped = (value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               .replace("\r", "\\r"))
    return f'"{escaped}"'


def _regex_literal(value: str) -> str:
    """`value` matched literally inside an RE2 pattern."""
    return "".join(f"\\{c}" if c in _RE2_SPECIAL else c for c in value)


def _selector(alertnames: Iterable[str], hostname: str) -> str:
    names = sorted(set(alertnames))
    if len(names) == 1:
        name = f"alertname={promql_string(names[0])}"
    else:
        name = f"alertname=~{promql_string('|'.join(_regex_literal(n) for n in names))}"
    return (f"{name},hostname={promql_string(hostname)},"
            f"{REMEDIATE_LABEL}={promql_string(REMEDIATE_VALUE)}")


def firing_query(alertnames: Iterable[str], hostname: str) -> str:
    """The PromQL of one poll: this host's firing, remediate="true" alerts named in
    `alertnames`, each as its ALERTS_FOR_STATE series (value: active since, Unix seconds).

    `ALERTS_FOR_STATE{sel} and ignoring(alertstate) ALERTS{sel,alertstate="firing"}`: both
    selectors are answered from the label index, so the cost follows this host's series,
    not the fleet's alerts. Label values are escaped (PromQL strings; alert names inside
    the `=~` pattern also for RE2); one name is matched with `=`. Empty `alertnames`
    raises ValueError: no alert could ever match.
    """
    names = list(alertnames)
    if not names:
        raise ValueError("no alertnames: nothing to ask for")
    selector = _selector(names, hostname)
    return (f"ALERTS_FOR_STATE{{{selector}}} and ignoring(alertstate) "
            f'ALERTS{{{selector},alertstate="firing"}}')


def _rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def _series(at: At, raw: Any) -> Pulled:
    """One result of the vector: its labels (less __name__), its value as startsAt."""
    of_type(at, raw, dict)
    labels = dict(string_map(at.child("metric"), raw.get("metric")))
    labels.pop("__name__", None)
    value = raw.get("value")
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], str)):
        raise at.child("value").error("not [time, \"number\"]")
    try:
        since = float(value[1])
    except ValueError:
        raise at.child("value").error("not a number") from None
    if not math.isfinite(since) or since <= 0:
        raise at.child("value").error("not a time")
    return Pulled(labels=labels, active=True, starts_at=_rfc3339(since))


def _parse_vector(data: Any) -> tuple[list[Pulled], int]:
    """/api/v1/query's body -> (the well-formed series, how many were not). The envelope
    must be a successful vector; one odd series does not hide the others."""
    body = of_type(At(_ANSWER, "body"), data, dict)
    if body.get("status") != "success":
        raise At(_ANSWER, "status").error(f"not success: {str(body.get('error'))[:200]!r}")
    result = of_type(At(_ANSWER, "data"), body.get("data"), dict)
    if result.get("resultType") != "vector":
        raise At(_ANSWER, "data.resultType").error("not a vector")
    out, bad = [], 0
    for i, raw in enumerate(of_type(At(_ANSWER, "data.result"), result.get("result"), list)):
        try:
            out.append(_series(At(_ANSWER, "data.result").item(i), raw))
        except _ShapeError:
            bad += 1
    return out, bad


def tls_context(ca_file: str | None) -> tuple[ssl.SSLContext | None, str | None]:
    """The context https requests use, or why there is none (a ca_file not loaded)."""
    return peers.tls_context(ca_file, "remediate.prometheus.ca_file")


def credentials(config: PrometheusConfig) -> Credentials:
    """Basic auth or a bearer token (the config allows one), or none."""
    if config.basic_auth is not None:
        return basic_credentials(config.basic_auth.username, config.basic_auth.password_file)
    return bearer_credentials(config.credentials_file)


class PrometheusClient:
    """Pull mode's source when it polls Prometheus (one server, or the peers of an HA
    pair, each evaluating the same rules). Thread-safe; the same accounting as the
    Alertmanager client's poll (`polls`, skip counts), so pull.Puller, /healthz and
    /metrics serve both."""

    source = "prometheus"

    def __init__(self, config: PrometheusConfig) -> None:
        """Raises ValueError for a config that would send a secret in clear (the config
        file refuses one already)."""
        if not config.url:
            raise ValueError("PrometheusConfig.url is empty")
        if (problem := config.secret_in_clear()) is not None:
            raise ValueError(f"remediate.prometheus: {problem}")
        self.urls = tuple(u.rstrip("/") for u in config.url)
        self.timeout = float(config.timeout_seconds)
        self.polls = PollStats()
        self.skips = SkipCounts()
        tls: ssl.SSLContext | None = None
        tls_problem: str | None = None
        if any(u.lower().startswith("https:") for u in self.urls):
            tls, tls_problem = tls_context(config.ca_file)
        self._peers = JsonPeers(self.urls, timeout=self.timeout, credentials=credentials(config),
                                tls=tls, tls_problem=tls_problem, what="prometheus",
                                max_body=MAX_BODY_BYTES, log=log, monotonic=time.monotonic)

    def request_counts(self) -> dict[str, int]:
        return self._peers.request_counts()

    def skip_counts(self) -> dict[str, int]:
        return self.skips.counts()

    def count_skipped(self, why: SkipReason, n: int = 1) -> None:
        self.skips.count(why, n)

    def poll(self, *, hostname: str, alertnames: Iterable[str]) -> PollAnswer:
        """This host's firing remediate="true" alerts named in `alertnames`, shaped like a
        webhook's (pulled.sort_pulled); `alerts` None when no peer answered well. Peers in
        this host's order (polling.peer_order) until one answers, each within
        timeout_seconds; counted and timed in `polls`."""
        names = frozenset(alertnames)
        monotonic = self._peers.monotonic
        began = monotonic()
        deadline = began + self.timeout * len(self.urls)
        query = urlencode([("query", firing_query(names, hostname))], quote_via=quote)
        failures: list[RequestFailure] = []
        got: tuple[list[Pulled], int] | None = None
        for base in peer_order(self.urls, hostname):
            try:
                got = self._peers.get(base, f"/api/v1/query?{query}", deadline, _parse_vector)
                break
            except RequestFailure as exc:
                failures.append(exc)
        if got is None:
            asked = [f.retry_after for f in failures if f.retry_after is not None]
            answer = PollAnswer(None, poll_result(failures),
                                "; ".join(f.detail for f in failures),
                                min(asked) if asked else None)
        else:
            answer = PollAnswer(self.skips.kept(got[0], got[1], hostname, names),
                                PollResult.OK)
        ended = monotonic()
        self.polls.record(answer.result, ended - began, ended)
        return answer
