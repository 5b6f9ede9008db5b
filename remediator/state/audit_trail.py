"""The worker's audit records, each written durably before it counts as written.

A failed write is counted, makes /healthz answer 503 (`error`) and raises to the
caller, since no signal goes out without its record; the next good write clears it.
"""

from __future__ import annotations

import logging
from typing import Any

from gpuguard.remediator.decision.policy import Decision
from gpuguard.remediator.decision.tree import LiveTree
from gpuguard.remediator.intake.confirmation import Confirmation
from gpuguard.remediator.reap.outcome import ReapResult
from gpuguard.remediator.state.audit import AuditLog, audit_record
from gpuguard.remediator.state.pending import PendingItem
from gpuguard.remediator.state.workstate import WorkState

log = logging.getLogger("gpuguard.remediator")


class AuditTrail:
    def __init__(self, work: WorkState, audit: AuditLog) -> None:
        self._work = work
        self.log = audit
        self.error: str | None = None  # the last write failed: unhealthy

    def append(self, record: dict[str, Any]) -> None:
        """One durable audit record; a failure is counted, makes /healthz 503, and raises."""
        try:
            self.log.append(record)
        except OSError as exc:
            with self._work.lock:
                self._work.metrics.audit_failures += 1
                self.error = f"{self.log.path}: {exc.strerror or exc}"
            log.error("audit record not written: %s", self.error)
            raise
        if self.error is not None:
            with self._work.lock:
                self.error = None
            log.info("audit log %s is writable again", self.log.path)

    def decision(self, item: PendingItem, decision: Decision, live: LiveTree | None,
                 result: ReapResult | None, *, reap_id: str | None = None,
                 confirmation: Confirmation | None = None, repeats_before: int = 0) -> None:
        """The final record of one item; a failed write is counted, the decision stands."""
        work = self._work
        record = audit_record(work.hostname, work.clocks.wall(), decision, live, result,
                              key=item.key, mode=work.policy.mode, item=item, reap_id=reap_id)
        if repeats_before:
            record["repeats_before"] = repeats_before
        if confirmation is not None:
            record["alertmanager"] = confirmation.to_json()
        try:
            self.append(record)
        except OSError:
            pass  # counted and reported by append; the decision stands either way
