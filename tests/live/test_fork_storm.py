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

from collections.abc import Callable

import pytest

from gpuguard.config.remediate import Remediate
from gpuguard.exporter.scanner import Scanner
from gpuguard.host.counters import Counters
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.host.nvml import Nvml
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.rules_config import Rules
from tests.support.ci import RUN_INITIAL_PIDNS, require
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import SMALL_EXIT_STORE, Trees, exit_burst, wait_for
from tests.support.remediator_harness import (
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
