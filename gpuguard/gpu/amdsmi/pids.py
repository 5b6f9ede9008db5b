"""Pure: which pids AMD SMI lists are holders, and which of them used a GPU since the last
read. AMD's list is not taken at its word: ROCm kept dead pids listed for ever until
mid-2026, and reports host pids from inside PID namespaces, so a listed pid is a holder only
while /proc shows a process there that can be the one listed (docs/gpu-vendors.md).

What each sighting can verify. The first time a (GPU, pid) is listed, the process at the
pid must have started no later than that listing (the boot clock just after the call that
listed it): a pid reused between the listing and the /proc read is caught. A pid reused
before gpuguard first saw it listed is not: nothing in the listing dates it (its memory and
engine time are what a live process would show), so a stale entry whose pid a new process
took before the first read reads as that process's, until the entry goes. Every later
sighting must find the same start time as the first: a pid reused since is never a holder.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuguard.gpu.reading import Listed


@dataclass(frozen=True)
class Sighting:
    """The first listing of one (GPU, pid): when (boot clock, seconds) and the start time
    (clock ticks since boot) of the process /proc showed at the pid then (None: none)."""

    listed_at: float
    start_time: int | None


def judge(first: Sighting | None, start_time: int | None, listed_at: float,
          ticks_per_second: int) -> tuple[Listed, Sighting]:
    """What the process now at a listed pid (`start_time`; None: no process) is, and the
    first sighting to remember: `first`, or this one (made at `listed_at`) when there was
    none. A process that started after the first listing, or whose start time differs from
    the one first seen, is another process than the one listed (a reused pid)."""
    seen = first if first is not None else Sighting(listed_at, start_time)
    if start_time is None:
        return Listed.NO_PROCESS, seen
    if start_time != seen.start_time or start_time > seen.listed_at * ticks_per_second:
        return Listed.PID_REUSED, seen
    return Listed.HOLDER, seen


#: One holder's identity on a GPU: (pid, start time).
Identity = tuple[int, int]


def busy(previous: Mapping[Identity, int] | None,
         now: Mapping[Identity, int]) -> frozenset[int] | None:
    """The holders (by pid) whose gfx engine time moved since the previous read: `previous`
    and `now` map each holder to its engine_usage.gfx (ns). None when there was no previous
    read (unknown, never idle). A holder not listed then got its context since, so any
    engine time it has was spent since; a counter that went back (a driver reset) cannot
    say how much was used, and counts as busy."""
    if previous is None:
        return None
    return frozenset(pid for (pid, start), ns in now.items()
                     if ns != previous.get((pid, start), 0))
