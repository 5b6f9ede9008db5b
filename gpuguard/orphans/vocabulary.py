"""gpuguard's words, in one module of the pure core: the classifier's verdicts, the rules
that decide them and the reasons it gives (Verdict, Rule, Reason); the remediator's own
decision reasons (DecisionReason); and why a reap could not hold a process (Unheld).

StrEnums: each value is the exact string that JSON, metric labels and audit logs carry
(str() and format() give the value on every Python gpuguard runs on: gpuguard.base.compat).
No module outside this one spells a value as a bare string where it decides or records
something (tests/pure/test_layering.py, test_no_vocabulary_literal_outside_the_vocabulary).
"""

from __future__ import annotations

from typing import NewType, Union

from gpuguard.base.compat import StrEnum


class Verdict(StrEnum):
    """What a holder's chain (or a tree) is. Only ORPHAN is ever reaped."""

    NORMAL = "normal"
    ORPHAN = "orphan"
    PROTECTED = "protected"
    UNKNOWN = "unknown"


class Rule(StrEnum):
    """The orphan rules by number (docs/design.md, Orphan rules): the rule that decided."""

    HOLDER = "1"  # the holder itself: visible, not a zombie
    CHAIN = "2"  # the parent chain (and a member's facts) readable and sane
    PROTECT = "3"  # protect patterns
    DETACH = "4"  # SIGHUP ignored, the keep marker
    MANAGED = "5"  # service manager cgroups, deeper PID namespaces
    ADOPTION = "6"  # adoption evidence, the launcher's fate
    SESSION = "7"  # no adoption: attached to or leading a live session


class Reason(StrEnum):
    """Why a verdict was given; the rule that gives each is at its use.

    Each orphan reason carries its place in the reapability order as data: `reapability`
    ranks it (1 the least reapable; 0 for a reason that is not an orphan's), so that the
    classifier's tree (holders that disagree), the remediator's reading of an alert's
    `reason` label and the config's list of reasons share one order, written here once
    (docs/decisions.md, Reapability, lists it; tests/pure/test_vocabulary.py compares).
    `launcher_gone` marks rule 6's reasons for a gone session leader, the ones the
    launcher memory keeps and an alert's label may lower; `recorded` those of them that
    rest on the kernel's exit record. Orphan reasons are declared in the order
    `remediate.reasons`' errors list them.
    """

    reapability: int
    launcher_gone: bool
    recorded: bool

    def __new__(cls, value: str, reapability: int = 0, launcher_gone: bool = False,
                recorded: bool = False) -> Reason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.reapability = reapability
        member.launcher_gone = launcher_gone
        member.recorded = recorded
        return member

    NOT_VISIBLE = "not-visible"
    EXITING = "exiting"
    TOO_DEEP = "too-deep"
    CYCLE = "cycle"
    VANISHED = "vanished"
    INCONSISTENT = "inconsistent"
    UNREADABLE = "unreadable"
    PROTECT_PATTERN = "protect-pattern"
    IGNORES_SIGHUP = "ignores-sighup"
    KEEP_MARKER = "keep-marker"
    MANAGED = "managed"
    CONTAINER = "container"
    DAEMON = "daemon"
    #: Adopted by the live `gpuguard run` launcher that started it, which reaps the tree
    #: when it ends: attached to a live launcher, not orphaned.
    RUN_LAUNCHER = "run-launcher"
    #: Orphan reasons of rule 6: how the session leader (the launcher) went away.
    #: Died by a signal (an agent stopping its shell): the most reapable.
    LAUNCHER_KILLED = "launcher-killed", 8, True, True
    SESSION_ENDED = "session-ended", 7, True  # gone, and no process-event listener runs here
    LAUNCHER_EXITED = "launcher-exited", 5, True, True  # exited by itself (`exit`, a script)
    #: Gone, and the listener that runs holds no record of how: it died before the
    #: listener started, or the record was evicted or dropped. Not reaped by default.
    LAUNCHER_UNRECORDED = "launcher-unrecorded", 6, True
    PARENT_EXITED = "parent-exited", 2  # the leader lives; only a parent in between died
    #: The holder's session lives, but a process above it (that created it, or adopted
    #: it) lost its own launcher: alerted, reaped only where the policy names it.
    #: The least reapable: a setsid'd job's must not ride on its sibling's launcher-killed.
    SESSION_ORPHANED = "session-orphaned", 1
    #: Windows orphan reasons (gpuguard/host/windows/tree.py; never given on Linux): the
    #: parent pid is in no process table (the parent is gone), or names a process created
    #: after the child (the pid was reused: the parent is gone too). Windows cannot say how
    #: the launcher went (killed, or exited by itself): not reaped by default.
    PARENT_GONE = "parent-gone", 4
    PARENT_REUSED = "parent-reused", 3
    #: Rule 6's unknown: the evidence fits an adoption and a fork alike.
    ADOPTION_UNCERTAIN = "adoption-uncertain"
    ATTACHED = "attached"
    DETACHED = "detached"
    #: Tree reasons when the root's chain says orphan but a member must not be signalled.
    MEMBER_PROTECTED = "member-protected"
    MEMBER_UNKNOWN = "member-unknown"
    MEMBER_NORMAL = "member-normal"  # a GPU holder below the root that is not an orphan

    @property
    def orphan(self) -> bool:
        """An orphan's reason (rule 6, or Windows' rule 8): one `remediate.reasons` names."""
        return self.reapability > 0


