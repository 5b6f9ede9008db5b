"""The imperative edge that touches processes: the reap itself.

A reap must never hit the wrong process, so identity is checked after a
handle is held: open a pidfd, then compare /proc/PID/stat's start time with
the one the decision was made on; a pidfd keeps naming that process even if
the pid is reused later. The tree is frozen (SIGSTOP, root first, re-collected
until no new member appears) before anything is killed, so a retry loop
cannot respawn its child between kills. Every process, planned or joining
while we act, is judged on facts read during this reap (a fresh ProcessView)
by the policy's refusals and the classifier's own protections, and is named in
a durable audit record (the journal) before its first signal.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from gpuguard.config import Remediate
from gpuguard.host.counters import COUNTERS, Counters
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.nvml import NvmlReading
from gpuguard.host.procfs import ExitSource, ProcessView
from gpuguard.orphans.classify import MEMBER_UNKNOWN, Rules, judge_member
from gpuguard.orphans.process import Holder, ProcInfo, ProcUnreadable, is_child_of, still_same
from gpuguard.remediator.audit import INTENT, JOINED
from gpuguard.remediator.inspection import (
    HolderSource,
    NvmlTimeout,
    inspect_tree,
    member_of,
    nvml_problem,
    read_within,
)
from gpuguard.remediator.policy import Member, TreeKey, member_refusal, verify_live

log = logging.getLogger("gpuguard.remediator.reaper")

PIDFD = "pidfd"
PID = "pid"


class Outcome(enum.StrEnum):
    """How a reap ended; the values are the audit's, the ledger's and `gpuguard reap`'s."""

    REAPED = "reaped"  # every member is gone or a zombie
    FAILED = "failed"  # some survived SIGKILL, or the reap raised mid-way
    DRY_RUN = "dry-run"  # held and judged, nothing signalled
    ABORTED = "aborted"  # refused before any kill; `reason` says why


#: How long SIGKILLed members get to become zombies before they count as survivors.
KILL_CONFIRM_SECONDS = 5.0
#: How long one freeze pass waits for SIGSTOPped members to show state T (a process in
#: uninterruptible sleep stops only when it leaves it; the pass then goes on regardless).
FREEZE_CONFIRM_SECONDS = 1.0
#: Bound on re-collection rounds once the term wait is over (the deadline no longer applies).
MAX_FREEZE_ROUNDS = 100
#: Poll granularity of the bounded waits.
POLL_SECONDS = 0.01


@dataclass(frozen=True)
class ReapPlan:
    key: TreeKey
    members: tuple[Member, ...]  # root first, as inspected
    holders: tuple[Holder, ...]
    gpu_bytes: int
    dry_run: bool
    gpus: tuple[str, ...] = ()  # every GPU NVML reported when the tree was inspected
    #: The decision rested on the classifier calling this root an orphan (an alert, a
    #: person): with the tree frozen that verdict is derived again, and the reap goes on
    #: only if it still holds. False only for `gpuguard run`'s own tree (no verdict).
    classified: bool = True
    #: Orphan reasons the verdict derived again may carry (the alert path: the policy's
    #: remediate.reasons); None: any orphan reason (a person's `gpuguard reap`).
    reasons: tuple[str, ...] | None = None


@dataclass(frozen=True)
class SignalRecord:
    pid: int
    signal: str
    result: str  # sent | gone | error: ...
    at_ms: float  # since the reap began

    def to_json(self) -> dict[str, object]:
        return {"pid": self.pid, "signal": self.signal, "result": self.result,
                "at_ms": round(self.at_ms, 3)}


@dataclass(frozen=True)
class ReapResult:
    outcome: Outcome
    reason: str = ""  # why an abort happened (a policy-style reason code)
    detail: str = ""
    kill_path: str | None = None  # pidfd | pid; None when refused before choosing
    members: tuple[Member, ...] = ()  # every process the reap held, joiners included
    signals: tuple[SignalRecord, ...] = ()
    survivors: tuple[int, ...] = ()
    gpu_bytes_before: int = 0
    gpu_bytes_after: int | None = None
    reclaimed_bytes: int | None = None
    duration_seconds: float = 0.0
    confirmed_ms: float | None = None  # when `confirm` answered, ms since the reap began
    #: Members let go of because the kernel refused their SIGSTOP (only with
    #: refused_stop="release"; never signalled again, never in `members`).
    released: tuple[Member, ...] = ()

    @property
    def signalled(self) -> bool:
        return any(s.result == "sent" for s in self.signals)

    @property
    def killed(self) -> int:
        """Members that are gone at the end (0 for dry runs and aborts)."""
        if self.outcome not in (Outcome.REAPED, Outcome.FAILED):
            return 0
        return len(self.members) - len(self.survivors)


#: Why a child found in a children file is simply not part of the tree (not a refusal).
_NOT_OURS = ("exited", "replaced", "reparented", "parent-replaced")


