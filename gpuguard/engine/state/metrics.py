"""The remediator's own counters, as typed fields: what /metrics exports.

Mutated by the intake and the worker under the remediator's lock (WorkState.lock);
`counts()` is one consistent copy for a scrape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from gpuguard.base.compat import StrEnum


class RejectCause(StrEnum):
    """Why a POST /alerts was refused (gpuguard_remediator_rejected_requests{cause})."""

    UNAUTHORIZED = "unauthorized"
    TOO_LARGE = "too_large"
    NOT_JSON = "not_json"
    MALFORMED = "malformed"
    STATE_UNWRITABLE = "state_unwritable"


class Counts(TypedDict):
    """One scrape's copy of the counters."""

    decisions: dict[tuple[str, str], int]  # (action, reason) -> count
    rejected: dict[RejectCause, int]
    reaped_processes: int
    reclaimed_bytes: int
    reap_failures: int
    refusals_repeated: int
    audit_failures: int
    audit_ok: bool
    audit_damaged_lines: int


def _no_rejections() -> dict[RejectCause, int]:
    return dict.fromkeys(RejectCause, 0)


@dataclass
class RemediatorMetrics:
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    rejected: dict[RejectCause, int] = field(default_factory=_no_rejections)
    reaped_processes: int = 0
    reclaimed_bytes: int = 0
    reap_failures: int = 0
    refusals_repeated: int = 0  # identical refusals counted instead of audited
    audit_failures: int = 0

    def count_decision(self, action: str, reason: str) -> None:
        slot = (action, reason)
        self.decisions[slot] = self.decisions.get(slot, 0) + 1

    def counts(self, *, audit_ok: bool, audit_damaged_lines: int = 0) -> Counts:
        """A copy (the caller holds the lock); the audit log counts its damaged lines."""
        return Counts(decisions=dict(self.decisions), rejected=dict(self.rejected),
                      reaped_processes=self.reaped_processes,
                      reclaimed_bytes=self.reclaimed_bytes,
                      reap_failures=self.reap_failures,
                      refusals_repeated=self.refusals_repeated,
                      audit_failures=self.audit_failures, audit_ok=audit_ok,
                      audit_damaged_lines=audit_damaged_lines)
