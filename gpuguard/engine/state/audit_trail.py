"""The worker's audit records, each written durably before it counts as written.

A failed write is counted, makes /healthz answer 503 (`error`) and raises to the
caller, since no signal goes out without its record. A record that tells what was
signalled (a reap's final record, crash recovery's) is not dropped when the log cannot
take it: it is owed, kept in the state file by whoever settles the reap, and `pay`
writes it (original content and time, plus `retried_at`) at the worker's next loop that
can. /healthz stays 503 and gpuguard_remediator_audit_ok 0 until nothing is owed.
While MAX_OWED_RECORDS (or MAX_OWED_BYTES) are owed, no reap begins (`bounded`): nothing
owed is ever dropped, so the bound is kept by refusing what would add to it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from gpuguard.engine.alerting.confirmation import Confirmation
from gpuguard.engine.decision.pending import PendingItem
from gpuguard.engine.decision.policy import Action, Decision
from gpuguard.engine.decision.tree import LiveTree
from gpuguard.engine.reap.audit import (
    RETRIED_AT,
    AuditLog,
    as_written,
    audit_record,
    iso_time,
)
from gpuguard.engine.reap.outcome import ReapResult
from gpuguard.engine.state.ledger import LedgerError
from gpuguard.engine.state.workstate import WorkState
from gpuguard.orphans.vocabulary import DecisionReason

log = logging.getLogger("gpuguard.remediator")

#: Owed records past which no reap begins (each reap owes at most its final record).
MAX_OWED_RECORDS = 64
#: Their size as JSON past which no reap begins: the state file holds them, and is
#: rewritten whole at every change.
MAX_OWED_BYTES = 4 * 2**20


class AuditTrail:
    def __init__(self, work: WorkState, audit: AuditLog) -> None:
        self._work = work
        self.log = audit
        self.error: str | None = None  # the last write failed: unhealthy
        #: owed records the state file could not take either: written from memory
        self._unsaved: list[dict[str, Any]] = []
        #: owed records (as JSON) written to the log but not yet noted paid in the state
        self._written: set[str] = set()
        #: owed records found in the state file at start: perhaps written before a crash
        self._inherited = {_identity(r) for r in work.ledger.owed()}

    def append(self, record: dict[str, Any]) -> None:
        """One durable audit record; a failure is counted, makes /healthz 503, and raises."""
        try:
            self.log.append(record)
        except OSError as exc:
            with self._work.lock:
                self._work.metrics.audit_failures += 1
            self._failed(exc)
            raise
        self._cleared()

    def write_or_owe(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """Write `record`, or return it as it would have been written (as_written): the
        caller then owes it, in the same state write that settles what it records."""
        try:
            self.append(record)
        except OSError:
            return as_written(record)
        return None

    def decision(self, item: PendingItem, decision: Decision, live: LiveTree | None,
                 result: ReapResult | None, *, reap_id: str | None = None,
                 confirmation: Confirmation | None = None,
                 repeats_before: int = 0) -> dict[str, Any] | None:
        """The final record of one item; the decision stands whether or not it was
        written. Returns it when it was not (as write_or_owe): a reap's is owed; a
        refusal's is written again at the tree's next delivery instead."""
        work = self._work
        record = audit_record(work.hostname, work.clocks.wall(), decision, live, result,
                              key=item.key, mode=work.policy.mode, item=item, reap_id=reap_id)
        if repeats_before:
            record["repeats_before"] = repeats_before
        if confirmation is not None:
            record["alertmanager"] = confirmation.to_json()
        return self.write_or_owe(record)

    def keep(self, owed: list[dict[str, Any]]) -> None:
        """Owed records the state file could not take: written from memory (a restart
        before then loses them: crash recovery then writes its own)."""
        self._unsaved.extend(owed)

    def owed_count(self) -> int:
        return self._work.ledger.owed_count() + len(self._unsaved)

    def problem(self) -> str | None:
        """Why the audit is not healthy (/healthz 503, audit_ok 0), None when it is:
        the last write failed, or records are owed."""
        owed = self.owed_count()
        owing = f"{owed} record(s) owed, retried every loop" if owed else ""
        if self.error is not None:
            return f"{self.error}; {owing}" if owing else self.error
        return owing or None

    def bounded(self, decision: Decision) -> Decision:
        """`decision`, unless it is a reap (or dry run) and the owed records are at their
        bound: then refused (`audit-failed`), before any record or signal."""
        if decision.action not in (Action.REAP, Action.DRY_RUN):
            return decision
        count, size = self._work.ledger.owed_load()
        if count < MAX_OWED_RECORDS and size < MAX_OWED_BYTES:
            return decision
        return Decision(Action.IGNORE, DecisionReason.AUDIT_FAILED,
                        f"{count} audit record(s) ({size} bytes) are owed to the audit log, "
                        f"the most that may be ({MAX_OWED_RECORDS} records, {MAX_OWED_BYTES} "
                        "bytes): no reap begins until they are written", decision.key)

    def pay(self) -> None:
        """Write what is owed, oldest first; cheap when nothing is (the worker calls it
        every loop). The first record the log refuses ends the try: the order stays."""
        ledger = self._work.ledger
        if not self._unsaved and not ledger.owed_count():
            return
        for record in ledger.owed():
            if not self._pay(record):
                return
            try:
                ledger.paid(record)
            except LedgerError as exc:  # written; the state file still owes it
                log.error("owed audit record written, but the state file cannot note it "
                          "(%s): it stays owed there, and is not written again", exc)
                return
            self._written.discard(_identity(record))
        while self._unsaved:
            if not self._pay(self._unsaved[0]):
                return
            self._written.discard(_identity(self._unsaved.pop(0)))
        log.info("audit log %s: every owed record is written", self.log.path)

    def _pay(self, record: dict[str, Any]) -> bool:
        """Write one owed record unless it is written already; False when the log refused."""
        ident = _identity(record)
        if ident in self._written:
            return True
        try:
            if ident in self._inherited and self.log.has_written(record):
                self._written.add(ident)
                return True
            self.log.append({**record, RETRIED_AT: iso_time(self._work.clocks.wall())})
        except OSError as exc:  # a retry: not counted again, logged when the error changes
            self._failed(exc, quiet=True)
            return False
        self._inherited.discard(ident)
        self._written.add(ident)
        self._cleared()
        return True

    def _failed(self, exc: OSError, *, quiet: bool = False) -> None:
        error = f"{self.log.path}: {exc.strerror or exc}"
        with self._work.lock:
            before, self.error = self.error, error
        if not quiet or error != before:
            log.error("audit record not written: %s", error)

    def _cleared(self) -> None:
        if self.error is not None:
            with self._work.lock:
                self.error = None
            log.info("audit log %s is writable again", self.log.path)


def _identity(record: dict[str, Any]) -> str:
    """An owed record's identity: all of it (two records never share a time and content)."""
    return json.dumps(record, sort_keys=True)