class _Abort(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _NoPidfd(Exception):
    """The kernel has no pidfd_open (before 5.3, or blocked by seccomp)."""


#: The reason of a reap that an Interrupted (a signal to `gpuguard reap --apply`) ended.
INTERRUPTED = "interrupted"
#: The reason of a reap whose NVML re-check with the tree frozen outlived the deadline.
NVML_TIMEOUT = "nvml-timeout"


class Interrupted(BaseException):
    """Raised into a running reap to stop it now (by `gpuguard reap --apply`'s handlers for
    SIGINT, SIGTERM and SIGHUP). A BaseException, like KeyboardInterrupt, so that nothing
    on the way mistakes it for a failure to handle; the reap continues (SIGCONT) what it
    stopped and returns outcome aborted (or failed, once SIGTERM was sent), reason
    `interrupted`, instead of raising."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


#: Writes one audit record naming processes before they get their first signal:
#: phase INTENT (every planned member, before the first SIGSTOP) or JOINED
#: (processes that joined the tree while it was being reaped). Raises when the
#: record could not be made durable; then those processes are not signalled.
Journal = Callable[[str, tuple[Member, ...]], None]

#: The last question before the first signal (Alertmanager: does the alert still fire,
#: unsilenced and uninhibited?). None means go on; (reason, detail) aborts the reap.
Confirm = Callable[[], "tuple[str, str] | None"]

#: Tells the caller's crash ledger which members this reap may be holding stopped:
#: (pid, start_time) pairs with True right before their SIGSTOP (durably: raising means
#: they are not stopped), with False once the reap has continued them. Crash recovery
#: continues only members marked True (see Reaper.thaw_interrupted).
Holding = Callable[[tuple[tuple[int, int], ...], bool], None]


@dataclass
class _Target:
    member: Member
    info: ProcInfo
    fd: int | None
    stopped: bool = False  # stopped by this reap: an abort continues it
    exited: bool = False


@dataclass
class _Run:
    """Mutable state of one reap; only the Reaper touches it."""

    started: float
    path: str
    view: ProcessView  # fresh for this reap: nothing read before it is trusted
    policy: Remediate
    rules: Rules
    protected: frozenset[int]
    journal: Journal | None  # None for dry runs: they send nothing
    force: bool = False  # a person overrode the classifier: only the policy's guards apply
    targets: dict[int, _Target] = field(default_factory=dict)
    signals: list[SignalRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    confirmed_ms: float | None = None
    released: list[Member] = field(default_factory=list)
    holding: Holding | None = None  # the crash ledger's marks (the worker's reaps)
    events: ExitSource | None = None  # as the inspection had them: the verdict re-derived
    memory: LauncherMemory | None = None  # with the tree frozen rests on the same facts


PidfdOpen = Callable[[int], int]
PidfdSend = Callable[[int, int], None]

#: The kernel's pidfd calls where this Python has them (3.9+ on Linux).
PIDFD_OPEN: PidfdOpen | None = getattr(os, "pidfd_open", None)
PIDFD_SEND: PidfdSend | None = getattr(signal, "pidfd_send_signal", None)

#: What a reap does when the kernel refuses a member's SIGSTOP (EPERM): "abort" the whole
#: reap before any SIGTERM (the remediator: a tree it may not signal whole is left as it
#: was), or "release" that member (`gpuguard run`: its own tree must go even when one
#: member, a setuid-root helper, is beyond an unprivileged launcher's reach).
RefusedStop = Literal["abort", "release"]


class Reaper:
    """Verify, freeze, signal, confirm. The only code in gpuguard that sends signals.

    One reap at a time per instance (the remediator has one worker thread).
    """

    def __init__(
        self,
        *,
        nvml: HolderSource,
        counters: Counters = COUNTERS,
        pidfd_open: PidfdOpen | None = PIDFD_OPEN,
        pidfd_send: PidfdSend | None = PIDFD_SEND,
        kill: Callable[[int, int], None] = os.kill,
        monotonic: Callable[[], float] = time.monotonic,
        refused_stop: RefusedStop = "abort",
    ) -> None:
        self.nvml = nvml
        self._on_refused_stop = refused_stop
        self.counters = counters
        self._pidfd_open = pidfd_open if pidfd_send is not None else None
        self._pidfd_send = pidfd_send
        self._kill = kill
        self._monotonic = monotonic

    def reap(
        self,
        plan: ReapPlan,
        *,
        policy: Remediate,
        rules: Rules,
        protected_pids: frozenset[int],
        deadline: float,
        journal: Journal | None,
        cancelled: Callable[[], bool] = lambda: False,
        confirm: Confirm | None = None,
        force: bool = False,
        holding: Holding | None = None,
        events: ExitSource | None = None,
        memory: LauncherMemory | None = None,
    ) -> ReapResult:
        """Run one reap (or dry run) of `plan`; never raises for process-level trouble.

        `journal` must be given unless `plan.dry_run`: no process is signalled before
        a record naming it has been written through it. `force` (a person's `gpuguard
        reap --force`, never an alert) skips the classifier's protections of members;
        the policy's refusals (pid 1, kernel threads, root-owned, users) still apply.
        `confirm` is asked after the intent record right before the first SIGSTOP, and
        again with the tree frozen right before the first SIGTERM (in a dry run, once,
        before it reports): the smallest windows a remote answer allows. `holding` (the
        worker's ledger) is told which members the reap may hold stopped; `events` and
        `memory` are the inspection's, for the verdict derived again with the tree frozen.

        Every way out continues (SIGCONT) what the reap stopped and has not killed: an
        abort, an exception, a deadline (NVML, asked with the tree frozen, is waited for
        no longer than `deadline`), and an Interrupted raised into it (then it returns,
        reason `interrupted`); any other BaseException is raised again after the thaw.
        """
        if journal is None and not plan.dry_run:
            raise ValueError("a reap that may signal needs a journal")

        def new_run(path: str) -> _Run:
            return _Run(started=started, path=path, view=ProcessView(counters=self.counters),
                        policy=policy, rules=rules, protected=protected_pids,
                        journal=None if plan.dry_run else journal, force=force,
                        holding=None if plan.dry_run else holding, events=events,
                        memory=memory)

        started = self._monotonic()
        run = new_run(PIDFD if self._pidfd_open else PID)
        if run.path == PID and not policy.allow_without_pidfd:
            return self._result(run, plan, Outcome.ABORTED, "no-pidfd",
                                "pidfd_open is unavailable and remediate.allow_without_pidfd "
                                "is false")
        # Every path out of here thaws before the handles close (the outer handlers and
        # the finally): a thaw through pidfds cannot reach a reused pid.
        try:
            try:
                try:
                    self._hold_planned(run, plan)
                except _NoPidfd:
                    self._close(run)
                    if not policy.allow_without_pidfd:
                        return self._result(run, plan, Outcome.ABORTED, "no-pidfd",
                                            "pidfd_open failed with ENOSYS and "
                                            "remediate.allow_without_pidfd is false")
                    run = new_run(PID)
                    self._pidfd_open = None
                    self._hold_planned(run, plan)
                if plan.dry_run:
                    self._collect(run, stop=False)
                    self._confirm(run, confirm)
                    return self._result(run, plan, Outcome.DRY_RUN, "",
                                        "dry run: no signal sent")
                self._check(cancelled, deadline)
                self._write(run, INTENT, list(run.targets.values()))
                self._confirm(run, confirm)
                self._check(cancelled, deadline)  # resolved while Alertmanager was asked
                self._freeze(run, deadline, cancelled)
                # Judged again now that nothing can exec or change a disposition any more.
                self._rejudge(run, list(run.targets.values()), refuse=True)
                self._check_holders(run, plan, deadline)
                # Freezing and judging take a while: the last question right before SIGTERM.
                self._confirm(run, confirm)
                self._check(cancelled, deadline)
            except _Abort as abort:
                self._thaw(run)
                return self._result(run, plan, Outcome.ABORTED, abort.reason, abort.detail)
            except Exception as exc:  # a bug or a surprise from /proc: never leave it frozen
                log.exception("reap of %s failed before any kill; continuing what it stopped",
                              plan.key)
                self._thaw(run)
                return self._result(run, plan, Outcome.ABORTED, "internal-error",
                                    f"{type(exc).__name__}: {exc}")
            try:
                return self._kill_frozen(run, plan)
            except _Abort as abort:  # refused before SIGKILL: nobody is SIGKILLed
                self._thaw(run)
                alive = tuple(t.member.pid for t in run.targets.values()
                              if not self._gone(run, t))
                return self._result(run, plan, Outcome.FAILED, abort.reason,
                                    f"{abort.detail}; after SIGTERM, before SIGKILL: no "
                                    "SIGKILL was sent and what the reap had stopped was "
                                    "continued", survivors=alive)
            except Exception as exc:
                log.exception("reap of %s failed while killing; continuing what it stopped",
                              plan.key)
                self._thaw(run)
                return self._result(run, plan, Outcome.FAILED, "internal-error",
                                    f"{type(exc).__name__}: {exc}")
        except Interrupted as stop:
            self._thaw(run)
            killing = any(s.signal in ("SIGTERM", "SIGKILL") and s.result == "sent"
                          for s in run.signals)
            log.warning("reap of %s interrupted (%s); continued what it had stopped",
                        plan.key, stop.why)
            return self._result(run, plan, Outcome.FAILED if killing else Outcome.ABORTED,
                                INTERRUPTED,
                                f"{stop.why}: the reap stopped there; "
                                + ("SIGTERM had been sent" if killing
                                   else "nothing was terminated")
                                + ", and every member the reap had stopped was continued")
        except BaseException:  # KeyboardInterrupt, SystemExit, a crash stand-in: thaw, re-raise
            self._thaw(run)
            raise
        finally:
            self._close(run)

    def thaw_interrupted(self, members: Iterable[tuple[int, int]]) -> tuple[SignalRecord, ...]:
        """SIGCONT every (pid, start_time) that is still that process and stopped.

        After a crash mid-reap the tree may be left frozen; it is continued and left
        alive: killing it again needs a new decision. The caller audits first, and
        passes only members the interrupted reap may have stopped itself: marked held
        (`Holding`: written right before their SIGSTOP, cleared once the reap continued
        them) and not stopped already when the reap found them.

        Why that is the most that can be known: /proc says that a process is stopped
        (state T), never who stopped it or when, so a stop of a member the crashed reap
        was holding stopped cannot be told from one its owner sent after the crash (or
        sent on top of ours, which changed nothing). Continuing such a member is the
        honest answer (principle 2: the freeze was ours; leaving it would keep a stop of
        ours in place for good). What the marks rule out is the rest: a member the reap
        never stopped (the crash came first) or had already continued (the SIGTERM
        phase, a thaw) is never continued here, whoever stopped it since. Left open: the
        members of the one SIGSTOP pass under way at the crash (marked, maybe never
        signalled), and the CPU time a process used since (/proc/PID/stat) was judged
        too coarse a clock (whole ticks) to prove a stop is not ours.
        """
        run = _Run(started=self._monotonic(), path=PIDFD if self._pidfd_open else PID,
                   view=ProcessView(counters=self.counters), policy=Remediate(), rules=Rules(),
                   protected=frozenset(), journal=None)
        try:
            for pid, start_time in members:
                try:
                    target, _ = self._open(run, pid, start_time)
                except _NoPidfd:
                    self._pidfd_open = None
                    run.path = PID
                    target, _ = self._open(run, pid, start_time)
                if target is None:
                    continue
                run.targets[pid] = target
                if self._maybe_stopped(run, target):
                    self._send(run, target, signal.SIGCONT)
        finally:
            self._close(run)
        return tuple(run.signals)

    # -- phases ----------------------------------------------------------------------

    def _hold_planned(self, run: _Run, plan: ReapPlan) -> None:
        """Open a handle on every planned member, verify it is still that process and still
        below the root, judge it. Root first, then breadth first: parents come first."""
        for member in plan.members:
            target, why = self._open(run, member.pid, member.start_time)
            if target is None:
                if member.pid == plan.key.root_pid:
                    reason = "root-replaced" if why in ("replaced", "unreadable") else "root-gone"
                    raise _Abort(reason, f"root {member.pid} {why} before the reap")
                if why in ("exited", "replaced"):
                    continue  # exited since the inspection: nothing to do for it
                raise _Abort(MEMBER_UNKNOWN, f"member {member.pid} ({member.comm}) {why}: "
                             "a process that cannot be held cannot be judged")
            parent = run.targets.get(target.info.ppid)
            if member.pid != plan.key.root_pid and (
                    parent is None
                    or not is_child_of(target.info, parent.info, run.view.thread_states)):
                self._release(target)  # its parent exited and it was adopted elsewhere
                continue
            self._admit(run, target)

    def _freeze(self, run: _Run, deadline: float, cancelled: Callable[[], bool]) -> None:
        """SIGSTOP root first, then breadth first; re-collect until no new member appears.

        A fork already under way when SIGSTOP arrives still links its child, so each
        pass first waits (bounded) until every member shows state T: a stopped
        process is back from fork(), and its children file is then complete.
        """
        self._mark(run, list(run.targets.values()), held=True)
        for target in list(run.targets.values()):
            self._stop(run, target)
        self._refused_stop(run)
        while True:
            self._wait_stopped(run, min(deadline, self._monotonic() + FREEZE_CONFIRM_SECONDS))
            if not self._collect(run, stop=True):
                break
            self._refused_stop(run)
            if self._monotonic() > deadline:
                raise _Abort("worker-timeout", "the tree kept growing while being frozen")
        self._check(cancelled, deadline)

    def _refused_stop(self, run: _Run) -> None:
        """A SIGSTOP the kernel refused (EPERM: another user's process, and no CAP_KILL)
        ends the reap before any SIGTERM, so the tree is left as it was found rather than
        signalled in part and reported as survivors of a SIGKILL that was never sent.
        With refused_stop="release" that member is let go of instead (never signalled
        again, reported in `released`) and the reap of the others goes on."""
        for record in run.signals:
            if record.signal == "SIGSTOP" and record.result.startswith("error"):
                if self._on_refused_stop == "release":
                    target = run.targets.pop(record.pid, None)
                    if target is not None:
                        self._release(target)
                        run.released.append(target.member)
                        why = record.result.removeprefix("error: ")
                        run.notes.append(f"left {record.pid} ({target.member.comm}) alone: "
                                         f"SIGSTOP refused ({why})")
                    continue
                raise _Abort("signal-failed", f"SIGSTOP to {record.pid} failed "
                             f"({record.result.removeprefix('error: ')}): the remediator may "
                             "not signal this tree (another user's processes need root or "
                             "CAP_KILL); nothing was terminated")

    def _rejudge(self, run: _Run, targets: list[_Target], *, refuse: bool) -> list[_Target]:
        """Every rule again, on facts read now from a new view, for stopped targets.

        A member judged while running could exec into a protected program or start
        ignoring SIGHUP before its SIGSTOP landed; once stopped it can do neither.
        Refused: abort (`refuse`), or continue it, let go of it and note why.
        """
        self._wait_stopped(run, self._monotonic() + FREEZE_CONFIRM_SECONDS, targets)
        view = ProcessView(counters=self.counters)
        kept: list[_Target] = []
        for target in targets:
            if target.exited:
                continue
            info = view.fresh_stat(target.member.pid)
            if (info is None or info.start_time != target.member.start_time
                    or not info.is_live(view.thread_states)):
                target.exited = True
                continue
            member = member_of(info, view)
            refused = self._refusal(run, member, info, view)
            if refused is None:
                target.member, target.info = member, info
                kept.append(target)
            elif refuse:
                raise _Abort(*refused)
            else:
                if target.stopped:
                    self._continue(run, [target])
                del run.targets[target.member.pid]
                self._release(target)
                run.notes.append(f"left {target.member.pid} alone: {refused[1]}")
        return kept

    @staticmethod
    def _release(target: _Target) -> None:
        if target.fd is not None:
            os.close(target.fd)
            target.fd = None

    def _check_holders(self, run: _Run, plan: ReapPlan, deadline: float) -> None:
        """With the tree frozen, NVML once more, waited for no longer than the deadline (a
        driver that hangs must not keep the tree stopped): complete, no GPU holder nobody
        judged, and (plan.classified) the root still the orphan the decision was made on."""
        left = deadline - self._monotonic()
        if left <= 0:
            raise _Abort("worker-timeout", "remediate.worker_timeout_seconds ran out before "
                         "any kill")
        try:
            reading = read_within(self.nvml, left)
        except NvmlTimeout as exc:  # fail closed: the abort continues the tree now
            raise _Abort(NVML_TIMEOUT, f"NVML re-check with the tree frozen: {exc}, the "
                         "rest of remediate.worker_timeout_seconds; nothing was "
                         "terminated") from None
        except Exception as exc:  # fail closed: an unreadable NVML confirms nothing
            raise _Abort("nvml-unavailable", f"NVML re-check failed: {exc}") from None
        gpus = {*plan.gpus, *(h.gpu_uuid for h in plan.holders)}
        problem = nvml_problem(reading, gpus)
        if problem is not None:
            raise _Abort(problem[0], f"NVML re-check with the tree frozen: {problem[1]}")
        judged = {h.pid for h in plan.holders}
        for holder in reading.holders if not run.force else ():
            target = run.targets.get(holder.pid)
            if target is not None and holder.pid not in judged:
                raise _Abort(MEMBER_UNKNOWN, f"member {holder.pid} ({target.member.comm}) "
                             "holds GPU memory but was not a GPU holder when the tree was "
                             "classified")
        if plan.classified:
            self._rederive(run, plan, reading, gpus)

    def _rederive(self, run: _Run, plan: ReapPlan, reading: NvmlReading,
                  gpus: set[str]) -> None:
        """The verdict the decision rested on, derived again now that no member can call
        setsid(), exec or fork any more: the inspection's own path (inspect_tree: a fresh
        view, classify()) over the frozen tree and the reading just taken, and the
        decision's own verification (policy.verify_live). Anything but the same root,
        still an orphan (unless a person forced it) with an allowed reason, aborts."""
        live = inspect_tree(plan.key, nvml=self.nvml, rules=run.rules, counters=self.counters,
                            expected_gpus=gpus, events=run.events, memory=run.memory,
                            reading=reading)
        refused = verify_live(plan.key, live, named_by="the decision",
                              require_orphan=not run.force)
        if refused is not None:
            raise _Abort(refused.reason, f"classified again with the tree frozen: "
                         f"{refused.detail}")
        if not run.force and plan.reasons is not None and live.reason not in plan.reasons:
            raise _Abort("reason-not-allowed", "classified again with the tree frozen: "
                         f"orphan reason {live.reason} is not in remediate.reasons")

    def _kill_frozen(self, run: _Run, plan: ReapPlan) -> ReapResult:
        """TERM + CONT everyone, wait, then freeze and KILL whoever is left."""
        for target in run.targets.values():
            self._send(run, target, signal.SIGTERM)
        self._continue(run, list(run.targets.values()))
        survivors = self._wait_gone(run, run.policy.term_timeout_seconds)
        if survivors:
            self._mark(run, survivors, held=True)
            for target in survivors:
                self._stop(run, target)
            joined: list[_Target] = []
            for _ in range(MAX_FREEZE_ROUNDS):  # each round stops what it finds: it converges
                found = self._collect(run, stop=True, refuse=False)
                if not found:
                    break
                joined += found
            if self._on_refused_stop == "release":
                self._refused_stop(run)
                joined = [t for t in joined if run.targets.get(t.member.pid) is t]
            self._rejudge(run, joined, refuse=False)
            # Every member again, not only those that joined: one that began ignoring
            # SIGHUP (or exec'd into a protected program) after its SIGTERM is no longer
            # ours to kill, and then nobody is SIGKILLed (the caller thaws the rest).
            new = {id(t) for t in joined}
            self._rejudge(run, [t for t in run.targets.values() if id(t) not in new],
                          refuse=True)
            for target in list(run.targets.values()):
                if not self._gone(run, target):
                    self._send(run, target, signal.SIGKILL)
            survivors = self._wait_gone(run, KILL_CONFIRM_SECONDS, adopt=False)
        outcome = Outcome.FAILED if survivors else Outcome.REAPED
        detail = (f"{len(survivors)} process(es) survived SIGKILL" if survivors
                  else "every member is gone or a zombie")
        detail = "; ".join([detail, *run.notes])
        return self._result(run, plan, outcome, "" if not survivors else "survivors", detail,
                            survivors=tuple(t.member.pid for t in survivors), reclaim=True)

    # -- handles ---------------------------------------------------------------------

    def _open(self, run: _Run, pid: int, start_time: int | None,
              parent: ProcInfo | None = None) -> tuple[_Target | None, str]:
        """Hold `pid`, then check it is the process we mean: (target, "") or (None, why).

        With `parent`, the process must (read after the handle is open) be a live
        child of it, and `parent` itself must still be the process the walk saw: a
        pid reused in between names someone else, and so do its children.
        """
        fd = None
        if run.path == PIDFD:
            assert self._pidfd_open is not None
            try:
                fd = self._pidfd_open(pid)
            except OSError as exc:
                if exc.errno in (errno.ESRCH, errno.EINVAL):
                    return None, "exited"
                if exc.errno == errno.ENOSYS:
                    raise _NoPidfd() from exc
                return None, f"could not be opened ({exc.strerror})"
        try:
            info = run.view.fresh_stat(pid)
            # A zombie main thread with a live thread (pthread_exit()) is a live process.
            live = info is not None and info.is_live(run.view.thread_states)
        except ProcUnreadable as exc:
            if fd is not None:
                os.close(fd)
            return None, f"unreadable ({exc})"
        why = ""
        if info is None or not live:
            why = "exited"
        elif start_time is not None and info.start_time != start_time:
            why = "replaced"
        elif parent is not None and not is_child_of(info, parent, run.view.thread_states):
            why = "reparented"
        elif parent is not None and not still_same(self._fresh(run, parent.pid), parent):
            why = "parent-replaced"
        if why:
            if fd is not None:
                os.close(fd)
            return None, why
        assert info is not None
        return _Target(member_of(info, run.view), info, fd), ""

    @staticmethod
    def _refusal(run: _Run, member: Member, info: ProcInfo,
                 view: ProcessView) -> tuple[str, str] | None:
        """Every rule one process must pass to be signalled, as (reason, detail), or None:
        the policy's refusals, then (unless a person forced it) the classifier's
        protections, judged from `view`."""
        refused = member_refusal(member, run.policy, run.protected)
        if refused is None and not run.force:
            judged = judge_member(info, view, run.rules)
            if judged is not None:
                refused = (judged.reason, judged.evidence.detail)
        return refused

    def _admit(self, run: _Run, target: _Target, *, refuse: bool = True) -> bool:
        """Add a held process to the reap unless a rule refuses it (then abort or skip).

        The policy's refusals (pid 1, root-owned, users) and the classifier's own
        protections (protect pattern, SIGHUP ignored, keep marker, unreadable facts)
        apply to every process a reap would signal, read now.
        """
        refused = self._refusal(run, target.member, target.info, run.view)
        if refused is not None:
            if target.fd is not None:
                os.close(target.fd)
            if refuse:
                raise _Abort(refused[0], refused[1])
            run.notes.append(f"left {target.member.pid} alone: {refused[1]}")
            return False
        run.targets[target.member.pid] = target
        return True

    def _collect(self, run: _Run, *, stop: bool, refuse: bool = True) -> list[_Target]:
        """Children of live members not held yet: hold, admit, record and (when freezing)
        stop them, one generation at a time."""
        joined: list[_Target] = []
        frontier = [t for t in run.targets.values() if not t.exited]
        while frontier:
            generation: list[_Target] = []
            for parent in frontier:
                for child in run.view.children(parent.member.pid) or ():
                    if child in run.targets or any(m.pid == child for m in run.released):
                        continue
                    target, why = self._open(run, child, None, parent=parent.info)
                    if target is None and why not in _NOT_OURS:
                        detail = (f"child {child} of member {parent.member.pid} {why}: a "
                                  "process that cannot be held cannot be judged")
                        if refuse:
                            raise _Abort(MEMBER_UNKNOWN, detail)
                        run.notes.append(detail)
                    if target is None or not self._admit(run, target, refuse=refuse):
                        continue
                    generation.append(target)
            if generation and run.journal is not None:
                try:
                    self._write(run, JOINED, generation)
                    if stop:
                        self._mark(run, generation, held=True)
                except _Abort:
                    if refuse:
                        raise
                    for target in generation:  # not recorded: not signalled
                        del run.targets[target.member.pid]
                        if target.fd is not None:
                            os.close(target.fd)
                            target.fd = None
                    run.notes.append(f"left {len(generation)} late joiner(s) unsignalled: "
                                     "the record naming them could not be written")
                    return joined
            if stop:
                for target in generation:
                    self._stop(run, target)
            joined.extend(generation)
            frontier = generation
        return joined

    def _confirm(self, run: _Run, confirm: Confirm | None) -> None:
        if confirm is None:
            return
        refused = confirm()
        run.confirmed_ms = (self._monotonic() - run.started) * 1000
        if refused is not None:
            raise _Abort(*refused)

    def _write(self, run: _Run, phase: str, targets: list[_Target]) -> None:
        """The write-ahead audit record for `targets`; no record, no signal."""
        assert run.journal is not None
        try:
            run.journal(phase, tuple(t.member for t in targets))
        except Exception as exc:
            raise _Abort("audit-failed", f"could not write the {phase} audit record: "
                         f"{exc}; nothing more is signalled") from None

    def _send(self, run: _Run, target: _Target, sig: int) -> str:
        pid = target.member.pid
        try:
            if target.fd is not None:
                assert self._pidfd_send is not None
                self._pidfd_send(target.fd, sig)
            else:
                # The weaker path: re-verify right before signalling (a small reuse window stays).
                info = run.view.fresh_stat(pid)
                if info is None or info.start_time != target.member.start_time:
                    result = "gone"
                    target.exited = True
                    run.signals.append(self._record(run, pid, sig, result))
                    return result
                self._kill(pid, sig)
            result = "sent"
        except ProcessLookupError:
            result = "gone"
            target.exited = True
        except OSError as exc:
            result = f"error: {exc.strerror}"
        run.signals.append(self._record(run, pid, sig, result))
        return result

    def _record(self, run: _Run, pid: int, sig: int, result: str) -> SignalRecord:
        return SignalRecord(pid, signal.Signals(sig).name, result,
                            (self._monotonic() - run.started) * 1000)

    def _stop(self, run: _Run, target: _Target) -> None:
        """SIGSTOP; a process that was stopped already (Ctrl-Z, a scheduler) stays ours
        to kill but not ours to continue if the reap is abandoned."""
        before = self._fresh(run, target.member.pid)
        previous = target.stopped
        # Flagged before the signal: an exception (a signal's Interrupted) landing right
        # after the kernel took the SIGSTOP still finds the member to continue.
        target.stopped = before is None or before.state not in ("T", "t")
        if self._send(run, target, signal.SIGSTOP) != "sent":
            target.stopped = previous

    def _fresh(self, run: _Run, pid: int) -> ProcInfo | None:
        """stat now; unreadable counts as unknown, which every caller treats as not-same."""
        try:
            return run.view.fresh_stat(pid)
        except ProcUnreadable:
            return None

    def _thaw(self, run: _Run) -> None:
        """Undo a partial freeze: an aborted reap must leave the tree as it found it (what
        was stopped before it came stays stopped). Every stopped member gets its SIGCONT
        even when one of them raises (that is raised at the end); a thaw that runs again
        sends only what is still owed."""
        failure: BaseException | None = None
        continued: list[_Target] = []
        for target in list(run.targets.values()):
            if target.stopped and not target.exited:
                try:
                    if self._send(run, target, signal.SIGCONT) in ("sent", "gone"):
                        target.stopped = False
                        continued.append(target)
                except BaseException as exc:  # the next member is still continued
                    failure = failure or exc
        self._mark(run, continued, held=False)
        if failure is not None:
            raise failure

    def _continue(self, run: _Run, targets: list[_Target]) -> None:
        """SIGCONT each of `targets`; the ones it reached are no longer the reap's to
        continue, nor held stopped as far as crash recovery is concerned."""
        continued = []
        for target in targets:
            if self._send(run, target, signal.SIGCONT) in ("sent", "gone"):
                target.stopped = False
                continued.append(target)
        self._mark(run, continued, held=False)

    def _mark(self, run: _Run, targets: list[_Target], *, held: bool) -> None:
        """Tell the crash ledger (`holding`) that this reap may now hold `targets` stopped
        (right before their SIGSTOP: no mark, no stop) or holds them no longer."""
        if run.holding is None or not targets:
            return
        try:
            run.holding(tuple((t.member.pid, t.member.start_time) for t in targets), held)
        except Exception as exc:
            if held:
                raise _Abort("state-failed", "could not record which members are about to "
                             f"be stopped ({exc}); they are not stopped") from None
            # Still marked: after a crash they would be continued, as a freeze is owed.
            log.warning("could not record that %d member(s) were continued: %s",
                        len(targets), exc)

    def _alive_info(self, run: _Run, target: _Target) -> ProcInfo | None:
        """The member as /proc shows it now; None (and marked exited) once every thread of
        it has exited (gone, or a zombie with no live thread), or the pid names someone
        else. A zombie main thread with a live thread (pthread_exit()) is alive, and so
        is a member whose stat or threads cannot be read (its last known facts are
        returned): it is never confirmed gone on a guess."""
        if target.exited:
            return None
        try:
            info = run.view.fresh_stat(target.member.pid)
            live = (info is not None and info.start_time == target.member.start_time
                    and info.is_live(run.view.thread_states))
        except ProcUnreadable:
            return target.info
        if not live:
            target.exited = True
            return None
        return info

    def _gone(self, run: _Run, target: _Target) -> bool:
        return self._alive_info(run, target) is None

    # -- bounded waits ---------------------------------------------------------------

    def _maybe_stopped(self, run: _Run, target: _Target) -> bool:
        """Whether a thread of the process may be stopped: its main thread shows T, or it
        is a zombie main thread (pthread_exit()) with a thread in T, or one whose threads
        cannot be read (a SIGCONT too many changes nothing; one too few leaves it stopped)."""
        if target.info.state in ("T", "t"):
            return True
        if not target.info.is_zombie:
            return False
        try:
            states = run.view.thread_states(target.member.pid)
        except ProcUnreadable:
            return True
        return states is not None and any(state in ("T", "t") for state in states)

    def _stopped_or_gone(self, run: _Run, target: _Target) -> bool:
        info = self._alive_info(run, target)
        if info is None:
            return True
        if info.state not in ("T", "t") and not info.is_zombie:
            return False
        # Every thread, not just the main one: a thread mid-fork links its child first.
        # (A zombie main thread is alive through its other threads: they must show T.)
        try:
            states = run.view.thread_states(target.member.pid)
        except ProcUnreadable:
            return False  # not known to be stopped; the wait is bounded
        if states is None:
            target.exited = True
            return True
        return all(state in ("T", "t", "Z", "X") for state in states)

    def _wait_stopped(self, run: _Run, until: float,
                      targets: list[_Target] | None = None) -> None:
        """Poll (bounded) until every member (or every one of `targets`) is stopped or gone."""
        while not all(self._stopped_or_gone(run, t)
                      for t in (targets if targets is not None else list(run.targets.values()))):
            if self._monotonic() >= until:
                return
            time.sleep(POLL_SECONDS / 5)

    def _wait_gone(self, run: _Run, timeout: float, *, adopt: bool = True) -> list[_Target]:
        """Wait (pidfd poll, or short /proc polls) until every member is gone or time is up.

        Children born after the SIGTERM (a cleanup handler that forks) join the
        reap and get a SIGTERM of their own, so the final SIGKILL reaches them.
        """
        until = self._monotonic() + timeout
        while True:
            if adopt:
                joined = self._collect(run, stop=True, refuse=False)
                if joined and self._on_refused_stop == "release":
                    self._refused_stop(run)
                    joined = [t for t in joined if run.targets.get(t.member.pid) is t]
                kept = self._rejudge(run, joined, refuse=False) if joined else []
                for target in kept:
                    self._send(run, target, signal.SIGTERM)
                self._continue(run, kept)
            alive = [t for t in run.targets.values() if not self._gone(run, t)]
            remaining = until - self._monotonic()
            if not alive or remaining <= 0:
                return alive
            self._sleep_until_exit(alive, min(remaining, POLL_SECONDS * 5))

    @staticmethod
    def _sleep_until_exit(alive: Iterable[_Target], seconds: float) -> None:
        fds = [t.fd for t in alive if t.fd is not None]
        if fds:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            poller.poll(seconds * 1000)  # a pidfd turns readable when its process exits
        else:
            time.sleep(min(seconds, POLL_SECONDS))

    # -- bookkeeping -----------------------------------------------------------------

    def _check(self, cancelled: Callable[[], bool], deadline: float) -> None:
        if cancelled():
            raise _Abort("cancelled", "a resolved alert withdrew the reap before any kill")
        if self._monotonic() > deadline:
            raise _Abort("worker-timeout", "remediate.worker_timeout_seconds ran out before "
                         "any kill")

    @staticmethod
    def _close(run: _Run) -> None:
        for target in run.targets.values():
            if target.fd is not None:
                try:
                    os.close(target.fd)
                except OSError:
                    pass
                target.fd = None

    def _result(self, run: _Run, plan: ReapPlan, outcome: Outcome, reason: str, detail: str, *,
                survivors: tuple[int, ...] = (), reclaim: bool = False) -> ReapResult:
        after: int | None = None
        reclaimed: int | None = None
        if reclaim:
            try:
                reading = self.nvml.read()
            except Exception as exc:  # the kill happened; a failed re-query must not hide it
                reading = NvmlReading(False, None, (), (), (("nvml", str(exc)),))
            if reading.up:
                pids = {h.pid for h in plan.holders}
                after = sum(h.used_bytes or 0 for h in reading.holders if h.pid in pids)
                reclaimed = max(0, plan.gpu_bytes - after)
        members = tuple(t.member for t in run.targets.values())
        if not members and not run.released:  # refused before any target was opened
            members = plan.members
        return ReapResult(
            outcome=outcome,
            reason=reason,
            detail=detail,
            kill_path=run.path if reason != "no-pidfd" else None,
            members=members,
            signals=tuple(run.signals),
            survivors=survivors,
            gpu_bytes_before=plan.gpu_bytes,
            gpu_bytes_after=after,
            reclaimed_bytes=reclaimed,
            duration_seconds=self._monotonic() - run.started,
            confirmed_ms=run.confirmed_ms,
            released=tuple(run.released),
        )
