"""The pids AMD SMI lists, checked against /proc (pids.py judges): which are holders, which
are not and why, each holder's engine time; the first sighting of each (GPU, pid) is kept
for as long as the library lists it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from gpuguard.base.counters import Counters
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
                 proc_root: str = PROC) -> None:
        self._view = ProcessView(proc_root=proc_root, counters=counters)
        self._boot = boot
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._sightings: dict[str, dict[int, Sighting]] = {}
        self._said: set[tuple[str, int, str]] = set()

    def begin_pass(self, gpus: set[str] | None = None) -> None:
        """A new pass: /proc is read afresh; with `gpus` (the GPUs read), forget the pids of
        every other GPU (a GPU whose list could not be read keeps its own)."""
        self._view.begin_scan()
        if gpus is not None:
            for uuid in set(self._sightings) - gpus:
                del self._sightings[uuid]

    def live(self, pids: list[int]) -> list[int]:
        """The pids /proc shows a process at now (raises ProcUnreadable)."""
        return sorted(p for p in pids if self._view.fresh_stat(p) is not None)

    def check(self, index: int, uuid: str, listed: list[dict[str, Any]]
               ) -> tuple[list[Holder], list[NotHolding], dict[Identity, int]]:
        """Each listed pid against /proc (pids.judge): the holders, the pids that are no
        holder, and each holder's gfx engine time (ns). A pid whose stat cannot be read is
        passed on as a holder: the classifier reads it unknown, and no reset goes ahead."""
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
        else:
            log.info("GPU %d: AMD SMI lists pid %d, which /proc does not show: not a holder "
                     "(counted as unseen)", index, pid)
