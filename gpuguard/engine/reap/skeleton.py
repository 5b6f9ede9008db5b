"""The one reap skeleton: the order of a reap's phases and the thaw on every way out,
written once for every platform. Linux's Reaper (reaper.py) and Windows' WindowsReaper
(gpuguard/engine/windows/reaper.py) derive from ReaperCore and supply only their steps
(hold, collect, freeze, re-judge, the recheck's inspection, terminate, thaw, close) and
their words (ReapTexts): what is done in which order, and what every exit continues,
cannot differ between them. The write-ahead audit record and the crash ledger's marks
are the run's (reap_run.Run). TreeReaper is what the worker, crash recovery and
`gpuguard reap` hold (gpuguard/engine/platforms.py builds the platform's)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

from gpuguard.base.counters import Counters
from gpuguard.config.remediate import Remediate
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.reap.audit import Phase
from gpuguard.engine.reap.outcome import Outcome, ReapResult, SignalRecord, SignalResult
from gpuguard.engine.reap.reap_run import (
    Abort,
    Confirm,
    Held,
    Holding,
    Journal,
    Run,
    Spare,
    check_wanted,
)
from gpuguard.engine.reap.recheck import Inspect, recheck_frozen
from gpuguard.engine.scan.inspection import HolderSource
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.launchers import ExitSource
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.vocabulary import AnyReason, DecisionReason

log = logging.getLogger("gpuguard.remediator.reaper")

#: The reason of a reap that an Interrupted (a signal to `gpuguard reap --apply`) ended.
INTERRUPTED = DecisionReason.INTERRUPTED


class Interrupted(BaseException):
    """Raised into a running reap to stop it now (by `gpuguard reap --apply`'s handlers for
    SIGINT, SIGTERM and SIGHUP). A BaseException, like KeyboardInterrupt, so that nothing
    on the way mistakes it for a failure to handle; the reap continues (SIGCONT) what it
    stopped and returns outcome aborted (or failed, once SIGTERM was sent), reason
    `interrupted`, instead of raising."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


#: The reason a reap gets when the kernel has no pidfd_open and the policy wants one:
#: refused before any kill path was chosen.
NO_PIDFD = DecisionReason.NO_PIDFD


@dataclass(frozen=True)
class ReapTexts:
    """The words a platform's results and logs use for its steps (signals, or suspends and
    TerminateProcess): the skeleton's texts, each platform's own spelling."""

    needs_journal: str  # the ValueError of a reap that may act without a journal
    dry_run: str  # a dry run's detail
    failed_before_kill: str  # the log line of an exception before any kill (%s: the key)
    failed_killing: str  # the log line of an exception while killing (%s: the key)
    survived: str  # the detail when members survived ({} the count)
    all_gone: str  # the detail when none did


class TreeReaper(Protocol):
    """What a reaper offers (ReaperCore.reap for the contract), on any platform."""

    @property
    def nvml(self) -> HolderSource: ...

    def reap(self, plan: ReapPlan, *, policy: Remediate, rules: Rules,
             protected_pids: frozenset[int], deadline: float, journal: Journal | None,
             cancelled: Callable[[], bool] = ..., confirm: Confirm | None = None,
             force: bool = False, holding: Holding | None = None,
             events: ExitSource | None = None,
             memory: LauncherMemory | None = None) -> ReapResult: ...

    def thaw_interrupted(self,
                         members: Iterable[tuple[int, int]]) -> tuple[SignalRecord, ...]: ...


#: A platform's run (Linux's ReapRun, Windows' WinRun).
R = TypeVar("R", bound=Run[Any])


