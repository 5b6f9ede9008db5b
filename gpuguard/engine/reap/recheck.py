"""The last look before SIGTERM, with the tree frozen: NVML once more (bounded by the
deadline), and the orphan verdict derived again now that no member can call setsid(),
exec or fork any more. Anything that no longer holds aborts the reap."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from gpuguard.engine.decision.policy import verify_live
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import LiveTree, Member
from gpuguard.engine.reap.reap_run import Abort
from gpuguard.engine.scan.inspection import (
    HolderSource,
    NvmlTimeout,
    nvml_problem,
    read_within,
)
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.launchers import ExitSource
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.vocabulary import DecisionReason, Reason

#: The reason of a reap whose NVML re-check with the tree frozen outlived the deadline.


class _Held(Protocol):
    @property
    def member(self) -> Member: ...


class FrozenRun(Protocol):
    """What the re-check reads of a reap in progress: Linux's ReapRun, or the Windows
    reaper's run (gpuguard/engine/windows/control.py's WinRun)."""

    @property
    def targets(self) -> Mapping[int, _Held]: ...
    @property
    def force(self) -> bool: ...
    @property
    def rules(self) -> Rules: ...
    @property
    def events(self) -> ExitSource | None: ...
    @property
    def memory(self) -> LauncherMemory | None: ...


#: The inspection a re-check derives the verdict with: (the reading just taken, the GPUs
#: expected) -> LiveTree. Each platform's reaper passes its own (ReaperCore._inspector):
#: Linux's over /proc, Windows' over its back-end's table.
Inspect = Callable[[GpuReading, set[str]], LiveTree]


def recheck_frozen(run: FrozenRun, plan: ReapPlan, deadline: float, *, nvml: HolderSource,
                   now: Callable[[], float], inspect: Inspect) -> None:
    """With the tree frozen, NVML once more, waited for no longer than the deadline (a
    driver that hangs must not keep the tree stopped): complete, no GPU holder nobody
    judged, and (plan.classified) the root still the orphan the decision was made on."""
    left = deadline - now()
    if left <= 0:
        raise Abort(DecisionReason.WORKER_TIMEOUT,
                    "remediate.worker_timeout_seconds ran out before "
                    "any kill")
    try:
        reading = read_within(nvml, left)
    except NvmlTimeout as exc:  # fail closed: the abort continues the tree now
        raise Abort(DecisionReason.NVML_TIMEOUT, f"NVML re-check with the tree frozen: {exc}, the "
                    "rest of remediate.worker_timeout_seconds; nothing was "
                    "terminated") from None
    except Exception as exc:  # fail closed: an unreadable NVML confirms nothing
        raise Abort(DecisionReason.NVML_UNAVAILABLE, f"NVML re-check failed: {exc}") from None
    gpus = {*plan.gpus, *(h.gpu_uuid for h in plan.holders)}
    problem = nvml_problem(reading, gpus)
    if problem is not None:
        raise Abort(problem[0], f"NVML re-check with the tree frozen: {problem[1]}")
    judged = {h.pid for h in plan.holders}
    for holder in reading.holders if not run.force else ():
        target = run.targets.get(holder.pid)
        if target is not None and holder.pid not in judged:
            raise Abort(Reason.MEMBER_UNKNOWN, f"member {holder.pid} ({target.member.comm}) "
                        "holds GPU memory but was not a GPU holder when the tree was "
                        "classified")
    if plan.classified:
        _rederive(run, plan, reading, gpus, inspect=inspect)


def _rederive(run: FrozenRun, plan: ReapPlan, reading: GpuReading, gpus: set[str], *,
              inspect: Inspect) -> None:
    """The verdict the decision rested on, derived again: the inspection's own path
    (`inspect`: on Linux a fresh view, classify()) over the frozen tree and the reading
    just taken, and the decision's own verification (policy.verify_live). Anything but the
    same root, still an orphan (unless a person forced it) with an allowed reason, aborts."""
    live = inspect(reading, gpus)
    refused = verify_live(plan.key, live, named_by="the decision",
                          require_orphan=not run.force)
    if refused is not None:
        raise Abort(refused.reason, f"classified again with the tree frozen: "
                    f"{refused.detail}")
    if not run.force and plan.reasons is not None and live.reason not in plan.reasons:
        raise Abort(DecisionReason.REASON_NOT_ALLOWED, "classified again with the tree frozen: "
                    f"orphan reason {live.reason} is not one the decision allows "
                    f"({', '.join(plan.reasons) or 'none'}: remediate.reasons and "
                    "remediate.idle_reasons, none stricter about idleness than the "
                    "decision's own)")
