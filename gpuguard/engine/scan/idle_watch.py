"""The remediator's own idle clock for GPU holders (remediate.require_idle_seconds and
remediate.idle_reasons: Remediate.idle_watch_seconds, the shortest requirement).

NVML keeps per-process utilization samples for seconds, so a reap cannot ask at kill time
whether a holder has been idle for an hour: it has to have watched. While the key is set,
a thread reads NVML every `period()` seconds (well under the requirement) into the same
pure clock the exporter keeps (gpuguard/orphans/idleness.py), and the worker's inspection
reads through it too, so the kill-time read is one more observation, not a separate one.
It has an NVML reader of its own: each utilization call answers the samples since that
reader's previous call, and a read by the reaper must not swallow a busy holder's samples.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

from gpuguard.base.counters import Counters
from gpuguard.base.periodic import Periodic
from gpuguard.engine.decision.tree import HolderIdle, LiveTree
from gpuguard.engine.scan.inspection import HolderSource
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.idleness import IdleBook, observe, sightings_of

log = logging.getLogger("gpuguard.remediator")

#: The watch thread wakes this often and reads when a read is due (the policy may change
#: on reload, so the period is asked for at every wake).
WAKE_SECONDS = 1.0
#: Reads per requirement at least, and the bounds of the period between them.
READS_PER_REQUIREMENT = 10
MIN_PERIOD_SECONDS = 1.0
#: A read this many periods after the previous one restarts every holder's clock.
GAP_PERIODS = 3
MAX_PERIOD_SECONDS = 15.0


def watch_period(required: float) -> float:
    """Seconds between two watch reads for a requirement of `required` seconds."""
    return min(MAX_PERIOD_SECONDS, max(MIN_PERIOD_SECONDS, required / READS_PER_REQUIREMENT))


def watched_inspection(watch: IdleWatch | None,
                       inspect: Callable[[GpuReading | None], LiveTree]) -> LiveTree:
    """`inspect(reading)` with NVML read through `watch` (that read is one more
    observation, the kill-time one) and the watch's idle facts on the tree; without a
    watch (no idle requirement in force) `inspect(None)`, which reads NVML itself.
    The worker and `gpuguard policy check` both inspect this way."""
    if watch is None:
        return inspect(None)
    live = inspect(watch.read())
    return dataclasses.replace(live, idle=watch.facts(live))


class IdleWatch:
    """Reads NVML for utilization while an idle requirement is in force (`required`: the
    shortest, Remediate.idle_watch_seconds; 0: none); bounded by
    the holders of its latest read (the clock drops the rest)."""

    def __init__(self, nvml: HolderSource, *, required: Callable[[], float],
                 boot: Callable[[], float], counters: Counters) -> None:
        self._nvml = nvml
        self._required = required
        self._boot = boot
        self._counters = counters
        self._lock = threading.Lock()  # one read and its observation at a time, in order
        self._book = IdleBook()
        self._last_read: float | None = None
        self._loop: Periodic | None = None

    def read(self) -> GpuReading:
        """One NVML read, observed: the worker's kill-time read goes through here."""
        with self._lock:
            reading = self._nvml.read()
            now = self._boot()
            view = ProcessView(counters=self._counters)
            holders = []
            for h in reading.holders:
                info = view.fresh_stat(h.pid)
                holders.append((h.pid, info.start_time if info is not None else None,
                                h.gpu_uuid))
            busy = {gpu.uuid: gpu.busy_pids for gpu in reading.gpus}
            # A read after a stall (this thread starved, the daemon stopped, a VM
            # paused) restarts every clock: NVML keeps samples for seconds only.
            self._book = observe(self._book, sightings_of(holders, busy), now,
                                 max_gap=GAP_PERIODS * watch_period(self._required()))
            self._last_read = now
            return reading

    def facts(self, live: LiveTree) -> tuple[HolderIdle, ...]:
        """Each holder of `live` as the watch saw it at its latest read (its identity
        from the inspection's members: a holder not among them is unknown)."""
        starts = {m.pid: m.start_time for m in live.members}
        with self._lock:
            book, now = self._book, self._last_read
        out = []
        for h in live.holders:
            start = starts.get(h.pid)
            key = (h.pid, start, h.gpu_uuid) if start is not None else None
            out.append(HolderIdle(
                h.pid, h.gpu_uuid,
                book.idle_seconds(key, now) if key is not None and now is not None else None,
                book.watched_seconds(key, now) if key is not None and now is not None else None))
        return tuple(out)

    def tick(self) -> None:
        """Read when one is due; with the key off, forget (a later start begins anew)."""
        required = self._required()
        if required <= 0:
            with self._lock:
                self._book, self._last_read = IdleBook(), None
            return
        last = self._last_read
        if last is not None and self._boot() - last < watch_period(required) - 1e-3:
            return
        try:
            self.read()
        except Exception:  # the watch must outlive a bad read; the holder's clock restarts
            log.exception("idle watch: NVML read failed")
            with self._lock:
                self._book = IdleBook()

    def start(self) -> None:
        self._loop = Periodic("gpuguard-idle-watch", WAKE_SECONDS, self.tick)
        self._loop.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None:
            self._loop.stop(timeout)
