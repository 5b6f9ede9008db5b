"""What every platform's reaper does the same way, written once: the confirmation
right before a kill step (Alertmanager, asked through `confirm`) and the result, with
the GPU memory re-read after a kill. Linux's Reaper (reaper.py) and Windows'
WindowsReaper (windows_reaper.py) both derive from ReaperCore; the write-ahead audit
record and the crash ledger's marks are the run's (reap_run.Run)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

from gpuguard.engine.decision.inspection import HolderSource
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.reap.outcome import Outcome, ReapResult, SignalResult
from gpuguard.engine.reap.reap_run import Abort, Confirm, Run
from gpuguard.gpu.reading import GpuReading
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


class ReaperCore:
    """The confirm and result steps of a reaper; a platform's reaper sets `nvml` and
    `_monotonic` and runs its own hold, freeze and kill phases around them."""

    nvml: HolderSource
    _monotonic: Callable[[], float]

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
