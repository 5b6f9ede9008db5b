"""The remediator's chain set, kept fresh between deliveries: launcher evidence a fork storm
cannot erase.

The remediator hears exits on its own listener but looks at a tree only when an alert is
delivered, minutes after the launcher died: by then other users' short-lived processes
may have pushed the launcher's record out of the listener's general ring, and the tree
would read launcher-unrecorded, which the default reasons do not reap. So this thread
reads NVML's holders every WATCH_PERIOD_SECONDS, walks the parent chain of each holder
it has not seen yet (stat reads only, no judgement) and hands the listener the chain set
(the chains and their session leaders): their exits are then kept apart
(gpuguard/host/events/watched.py).

A launcher alive at one of these reads is watched when it dies; one that dies before the
first read that sees its tree is taken from the ring at that read, which a storm must
outrun (the ring's 65,536 records within one period). A holder's chain is walked once, while
NVML lists its pid: what can change on it later is an ancestor dying (its exit is then
already kept) and an adoption, which changes no member's session. Cost per read: one NVML
reading; per new holder, one /proc/PID/stat read per chain member. Measured in
benchmarks/procevents_cost.py; see docs/remediator.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpuguard.host.counters import Counters
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.host.nvml import NvmlReading
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.chain import chain_set, holder_chain
from gpuguard.orphans.rules_config import Rules
from gpuguard.periodic import Periodic
from gpuguard.remediator.decision.inspection import HolderSource, read_within

log = logging.getLogger("gpuguard.remediator")

#: The exporter's default scan interval: the same window for a launcher that dies unseen.
WATCH_PERIOD_SECONDS = 5.0
#: The first read runs in start(): bounded, so a hung driver cannot hold the start up.
FIRST_READ_SECONDS = 5.0


class ChainWatch:
    """Publishes the chain set of NVML's holders to the remediator's listener."""

    def __init__(self, nvml: HolderSource, events: ProcessEvents, *,
                 rules: Callable[[], Rules], counters: Counters,
                 period: float = WATCH_PERIOD_SECONDS) -> None:
        self._nvml = nvml
        self._events = events
        self._rules = rules
        self._counters = counters
        self.period = period
        self._loop: Periodic | None = None
        self._failing = False
        self._chains: dict[int, frozenset[int]] = {}  # holder pid -> its whole chain's set
        self.reads = 0  # complete readings published
        self.walks = 0  # holders' chains walked

    def start(self) -> None:
        """Publish once now (the trees already there are watched before any delivery),
        then every period; nothing while the listener is unavailable."""
        if not self._events.available:
            return
        self.refresh(first=True)
        self._loop = Periodic("gpuguard-chain-watch", self.period, self.refresh,
                              first=self.period)
        self._loop.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None:
            self._loop.stop(timeout)

    def alive(self) -> bool:
        return self._loop is not None and self._loop.alive()

    def refresh(self, first: bool = False) -> None:
        """One read and publish; never raises (the watch outlives a bad read)."""
        try:
            reading = (read_within(self._nvml, FIRST_READ_SECONDS) if first
                       else self._nvml.read())
            self._publish(reading)
        except Exception as exc:
            if not self._failing:
                log.warning("chain watch: %s: %s (the last chain set stays watched)",
                            type(exc).__name__, exc)
            self._failing = True

    def _publish(self, reading: NvmlReading) -> None:
        # A reading that missed a GPU would stop watching that GPU's launchers: keep the
        # last set until a complete one comes.
        if not reading.up or reading.errors:
            return
        view = ProcessView(counters=self._counters)
        rules = self._rules()
        now: dict[int, frozenset[int]] = {}  # this reading's holders' sets
        whole: dict[int, frozenset[int]] = {}  # of those, the whole chains: kept
        for holder in reading.holders:
            pid = holder.pid
            if pid in now:
                continue  # the same process on another GPU
            known = self._chains.get(pid)
            if known is None:
                chain, complete = holder_chain(holder, view, rules)
                self.walks += 1
                known = chain_set([chain])
                if not complete:  # walked again next time: it may read whole then
                    now[pid] = known
                    continue
            now[pid] = whole[pid] = known
        self._chains = whole
        self._events.watch(frozenset().union(*now.values()))
        self.reads += 1
        self._failing = False
