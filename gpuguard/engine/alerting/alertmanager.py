"""Ask Alertmanager (v2 API) whether a tree's alert still fires, right before a reap; and,
in pull mode, poll this host's active alerts.

A webhook delivery can be minutes old when a reap runs (a silence, an inhibition or a
resolve may have come since), so the reap asks again. Several URLs are the peers of one
HA cluster. A peer that fails in any way counts as unreachable; when all do the answer is
"unreachable", which callers treat as "not confirmed", never as "firing".
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

from gpuguard.base.validation import (
    JSON_TYPES,
    At,
    Format,
    Invalid,
    of_type,
    optional_string,
    string_list,
    string_map,
)
from gpuguard.config.remediate import AlertmanagerConfig
from gpuguard.engine.alerting import peers
from gpuguard.engine.alerting.alerts import REMEDIATE_LABEL, REMEDIATE_VALUE
from gpuguard.engine.alerting.confirmation import Confirmation, ConfirmationState
from gpuguard.engine.alerting.peers import (
    JsonPeers,
    RequestFailure,
    RequestResult,
    bearer_credentials,
    poll_result,
)
from gpuguard.engine.alerting.polling import PollResult, PollStats, peer_order
from gpuguard.engine.alerting.pulled import (
    MAX_PULL_ALERTS,
    PollAnswer,
    Pulled,
    SkipCounts,
    SkipReason,
)

log = logging.getLogger("gpuguard.remediator.alertmanager")

T = TypeVar("T")
#: Re-exported for the callers that know them as the Alertmanager client's words.
__all__ = ["MAX_PULL_ALERTS", "AlertmanagerClient", "PollAnswer", "RequestResult",
           "SkipReason", "matcher", "tls_context"]


#: The labels that name one orphan tree on one host; all four must be equal.
TREE_LABELS = ("alertname", "hostname", "root_pid", "root_start_time")

#: When peers disagree, the answer that stops a reap wins; "firing" needs every peer that
#: answered to say so.
_PRECEDENCE = {ConfirmationState.SILENCED: 0, ConfirmationState.INHIBITED: 1,
               ConfirmationState.NOT_FIRING: 2, ConfirmationState.FIRING: 3}

#: A filtered alert list for one host is small; anything this big is not Alertmanager.
MAX_BODY_BYTES = 8 * 1024 * 1024
#: Silences looked up for creator and comment per confirmation (each is one request).
MAX_SILENCE_LOOKUPS = 8
class _ShapeError(Invalid, ValueError):
    """The body is JSON but not what Alertmanager 0.25 sends."""


#: Alertmanager's answers: a shape error only says what was expected where.
_ANSWER = Format(_ShapeError, JSON_TYPES, terse=True)


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


def matcher(name: str, value: str) -> str:
    """`name="value"` in Alertmanager's matcher syntax, quoting `\\`, `"` and newlines.

    Checked against 0.25's parser: only these three need escaping inside quotes;
    commas, braces, `=` and spaces are literal there.
    """
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'{name}="{escaped}"'


def _parse_alert(at: At, raw: Any) -> _ApiAlert:
    of_type(at, raw, dict)
    status = raw.get("status")
    if not isinstance(status, dict) or not isinstance(status.get("state"), str):
        raise at.child("status").error("no state")
    return _ApiAlert(
        labels=string_map(at.child("labels"), raw.get("labels")),
        annotations=string_map(at.child("annotations"), raw.get("annotations"),
                               required=False),
        state=status["state"],
        silenced_by=_ids(at.child("status").child("silencedBy"), status.get("silencedBy")),
        inhibited_by=_ids(at.child("status").child("inhibitedBy"), status.get("inhibitedBy")),
        starts_at=optional_string(at.child("startsAt"), raw.get("startsAt")),
        generator_url=optional_string(at.child("generatorURL"), raw.get("generatorURL")),
        fingerprint=optional_string(at.child("fingerprint"), raw.get("fingerprint")),
    )


def _ids(at: At, value: Any) -> tuple[str, ...]:
    return () if value is None else string_list(at, value)


def _parse_alerts(data: Any) -> list[_ApiAlert]:
    """GET /api/v2/alerts's body -> alerts; _ShapeError names the first thing that is off."""
    body = of_type(At(_ANSWER, "body"), data, list)
    return [_parse_alert(At(_ANSWER).item(i), raw) for i, raw in enumerate(body)]


def _parse_alerts_each(data: Any) -> tuple[list[_ApiAlert], int]:
    """Pull mode's parse: (the well-formed alerts, how many were not); the body must be a list.

    One odd alert must not hide the others of a poll, as it may for a confirmation
    (where any doubt refuses the reap).
    """
    out, bad = [], 0
    for i, raw in enumerate(of_type(At(_ANSWER, "body"), data, list)):
        try:
            out.append(_parse_alert(At(_ANSWER).item(i), raw))
        except _ShapeError:
            bad += 1
    return out, bad