class ReaperCore(ABC, Generic[R]):
    """The reap of every platform: reap() owns the phases' order and continues what the
    reap stopped on every way out; a platform's reaper sets `nvml`, `counters` and
    `_monotonic` and supplies the steps (the abstract methods) and, where its reap
    differs, the optional hooks (_refuse_early, _guard_begin/_guard_end, _kill_refused)."""

    TEXTS: ClassVar[ReapTexts]
    nvml: HolderSource
    counters: Counters
    _monotonic: Callable[[], float]

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
        spare: Spare | None = None,
    ) -> ReapResult:
        """Run one reap (or dry run) of `plan`; never raises for process-level trouble.

        `journal` must be given unless `plan.dry_run`: no process is signalled before
        a record naming it has been written through it. `force` (a person's `gpuguard
        reap --force`, never an alert) skips the classifier's protections of members;
        the policy's refusals (pid 1, kernel threads, root-owned, users) still apply.
        `confirm` is asked after the intent record right before the first stop, and
        again with the tree frozen right before the first kill step (in a dry run, once,
        before it reports). `holding` (the worker's ledger) is told which members the
        reap may hold stopped; `events` and `memory` are the inspection's. `spare` (the
        launcher's keep marks, Linux) is asked of every member before any other rule, at
        its hold and again once frozen: a member it names is let go of with everything
        below it (continued if the reap had stopped them) and reported in `kept`.

        Every way out continues what the reap stopped and has not killed: an abort, an
        exception, a deadline, and an Interrupted raised into it (then it returns, reason
        `interrupted`); any other BaseException is raised after the thaw.
        """
        if journal is None and not plan.dry_run:
            raise ValueError(self.TEXTS.needs_journal)
        run = self._open_run(plan, policy=policy, rules=rules, protected=protected_pids,
                             journal=None if plan.dry_run else journal, force=force,
                             holding=None if plan.dry_run else holding, events=events,
                             memory=memory, spare=spare)
        refused = self._refuse_early(run, plan)
        if refused is not None:
            return refused
        # Every path out of here thaws before the handles close (the handlers and the
        # finally): a thaw through handles cannot reach a reused pid.
        self._guard_begin(plan)
        try:
            try:
                early = self._prepare(run, plan, deadline, cancelled, confirm)
                return early if early is not None else self._kill(run, plan)
            except Interrupted as stop:
                return self._interrupted(run, plan, stop)
            except BaseException:  # KeyboardInterrupt, SystemExit, a crash stand-in
                self._thaw(run)
                raise
        finally:
            self._guard_end(plan)
            self._close(run)

    # -- the phases, in order ------------------------------------------------------------

    def _prepare(self, run: R, plan: ReapPlan, deadline: float,
                 cancelled: Callable[[], bool], confirm: Confirm | None) -> ReapResult | None:
        """Everything before the first kill step; its result when the reap ends there (a
        dry run, an abort: what it stopped is continued), None once the frozen tree may
        be killed."""
        try:
            return self._freeze_and_judge(run, plan, deadline, cancelled, confirm)
        except Abort as abort:
            self._thaw(run)
            return self._result(run, plan, Outcome.ABORTED, abort.reason, abort.detail)
        except Exception as exc:  # a bug or a surprise from the OS: never leave it frozen
            log.exception(self.TEXTS.failed_before_kill, plan.key)
            self._thaw(run)
            return self._result(run, plan, Outcome.ABORTED, DecisionReason.INTERNAL_ERROR,
                                f"{type(exc).__name__}: {exc}")

    def _freeze_and_judge(self, run: R, plan: ReapPlan, deadline: float,
                          cancelled: Callable[[], bool],
                          confirm: Confirm | None) -> ReapResult | None:
        refused = self._hold(run, plan)
        if refused is not None:
            return refused
        if plan.dry_run:  # one look below the members: nothing is stopped
            self._collect_dry(run)
            self._confirm(run, confirm)
            return self._result(run, plan, Outcome.DRY_RUN, "", self.TEXTS.dry_run)
        check_wanted(cancelled, deadline, self._monotonic)
        run.write(Phase.INTENT, list(run.targets.values()))
        self._confirm(run, confirm)
        check_wanted(cancelled, deadline, self._monotonic)  # resolved while Alertmanager was asked
        self._freeze(run, deadline, cancelled)
        # Judged again now that nothing can exec or change a disposition any more.
        self._rejudge(run)
        recheck_frozen(run, plan, deadline, nvml=self.nvml, now=self._monotonic,
                       inspect=self._inspector(run, plan))
        # Freezing and judging take a while: the last question right before the kill.
        self._confirm(run, confirm)
        check_wanted(cancelled, deadline, self._monotonic)
        return None

    def _kill(self, run: R, plan: ReapPlan) -> ReapResult:
        try:
            survivors = self._terminate(run)
        except Abort as abort:
            return self._kill_refused(run, plan, abort)
        except Exception as exc:
            return self._kill_failed(run, plan, exc)
        detail = (self.TEXTS.survived.format(len(survivors)) if survivors
                  else self.TEXTS.all_gone)
        return self._result(run, plan, Outcome.FAILED if survivors else Outcome.REAPED,
                            DecisionReason.SURVIVORS if survivors else "",
                            "; ".join([detail, *run.notes]),
                            survivors=tuple(t.member.pid for t in survivors), reclaim=True)

    def _kill_failed(self, run: R, plan: ReapPlan, exc: Exception) -> ReapResult:
        """An exception while killing (called in its handler): logged, what the reap
        stopped continued, failed."""
        log.exception(self.TEXTS.failed_killing, plan.key)
        self._thaw(run)
        return self._result(run, plan, Outcome.FAILED, DecisionReason.INTERNAL_ERROR,
                            f"{type(exc).__name__}: {exc}")

    def _interrupted(self, run: R, plan: ReapPlan, stop: Interrupted) -> ReapResult:
        self._thaw(run)
        return self._interrupted_result(run, plan, stop)

    # -- a platform's steps --------------------------------------------------------------

    @abstractmethod
    def _open_run(self, plan: ReapPlan, *, policy: Remediate, rules: Rules,
                  protected: frozenset[int], journal: Journal | None, force: bool,
                  holding: Holding | None, events: ExitSource | None,
                  memory: LauncherMemory | None, spare: Spare | None) -> R:
        """The state of a new reap (journal and holding already None for a dry run)."""

    @abstractmethod
    def _hold(self, run: R, plan: ReapPlan) -> ReapResult | None:
        """Hold and judge every planned member (Abort refuses); a result ends the reap."""

    @abstractmethod
    def _collect_dry(self, run: R) -> None:
        """A dry run's one look below the members: held and judged, nothing stopped."""

    @abstractmethod
    def _freeze(self, run: R, deadline: float, cancelled: Callable[[], bool]) -> None:
        """Stop the tree, root first, and whatever joins it, until nothing new does."""

    @abstractmethod
    def _rejudge(self, run: R) -> None:
        """Every member judged again with the tree frozen (Abort refuses)."""

    @abstractmethod
    def _inspector(self, run: R, plan: ReapPlan) -> Inspect:
        """recheck_frozen's inspection: this platform's, over the facts the decision had."""

    @abstractmethod
    def _terminate(self, run: R) -> Sequence[Held]:
        """Kill the frozen tree; the members that survived (left running)."""

    @abstractmethod
    def _thaw(self, run: R) -> None:
        """Continue every member the reap stopped and has not killed."""

    @abstractmethod
    def _close(self, run: R) -> None:
        """Let go of every handle the reap holds (after the thaw)."""

    # -- hooks where a platform's reap differs (defaults: nothing to do) ---------------

    def _refuse_early(self, run: R, plan: ReapPlan) -> ReapResult | None:
        """A refusal before anything is held or guarded (None: go on)."""
        return None

    def _guard_begin(self, plan: ReapPlan) -> None:
        """Before the first hold: arm what continues the tree if this process dies."""

    def _guard_end(self, plan: ReapPlan) -> None:
        """After the last thaw: disarm it."""

    def _kill_refused(self, run: R, plan: ReapPlan, abort: Abort) -> ReapResult:
        """An Abort in the kill phase (called in its handler). Default: nothing there
        refuses, so it is a failure like any exception."""
        return self._kill_failed(run, plan, abort)

    # -- what every platform does the same way -------------------------------------------

    def _confirm(self, run: Run[Any], confirm: Confirm | None) -> None:
        """Ask `confirm` (None: nothing to ask) and time it; its refusal aborts."""
        if confirm is None:
            return
        refused = confirm()
        run.confirmed_ms = (self._monotonic() - run.started) * 1000
        if refused is not None:
            raise Abort(*refused)

    def _result(self, run: Run[Any], plan: ReapPlan, outcome: Outcome,
                reason: AnyReason | Literal[""], detail: str, *, survivors: tuple[int, ...] = (),
                reclaim: bool = False) -> ReapResult:
        """The ReapResult of `run`; `reclaim`: re-read NVML for what the kill gave back."""
        after: int | None = None
        reclaimed: int | None = None
        if reclaim:
            try:
                reading = self.nvml.read()
            except Exception as exc:  # the kill happened; a failed re-query must not hide it
                reading = GpuReading(False, None, (), (), (("nvml", str(exc)),))
            if reading.up:
                pids = {h.pid for h in plan.holders}
                after = sum(h.used_bytes or 0 for h in reading.holders if h.pid in pids)
                reclaimed = max(0, plan.gpu_bytes - after)
        members = tuple(t.member for t in run.targets.values())
        if not members and not run.released and not run.kept:  # refused before any target
            members = plan.members  # was opened
        return ReapResult(
            outcome=outcome,
            reason=reason,
            detail=detail,
            kill_path=run.path if reason != NO_PIDFD else None,
            members=members,
            signals=tuple(run.signals),
            survivors=survivors,
            gpu_bytes_before=plan.gpu_bytes,
            gpu_bytes_after=after,
            reclaimed_bytes=reclaimed,
            duration_seconds=self._monotonic() - run.started,
            confirmed_ms=run.confirmed_ms,
            released=tuple(run.released),
            kept=tuple(run.kept),
        )

    def _interrupted_result(self, run: Run[Any], plan: ReapPlan,
                            stop: Interrupted) -> ReapResult:
        """An Interrupted ended the reap, after what it stopped was continued: failed
        once a kill step was sent, else aborted."""
        killing = any(s.signal in run.KILL_STEPS and s.result == SignalResult.SENT
                      for s in run.signals)
        log.warning("reap of %s interrupted (%s); %s what it had %s",
                    plan.key, stop.why, run.CONTINUED, run.STOPPED)
        return self._result(run, plan, Outcome.FAILED if killing else Outcome.ABORTED,
                            INTERRUPTED,
                            f"{stop.why}: the reap stopped there; "
                            + (run.KILLED if killing else "nothing was terminated")
                            + f", and every member the reap had {run.STOPPED} was "
                            f"{run.CONTINUED}")
