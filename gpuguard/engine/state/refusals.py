"""Refusals remembered per tree, so a tree refused again and again is audited once.

A refusal with the same reason and members as the tree's last one is counted, not
audited in full again; the next full record says how many it stands for. Within
REFUSAL_RECHECK_SECONDS of a refusal a delivery for the same tree is counted without a
new inspection (a refusal stands; a reap waits at most this long), or until the
refusal's own recheck_at where it has one and that comes sooner (a not-idle tree may
qualify in seconds).

The log follows the same rule (decision_log.py): a refusal's info line is written with
its full record, a counted repeat only at debug, and the next full record's line says how
many repeats it follows. Pull mode delivers a firing alert at every poll: one line per
tree and change, not 240 an hour.

A refusal record the audit log cannot take is not owed (nothing was signalled): the
refusal is forgotten instead, so the tree's next delivery is inspected and audited in
full again rather than counted against a record that was never written.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gpuguard.engine.decision.pending import PendingItem
from gpuguard.engine.decision.policy import Decision
from gpuguard.engine.decision.tree import LiveTree, TreeKey
from gpuguard.engine.state.audit_trail import AuditTrail
from gpuguard.engine.state.decision_log import DecisionSource
from gpuguard.engine.state.workstate import WorkState

REFUSAL_RECHECK_SECONDS = 60.0
#: Trees whose last refusal is remembered (oldest forgotten first): junk alerts naming
#: random roots cannot grow it.
REFUSALS_REMEMBERED = 4096


@dataclass
class _Refusal:
    """The last refusal of one tree: what it said, when it was inspected, and how many
    identical ones were counted instead of audited since its full record."""

    decision: Decision
    signature: tuple[object, ...]
    inspected_at: float  # boot clock
    repeats: int = 0


class RefusalMemory:
    """The worker's memory of refusals (used by the worker thread only)."""

    def __init__(self, work: WorkState, trail: AuditTrail) -> None:
        self._work = work
        self._trail = trail
        self._refusals: OrderedDict[TreeKey, _Refusal] = OrderedDict()

    def forget(self, key: TreeKey) -> None:
        self._refusals.pop(key, None)

    def standing(self, key: TreeKey, decision: Decision, live: LiveTree) -> tuple[bool, int]:
        """Whether `decision` (an IGNORE of `live`) repeats the tree's last refusal, which
        audit() will then count rather than write; and, when it does not, how many
        repeats of the last one its full record follows. What the log line says of it."""
        known = self._refusals.get(key)
        if known is None:
            return False, 0
        if known.signature == _signature(decision, live):
            return True, 0
        return False, known.repeats

    def repeated(self, item: PendingItem) -> bool:
        """A delivery for a tree refused less than REFUSAL_RECHECK_SECONDS ago: counted
        against that refusal, not inspected again (its ledger entry settled as one)."""
        work = self._work
        known = self._refusals.get(item.key)
        if known is None:
            return False
        window = REFUSAL_RECHECK_SECONDS
        if known.decision.recheck_at is not None:
            window = min(window, known.decision.recheck_at - known.inspected_at)
        if work.clocks.boot() - known.inspected_at >= window:
            return False
        with work.lock:
            if item.key in work.cancelled or item.key not in work.ledger.pending():
                return False  # withdrawn meanwhile: the ordinary path says so
            work.ledger.remove_pending(item.key)
            work.decisions.note(known.decision, item.alert, item.group_key,
                                source=DecisionSource.WORKER, repeat=True)
        known.repeats += 1
        work.metrics.refusals_repeated += 1
        return True

    def audit(self, item: PendingItem, decision: Decision, live: LiveTree) -> None:
        """Audit a refusal in full unless it repeats the last one of this tree (same
        action, reason and members): then count it. A full record carries how many
        identical refusals it follows (`repeats_before`)."""
        signature = _signature(decision, live)
        now = self._work.clocks.boot()
        known = self._refusals.pop(item.key, None)
        if known is not None and known.signature == signature:
            known.repeats += 1
            known.inspected_at = now
            known.decision = decision  # its recheck_at, if any, counts from now
            self._work.metrics.refusals_repeated += 1
            self._refusals[item.key] = known
            return
        self._refusals[item.key] = _Refusal(decision, signature, now)
        while len(self._refusals) > REFUSALS_REMEMBERED:
            self._refusals.popitem(last=False)
        unwritten = self._trail.decision(
            item, decision, live, None, repeats_before=known.repeats if known is not None else 0)
        if unwritten is not None:  # not owed: written again at the next delivery
            self._refusals.pop(item.key, None)


def _signature(decision: Decision, live: LiveTree) -> tuple[object, ...]:
    """What makes two refusals of a tree the same: action, reason and members."""
    members = tuple((m.pid, m.start_time) for m in live.members)
    return (decision.action, decision.reason, live.verdict, live.reason, members)
