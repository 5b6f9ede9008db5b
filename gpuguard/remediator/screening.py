"""Intake: screen each alert of a delivery (webhook or pull) and queue the acceptable
ones in the ledger, answering per alert in milliseconds; the worker does the rest."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from gpuguard.base.compat import StrEnum
from gpuguard.config.remediate import Remediate
from gpuguard.engine.alerting.alerts import AlertStatus, Notification
from gpuguard.engine.decision.pending import PendingItem
from gpuguard.engine.decision.policy import Action, Decision, PolicyState, screen
from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.state.decision_log import DecisionSource
from gpuguard.engine.state.metrics import RejectCause
from gpuguard.engine.state.workstate import WorkState
from gpuguard.orphans.vocabulary import AnyReason, DecisionReason

log = logging.getLogger("gpuguard.remediator")


class AccountStatus(StrEnum):
    """What happened to one alert of a delivery, as answered to Alertmanager."""

    ACCEPTED = "accepted"
    IGNORED = "ignored"
    DUPLICATE = "duplicate"
    CANCELLED = "cancelled"


#: Per-alert answer in the HTTP response, by decision action.
_ACCOUNT = {Action.ACCEPT: AccountStatus.ACCEPTED, Action.CANCEL: AccountStatus.CANCELLED,
            Action.IGNORE: AccountStatus.IGNORED}


@dataclass(frozen=True)
class Account:
    """What happened to one alert of a delivery, as answered to Alertmanager."""

    index: int
    fingerprint: str
    status: AccountStatus
    reason: AnyReason
    detail: str
    key: str | None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "fingerprint": self.fingerprint, "status": self.status,
                "reason": self.reason, "detail": self.detail, "key": self.key}


class Intake:
    """Thread-safe and fast: called from the HTTP threads and pull mode's poller."""

    def __init__(self, work: WorkState) -> None:
        self._work = work

    @property
    def hostname(self) -> str:
        return self._work.hostname

    @property
    def policy(self) -> Remediate:
        return self._work.policy

    def reject(self, cause: RejectCause) -> None:
        with self._work.lock:
            self._work.metrics.rejected[cause] += 1

    def submit(self, notification: Notification, *,
               source: DecisionSource = DecisionSource.HTTP) -> list[Account]:
        """Screen each alert, queue the acceptable ones durably, answer per alert."""
        if notification.truncated_alerts:
            log.warning("delivery %s had %d truncated alert(s): set max_alerts: 0 on the "
                        "webhook receiver", notification.group_key, notification.truncated_alerts)
        work = self._work
        accounts: list[Account] = []
        queued: list[PendingItem] = []
        with work.lock:
            now = work.clocks.boot()
            state = work.policy_state(now)
            pending = set(state.pending)
            owners = dict(state.pending_owners)
            for index, alert in enumerate(notification.alerts):
                decision = screen(alert, _with_pending(state, pending, owners))
                key = decision.key
                if decision.action == Action.ACCEPT and key is not None:
                    pending.add(key)
                    owners[key] = alert.label("user") or ""
                    queued.append(PendingItem(key, alert, notification.group_key, now, now))
                elif decision.action == Action.CANCEL and key is not None:
                    self._cancel(key)
                    pending.discard(key)
                    queued = [q for q in queued if q.key != key]
                elif (alert.status == AlertStatus.RESOLVED and key is not None
                      and key == work.current):
                    work.cancelled.add(key)  # past the pending stage: stop before any signal
                    decision = Decision(Action.CANCEL, DecisionReason.RESOLVED,
                                        "resolved while in flight: "
                                        "the reap stops unless it has already signalled", key)
                status = _ACCOUNT.get(decision.action, AccountStatus.IGNORED)
                if decision.reason == DecisionReason.DUPLICATE:
                    status = AccountStatus.DUPLICATE
                accounts.append(Account(index, alert.fingerprint, status, decision.reason,
                                        decision.detail, str(key) if key else None))
                work.decisions.note(decision, alert, notification.group_key, source=source)
            work.ledger.add_pending(queued)
        if queued:
            work.notify()
        return accounts

    def _cancel(self, key: TreeKey) -> None:
        """Withdraw a pending key; if the worker holds it now, stop it before any signal."""
        if key == self._work.current:
            self._work.cancelled.add(key)
        self._work.ledger.remove_pending(key)


def _with_pending(state: PolicyState, pending: set[TreeKey],
                  owners: dict[TreeKey, str]) -> PolicyState:
    """The same state with this delivery's own accepted keys counted as pending (and as
    their owners')."""
    if pending == state.pending:
        return state
    return dataclasses.replace(state, pending=frozenset(pending), pending_owners=dict(owners))