def _parse_silence(data: Any) -> tuple[str, str]:
    """GET /api/v2/silence/{id}'s body -> (createdBy, comment)."""
    body = of_type(At(_ANSWER, "body"), data, dict)
    creator, comment = body.get("createdBy"), body.get("comment")
    if not isinstance(creator, str) or not isinstance(comment, str):
        raise At(_ANSWER, "createdBy/comment").error("not strings")
    return creator, comment


def _pulled(alert: _ApiAlert) -> Pulled:
    return Pulled(labels=alert.labels, annotations=alert.annotations,
                  active=(alert.state == "active" and not alert.silenced_by
                          and not alert.inhibited_by),
                  starts_at=alert.starts_at, generator_url=alert.generator_url,
                  fingerprint=alert.fingerprint)


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def tls_context(ca_file: str | None) -> tuple[ssl.SSLContext | None, str | None]:
    """The context https requests use, or why there is none (a ca_file not loaded)."""
    return peers.tls_context(ca_file, "remediate.alertmanager.ca_file")


class AlertmanagerClient:
    """Read-only v2 API client for one Alertmanager cluster (one or more HA peers).

    Thread-safe: the webhook worker and a pull loop may share one instance.
    `request_counts()` feeds the requests counter metric.
    """

    def __init__(self, config: AlertmanagerConfig) -> None:
        """Raises ValueError for a config that would send its token in clear (the config
        file refuses one already). A ca_file that cannot be loaded fails every https
        request (the remediator checks it at start, as the token)."""
        if not config.url:
            raise ValueError("AlertmanagerConfig.url is empty")
        if (problem := config.token_in_clear()) is not None:
            raise ValueError(f"remediate.alertmanager.credentials_file: {problem}")
        self.urls = tuple(u.rstrip("/") for u in config.url)
        self.timeout = float(config.timeout_seconds)
        self.source = "alertmanager"  # pull mode's source (metrics label, /healthz wording)
        self.polls = PollStats()  # pull mode's accounting (polling.py)
        self.skips = SkipCounts()
        # No proxy from the environment and no redirects (bounded_http.py says why).
        tls: ssl.SSLContext | None = None
        tls_problem: str | None = None
        if any(u.lower().startswith("https:") for u in self.urls):
            tls, tls_problem = tls_context(config.ca_file)
        self._peers = JsonPeers(self.urls, timeout=self.timeout,
                                credentials=bearer_credentials(config.credentials_file),
                                tls=tls, tls_problem=tls_problem, what="alertmanager",
                                max_body=MAX_BODY_BYTES, log=log)

    @property
    def _monotonic(self) -> Callable[[], float]:
        return self._peers.monotonic

    # -- public API -------------------------------------------------------------------

    def request_counts(self) -> dict[str, int]:
        """Requests so far by result (ok, error, timeout, unauthorized), every key present.

        "unauthorized" also counts a request not sent because credentials_file gave
        no usable token.
        """
        return self._peers.request_counts()

    def skip_counts(self) -> dict[str, int]:
        """Pulled alerts not handed on, by SkipReason, every key present."""
        return self.skips.counts()

    def count_skipped(self, why: SkipReason, n: int = 1) -> None:
        """Count `n` pulled alerts not handed on for `why` (one of SkipReason)."""
        self.skips.count(why, n)

    def confirm(self, *, alertname: str, hostname: str, root_pid: str | int,
                root_start_time: str | int, within: float | None = None) -> Confirmation:
        """Is the alert for this tree firing right now, and not silenced or inhibited?

        Every peer is asked (in this host's order: polling.peer_order); each exchange
        has its own deadline of timeout_seconds (connect, TLS, headers, body), and the
        whole call ends within timeout_seconds per peer, or within `within` seconds
        when that is less (a reap passes what is left of its deadline: the tree may be
        frozen meanwhile); "unreachable" when no peer answered by then. Labels are
        compared again here: the
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
        budget = self.timeout * len(self.urls)
        if within is not None and within < budget:
            budget = within
            if budget <= 0:
                return Confirmation(ConfirmationState.UNREACHABLE, "unreachable: no time "
                                    "left before the reap's deadline to ask Alertmanager")
        deadline = self._monotonic() + budget
        answers: list[Confirmation] = []
        failures: list[str] = []
        # Every peer: one that has not heard of a silence must not outvote one that has
        # (a restart, a split, a slow gossip). Each gets a fair share of what is left, so
        # a slow peer cannot spend the time of the one that holds the silence.
        peers = peer_order(self.urls, hostname)
        for index, base in enumerate(peers):
            now = self._monotonic()
            share = min(deadline, now + (deadline - now) / (len(peers) - index))
            try:
                alerts = self._get(base, path, share, _parse_alerts)
            except RequestFailure as exc:
                failures.append(f"{base}: {exc.detail}")
                continue
            answers.append(self._judge(base, alerts, want, share))
        if not answers:
            return Confirmation(ConfirmationState.UNREACHABLE,
                                "unreachable: " + "; ".join(failures))
        answer = min(answers, key=lambda a: _PRECEDENCE[a.state])
        if answer.state == ConfirmationState.FIRING and len(self.urls) > 1:
            unanswered = (f"; no answer from {len(failures)} ({'; '.join(failures)})"
                          if failures else "")
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
            return Confirmation(ConfirmationState.SILENCED, "silenced: " + "; ".join(notes),
                                silenced_by, creators, inhibited_by, base)
        if inhibited_by:
            return Confirmation(ConfirmationState.INHIBITED,
                                f"inhibited by alert(s) {', '.join(inhibited_by)}",
                                (), (), inhibited_by, base)
        if any(a.state == "active" for a in matching):
            return Confirmation(ConfirmationState.FIRING, "active, not silenced or inhibited",
                                url=base)
        if matching:
            states = ", ".join(sorted({a.state for a in matching}))
            return Confirmation(ConfirmationState.NOT_FIRING,
                                f"matching alert is not active ({states})", url=base)
        return Confirmation(ConfirmationState.NOT_FIRING, "no matching unresolved alert",
                            url=base)

    def poll(self, *, hostname: str, alertnames: Iterable[str]) -> PollAnswer:
        """This host's active, unsilenced, uninhibited remediate="true" alerts named in
        `alertnames`, at most MAX_PULL_ALERTS; counted and timed in `polls`.

        Shaped like the alerts of a webhook notification (status "firing", endsAt the
        zero time as Alertmanager sends while firing) so gpuguard.engine.alerting.alerts
        parses both the same way. `alerts` is None when no peer answered well: "no
        alerts" and "could not ask" must stay different answers. An alert that is
        malformed or not for us is left out and counted (skip_counts), never the whole
        answer. Peers are tried in this host's order (polling.peer_order) until one
        answers, each exchange within timeout_seconds.
        """
        names = frozenset(alertnames)
        params = [("active", "true"), ("silenced", "false"), ("inhibited", "false"),
                  ("filter", matcher("hostname", hostname)),
                  ("filter", matcher(REMEDIATE_LABEL, REMEDIATE_VALUE))]
        began = self._monotonic()
        deadline = began + self.timeout * len(self.urls)
        path = f"/api/v2/alerts?{urlencode(params, quote_via=quote)}"
        failures: list[RequestFailure] = []
        got: tuple[list[_ApiAlert], int] | None = None
        for base in peer_order(self.urls, hostname):
            try:
                got = self._get(base, path, deadline, _parse_alerts_each)
                break
            except RequestFailure as exc:
                failures.append(exc)
        if got is None:
            result = poll_result(failures)
            asked = [f.retry_after for f in failures if f.retry_after is not None]
            answer = PollAnswer(None, result, "; ".join(f.detail for f in failures),
                                min(asked) if asked else None)
        else:
            parsed, malformed = got
            answer = PollAnswer(self.skips.kept([_pulled(a) for a in parsed], malformed,
                                                hostname, names), PollResult.OK)
        ended = self._monotonic()
        self.polls.record(answer.result, ended - began, ended)
        return answer

    # -- internals --------------------------------------------------------------------

    def _silence_owners(self, base: str, ids: tuple[str, ...],
                        deadline: float) -> tuple[tuple[str, ...], list[str]]:
        creators, notes = [], []
        for sid in ids[:MAX_SILENCE_LOOKUPS]:
            try:
                creator, comment = self._get(base, f"/api/v2/silence/{quote(sid, safe='')}",
                                             deadline, _parse_silence)
            except RequestFailure as exc:
                notes.append(f"silence {sid} (creator unknown: {exc.detail})")
                continue
            creators.append(creator)
            notes.append(f"silence {sid} by {_clip(creator, 100)!r}: {_clip(comment)!r}")
        if len(ids) > MAX_SILENCE_LOOKUPS:
            notes.append(f"{len(ids) - MAX_SILENCE_LOOKUPS} more silence(s) not looked up")
        return _unique(creators), notes

    def _get(self, base: str, path: str, deadline: float, parse: Callable[[Any], T]) -> T:
        return self._peers.get(base, path, deadline, parse)
