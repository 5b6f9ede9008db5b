"""The structural cost property: a scan's /proc reads do not depend on the host's process count.

Counted, never timed: the assertions are on gpuguard_inspector_proc_reads_total
deltas from a fresh registry, so they hold on a loaded CI machine too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpuguard.base.counters import CALLSITES, Counters
from gpuguard.engine.scan.scanner import Scanner
from gpuguard.exporter.metrics import GpuguardCollector
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.rules_config import Rules
from tests.support.ci import RUN_INITIAL_PIDNS, require
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, chain_lower_bound, children_of, descendants_of, wait_for

GIB = 2**30
EXTRA = 2000


def reads(registry: CollectorRegistry, callsite: str | None = None) -> float:
    sites = [callsite] if callsite else list(CALLSITES)
    return sum(registry.get_sample_value("gpuguard_inspector_proc_reads_total",
                                         {"callsite": c}) or 0 for c in sites)


def warm_scan_reads(scanner: Scanner, registry: CollectorRegistry) -> dict[str, float]:
    scanner.scan_once()  # warm the identity cache
    before = {c: reads(registry, c) for c in CALLSITES}
    scanner.scan_once()
    return {c: reads(registry, c) - before[c] for c in CALLSITES}


def test_reads_per_scan_ignore_unrelated_processes(trees: Trees, fake_gpu: FakeGpuWorld,
                                                   tmp_path: Path) -> None:
    orphan = trees.spawn("sh -c '{holder} --pidfile {dir}/worker & echo $$ > {dir}/sh; wait' "
                         "& wait")
    healthy = trees.spawn("{holder} --pidfile {dir}/worker & wait")
    holders = [orphan.pid("worker"), healthy.pid("worker")]
    for pid in holders:
        fake_gpu.add_process(0, pid, GIB)
    orphan.pid("sh")
    orphan.kill_launcher()

    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters),
                      view=ProcessView(counters=counters), counters=counters)
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="test"))
    verdicts = {t.verdict for t in scanner.scan_once().trees}
    assert verdicts == {"orphan", "normal"}

    quiet = warm_scan_reads(scanner, registry)
    # A warm scan reads only stat (plus the orphan's member walk): no extras again. The walk
    # re-reads each member that has children once, after its children file (pid reuse).
    assert {c for c, n in quiet.items() if n} <= {"proc_stat", "proc_children"}
    sh = orphan.pid("sh")
    parents = [p for p in [sh, *descendants_of(sh)] if children_of(p)]
    assert parents == [sh]
    assert quiet["proc_stat"] <= chain_lower_bound(holders) + len(parents)

    crowd = trees.spawn(f"for i in $(seq {EXTRA}); do sleep 3600 & done; "
                        "echo done > {dir}/ready; wait")
    wait_for(lambda: (crowd.dir / "ready").exists(), timeout=60, what="2,000 sleepers")
    busy = warm_scan_reads(scanner, registry)
    assert busy == quiet, f"reads changed with {EXTRA} extra processes: {quiet} -> {busy}"
    scans = registry.get_sample_value("gpuguard_scans_total")
    assert scans == 5


@pytest.mark.initial_pidns
def test_a_burst_of_process_exits_changes_no_scan_read(trees: Trees,
                                                       fake_gpu: FakeGpuWorld) -> None:
    """5,000 short processes exit while the listener runs: its record grows, the scan's
    /proc reads do not (the evidence is a lookup in memory)."""
    from gpuguard.host.events.listener import ProcessEvents

    events = ProcessEvents()
    events.start()
    try:
        require(events.available, f"process-events connector unavailable "
                f"({events.unavailable_reason}); {RUN_INITIAL_PIDNS}")
        tree = trees.spawn("sh -c '{holder} --pidfile {dir}/worker & echo $$ > {dir}/sh; "
                           "wait' & wait")
        fake_gpu.add_process(0, tree.pid("worker"), GIB)
        tree.pid("sh")
        tree.kill_launcher()
        counters = Counters()
        scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters), counters=counters,
                          view=ProcessView(counters=counters, events=events))
        registry = CollectorRegistry()
        registry.register(GpuguardCollector(scanner, hostname="test", events=events))
        before = warm_scan_reads(scanner, registry)
        seen = events.counts()["exit"]
        burst = trees.spawn("for i in $(seq 5000); do /bin/true; done; echo done > {dir}/ok")
        wait_for(lambda: (burst.dir / "ok").exists(), timeout=120, what="5,000 exits")
        wait_for(lambda: events.counts()["exit"] + events.counts()["dropped"]
                 >= seen + 5000, timeout=30, what="the burst's events, read or counted")
        assert warm_scan_reads(scanner, registry) == before
    finally:
        events.stop()


THREADS = 2000


def test_a_thread_heavy_orphan_is_read_in_turns_not_every_thread_every_scan(
        trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """An orphan holder of 2,000 threads (issue 48: 20,000 made every scan 530 ms): a warm
    scan reads the children files of its main thread, of its new threads and of
    SCAN_THREAD_TURNS others in turn, not all 2,001; and a child forked by one of its
    other threads after the first scan still joins the tree within a round of turns."""
    import math
    import signal

    from gpuguard.host.procfs import SCAN_THREAD_TURNS
    from tests.support.remediator_harness import spawn_orphan

    script = (f'sh -c "{{holder}} --threads {THREADS} --thread-fork-on-usr1 '
              '--pidfile {dir}/holder" & echo $! > {dir}/root; wait')
    orphan = spawn_orphan(trees, fake_gpu, script)
    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters), counters=counters)
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="test"))
    (tree,) = scanner.scan_once().trees
    assert (tree.verdict, len(tree.members)) == ("orphan", 2), tree.evidence
    quiet = warm_scan_reads(scanner, registry)
    # the root's one thread, the holder's listing, its main thread and one turn
    assert quiet["proc_children"] <= 2 + 2 + SCAN_THREAD_TURNS, quiet

    os.kill(orphan.holder, signal.SIGUSR1)  # a thread other than the main one forks
    child_file = orphan.tree.dir / "holder.child"
    child = int(wait_for(lambda: child_file.exists() and child_file.read_text(),
                         what="the thread's child"))
    rounds = math.ceil((THREADS + 1) / SCAN_THREAD_TURNS) + 1
    for _ in range(rounds):
        (tree,) = scanner.scan_once().trees
        if child in {m.pid for m in tree.members}:
            break
    assert child in {m.pid for m in tree.members}, (child, [m.pid for m in tree.members])
