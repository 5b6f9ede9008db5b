"""Reaps a crash cut short ("reaping" in the ledger), settled at start: what they may have
stopped is continued, each is audited (its records owed where the log cannot take them,
as the worker's final records are), nothing is re-killed."""

from __future__ import annotations

import functools
import logging
from typing import Any

from gpuguard.engine.decision.policy import Action, Decision
from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.reap.audit import Phase, as_written, audit_record
from gpuguard.engine.reap.outcome import SignalRecord, SignalResult
from gpuguard.engine.reap.skeleton import TreeReaper
from gpuguard.engine.state.audit_trail import AuditTrail
from gpuguard.engine.state.ledger import LedgerError, may_have_signalled
from gpuguard.engine.state.reap_lock import ReapLock, ReapLockRefused, host_reap_lock
from gpuguard.engine.state.workstate import WorkState
from gpuguard.orphans.vocabulary import DecisionReason

log = logging.getLogger("gpuguard.remediator")

#: (pid, start time, stopped already when the reap held it, held) as the ledger recorded.
_Recorded = tuple[int, int, bool, bool]


class InterruptedReaps:
    def __init__(self, work: WorkState, trail: AuditTrail, reaper: TreeReaper,
                 reap_lock: ReapLock | None = None) -> None:
        self._work = work
        self._trail = trail
        self._reaper = reaper
        #: Recovery's SIGCONTs wait for the host's reap lock: another reaper may hold
        #: those very processes stopped, and a SIGCONT would undo its freeze.
        self._reap_lock = reap_lock if reap_lock is not None else host_reap_lock(work)
        #: why the last settle() could not take the reap lock (None: it could)
        self.waiting: str | None = None
        #: reaps a crash cut short, not yet settled (the worker retries while the lock is held)
        self.unsettled: list[tuple[TreeKey, dict[str, Any]]] = list(work.ledger.interrupted)

    def settle(self) -> None:
        """Reaps a crash cut short: continue what they left stopped, audit, never re-kill.

        What each stopped is continued even when the audit log cannot be written (a
        SIGCONT undoes the reap's own SIGSTOP of members its intent record named); records
        the log cannot take are owed, in the state write that settles the reap, and the
        worker writes them once it can (/healthz 503 meanwhile), as it does a reap's own.
        """
        if not self.unsettled:
            return
        try:
            self._reap_lock.acquire({"by": "gpuguard-remediator recovery",
                                     "key": ", ".join(str(k) for k, _ in self.unsettled[:4])})
        except ReapLockRefused as refused:
            if refused.reason != DecisionReason.REAP_IN_PROGRESS:
                # No lock can be had here at all (a read-only or broken state directory):
                # nobody can hold it either, and every freeze thaws: go on without it.
                log.warning("interrupted reaps are settled without the host's reap lock: %s",
                            refused.detail)
                self._settle_all()
                return
            if self.waiting != refused.detail:
                log.warning("interrupted reaps wait for the host's reap lock: %s",
                            refused.detail)
            self.waiting = refused.detail  # the worker tries again every loop
            return
        self.waiting = None
        try:
            self._settle_all()
        finally:
            self._reap_lock.release()

    def _settle_all(self) -> None:
        for key, entry in self.unsettled:
            self._settle_one(key, entry)
        self.unsettled = []

    def _settle_one(self, key: TreeKey, entry: dict[str, Any]) -> None:
        """Settle one interrupted reap."""
        work = self._work
        reap_id = entry.get("reap_id")
        audit = self._trail.log
        signalled = may_have_signalled(entry)
        try:
            finished = (audit.has_final(str(reap_id)) if reap_id else
                        audit.has_record(key.hostname, key.root_pid, key.root_start_time,
                                         since=float(entry.get("at", 0))))
        except OSError as exc:  # an I/O error: what it stopped must not wait on the disk
            log.error("interrupted reap of %s: the audit log cannot be read (%s); "
                      "continuing what it stopped", key, exc.strerror or exc)
            finished = False
        if finished:  # the final record made it; only settle
            self._settle_ledger(key, INTERRUPTED, signalled, [])
            return
        recorded: list[_Recorded] = [
            (int(m[0]), int(m[1]), bool(m[2]) if len(m) > 2 else False,
             bool(m[3]) if len(m) > 3 else True)
            for m in entry.get("members", [])]
        # Only what this reap may have stopped: marked held (right before its SIGSTOP,
        # cleared once the reap continued it: see Reaper.thaw_interrupted for what that
        # can and cannot tell), and not stopped already when the reap held it (Ctrl-Z,
        # a scheduler): that one is left as its owner left it. A reap refuses such a
        # member before recording it (member-stopped), so only a state file an earlier
        # version wrote has one. A state file from before the marks (3 fields) counts
        # every member as held.
        thaw = [(pid, start) for pid, start, was_stopped, held in recorded
                if held and not was_stopped]
        record = functools.partial(
            audit_record, work.hostname, live=None, result=None, key=key,
            mode=str(entry.get("mode")), reap_id=reap_id,
            fingerprint=str(entry.get("fingerprint", "")),
            member_ids=[(pid, start) for pid, start, _, _ in recorded])
        owed: list[dict[str, Any]] = []
        if thaw:  # the SIGCONTs are signals too: written down first, where that can be
            intent = self._trail.write_or_owe(record(
                decision=Decision(Action.IGNORE, INTERRUPTED, f"{CUT_SHORT}; the "
                                  f"{len(thaw)} member(s) it may have stopped are "
                                  "continued (SIGCONT) if still stopped, and left alive",
                                  key),
                now=work.clocks.wall(), phase=Phase.INTENT))
            if intent is not None:
                # Every freeze thaws: a SIGCONT only undoes this reap's own SIGSTOP, of
                # members its intent record already named; a full disk must not keep them
                # stopped. This record is owed, and written (first) once the log can be.
                owed.append(intent)
                log.error("interrupted reap of %s: the audit log cannot be written (%s); "
                          "continuing the %d member(s) it stopped anyway", key,
                          self._trail.error, len(thaw))
        signals = self._reaper.thaw_interrupted(thaw)
        self._let_go(key, thaw)
        decision = settled_decision(key, thaw, signals, signalled=signalled)
        final = record(decision=decision, now=work.clocks.wall(), signals=signals)
        if owed:  # after its owed intent record, never before it
            owed.append(as_written(final))
        elif (unwritten := self._trail.write_or_owe(final)) is not None:
            owed.append(unwritten)
        work.metrics.reap_failures += 1
        log.warning("interrupted reap of %s settled: %s", key, decision.detail)
        self._settle_ledger(key, decision.reason, signalled, owed)

    def _let_go(self, key: TreeKey, members: list[tuple[int, int]]) -> None:
        """Mark what recovery continued as no longer held, so that a restart before the
        reap is settled (a crash in between) does not continue it again, perhaps after
        its owner stopped it. A state file that cannot be written cannot say so: then a
        restart continues again what is still stopped (docs/remediator.md)."""
        if not members:
            return
        try:
            self._work.ledger.mark_held(key, members, False)
        except LedgerError as exc:
            log.warning("interrupted reap of %s: cannot note in the state file that its "
                        "members were continued (%s)", key, exc)

    def _settle_ledger(self, key: TreeKey, outcome: str, signalled: bool,
                       owed: list[dict[str, Any]]) -> None:
        """The state file's side of a settled reap, with the records it owes. One that
        cannot be written (a full or read-only state directory) is left "reaping" there:
        its records are written from memory where the log can take them, and the next
        start only settles it from its final record, continuing nothing twice."""
        try:
            self._work.ledger.settle_interrupted(key, outcome, signalled=signalled,
                                                 owed=owed)
        except LedgerError as exc:
            self._trail.keep(owed)
            log.error("interrupted reap of %s is not settled in the state file (%s); the "
                      "next start settles it from its final record", key, exc)


