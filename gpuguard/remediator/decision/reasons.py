"""The remediator's decision reasons: every `reason` a decision, an audit record, a
`/state` entry and `gpuguard_remediator_decisions_total{reason}` can carry besides the
classifier's own (an orphan reason when a tree is reaped, a `member-*` reason when one of
its members refuses it: gpuguard.orphans.vocabulary.Reason).

docs/decisions.md explains each to on-call; tests/pure/test_vocabulary.py keeps the two
in step, so a reason cannot be added here without its meaning there, nor the reverse.
"""

from __future__ import annotations

from gpuguard.compat import StrEnum


class DecisionReason(StrEnum):
    """Why the remediator (or `gpuguard reap`) decided what it did."""

    # screening an alert (policy.screen)
    NOT_FIRING = "not-firing"
    ALERTNAME_NOT_LISTED = "alertname-not-listed"
    NOT_REMEDIATE = "not-remediate"
    OTHER_HOST = "other-host"
    MISSING_LABEL = "missing-label"
    BAD_LABEL = "bad-label"
    PROTECTED_PID = "protected-pid"
    DUPLICATE = "duplicate"
    QUEUE_FULL = "queue-full"
    QUEUED = "queued"
    # the live check (policy.verify_live, policy.decide)
    ROOT_GONE = "root-gone"
    ROOT_REPLACED = "root-replaced"
    NVML_UNAVAILABLE = "nvml-unavailable"
    NVML_INCOMPLETE = "nvml-incomplete"
    TREE_NOT_FOUND = "tree-not-found"
    INSPECT_FAILED = "inspect-failed"
    #: A prefix: `not-orphan:<verdict>`, the local classifier's verdict after the colon.
    NOT_ORPHAN = "not-orphan"
    REASON_NOT_ALLOWED = "reason-not-allowed"
    USER_DENIED = "user-denied"
    ROOT_OWNED = "root-owned"
    USER_UNRESOLVED = "user-unresolved"
    RATE_LIMITED = "rate-limited"
    TOO_YOUNG = "too-young"
    #: remediate.require_idle_seconds or idle_reasons: a holder used the GPU too recently
    #: (or was watched too briefly), or its utilization cannot be read.
    NOT_IDLE = "not-idle"
    IDLE_UNKNOWN = "idle-unknown"
    # Alertmanager at kill time, and withdrawn reaps
    SILENCED = "silenced"
    INHIBITED = "inhibited"
    ALERTMANAGER_UNREACHABLE = "alertmanager-unreachable"
    RESOLVED = "resolved"
    CANCELLED = "cancelled"
    # the reap itself
    NO_PIDFD = "no-pidfd"
    SIGNAL_FAILED = "signal-failed"
    TREE_TOO_LARGE = "tree-too-large"
    MEMBER_TRACED = "member-traced"
    #: A member stopped (state T) before this reap sent it SIGSTOP: someone else's stop.
    MEMBER_STOPPED = "member-stopped"
    WORKER_TIMEOUT = "worker-timeout"
    NVML_TIMEOUT = "nvml-timeout"
    GUARDIAN_FAILED = "guardian-failed"
    STATE_FAILED = "state-failed"
    AUDIT_FAILED = "audit-failed"
    SURVIVORS = "survivors"
    INTERNAL_ERROR = "internal-error"
    # after a crash, and `gpuguard reap --apply`
    INTERRUPTED_THAWED = "interrupted-thawed"
    INTERRUPTED = "interrupted"
    AUDIT_UNSAFE = "audit-unsafe"
    # one reap at a time on a host (remediator/state/reap_lock.py)
    REAP_IN_PROGRESS = "reap-in-progress"
    REAP_LOCK_UNAVAILABLE = "reap-lock-unavailable"
    #: `gpuguard reap --force` over a tree the classifier gave no orphan reason for.
    FORCED = "forced"


def not_orphan(verdict: str) -> str:
    """The reason for a tree the local classifier does not call an orphan."""
    return f"{DecisionReason.NOT_ORPHAN}:{verdict}"
