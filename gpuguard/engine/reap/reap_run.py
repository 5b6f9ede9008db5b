"""The state of one reap in progress (ReapRun, Target), the callbacks it reports through
(Journal, Confirm, Holding) and how it is refused (Abort). Shared by the reaper's parts."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Literal, TypeVar

from gpuguard.config.remediate import Remediate
from gpuguard.engine.decision.tree import Member
from gpuguard.engine.reap.audit import Phase
from gpuguard.engine.reap.outcome import Kept, KillPath, SignalRecord
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.launchers import ExitSource
from gpuguard.orphans.process import ProcInfo
from gpuguard.orphans.protections import ProcSource
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.vocabulary import AnyReason, DecisionReason

log = logging.getLogger("gpuguard.remediator.reaper")  # the reaper's log: one for all its parts

#: Writes one audit record naming processes before they get their first signal:
#: phase INTENT (every planned member, before the first SIGSTOP) or JOINED
#: (processes that joined the tree while it was being reaped). Raises when the
#: record could not be made durable; then those processes are not signalled.
Journal = Callable[[Phase, tuple[Member, ...]], None]

#: The last question before the first signal (Alertmanager: does the alert still fire,
#: unsilenced and uninhibited?). None means go on; (reason, detail) aborts the reap.
Confirm = Callable[[], "tuple[AnyReason, str] | None"]

#: Tells the caller's crash ledger which members this reap may be holding stopped:
#: (pid, start_time) pairs with True right before their SIGSTOP (durably: raising means
#: they are not stopped), with False once the reap has continued them. Crash recovery
#: continues only members marked True (see gpuguard/engine/reap/recovery.py).
Holding = Callable[[tuple[tuple[int, int], ...], bool], None]

#: What a reap does when the kernel refuses a member's SIGSTOP (EPERM): "abort" the whole
#: reap before any SIGTERM (the remediator: a tree it may not signal whole is left as it
#: was), or "release" that member (`gpuguard run`: its own tree must go even when one
#: member, a setuid-root helper, is beyond an unprivileged launcher's reach).
RefusedStop = Literal["abort", "release"]


#: What a reap keeps although a person or a launcher forced it: (the member as read, the
#: reap's view) -> why it is kept (it and everything below it are let go of, never
#: signalled), or None. `gpuguard run`'s teardown keeps what its user marked to keep.
Spare = Callable[[ProcInfo, ProcSource], "str | None"]


class Abort(Exception):
    """Refuses the reap: (reason, detail) become the result's."""

    def __init__(self, reason: AnyReason, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class NoPidfd(Exception):
    """The kernel has no pidfd_open (before 5.3, or blocked by seccomp)."""


def check_wanted(cancelled: Callable[[], bool], deadline: float,
                 now: Callable[[], float]) -> None:
    """Abort unless the reap is still wanted and within its deadline."""
    if cancelled():
        raise Abort(DecisionReason.CANCELLED, "a resolved alert withdrew the reap before any kill")
    if now() > deadline:
        raise Abort(DecisionReason.WORKER_TIMEOUT,
                    "remediate.worker_timeout_seconds ran out before "
                    "any kill")


@dataclass
class Held:
    """What every platform's target is first: the member a reap holds, as judged."""

    member: Member


#: A platform's target (Linux's Target, Windows' WinTarget): a Held and more.
T = TypeVar("T", bound=Held)


@dataclass
class Target(Held):
    """A process the reap holds: as judged, as read, and its handle (None: the pid path)."""

    info: ProcInfo
    fd: int | None
    stopped: bool = False  # stopped by this reap: an abort continues it
    exited: bool = False


@dataclass(kw_only=True)
class Run(Generic[T]):
    """Mutable state of one reap, on any platform; only the reaper's parts touch it.

    What both platforms record the same way lives here once: the write-ahead audit
    record (`write`: no record, no signal) and the crash ledger's marks (`mark`: no
    mark, no stop). The refusals name a platform's own steps (STOPPED, SENT,
    CONTINUED: a SIGSTOP, or a suspend)."""

    #: The words a platform's refusals and logs use for its steps.
    STOPPED: ClassVar[str] = "stopped"
    SENT: ClassVar[str] = "signalled"
    CONTINUED: ClassVar[str] = "continued"
    #: The steps that kill (sent, an interrupted reap failed), and what the refusal says.
    KILL_STEPS: ClassVar[tuple[str, ...]] = ("SIGTERM", "SIGKILL")
    KILLED: ClassVar[str] = "SIGTERM had been sent"

    started: float
    path: KillPath
    policy: Remediate
    rules: Rules
    protected: frozenset[int]
    journal: Journal | None  # None for dry runs: they send nothing
    force: bool = False  # a person overrode the classifier: only the policy's guards apply
    targets: dict[int, T] = field(default_factory=dict)
    signals: list[SignalRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    confirmed_ms: float | None = None
    released: list[Member] = field(default_factory=list)
    kept: list[Kept] = field(default_factory=list)  # let go of, with what is below them
    holding: Holding | None = None  # the crash ledger's marks (the worker's reaps)
    events: ExitSource | None = None  # as the inspection had them: the verdict re-derived
    memory: LauncherMemory | None = None  # with the tree frozen rests on the same facts

    def write(self, phase: Phase, targets: list[T]) -> None:
        """The write-ahead audit record for `targets`; no record, no signal."""
        assert self.journal is not None
        try:
            self.journal(phase, tuple(t.member for t in targets))
        except Exception as exc:
            raise Abort(DecisionReason.AUDIT_FAILED, f"could not write the {phase} audit record: "
                        f"{exc}; nothing more is {self.SENT}") from None

    def mark(self, targets: list[T], *, held: bool) -> None:
        """Tell the crash ledger (`holding`) that this reap may now hold `targets` stopped
        (right before their stop: no mark, no stop) or holds them no longer."""
        if self.holding is None or not targets:
            return
        try:
            self.holding(tuple((t.member.pid, t.member.start_time) for t in targets), held)
        except Exception as exc:
            if held:
                raise Abort(DecisionReason.STATE_FAILED,
                            "could not record which members are about to "
                            f"be {self.STOPPED} ({exc}); they are not {self.STOPPED}") from None
            # Still marked: after a crash they would be continued, as a freeze is owed.
            log.warning("could not record that %d member(s) were %s: %s",
                        len(targets), self.CONTINUED, exc)


@dataclass(kw_only=True)
class ReapRun(Run[Target]):
    """Linux's run: its kill path can change (pidfds, or the pid path), over a view."""

    view: ProcSource  # fresh for this reap: nothing read before it is trusted
    spare: Spare | None = None  # what is kept, asked of every member before anything else

    def restart(self, path: KillPath, view: ProcSource) -> None:
        """Begin again on another kill path, with a new view: nothing held, nothing sent."""
        self.path, self.view = path, view
        self.targets, self.signals, self.notes, self.released = {}, [], [], []
        self.kept = []
        self.confirmed_ms = None
