"""A fork storm cannot erase a launcher's death (issue 48): real trees, the real listener,
the real remediator under the product's default reasons (`launcher-killed` only).

The listener's general ring of exits is bounded (65,536 records by default); any user's
short-lived processes push old records out of it, ~180 exits a second in 6 minutes, before
the first delivery of GPUOrphanTree. The exits that matter (the holders' chains and their
session leaders) are kept apart, in a store that exits of other processes cannot evict.
Here the ring is small (SMALL_EXIT_STORE) so that a storm of 1,024 exits is enough.

Marked `initial_pidns`: the kernel's process events (see tests/live/test_procevents.py).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
from collections.abc import Callable

import pytest

from gpuguard.base.counters import Counters
from gpuguard.config.remediate import Remediate
from gpuguard.engine.scan.chain_watch import ChainWatch
from gpuguard.engine.scan.scanner import Scanner
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.rules_config import Rules
from tests.support.ci import RUN_INITIAL_PIDNS, require
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import (
    SMALL_EXIT_STORE,
    Tree,
    Trees,
    exit_burst,
    reap_zombie_children,
    stat_fields,
    wait_for,
)
from tests.support.remediator_harness import (
    GIB,
    Harness,
    Orphan,
    account,
    payload,
    spawn_orphan,
)

pytestmark = pytest.mark.initial_pidns

#: The product's default `remediate.reasons`: only a death the kernel showed is reaped.
DEFAULT_REASONS = [str(r) for r in Remediate().reasons]


def small_listener() -> ProcessEvents:
    events = ProcessEvents(max_records=SMALL_EXIT_STORE)
    events.start()
    require(events.available, f"process-events connector unavailable "
            f"({events.unavailable_reason}); {RUN_INITIAL_PIDNS}")
    return events


def storm(events: ProcessEvents, trees: Trees, leader: int) -> None:
    """Exits of unrelated short-lived processes until `leader`'s record has left the
    listener's general ring (what erased the evidence before)."""
    exit_burst(trees)
    wait_for(lambda: events.evictions()["count"] > 0
             and leader not in {e.pid for e in events.records()},
             what=f"the general ring to lose the exit of {leader}")


def reaped_after_delivery(h: Harness, orphan: Orphan) -> dict:
    """Deliver GPUOrphanTree as the exporter labels it; the final audit record."""
    answer = account(h.post(payload(orphan.alert(reason="launcher-killed"))))
    assert answer["status"] == "accepted", answer
    h.settle()
    finals = [r for r in h.audit()
              if r["key"]["root_pid"] == orphan.root and r["phase"] == "final"]
    assert len(finals) == 1, finals
    return dict(finals[0])


