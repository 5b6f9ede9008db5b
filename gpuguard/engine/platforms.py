"""The engine of this platform, chosen once: its reaper (signals through pidfds on Linux,
gpuguard/engine/reap/reaper.py; handles, suspends and TerminateProcess on Windows,
gpuguard/engine/windows/reaper.py), whether its reaps have a thaw guardian, its live
inspection of a tree and the pids it never signals. Both reapers answer the same reap()
with the same ReapResult, so the worker, crash recovery and `gpuguard reap` hold a
TreeReaper and never ask which.

Only the programs (gpuguard/remediator/, gpuguard/console/) import this module: it is
the one place above host/ that names both back-ends, each by gpuguard.host.platform's
name (REAPERS, GUARDIANS) or through Platform.processes (inspect_tree, protected_pids). What lies
below (engine/decision, engine/reap, engine/state) is handed what it needs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.engine.decision.tree import LiveTree, TreeKey
from gpuguard.engine.reap.skeleton import TreeReaper
from gpuguard.engine.reap.thaw_guardian import ThawGuardian
from gpuguard.engine.scan.inspection import (
    HolderSource,
    inspect_proc_tree,
    proc_protected_pids,
)
from gpuguard.engine.windows.inspection import inspect_windows_tree, table_protected_pids
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.launchers import ExitSource
from gpuguard.host.platform import LINUX, PLATFORM, WINDOWS, Platform
from gpuguard.orphans.protections import ProcSource
from gpuguard.orphans.rules_config import Rules

__all__ = ["GUARDIANS", "REAPERS", "TreeReaper", "inspect_tree", "platform_guardian",
           "platform_reaper", "protected_pids"]


def _linux_reaper(nvml: HolderSource, counters: Counters, monotonic: Callable[[], float],
                  guardian: ThawGuardian | None) -> TreeReaper:
    from gpuguard.engine.reap.reaper import Reaper

    return Reaper(nvml=nvml, counters=counters, monotonic=monotonic, guardian=guardian)


def _windows_reaper(nvml: HolderSource, counters: Counters, monotonic: Callable[[], float],
                    guardian: ThawGuardian | None) -> TreeReaper:
    from gpuguard.engine.windows.reaper import WindowsReaper

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


#: Whether each platform's reaps have a thaw guardian, by gpuguard.host.platform's name:
#: Linux's reaper hands it the pidfd of every member before its SIGSTOP; Windows has none
#: (a Job Object's handles die with the process that holds them).
GUARDIANS: dict[str, Callable[[], ThawGuardian | None]] = {
    LINUX: ThawGuardian, WINDOWS: lambda: None}


def platform_guardian(platform: Platform = PLATFORM) -> ThawGuardian | None:
    """A new thaw guardian for `platform`'s reaper (platform_reaper's `guardian`), or None
    where the platform has none; its owner starts it and closes it."""
    return GUARDIANS[platform.name]()


def inspect_tree(key: TreeKey, *, nvml: HolderSource, rules: Rules,
                 counters: Counters = COUNTERS, expected_gpus: Iterable[str] = (),
                 events: ExitSource | None = None,
                 memory: LauncherMemory | None = None,
                 reading: GpuReading | None = None,
                 platform: Platform = PLATFORM) -> LiveTree:
    """Re-read the root, re-query NVML, re-run classify(): the facts policy.decide() judges,
    over the platform's processes (Platform.processes): /proc (inspect_proc_tree), or a
    fresh process table and the Windows rules (inspect_windows_tree)."""
    return platform.processes(
        procfs=lambda: inspect_proc_tree(key, nvml=nvml, rules=rules, counters=counters,
                                         expected_gpus=expected_gpus, events=events,
                                         memory=memory, reading=reading),
        table=lambda read: inspect_windows_tree(key, nvml=nvml, rules=rules,
                                                expected_gpus=expected_gpus, reading=reading,
                                                table=read()))


def protected_pids(view: ProcSource | None = None,
                   platform: Platform = PLATFORM) -> frozenset[int]:
    """PID 1, this process and every ancestor: never to be signalled, whatever the alert
    says (on Windows: System Idle, System, this process and its ancestors). `view` given:
    its /proc, whatever the platform."""
    if view is not None:
        return proc_protected_pids(view)
    return platform.processes(procfs=proc_protected_pids, table=table_protected_pids)
