"""The imperative edge that touches processes: the reap itself, on Linux.

A reap must never hit the wrong process: every member is held by a handle and its
identity checked (signalling.py), the tree is frozen before anything is killed
(freezing.py), checked once more while frozen (recheck.py), then killed (killing.py).
Every process is named in a durable audit record (the journal) before its first signal.
The order of those phases and the thaw on every way out are the skeleton's
(skeleton.ReaperCore.reap); this module supplies Linux's steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.config.remediate import Remediate
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import LiveTree
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
    Holding,
    Journal,
    NoPidfd,
    ReapRun,
    RefusedStop,
    Spare,
    Target,
)
from gpuguard.engine.reap.recheck import Inspect
from gpuguard.engine.reap.recovery import thaw_interrupted
from gpuguard.engine.reap.signalling import (
    PIDFD_OPEN,
    PIDFD_SEND,
    PidfdOpen,
    PidfdSend,
    Signaller,
)
from gpuguard.engine.reap.skeleton import NO_PIDFD, ReaperCore, ReapTexts
from gpuguard.engine.reap.thaw_guardian import ThawGuardian
from gpuguard.engine.scan.inspection import HolderSource, inspect_proc_tree
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.launchers import ExitSource
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.rules_config import Rules


class Reaper(ReaperCore[ReapRun]):
    """Verify, freeze, signal, confirm. The only code in gpuguard that sends signals.

    One reap at a time per instance (the remediator has one worker thread); reap() is
    the skeleton's (ReaperCore.reap: its contract), over pidfds and signals.
    """

    TEXTS = ReapTexts(
        needs_journal="a reap that may signal needs a journal",
        dry_run="dry run: no signal sent",
        failed_before_kill="reap of %s failed before any kill; continuing what it stopped",
        failed_killing="reap of %s failed while killing; continuing what it stopped",
        survived="{} process(es) survived SIGKILL",
        all_gone="every member is gone or a zombie")

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

    def _open_run(self, plan: ReapPlan, *, policy: Remediate, rules: Rules,
                  protected: frozenset[int], journal: Journal | None, force: bool,
                  holding: Holding | None, events: ExitSource | None,
                  memory: LauncherMemory | None, spare: Spare | None) -> ReapRun:
        return ReapRun(started=self._monotonic(), path=self._signaller.path,
                       view=ProcessView(counters=self.counters), policy=policy, rules=rules,
                       protected=protected, journal=journal, force=force, holding=holding,
                       events=events, memory=memory, spare=spare)

    def _refuse_early(self, run: ReapRun, plan: ReapPlan) -> ReapResult | None:
        """No pidfd_open and a policy that wants it: refused before anything is held."""
        if run.path == KillPath.PID and not run.policy.allow_without_pidfd:
            return self._result(run, plan, Outcome.ABORTED, NO_PIDFD,
                                "pidfd_open is unavailable and remediate.allow_without_pidfd "
                                "is false")
        return None

    def _guard_begin(self, plan: ReapPlan) -> None:
        if self.guardian is not None and not plan.dry_run:
            self.guardian.begin()  # one that died is started again; failing, it refuses

    def _guard_end(self, plan: ReapPlan) -> None:
        if self.guardian is not None and not plan.dry_run:
            self.guardian.done()

    def thaw_interrupted(self, members: Iterable[tuple[int, int]]) -> tuple[SignalRecord, ...]:
        """SIGCONT every (pid, start_time) that is still that process and stopped: crash
        recovery of a reap's held marks (gpuguard/engine/reap/recovery.py says which to pass)."""
        return thaw_interrupted(self._signaller, self.counters, members)

    # -- Linux's steps ---------------------------------------------------------------

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

    def _collect_dry(self, run: ReapRun) -> None:
        self._freezer.collect(run, stop=False)

    def _freeze(self, run: ReapRun, deadline: float, cancelled: Callable[[], bool]) -> None:
        self._freezer.freeze(run, deadline, cancelled)

    def _rejudge(self, run: ReapRun) -> None:
        self._freezer.rejudge(run, list(run.targets.values()), refuse=True)

    def _inspector(self, run: ReapRun, plan: ReapPlan) -> Inspect:
        """recheck_frozen's inspection: /proc's (a fresh view, classify()), with the
        process events and launcher memory the inspection had."""
        def inspect(reading: GpuReading, gpus: set[str]) -> LiveTree:
            return inspect_proc_tree(plan.key, nvml=self.nvml, rules=run.rules,
                                     counters=self.counters, expected_gpus=gpus,
                                     events=run.events, memory=run.memory, reading=reading)
        return inspect

    def _terminate(self, run: ReapRun) -> list[Target]:
        """SIGTERM, the grace period, SIGKILL (killing.py): the members that survived."""
        return self._killer.kill(run)

    def _kill_refused(self, run: ReapRun, plan: ReapPlan, abort: Abort) -> ReapResult:
        """Refused after SIGTERM, before SIGKILL: nobody is SIGKILLed."""
        self._signaller.thaw(run)
        alive = tuple(t.member.pid for t in run.targets.values()
                      if not self._signaller.gone(run, t))
        return self._result(run, plan, Outcome.FAILED, abort.reason,
                            f"{abort.detail}; after SIGTERM, before SIGKILL: no "
                            "SIGKILL was sent and what the reap had stopped was "
                            "continued", survivors=alive)

    def _thaw(self, run: ReapRun) -> None:
        self._signaller.thaw(run)

    def _close(self, run: ReapRun) -> None:
        self._signaller.close(run)