def test_a_fork_storm_after_the_kill_leaves_the_tree_launcher_killed_and_reaped(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """The issue's reproduction: the remediator runs while the job does; its launcher is
    SIGKILLed; a storm of other exits overruns the ring before the alert is delivered.
    Before: launcher-unrecorded, reason-not-allowed, nothing reaped."""
    events = small_listener()
    orphan = spawn_orphan(trees, fake_gpu, orphan=False)
    leader = orphan.tree.launcher.pid
    h = harness(events=events, reasons=DEFAULT_REASONS)
    orphan.tree.kill_launcher()
    wait_for(lambda: events.exit_of(leader, after=0), what="the launcher's exit event")
    storm(events, trees, leader)
    final = reaped_after_delivery(h, orphan)
    assert final["decision"]["action"] == "reap", final["decision"]
    assert "launcher-killed" in final["decision"]["reason"] + final["decision"]["detail"]
    assert final["outcome"] == "reaped" and orphan.none_alive()


def test_a_tree_orphaned_before_the_remediator_looked_is_pinned_when_it_first_looks(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """The launcher died before the remediator ever saw its tree (the remediator started
    after the kill): the record still in the ring is taken into the kept store the first
    time the remediator sees the tree, and the storm that follows cannot erase it."""
    events = small_listener()
    orphan = spawn_orphan(trees, fake_gpu, orphan=False)
    leader = orphan.tree.launcher.pid
    orphan.tree.kill_launcher()
    wait_for(lambda: events.exit_of(leader, after=0), what="the launcher's exit event")
    h = harness(events=events, reasons=DEFAULT_REASONS)
    storm(events, trees, leader)
    final = reaped_after_delivery(h, orphan)
    assert final["decision"]["action"] == "reap", final["decision"]
    assert final["outcome"] == "reaped" and orphan.none_alive()


def test_the_exporter_scan_watches_each_holders_chain_and_session_leader(
        trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """The scan publishes its chain set (holder, ancestors, their session leaders) to the
    listener: the launcher's death, heard after the scan, survives a storm, and the set is
    what the listener tests each exit against (issue 49's early rescans use the same)."""
    events = small_listener()
    try:
        orphan = spawn_orphan(trees, fake_gpu, orphan=False)
        leader = orphan.tree.launcher.pid
        counters = Counters()
        scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters), counters=counters,
                          view=ProcessView(counters=counters, events=events),
                          watch=events.watch)
        scanner.scan_once()
        assert {orphan.holder, orphan.root, leader} <= events.watched()
        orphan.tree.kill_launcher()
        wait_for(lambda: events.exit_of(leader, after=0), what="the launcher's exit event")
        storm(events, trees, leader)
        (tree,) = [t for t in scanner.scan_once().trees if t.root_pid == orphan.root]
        assert tree.reason == "launcher-killed", tree.evidence  # no launcher memory here
        assert leader in events.watched()  # still the holder's session id
        assert events.watched_evictions() == 0
    finally:
        events.stop()


# -- one user's many holders against another user's launcher record (review of issue 48) ----

#: The hostile user: a uid with no passwd entry, as tests/live/test_users.py uses.
HOSTILE_UID = 54321
#: The watched store, scaled down as the review did (16,384 in the product): three chains
#: of ANCESTORS session leaders overfill it.
SMALL_WATCHED_STORE = 120
ANCESTORS = 48
#: One level of a hostile chain, run by `sh -c "$LEVEL" sh N` as HOSTILE_UID: N > 0 writes
#: its pid ("A PID") to fd 3 and runs level N-1 in a session of its own, waiting for it;
#: level 0 writes "H PID" and becomes the holder (sleep).
LEVEL = ('n=$1; if [ "$n" -gt 0 ]; then echo "A $$" >&3; '
         'setsid -w sh -c "$LEVEL" sh $((n-1)) & wait; '
         'else echo "H $$" >&3; exec sleep 3600; fi')
HOSTILE_TREE = (f"setpriv --reuid={HOSTILE_UID} --regid={HOSTILE_UID} --clear-groups "
                f'sh -c "$LEVEL" sh {ANCESTORS} 3>{{dir}}/pids & wait')


def hostile_chain(trees: Trees, fake_gpu: FakeGpuWorld) -> tuple[Tree, int, list[int]]:
    """A GPU holder of HOSTILE_UID under ANCESTORS live session leaders of its own:
    (its tree, the holder, the ancestors)."""
    tree = trees.spawn(HOSTILE_TREE, env={**os.environ, "LEVEL": LEVEL})
    pids = tree.dir / "pids"
    wait_for(lambda: pids.exists() and "H " in pids.read_text(), what="the hostile holder")
    ancestors, holder = [], 0
    for line in pids.read_text().splitlines():
        kind, pid = line.split()
        if kind == "A":
            ancestors.append(int(pid))
        else:
            holder = int(pid)
    assert len(ancestors) == ANCESTORS
    for pid in [holder, *ancestors]:  # recorded for cleanup, by pid and start time
        trees.pids.append((pid, stat_fields(pid)))
        trees.sessions.add(pid)
    wait_for(lambda: (stat_fields(holder) or {}).get("comm") == "sleep",
             what="the hostile holder to exec sleep")
    assert os.stat(f"/proc/{holder}").st_uid == HOSTILE_UID
    fake_gpu.add_process(0, holder, GIB)
    return tree, holder, ancestors


def test_a_user_with_many_holders_cannot_push_another_users_launcher_record_out(
        trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """The review's reproduction, scaled down: the victim's launcher is watched, then
    SIGKILLed; a hostile user's three holders, each under 48 session leaders, are watched,
    then every ancestor of theirs exits; an ordinary storm follows. Before: the store made
    room by dropping the oldest record of all, the victim's launcher's, and the victim's
    tree read launcher-unrecorded (not reaped by default). Now the remediator watches only
    the sessions of live chain members, and a full store drops the oldest record of the
    uid that holds the most: the hostile user's own."""
    require(os.geteuid() == 0, "needs root to run processes as another uid")
    require(shutil.which("setpriv") and shutil.which("setsid"),
            "setpriv or setsid not found (util-linux)")
    try:
        pytest.skip(f"uid {HOSTILE_UID} has a passwd entry here "
                    f"({pwd.getpwuid(HOSTILE_UID).pw_name})")
    except KeyError:
        pass
    events = ProcessEvents(max_records=SMALL_EXIT_STORE, max_watched=SMALL_WATCHED_STORE)
    events.start()
    require(events.available, f"process-events connector unavailable "
            f"({events.unavailable_reason}); {RUN_INITIAL_PIDNS}")
    try:
        counters = Counters()
        nvml = Nvml(counters=counters)
        watch = ChainWatch(nvml, events, rules=Rules, counters=counters)
        victim = spawn_orphan(trees, fake_gpu, orphan=False)
        leader = victim.tree.launcher.pid
        watch.refresh()
        assert leader in events.watched()
        # Only session ids are read as launcher evidence: the victim's holder, which
        # leads no session, is not watched by the remediator (the exporter's scan does).
        assert victim.holder not in events.watched()
        victim.tree.kill_launcher()
        wait_for(lambda: events.exit_of(leader, after=0), what="the launcher's exit event")

        hostile = [hostile_chain(trees, fake_gpu) for _ in range(3)]
        watch.refresh()
        # Alive, they lead the sessions of the holders' chains (the top level's is its
        # launcher's): each is watched, and its exit will be kept.
        dead = {pid for tree, _, ancestors in hostile for pid in [tree.sid, *ancestors[1:]]}
        assert dead <= events.watched()
        for tree, _, ancestors in hostile:
            tree.kill_launcher()
            for pid in ancestors:
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all(events.exit_of(pid, after=0) for pid in dead),
                 what="the hostile session leaders' exits")
        assert events.watched_evictions() > 0  # the store overflowed: the hostile user's
        reap_zombie_children()
        watch.refresh()
        assert not dead & events.watched()  # a dead ancestor's session is no one's now

        storm(events, trees, leader)
        died = events.exit_of(leader, after=0)
        assert died is not None and died.signal == signal.SIGKILL, (
            f"the victim's launcher record is gone; watched evictions: "
            f"{events.watched_evictions()}")
        scanner = Scanner(rules=Rules(), nvml=nvml, counters=counters,
                          view=ProcessView(counters=counters, events=events))
        (tree,) = [t for t in scanner.scan_once().trees if t.root_pid == victim.root]
        assert tree.reason == "launcher-killed", tree.evidence
    finally:
        events.stop()