#: How every record of a settled interrupted reap begins.
CUT_SHORT = "the remediator stopped during this reap"
INTERRUPTED = DecisionReason.INTERRUPTED
THAWED = DecisionReason.INTERRUPTED_THAWED


def settled_decision(key: TreeKey, thaw: list[tuple[int, int]],
                     signals: tuple[SignalRecord, ...], *, signalled: bool) -> Decision:
    """What the settled reap's final record says, true to the SIGCONTs really sent:
    `interrupted-thawed` only when one was; `interrupted` (with why) when none was."""
    sent = [s.pid for s in signals if s.signal == "SIGCONT" and s.result == SignalResult.SENT]
    failed = [f"{s.pid} ({s.error})" for s in signals if s.failed]
    if not thaw:
        detail = (f"{CUT_SHORT} before its first signal: nothing was signalled; the tree "
                  "may be decided again on the next delivery" if not signalled else
                  f"{CUT_SHORT}; it held none of the members stopped: nothing was "
                  "continued")
    elif not sent:
        detail = (f"{CUT_SHORT}; none of the {len(thaw)} member(s) it may have stopped "
                  "was still stopped (or still the same process): nothing was continued")
    else:
        others = len(thaw) - len(sent) - len(failed)
        detail = (f"{CUT_SHORT}; continued (SIGCONT) {len(sent)} of the {len(thaw)} "
                  f"member(s) it may have stopped ({', '.join(map(str, sent))}) and left "
                  "them alive" + (f"; {others} no longer stopped or gone" if others else ""))
    if failed:
        detail += f"; SIGCONT failed for {', '.join(failed)}: still stopped"
    return Decision(Action.IGNORE, THAWED if sent else INTERRUPTED, detail, key)
