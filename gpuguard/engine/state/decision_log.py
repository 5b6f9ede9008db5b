"""Every decision the remediator makes: counted, logged, and the latest kept for /state."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from gpuguard.base.compat import StrEnum
from gpuguard.engine.alerting.alerts import Alert
from gpuguard.engine.decision.policy import Action, Decision
from gpuguard.engine.reap.audit import iso_time
from gpuguard.engine.state.clocks import Clocks
from gpuguard.engine.state.metrics import RemediatorMetrics

log = logging.getLogger("gpuguard.remediator")

RECENT_DECISIONS = 200


class DecisionSource(StrEnum):
    """Who decided: the intake of a webhook delivery or of a pull, or the worker."""

    HTTP = "http"
    PULL = "pull"
    WORKER = "worker"


class DecisionLog:
    """The last RECENT_DECISIONS decisions (newest last); callers hold the remediator lock."""

    def __init__(self, metrics: RemediatorMetrics, clocks: Clocks) -> None:
        self._metrics = metrics
        self._clocks = clocks
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_DECISIONS)

    def note(self, decision: Decision, alert: Alert | None, group_key: str, *,
             source: DecisionSource, repeat: bool = False, repeats_before: int = 0) -> None:
        """Count a decision and keep it for /state. Logged at info when it is a reap, a
        dry run, a cancel or the worker's refusal; a `repeat` of the tree's last refusal
        (refusals.py: audited once, then counted) only at debug, as its audit record is
        not written again: one line per tree and change, not one per delivery (pull mode
        delivers every poll). `repeats_before`: how many such repeats this line follows."""
        self._metrics.count_decision(decision.action, decision.reason)
        shown = decision.to_json()
        if decision.recheck_at is not None:
            shown["recheck_at"] = self._clocks.on_wall(decision.recheck_at)
        self._recent.append({
            "time": iso_time(self._clocks.wall()),
            "source": source,
            "key": str(decision.key) if decision.key else None,
            "fingerprint": alert.fingerprint if alert else "",
            "group_key": group_key,
            **shown,
        })
        level = (logging.INFO if decision.action in (Action.REAP, Action.DRY_RUN, Action.CANCEL)
                 else logging.DEBUG)
        if decision.action == Action.IGNORE and source == DecisionSource.WORKER:
            level = logging.DEBUG if repeat else logging.INFO
        if repeats_before:
            log.log(level, "%s %s: %s (%s); %d identical refusal(s) before it were counted, "
                    "not logged", decision.action, decision.key or "-", decision.reason,
                    decision.detail, repeats_before)
            return
        log.log(level, "%s %s: %s (%s)", decision.action, decision.key or "-", decision.reason,
                decision.detail)

    def recent(self) -> list[dict[str, Any]]:
        return list(self._recent)
