"""What one poll hands on: this host's firing alerts, shaped like a webhook's, and every
other alert it was given counted by why it was left out.

Shared by the two sources pull mode may poll (Alertmanager's v2 API, Prometheus's
ALERTS series): whatever a source's filter did, these checks decide, and one poll hands
on at most MAX_PULL_ALERTS, so whatever else the source holds, this host's alerts still
arrive.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuguard.base.compat import StrEnum
from gpuguard.engine.alerting.alerts import (
    MAX_ALERTS,
    ZERO_TIME,
    AlertStatus,
    asks_for_remediation,
)
from gpuguard.engine.alerting.polling import PollResult

log = logging.getLogger("gpuguard.remediator.pull")

#: Alerts one poll hands on at most (as many as one webhook notification may carry); the
#: rest are counted as "over-limit" and the next poll sees them again.
MAX_PULL_ALERTS = MAX_ALERTS


class SkipReason(StrEnum):
    """Why a pulled alert was not handed on (gpuguard_remediator_pull_alerts_skipped_total{why})."""

    MALFORMED = "malformed"  # not the shape the source sends, or refused by alerts.py
    OTHER_HOST = "other-host"
    NOT_LISTED = "alertname-not-listed"  # not in remediate.alerts
    NOT_REMEDIATE = "not-remediate"  # no remediate="true"
    NOT_ACTIVE = "not-active"  # silenced, inhibited, unprocessed
    OVER_LIMIT = "over-limit"  # past MAX_PULL_ALERTS in one poll


@dataclass(frozen=True)
class PollAnswer:
    """One poll: the alerts (None when no peer answered well), how it went (`result`,
    `detail`), and the smallest Retry-After a busy peer asked for."""

    alerts: list[dict[str, Any]] | None
    result: PollResult
    detail: str = ""
    retry_after: float | None = None


@dataclass(frozen=True)
class Pulled:
    """One alert as a source reported it: `active` is false for one silenced, inhibited or
    not yet processed (Alertmanager's word; Prometheus's query asks for firing ones only)."""

    labels: Mapping[str, str]
    active: bool
    starts_at: str = ""  # RFC 3339, or "" when the source did not say
    annotations: Mapping[str, str] | None = None
    generator_url: str = ""
    fingerprint: str = ""


def skip_reason(alert: Pulled, hostname: str, names: frozenset[str]) -> SkipReason | None:
    """Why a pulled alert is not for this remediator to act on; None when it is."""
    if alert.labels.get("hostname") != hostname:
        return SkipReason.OTHER_HOST
    if alert.labels.get("alertname") not in names:
        return SkipReason.NOT_LISTED
    if not asks_for_remediation(alert.labels):
        return SkipReason.NOT_REMEDIATE
    if not alert.active:
        return SkipReason.NOT_ACTIVE
    return None


def sort_pulled(pulled: list[Pulled], malformed: int, hostname: str,
                names: frozenset[str]) -> tuple[list[dict[str, Any]], dict[SkipReason, int]]:
    """(the pulled alerts to hand on, shaped like a webhook's; how many were skipped by why)."""
    skipped = dict.fromkeys(SkipReason, 0)
    skipped[SkipReason.MALFORMED] = malformed
    kept: list[Pulled] = []
    for a in pulled:  # the source's filter narrows; these checks decide (a proxy may drop it)
        why = skip_reason(a, hostname, names)
        if why is not None:
            skipped[why] += 1
        elif len(kept) < MAX_PULL_ALERTS:
            kept.append(a)
        else:
            skipped[SkipReason.OVER_LIMIT] += 1
    return [
        {
            "status": AlertStatus.FIRING,
            "labels": dict(a.labels),
            "annotations": dict(a.annotations or {}),
            "startsAt": a.starts_at or None,
            "endsAt": ZERO_TIME,
            "generatorURL": a.generator_url,
            "fingerprint": a.fingerprint,
        }
        for a in kept
    ], skipped


class SkipCounts:
    """Pulled alerts not handed on, by SkipReason; logs once while a poll overflows.
    Thread-safe (the poller writes, scrapes read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._skipped: dict[str, int] = dict.fromkeys(SkipReason, 0)
        self._flooded = False  # the last poll had more than MAX_PULL_ALERTS: logged once

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._skipped)

    def count(self, why: SkipReason, n: int = 1) -> None:
        if n:
            with self._lock:
                self._skipped[why] += n

    def kept(self, pulled: list[Pulled], malformed: int, hostname: str,
             names: frozenset[str]) -> list[dict[str, Any]]:
        """The pulled alerts to hand on; the others counted by why."""
        kept, skipped = sort_pulled(pulled, malformed, hostname, names)
        for why, n in skipped.items():
            self.count(why, n)
        if skipped[SkipReason.OVER_LIMIT] and not self._flooded:
            log.warning("pull: %d of this host's alerts past the first %d of a poll are "
                        "skipped (counted as over-limit) while there are that many",
                        skipped[SkipReason.OVER_LIMIT], MAX_PULL_ALERTS)
        self._flooded = bool(skipped[SkipReason.OVER_LIMIT])
        return kept
