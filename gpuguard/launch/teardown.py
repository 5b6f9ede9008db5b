"""The teardown: reap every live descendant of the launcher with the remediator's reaper.

The same verified reap as the remediator's (identity by pidfd, freeze, TERM, grace, KILL,
confirm), never a pid list or a process-group kill; its result is one stderr line.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gpuguard.config.remediate import Mode, Remediate, UserFilter
from gpuguard.host.counters import Counters
from gpuguard.host.nvml import NvmlReading
from gpuguard.host.procfs import ProcessView
from gpuguard.launch.events import Options
from gpuguard.launch.subreaper import collect_zombies
from gpuguard.orphans.process import ProcInfo, live_children, walk_members
from gpuguard.orphans.rules_config import Rules
from gpuguard.remediator.decision.inspection import member_of, protected_pids
from gpuguard.remediator.decision.tree import Member, TreeKey
from gpuguard.remediator.reap.outcome import Outcome, ReapResult
from gpuguard.remediator.reap.reap_plan import ReapPlan
from gpuguard.remediator.reap.reaper import Reaper

#: A tree that grows faster than it can be frozen this long is left (and reported).
REAP_DEADLINE_SECONDS = 30.0
#: Rounds of reaps go on while dying members hand the launcher new children; no round
#: starts once this long has passed since the first one ended (what is left is reported).
MORE_ROUNDS_SECONDS = 60.0
#: While a member the kernel refused to stop still runs, the teardown watches it this long
#: after a round for what a reap can catch: a new child (it forks when its last one is
#: frozen), or the member itself become the user's (a setuid program dropping root).
RELEASED_WATCH_SECONDS = 1.0
RELEASED_POLL_SECONDS = 0.02


@dataclass(frozen=True)
class Teardown:
    """What the reaps of one teardown did, for the one stderr line."""

    killed: tuple[Member, ...] = ()
    survivors: tuple[Member, ...] = ()  # survived SIGKILL
    refused: tuple[Member, ...] = ()  # the kernel refused their SIGSTOP: left untouched
    exited: tuple[Member, ...] = ()  # refused so, and gone by the teardown's last read
    problems: tuple[str, ...] = ()  # reaps that refused or failed, and why; each once


def launcher_words(detail: str) -> str:
    """The reaper's details are written for the remediator; the launcher's line names
    itself and its own deadline instead."""
    return (detail.replace("remediate.worker_timeout_seconds",
                           f"the launcher's {REAP_DEADLINE_SECONDS:g} s reap deadline")
            .replace("the remediator", "the launcher"))


def summarise(results: Sequence[ReapResult], left: Sequence[ProcInfo],
              rounds: int = 0, ended: frozenset[tuple[int, int]] = frozenset()) -> Teardown:
    """`left`: children still below the launcher after the last of `rounds` rounds, not
    accounted for. `ended`: the (pid, start time) of members let go of that no longer
    ran at the last read (gone, by whatever hand): not survivors."""
    killed: list[Member] = []
    survivors: list[Member] = []
    refused: list[Member] = []
    problems: list[str] = []
    for result in results:
        refused += result.released
        if result.outcome in (Outcome.REAPED, Outcome.FAILED):
            gone = set(result.survivors)
            killed += [m for m in result.members if m.pid not in gone]
            survivors += [m for m in result.members if m.pid in gone]
    # A member let go of in one round and reaped by a later one (it dropped root) is
    # reported as what happened to it last; one let go of again by its retry (the
    # kernel allowed signal 0 but refused SIGSTOP) is named once.
    seen = {(m.pid, m.start_time) for m in (*killed, *survivors)}
    once: list[Member] = []
    for member in refused:
        if (member.pid, member.start_time) not in seen:
            seen.add((member.pid, member.start_time))
            once.append(member)
    exited = [m for m in once if (m.pid, m.start_time) in ended]
    refused = [m for m in once if (m.pid, m.start_time) not in ended]
    for result in results:
        if (result.outcome not in (Outcome.REAPED, Outcome.FAILED)
                and result.reason not in ("root-gone", "root-replaced")):  # exited: fine
            problem = f"{result.reason}: {launcher_words(result.detail)}"
            if problem not in problems:
                problems.append(problem)
    if left:
        problems.append(f"{len(left)} process(es) still below the launcher after "
                        f"{rounds} rounds (the tree kept handing it new children for "
                        f"{MORE_ROUNDS_SECONDS:g} s)")
    return Teardown(tuple(killed), tuple(survivors), tuple(refused), tuple(exited),
                    tuple(problems))


def teardown_line(why: str, teardown: Teardown) -> str | None:
    """The one stderr line a teardown writes; None when there was nothing to reap."""
    if not (teardown.killed or teardown.survivors or teardown.refused or teardown.exited
            or teardown.problems):
        return None

    def names(members: Sequence[Member]) -> str:
        return ", ".join(f"{m.pid} ({m.comm})" for m in members)

    parts = [f"gpuguard run: {why}: reaped {len(teardown.killed)} process(es)"
             + (f": {names(teardown.killed)}" if teardown.killed else "")]
    if teardown.survivors:
        parts.append(f"{len(teardown.survivors)} survived SIGKILL: {names(teardown.survivors)}")
    if teardown.refused:
        parts.append(f"{len(teardown.refused)} survived, not signalled (the kernel refused "
                     "the launcher's SIGSTOP: another user's process, such as a setuid-root "
                     f"program; needs root or CAP_KILL): {names(teardown.refused)}")
    if teardown.exited:
        parts.append(f"{len(teardown.exited)} not signalled (the kernel refused the "
                     f"launcher's SIGSTOP), gone by the end: {names(teardown.exited)}")
    parts += teardown.problems
    return "; ".join(parts)


class _NoGpus:
    """The reaper's NVML, for a reap that GPU holders do not decide.

    The remediator's reap re-reads NVML to confirm no unjudged holder joined; the
    launcher reaps its own tree whoever holds GPU memory (force=True: no holder check),
    so it answers "up, nothing held" instead of loading NVML into every launcher.
    """

    #: read_within() calls it in place, on no thread (the pidns tier's launcher has none).
    never_blocks = True

    def read(self) -> NvmlReading:
        return NvmlReading(True, None, (), (), ())


def _no_audit(_phase: str, _members: tuple[Member, ...]) -> None:
    """The reaper's write-ahead journal: the launcher reaps the user's own tree,
    unprivileged, and writes no audit file; its record is the one stderr line."""


def policy_for(options: Options) -> Remediate:
    """The reaper's guards for the launcher's own tree: every descendant, whoever owns it
    (a root launcher's tree is root-owned); pid 1, kernel threads, the launcher and its
    ancestors stay refused by the reaper itself."""
    return Remediate(mode=Mode.ENFORCE, term_timeout_seconds=options.grace, allow_root_owned=True,
                     users=UserFilter(allow=("*",), deny=()), allow_without_pidfd=False)


def children(view: ProcessView, parent: ProcInfo) -> tuple[ProcInfo, ...]:
    """`parent`'s live children, by identity, read now (for the launcher: CMD and every
    descendant adopted since; for a released member, what it started). A released
    member's pid may be reused after `released_alive` read it: `live_children` re-reads
    the parent after its children file, as the walk does. A child whose main thread
    called pthread_exit() while others run (state Z) is a live child."""
    return live_children(parent, view.children, view.fresh_stat, view.fresh_stat,
                         view.thread_states)


def reap_tree(options: Options, *, counters: Counters | None = None,
              kept: frozenset[tuple[int, int]] = frozenset()) -> Teardown:
    """Reap every live descendant of this process with the remediator's reaper.

    The reaper reaps one tree under one root; a subreaper's descendants hang under
    each of its children, so each child roots one reap (members walked with the
    classifier's walk_members), CMD first. A member dying mid-reap hands its children
    to us, already held by that reap; a round lists our children again until none is
    left, so whatever was handed over after a listing is caught by the next round
    (for at most MORE_ROUNDS_SECONDS after the first round). `kept`: children of ours
    (the pidns tier's init) that are not reaped, but what is below them is.
    """
    counters = counters if counters is not None else Counters()
    # A member whose SIGSTOP the kernel refuses (a setuid-root helper under an
    # unprivileged launcher) is let go of; the rest of the tree is still reaped.
    reaper = Reaper(nvml=_NoGpus(), counters=counters, refused_stop="release")
    policy = policy_for(options)
    guarded = protected_pids()
    hostname = socket.gethostname()
    results: list[ReapResult] = []
    left: list[ProcInfo] = []
    # Processes a reap could not kill (survivors, released members, roots a reap refused):
    # not tried again by the next rounds, and reported once.
    done: set[tuple[int, int]] = set()
    released: set[tuple[int, int]] = set()
    retried: set[tuple[int, int]] = set()
    live: set[tuple[int, int]] = set()  # released or retried, and live at the last read
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
        watched = released_alive(view, released | retried)
        live = {m.identity for m in watched}
        still = [m for m in watched if m.identity in released]
        holders = (*still, *released_alive(view, set(kept)))
        left = [c for parent in (me, *holders) for c in children(view, parent)
                if c.identity not in done and c.identity not in kept]
        now = time.monotonic()
        if more_until is not None and now >= more_until:
            break
        if not left:
            # A released member that may now be signalled is one more tree for the next
            # listing (its parent is us or another released member: all else is gone).
            retry = {m.identity for m in still
                     if m.identity not in retried and may_signal(m.pid)}
            if retry:  # each once: an LSM may allow signal 0 and still refuse SIGSTOP
                retried |= retry
                done -= retry
                released -= retry
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
            members = walk_members(root, view.children, view.stat, view.fresh_stat,
                                   view.thread_states)
            plan = ReapPlan(key=TreeKey(hostname, root.pid, root.start_time),
                            members=tuple(member_of(m, view) for m in members),
                            holders=(), gpu_bytes=0, dry_run=False,
                            classified=False)  # its own tree: no verdict to re-derive
            result = reaper.reap(plan, policy=policy, rules=Rules(), protected_pids=guarded,
                                 deadline=time.monotonic() + REAP_DEADLINE_SECONDS,
                                 journal=_no_audit, force=True)
            results.append(result)
            done |= {(m.pid, m.start_time) for m in result.members if m.pid in result.survivors}
            done |= {(m.pid, m.start_time) for m in result.released}
            released |= {(m.pid, m.start_time) for m in result.released}
            if result.outcome is Outcome.ABORTED:
                done.add(root.identity)
        collect_zombies()
        if more_until is None:
            more_until = time.monotonic() + MORE_ROUNDS_SECONDS
    return summarise(results, left, rounds, frozenset((released | retried) - live))


def may_signal(pid: int) -> bool:
    """Whether the kernel would let this process signal `pid` now (signal 0 delivers
    nothing, so a reused pid costs no wrong signal: the reap re-checks identity)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def released_alive(view: ProcessView, released: set[tuple[int, int]]) -> list[ProcInfo]:
    """The members a reap let go of that still run (ProcInfo.is_live), as read now."""
    out = []
    for pid, start_time in sorted(released):
        info = view.fresh_stat(pid)
        if (info is not None and info.start_time == start_time
                and info.is_live(view.thread_states)):
            out.append(info)
    return out
