"""The reap back-end of this platform, chosen once: signals through pidfds on Linux
(reaper.Reaper), handles, suspends and TerminateProcess on Windows
(windows_reaper.WindowsReaper). Both answer the same reap() with the same ReapResult, so
the worker, crash recovery and `gpuguard reap` hold a TreeReaper and never ask which."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.config.remediate import Remediate
from gpuguard.engine.decision.inspection import HolderSource
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.reap.outcome import ReapResult, SignalRecord
from gpuguard.engine.reap.reap_run import Confirm, Holding, Journal
from gpuguard.engine.reap.thaw_guardian import ThawGuardian
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.platform import LINUX, PLATFORM, WINDOWS, Platform
from gpuguard.host.procfs import ExitSource
from gpuguard.orphans.rules_config import Rules


class TreeReaper(Protocol):
    """What a reaper offers (see reaper.Reaper.reap for the contract)."""

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


def _linux_reaper(nvml: HolderSource, counters: Counters, monotonic: Callable[[], float],
                  guardian: ThawGuardian | None) -> TreeReaper:
    from gpuguard.engine.reap.reaper import Reaper

    return Reaper(nvml=nvml, counters=counters, monotonic=monotonic, guardian=guardian)


def _windows_reaper(nvml: HolderSource, counters: Counters, monotonic: Callable[[], float],
                    guardian: ThawGuardian | None) -> TreeReaper:
    from gpuguard.engine.reap.windows_reaper import WindowsReaper

    return WindowsReaper(nvml=nvml, counters=counters, monotonic=monotonic)


#: Each platform's reaper, by gpuguard.host.platform's name (neither imports elsewhere).
REAPERS: dict[str, Callable[[HolderSource, Counters, Callable[[], float],
                             ThawGuardian | None], TreeReaper]] = {
    LINUX: _linux_reaper, WINDOWS: _windows_reaper}


def platform_reaper(platform: Platform = PLATFORM, *, nvml: HolderSource,
                    counters: Counters = COUNTERS,
                    monotonic: Callable[[], float] = time.monotonic,
                    guardian: ThawGuardian | None = None) -> TreeReaper:
    """The reaper of `platform` (its name picks it from REAPERS); `guardian` (where the
    platform has one) continues what a reap stopped if the process doing it dies."""
    return REAPERS[platform.name](nvml, counters, monotonic, guardian)
