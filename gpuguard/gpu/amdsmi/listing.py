"""The pids AMD SMI lists, checked against /proc (pids.py judges the start times, kfd.py
looks for /dev/kfd among the process's open files where the host has it): which are
holders, which are not and why, each holder's engine time; the first sighting of each
(GPU, pid) is kept for as long as the library lists it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from gpuguard.base.counters import Counters
from gpuguard.gpu.amdsmi.kfd import KFD, Kfd
from gpuguard.gpu.amdsmi.pids import Identity, Sighting, judge
from gpuguard.gpu.reading import Listed, NotHolding
from gpuguard.host.procfs import PROC, ProcessView
from gpuguard.orphans.process import Holder, ProcUnreadable

log = logging.getLogger("gpuguard.gpu.amdsmi")
#: Logged once each; past this many remembered, the memory starts again.
MAX_SAID = 4096


class Listing:
    """Per GPU, each listed pid's first sighting; a /proc view read once per pass."""

    def __init__(self, counters: Counters, boot: Callable[[], float],
                 proc_root: str = PROC, kfd_path: str = KFD) -> None:
        self._view = ProcessView(proc_root=proc_root, counters=counters)
        self._kfd = Kfd(kfd_path, proc_root, counters)
        self._boot = boot
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._sightings: dict[str, dict[int, Sighting]] = {}
        self._said: set[tuple[str, int, str]] = set()

    def begin_pass(self) -> None:
        """A new pass: /proc is read afresh, and the KFD device stat()ed."""
        self._view.begin_scan()
        self._kfd.begin_pass()

    def end_pass(self, gpus: set[str]) -> None:
        """The pass is over: `gpus` (the GPUs read) keep their pids' sightings, every other
        GPU's are forgotten (a GPU whose list could not be read keeps its own)."""
        self._view.begin_scan()  # nothing read in this pass is kept past it
        for uuid in set(self._sightings) - gpus:
            del self._sightings[uuid]

    def blocking(self, pids: list[int]) -> list[int]:
        """The pids that may hold a GPU now (a reset's last look): a process at the pid
        that, where the host has the KFD device, has it open or cannot be shown not to
        (raises ProcUnreadable)."""
        self._kfd.refresh()
        out = []
        for pid in sorted(set(pids)):
            info = self._view.fresh_stat(pid)
            if info is None:
                continue
            if not self._kfd.present or self._kfd.holds(pid, info.start_time) is not False:
                out.append(pid)
        return out

    def check(self, index: int, uuid: str, listed: list[dict[str, Any]]
               ) -> tuple[list[Holder], list[NotHolding], dict[Identity, int]]:
        """Each listed pid against /proc (pids.judge, then the KFD device where the host has
        it): the holders, the pids that are no holder, and each holder's gfx engine time
        (ns). A pid whose stat cannot be read is passed on as a holder: the classifier
        reads it unknown, and no reset goes ahead."""
        listed_at = self._boot()  # after the list call: whatever it listed had started
        before = self._sightings.get(uuid, {})
        seen: dict[int, Sighting] = {}
        holders: list[Holder] = []
        not_holding: list[NotHolding] = []
        gfx: dict[Identity, int] = {}
        per_pid: dict[int, tuple[int, int]] = {}
        for entry in listed:
            pid = int(entry["pid"])
            vram, ns = per_pid.get(pid, (0, 0))
            per_pid[pid] = (vram + int(entry["memory_usage"]["vram_mem"]),
                            max(ns, int(entry["engine_usage"]["gfx"])))
        for pid, (vram, ns) in per_pid.items():
            try:
                info = self._view.stat(pid)
            except ProcUnreadable:
                holders.append(Holder(pid, uuid, index, vram, "C"))
                continue
            start = None if info is None else info.start_time
            verdict, seen[pid] = judge(before.get(pid), start, listed_at, self._ticks)
            if verdict == Listed.HOLDER and start is not None and self._kfd.present:
                held = self._kfd.holds(pid, start)
                if not held:
                    verdict = Listed.UNVERIFIED if held is None else Listed.NO_KFD
            if verdict == Listed.HOLDER and start is not None:
                holders.append(Holder(pid, uuid, index, vram, "C"))
                gfx[(pid, start)] = ns
                continue
            not_holding.append(NotHolding(pid, vram, verdict))
            self._say(index, uuid, pid, verdict)
        self._sightings[uuid] = seen
        return holders, not_holding, gfx

    def _say(self, index: int, uuid: str, pid: int, verdict: Listed) -> None:
        """Once per GPU, pid and verdict: why a listed pid is no holder."""
        if (uuid, pid, verdict) in self._said:
            return
        if len(self._said) > MAX_SAID:
            self._said.clear()
        self._said.add((uuid, pid, verdict))
        if verdict == Listed.PID_REUSED:
            log.warning("GPU %d: AMD SMI lists pid %d, which now names another process than "
                        "the one listed: not attributed (counted as unseen)", index, pid)
        elif verdict == Listed.NO_KFD:
            log.warning("GPU %d: AMD SMI lists pid %d, whose process does not have %s open: "
                        "not the one listed, not attributed (counted as unseen)", index, pid,
                        self._kfd.path)
        elif verdict == Listed.UNVERIFIED:
            log.warning("GPU %d: AMD SMI lists pid %d, whose open files could not be looked "
                        "at for %s: not attributed (counted as unseen) and not reaped",
                        index, pid, self._kfd.path)
        else:
            log.info("GPU %d: AMD SMI lists pid %d, which /proc does not show: not a holder "
                     "(counted as unseen)", index, pid)
