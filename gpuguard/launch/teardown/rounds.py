"""The teardown's rounds: every live descendant of the launcher reaped, root by root,
until none is left but what its user marked to keep.

The reaper reaps one tree under one root; a subreaper's descendants hang under each of
its children, so each child roots one reap (reaping.RootReaper), CMD first. A member
dying mid-reap hands its children to the launcher, already held by that reap; a round
lists the launcher's children again until none is left, so whatever was handed over
after a listing is caught by the next round.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from gpuguard.base.counters import Counters
from gpuguard.engine.reap.outcome import Outcome, ReapResult
from gpuguard.host.procfs import ProcessView
from gpuguard.launch.options import Options
from gpuguard.launch.subreaper import collect_zombies
from gpuguard.launch.teardown.keeping import honoured
from gpuguard.launch.teardown.reaping import RootReaper
from gpuguard.launch.teardown.report import MORE_ROUNDS_SECONDS, Identity, Teardown, summarise
from gpuguard.orphans.process import ProcInfo, live_children
from gpuguard.orphans.protections import Protection

#: While a member the kernel refused to stop still runs, the teardown watches it this long
#: after a round for what a reap can catch: a new child (it forks when its last one is
#: frozen), or the member itself become the user's (a setuid program dropping root).
RELEASED_WATCH_SECONDS = 1.0
RELEASED_POLL_SECONDS = 0.02


@dataclass
class Rounds:
    """What the rounds of one teardown have done so far."""

    results: list[ReapResult] = field(default_factory=list)
    #: Not tried again by the next rounds, and reported once: survivors, members let go
    #: of, roots a reap refused, members kept (what is below them is theirs).
    done: set[Identity] = field(default_factory=set)
    released: set[Identity] = field(default_factory=set)  # their SIGSTOP refused
    retried: set[Identity] = field(default_factory=set)  # released, then tried once more

    def record(self, root: ProcInfo, result: ReapResult) -> None:
        self.results.append(result)
        let_go = {(m.pid, m.start_time) for m in result.released}
        self.done |= {(m.pid, m.start_time) for m in result.members if m.pid in result.survivors}
        self.done |= let_go | {(k.member.pid, k.member.start_time) for k in result.kept}
        self.released |= let_go
        if result.outcome is Outcome.ABORTED:
            self.done.add(root.identity)

    def retry(self, still: list[ProcInfo]) -> bool:
        """A released member that may now be signalled is one more tree for the next
        listing (its parent is the launcher or another released member: all else is
        gone); each once: an LSM may allow signal 0 and still refuse SIGSTOP."""
        again = {m.identity for m in still if m.identity not in self.retried and may_signal(m.pid)}
        self.retried |= again
        self.done -= again
        self.released -= again
        return bool(again)


def reap_tree(options: Options, *, counters: Counters | None = None,
              kept: frozenset[Identity] = frozenset(),
              marks: tuple[Protection, ...] = honoured(False)) -> Teardown:
    """Reap every live descendant of this process, round after round (for at most
    MORE_ROUNDS_SECONDS after the first one). `kept`: children of ours (the pidns tier's
    init) that are not reaped, but what is below them is. `marks`: the keep marks that
    keep a member and what is below it (keeping.honoured)."""
    counters = counters if counters is not None else Counters()
    reaper = RootReaper(options, counters, marks)
    state = Rounds()
    left: list[ProcInfo] = []
    live: set[Identity] = set()  # released or retried, and live at the last read
    rounds = 0
    more_until: float | None = None  # no round starts after this (set by the first)
    watch_until: float | None = None  # released members are watched until then
    while True:
        view = ProcessView(counters=counters)
        me = view.fresh_stat(os.getpid())
        assert me is not None
        # The children of a released member are ours to reap too (the reaper never walks
        # below a member it let go of); so are theirs, walked from there.
        # Read before the listing below, so a member not live here had its children
        # (handed to us when it exited) listed after: "gone by the end" is this read's.
        watched = released_alive(view, state.released | state.retried)
        live = {m.identity for m in watched}
        still = [m for m in watched if m.identity in state.released]
        holders = (*still, *released_alive(view, set(kept)))
        left = [c for parent in (me, *holders) for c in children(view, parent)
                if c.identity not in state.done and c.identity not in kept]
        now = time.monotonic()
        if more_until is not None and now >= more_until:
            break
        if not left:
            if state.retry(still):
                continue
            if not still:
                break
            watch_until = watch_until if watch_until is not None else (
                now + RELEASED_WATCH_SECONDS)
            if now >= watch_until:
                break
            time.sleep(RELEASED_POLL_SECONDS)
            continue
        watch_until = None
        rounds += 1
        for root in left:
            state.record(root, reaper.reap(root, view))
        collect_zombies()
        if more_until is None:
            more_until = time.monotonic() + MORE_ROUNDS_SECONDS
    return summarise(state.results, left, rounds,
                     frozenset((state.released | state.retried) - live))


def children(view: ProcessView, parent: ProcInfo) -> tuple[ProcInfo, ...]:
    """`parent`'s live children, by identity, read now (for the launcher: CMD and every
    descendant adopted since; for a released member, what it started). A released
    member's pid may be reused after `released_alive` read it: `live_children` re-reads
    the parent after its children file, as the walk does. A child whose main thread
    called pthread_exit() while others run (state Z) is a live child."""
    return live_children(parent, view.children, view.fresh_stat, view.fresh_stat,
                         view.thread_states)


def may_signal(pid: int) -> bool:
    """Whether the kernel would let this process signal `pid` now (signal 0 delivers
    nothing, so a reused pid costs no wrong signal: the reap re-checks identity)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def released_alive(view: ProcessView, released: set[Identity]) -> list[ProcInfo]:
    """The members a reap let go of that still run (ProcInfo.is_live), as read now."""
    out = []
    for pid, start_time in sorted(released):
        info = view.fresh_stat(pid)
        if (info is not None and info.start_time == start_time
                and info.is_live(view.thread_states)):
            out.append(info)
    return out
