"""The imperative edge that touches processes: the reap itself.

A reap must never hit the wrong process: every member is held by a handle and its
identity checked (signalling.py), the tree is frozen before anything is killed
(freezing.py), checked once more while frozen (recheck.py), then killed (killing.py).
Every process is named in a durable audit record (the journal) before its first signal.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.config.remediate import Remediate
from gpuguard.engine.decision.inspection import HolderSource
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.reap.audit import Phase
from gpuguard.engine.reap.freezing import Freezer
from gpuguard.engine.reap.killing import Killer
from gpuguard.engine.reap.outcome import (
    KillPath,
    Outcome,
    ReapResult,
    SignalRecord,
)
from gpuguard.engine.reap.reap_run import (
    Abort,
    Confirm,
    Holding,
    Journal,
    NoPidfd,
    ReapRun,
    RefusedStop,
    Spare,
    check_wanted,
)
from gpuguard.engine.reap.recheck import recheck_frozen
from gpuguard.engine.reap.recovery import thaw_interrupted
from gpuguard.engine.reap.signalling import (
    PIDFD_OPEN,
    PIDFD_SEND,
    PidfdOpen,
    PidfdSend,
    Signaller,
)
from gpuguard.engine.reap.skeleton import NO_PIDFD, Interrupted, ReaperCore
from gpuguard.engine.reap.thaw_guardian import ThawGuardian
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.procfs import ExitSource, ProcessView
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.vocabulary import DecisionReason

log = logging.getLogger("gpuguard.remediator.reaper")

class Reaper(ReaperCore):
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
        guardian: ThawGuardian | None = None,
    ) -> None:
        self.nvml = nvml
        self.counters = counters
        self._monotonic = monotonic
        #: With a guardian, every member is handed to it before its SIGSTOP: a SIGKILL of
        #: this process mid-reap is then followed by SIGCONTs (thaw_guardian.py).
        self.guardian = guardian
        self._signaller = Signaller(pidfd_open=pidfd_open, pidfd_send=pidfd_send, kill=kill,
                                    monotonic=monotonic, guardian=guardian)
        self._freezer = Freezer(self._signaller, counters=counters, refused_stop=refused_stop)
        self._killer = Killer(self._freezer)

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
        `confirm` is asked after the intent record right before the first SIGSTOP, and
        again with the tree frozen right before the first SIGTERM (in a dry run, once,
        before it reports). `holding` (the worker's ledger) is told which members the
        reap may hold stopped; `events` and `memory` are the inspection's. `spare` (the
        launcher's keep marks) is asked of every member before any other rule, at its
        hold and again once frozen: a member it names is let go of with everything below
        it (continued if the reap had stopped them) and reported in `kept`.

        Every way out continues (SIGCONT) what the reap stopped and has not killed: an
        abort, an exception, a deadline, and an Interrupted raised into it (then it
        returns, reason `interrupted`); any other BaseException is raised after the thaw.
        """
        if journal is None and not plan.dry_run:
            raise ValueError("a reap that may signal needs a journal")
        run = ReapRun(started=self._monotonic(), path=self._signaller.path,
                      view=ProcessView(counters=self.counters), policy=policy, rules=rules,
                      protected=protected_pids, journal=None if plan.dry_run else journal,
                      force=force, holding=None if plan.dry_run else holding, events=events,
                      memory=memory, spare=spare)
        if run.path == KillPath.PID and not policy.allow_without_pidfd:
            return self._result(run, plan, Outcome.ABORTED, NO_PIDFD,
                                "pidfd_open is unavailable and remediate.allow_without_pidfd "
                                "is false")
        # Every path out of here thaws before the handles close (the handlers and the
        # finally): a thaw through pidfds cannot reach a reused pid.
        if self.guardian is not None and not plan.dry_run:
            self.guardian.begin()  # one that died is started again; failing, it refuses
        try:
            try:
                early = self._prepare(run, plan, deadline, cancelled, confirm)
                return early if early is not None else self._kill(run, plan)
            except Interrupted as stop:
                return self._interrupted(run, plan, stop)
            except BaseException:  # KeyboardInterrupt, SystemExit, a crash stand-in
                self._signaller.thaw(run)
                raise
        finally:
            if self.guardian is not None and not plan.dry_run:
                self.guardian.done()
            self._signaller.close(run)

    def thaw_interrupted(self, members: Iterable[tuple[int, int]]) -> tuple[SignalRecord, ...]:
        """SIGCONT every (pid, start_time) that is still that process and stopped: crash
        recovery of a reap's held marks (gpuguard/engine/reap/recovery.py says which to pass)."""
        return thaw_interrupted(self._signaller, self.counters, members)

    # -- phases ----------------------------------------------------------------------

    def _prepare(self, run: ReapRun, plan: ReapPlan, deadline: float,
                 cancelled: Callable[[], bool], confirm: Confirm | None) -> ReapResult | None:
        """Everything before SIGTERM; its result when the reap ends there (a dry run, an
        abort: what it stopped is continued), None once the frozen tree may be killed."""
        try:
            return self._freeze_and_judge(run, plan, deadline, cancelled, confirm)
        except Abort as abort:
            self._signaller.thaw(run)
            return self._result(run, plan, Outcome.ABORTED, abort.reason, abort.detail)
        except Exception as exc:  # a bug or a surprise from /proc: never leave it frozen
            log.exception("reap of %s failed before any kill; continuing what it stopped",
                          plan.key)
            self._signaller.thaw(run)
            return self._result(run, plan, Outcome.ABORTED, DecisionReason.INTERNAL_ERROR,
                                f"{type(exc).__name__}: {exc}")

    def _freeze_and_judge(self, run: ReapRun, plan: ReapPlan, deadline: float,
                          cancelled: Callable[[], bool],
                          confirm: Confirm | None) -> ReapResult | None:
        refused = self._hold(run, plan)
        if refused is not None:
            return refused
        if plan.dry_run:
            self._freezer.collect(run, stop=False)
            self._confirm(run, confirm)
            return self._result(run, plan, Outcome.DRY_RUN, "", "dry run: no signal sent")
        check_wanted(cancelled, deadline, self._monotonic)
        run.write(Phase.INTENT, list(run.targets.values()))
        self._confirm(run, confirm)
        check_wanted(cancelled, deadline, self._monotonic)  # resolved while Alertmanager was asked
        self._freezer.freeze(run, deadline, cancelled)
        # Judged again now that nothing can exec or change a disposition any more.
        self._freezer.rejudge(run, list(run.targets.values()), refuse=True)
        recheck_frozen(run, plan, deadline, nvml=self.nvml, counters=self.counters,
                       now=self._monotonic)
        # Freezing and judging take a while: the last question right before SIGTERM.
        self._confirm(run, confirm)
        check_wanted(cancelled, deadline, self._monotonic)
        return None

    def _hold(self, run: ReapRun, plan: ReapPlan) -> ReapResult | None:
        """Hold the planned members; on a kernel without pidfd_open, again by pid (if the
        policy allows it; else the refusal)."""
        try:
            self._freezer.hold_planned(run, plan)
        except NoPidfd:
            self._signaller.close(run)
            if not run.policy.allow_without_pidfd:
                return self._result(run, plan, Outcome.ABORTED, NO_PIDFD,
                                    "pidfd_open failed with ENOSYS and "
                                    "remediate.allow_without_pidfd is false")
            run.restart(KillPath.PID, ProcessView(counters=self.counters))
            self._signaller.drop_pidfd()
            self._freezer.hold_planned(run, plan)
        return None

    def _kill(self, run: ReapRun, plan: ReapPlan) -> ReapResult:
        try:
            survivors = self._killer.kill(run)
        except Abort as abort:  # refused before SIGKILL: nobody is SIGKILLed
            self._signaller.thaw(run)
            alive = tuple(t.member.pid for t in run.targets.values()
                          if not self._signaller.gone(run, t))
            return self._result(run, plan, Outcome.FAILED, abort.reason,
                                f"{abort.detail}; after SIGTERM, before SIGKILL: no "
                                "SIGKILL was sent and what the reap had stopped was "
                                "continued", survivors=alive)
        except Exception as exc:
            log.exception("reap of %s failed while killing; continuing what it stopped",
                          plan.key)
            self._signaller.thaw(run)
            return self._result(run, plan, Outcome.FAILED, DecisionReason.INTERNAL_ERROR,
                                f"{type(exc).__name__}: {exc}")
        outcome = Outcome.FAILED if survivors else Outcome.REAPED
        detail = (f"{len(survivors)} process(es) survived SIGKILL" if survivors
                  else "every member is gone or a zombie")
        detail = "; ".join([detail, *run.notes])
        return self._result(run, plan, outcome,
                            DecisionReason.SURVIVORS if survivors else "", detail,
                            survivors=tuple(t.member.pid for t in survivors), reclaim=True)

    def _interrupted(self, run: ReapRun, plan: ReapPlan, stop: Interrupted) -> ReapResult:
        self._signaller.thaw(run)
        return self._interrupted_result(run, plan, stop)