#: The orphan reasons in declaration order (`remediate.reasons`' choices).
ORPHAN_REASONS: tuple[Reason, ...] = tuple(r for r in Reason if r.orphan)


def reapability(reason: str) -> int:
    """The rank of any reason string (an alert's label, a remembered reason): 0 for one
    that is no orphan reason, or no reason at all."""
    try:
        return Reason(reason).reapability
    except ValueError:
        return 0


def launcher_gone(reason: str) -> bool:
    """Whether `reason` (any string) is one of rule 6's reasons for a gone launcher."""
    try:
        return Reason(reason).launcher_gone
    except ValueError:
        return False


class DecisionReason(StrEnum):
    """Why the remediator (or `gpuguard reap`) decided what it did: every `reason` a
    decision, an audit record, a `/state` entry and
    `gpuguard_remediator_decisions_total{reason}` can carry besides the classifier's own
    (an orphan reason when a tree is reaped, a `member-*` reason when one of its members
    refuses it).

    docs/decisions.md explains each to on-call; tests/pure/test_vocabulary.py keeps the two
    in step, so a reason cannot be added here without its meaning there, nor the reverse.
    """

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
    # one reap at a time on a host (gpuguard/engine/state/reap_lock.py)
    REAP_IN_PROGRESS = "reap-in-progress"
    REAP_LOCK_UNAVAILABLE = "reap-lock-unavailable"
    #: `gpuguard reap --force` over a tree the classifier gave no orphan reason for.
    FORCED = "forced"


#: `not-orphan:<verdict>`: a decision's reason for a tree the local classifier does not
#: call an orphan; only not_orphan() makes one.
NotOrphan = NewType("NotOrphan", str)


def not_orphan(verdict: str) -> NotOrphan:
    """The reason for a tree the local classifier does not call an orphan."""
    return NotOrphan(f"{DecisionReason.NOT_ORPHAN}:{verdict}")


#: Every reason a decision, a reap's result and an audit record can carry: the
#: remediator's own, the classifier's (an orphan's reason on an accept, a `member-*`
#: refusal), or not-orphan:<verdict>.
AnyReason = Union[DecisionReason, Reason, NotOrphan]  # noqa: UP007 (a runtime alias on 3.10)


class Unheld(StrEnum):
    """Why a reap could not hold a process as the one it means (the signaller's `why`, on
    Linux and Windows alike). Any other why is words saying the process could not be
    opened or read: such a process cannot be judged."""

    EXITED = "exited"
    REPLACED = "replaced"  # a later process has its pid (another start or creation time)
    REPARENTED = "reparented"  # no longer a child of the member it was found below
    PARENT_REPLACED = "parent-replaced"  # the member it was found below is not that one now
    #: The process ran out of descriptors (EMFILE, or the system's table is full: ENFILE):
    #: the tree is too large here, not unknown.
    NO_DESCRIPTOR = "could not be held: no descriptor left"
