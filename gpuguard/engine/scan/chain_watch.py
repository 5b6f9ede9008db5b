"""The remediator's launcher sessions, kept fresh between deliveries: launcher evidence a
fork storm cannot erase.

The remediator hears exits on its own listener but looks at a tree only when an alert is
delivered, minutes after the launcher died: by then other users' short-lived processes
may have pushed the launcher's record out of the listener's general ring, and the tree
would read launcher-unrecorded, which the default reasons do not reap. So this thread
reads NVML's holders every WATCH_PERIOD_SECONDS, walks each holder's parent chain (stat
reads only, no judgement) and hands the listener the session ids of the chains' members,
each charged to the holder's uid (gpuguard/orphans/chain.py `session_set`): their exits
are then kept apart (gpuguard/host/events/watched.py).

Only session ids: the one exit the classifier reads is the adopted member's session
leader's, and the adopted member is a live chain member; ancestors that lead no session
would only take room. Only live members' sessions: a holder's chain is walked again at
the first read after the listener heard one of its ancestors exit (a lookup per member,
no /proc read), and every REWALK_READS reads whatever was heard; so an ancestor that
died leaves the set once no live member's session bears its pid (chains whose ancestors
are gone hold no room), and the adopter that took a member in is walked too.

A launcher alive at one read is watched when it dies (its session outlives it in the
member it orphaned); one that dies before the first read that sees its tree is taken from
the ring at that read, which a storm must outrun (the ring's 65,536 records within one
period). A store filled all the same (one user's hundreds of holders under 64-deep chains
of live session leaders) loses that user's records first. Cost per read: one NVML
reading, a listener lookup per cached chain member, and one /proc/PID/stat read per
member of a chain walked. Measured in benchmarks/procevents_cost.py; see
docs/remediator.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpuguard.base.counters import Counters
from gpuguard.base.periodic import Periodic
from gpuguard.engine.scan.inspection import HolderSource, read_within
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.chain import holder_chain, session_set
from gpuguard.orphans.process import ProcInfo
from gpuguard.orphans.rules_config import Rules

log = logging.getLogger("gpuguard.remediator")

#: The exporter's default scan interval: the same window for a launcher that dies unseen.
WATCH_PERIOD_SECONDS = 5.0
#: The first read runs in start(): bounded, so a hung driver cannot hold the start up.
FIRST_READ_SECONDS = 5.0
#: Every chain is walked afresh once in this many reads (60 s), whatever was heard: an
#: ancestor's exit the general ring lost under a storm, a member that called setsid().
REWALK_READS = 12


class ChainWatch:
    """Publishes the sessions of NVML's holders' chains to the remediator's listener."""

    def __init__(self, nvml: HolderSource, events: ProcessEvents, *,
                 rules: Callable[[], Rules], counters: Counters,
                 period: float = WATCH_PERIOD_SECONDS) -> None:
        self.nvml = nvml
        self._events = events
        self._rules = rules
        self._counters = counters
        self.period = period
        self._loop: Periodic | None = None
        self._failing = False
        #: Holder pid -> its chain as last walked, and whether that walk read it whole.
        self._chains: dict[int, tuple[tuple[ProcInfo, ...], bool]] = {}
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
            reading = (read_within(self.nvml, FIRST_READ_SECONDS) if first
                       else self.nvml.read())
            self._publish(reading)
        except Exception as exc:
            if not self._failing:
                log.warning("chain watch: %s: %s (the last chain set stays watched)",
                            type(exc).__name__, exc)
            self._failing = True

    def _publish(self, reading: GpuReading) -> None:
        # A reading that missed a GPU would stop watching that GPU's launchers: keep the
        # last set until a complete one comes.
        if not reading.up or reading.errors:
            return
        view = ProcessView(counters=self._counters)  # one stat read per pid per read
        rules = self._rules()
        backstop = self.reads % REWALK_READS == 0
        chains: dict[int, tuple[tuple[ProcInfo, ...], bool]] = {}
        now: dict[int, dict[int, int]] = {}  # holder pid -> its chain's sessions
        for holder in reading.holders:
            pid = holder.pid
            if pid in chains:
                continue  # the same process on another GPU
            known = self._chains.get(pid)
            if known is None or not known[1] or backstop or self._changed(known[0], view):
                chain, complete = holder_chain(holder, view, rules)
                self.walks += 1
                sessions = session_set([chain])
                if not complete and known is not None and known[1]:
                    # An ancestor died mid-walk: what the last whole walk read stays
                    # watched until the next walk reads whole.
                    sessions = {**session_set([known[0]]), **sessions}
                    chain, complete = known[0], False
                known = chain, complete
            else:
                sessions = session_set([known[0]])
            chains[pid], now[pid] = known, sessions
        self._chains = chains
        merged: dict[int, int] = {}
        for sets in now.values():
            for sid, uid in sets.items():
                merged[sid] = min(uid, merged.get(sid, uid))
        self._events.watch(merged)
        self.reads += 1
        self._failing = False

    def _changed(self, chain: tuple[ProcInfo, ...], view: ProcessView) -> bool:
        """An ancestor on `chain` has exited since it started (the listener heard it: one
        lookup each, no /proc read): its child was adopted, and its session may be no
        live member's any more."""
        events = self._events
        return any(events.exit_of(m.pid, after=view.wall_time(m.start_time)) is not None
                   for m in chain[1:])
