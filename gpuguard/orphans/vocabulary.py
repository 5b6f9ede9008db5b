"""The classifier's words: verdicts, the rules that decide them, the reasons given.

StrEnums: each value is the exact string that JSON, metric labels and audit logs carry.
"""

from __future__ import annotations

from gpuguard.compat import StrEnum


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
    """Why a verdict was given; the rule that gives each is at its use."""

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
    LAUNCHER_KILLED = "launcher-killed"  # died by a signal (an agent stopping its shell)
    LAUNCHER_EXITED = "launcher-exited"  # exited by itself (`exit`, a script finishing)
    #: Gone, and the listener that runs holds no record of how: it died before the
    #: listener started, or the record was evicted or dropped. Not reaped by default.
    LAUNCHER_UNRECORDED = "launcher-unrecorded"
    SESSION_ENDED = "session-ended"  # gone, and no process-event listener runs here
    PARENT_EXITED = "parent-exited"  # the leader lives; only a parent in between died
    #: The holder's session lives, but a process above it (that created it, or adopted
    #: it) lost its own launcher: alerted, reaped only where the policy names it.
    SESSION_ORPHANED = "session-orphaned"
    #: Windows orphan reasons (gpuguard/orphans/windows.py; never given on Linux): the
    #: parent pid is in no process table (the parent is gone), or names a process created
    #: after the child (the pid was reused: the parent is gone too). Windows cannot say how
    #: the launcher went (killed, or exited by itself): not reaped by default.
    PARENT_GONE = "parent-gone"
    PARENT_REUSED = "parent-reused"
    #: Rule 6's unknown: the evidence fits an adoption and a fork alike.
    ADOPTION_UNCERTAIN = "adoption-uncertain"
    ATTACHED = "attached"
    DETACHED = "detached"
    #: Tree reasons when the root's chain says orphan but a member must not be signalled.
    MEMBER_PROTECTED = "member-protected"
    MEMBER_UNKNOWN = "member-unknown"
    MEMBER_NORMAL = "member-normal"  # a GPU holder below the root that is not an orphan
