"""The lab preset (deploy/systemd/gpuguard-lab.yml, issue 50) against real `launcher-exited`
trees: a launcher that exits by itself with its job running below it, heard by the real
process-event listener, judged by the in-process remediator over the fake NVML (fresh
samples for a busy holder, none for an idle one). `remediate.idle_reasons` allows the
reason only for a tree idle its stated time: busy, kept; idle past the limit, reaped;
idleness unknown, kept. The remediator's clock is a FakeClock: the preset's real hour
passes in reads of its own watch, one per watch period.

The kernel reports host pids, so these are `initial_pidns` tests (see
tests/live/test_launcher_evidence.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.engine.scan.idle_watch import watch_period
from gpuguard.host.events.listener import ProcessEvents
from tests.support.ci import RUN_INITIAL_PIDNS, require
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, wait_for
from tests.support.remediator_harness import (
    FakeClock,
    Harness,
    Orphan,
    account,
    alert,
    payload,
    spawn_orphan,
)

pytestmark = pytest.mark.initial_pidns

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "deploy" / "systemd" / "gpuguard-lab.yml"
#: The launcher (a session leader) starts sh -> holder and leaves at once, status 0.
LEAVES = 'sh -c "{holder} --pidfile {dir}/holder" & echo $! > {dir}/root; exit 0'
HOUR = 3600.0


def lab_policy() -> dict[str, Any]:
    """The preset's reasons and idle_reasons as shipped; the harness's test policy for the
    rest (enforce, no minimum age, the tests' own user allowed)."""
    section = yaml.safe_load(LAB.read_text())["remediate"]
    assert section["idle_reasons"]["launcher-exited"] == "1h"
    return {"reasons": section["reasons"], "idle_reasons": section["idle_reasons"]}


@pytest.fixture
def events() -> Iterator[ProcessEvents]:
    listener = ProcessEvents()
    listener.start()
    require(listener.available, f"no process-events connector here "
            f"({listener.unavailable_reason}); {RUN_INITIAL_PIDNS}")
    try:
        yield listener
    finally:
        listener.stop()


def launcher_exited(trees: Trees, fake_gpu: FakeGpuWorld, events: ProcessEvents) -> Orphan:
    """`cmd &; exit 0`: the launcher leaves by itself, its job holds GPU 0 below it."""
    orphan = spawn_orphan(trees, fake_gpu, LEAVES, orphan=False)
    leader = orphan.tree.launcher.pid
    orphan.tree.launcher.wait(timeout=10)
    wait_for(lambda: events.exit_of(leader, after=0), what="the launcher's exit event")
    return orphan


def lab(harness: Callable[..., Harness], events: ProcessEvents,
        clock: FakeClock) -> Harness:
    return harness(events=events, clock=clock, **lab_policy())


def deliver(h: Harness, orphan: Orphan) -> dict[str, Any]:
    """One delivery (the exporter's reason label), the worker finished; its decision."""
    answer = account(h.post(payload(alert(orphan.root, orphan.root_start,
                                          reason="launcher-exited"))))
    assert answer["status"] == "accepted", answer
    h.settle()
    (decision,) = [d for d in h.service.snapshot()["recent_decisions"]
                   if d["fingerprint"] == answer["fingerprint"] and d["action"] != "accept"]
    return decision


def elapse(h: Harness, clock: FakeClock, seconds: float) -> None:
    """`seconds` pass on the remediator's clock with its watch reading once a period, as
    its thread does (a jump with no read is a stall, which restarts every idle clock)."""
    step = watch_period(HOUR)
    left = seconds
    while left > 0:
        clock.now += min(step, left)
        left -= step
        h.service.idle.read()
    h.service.wake()


def test_an_idle_launcher_exited_tree_is_reaped_past_its_hour(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        events: ProcessEvents) -> None:
    orphan = launcher_exited(trees, fake_gpu, events)
    clock = FakeClock()
    h = lab(harness, events, clock)
    first = deliver(h, orphan)
    # Allowed only when idle: the watch has only just begun to look.
    assert (first["action"], first["reason"]) == ("ignore", "not-idle"), first
    assert "remediate.idle_reasons.launcher-exited is 3600s" in first["detail"], first
    elapse(h, clock, HOUR - 60)
    early = deliver(h, orphan)
    assert early["reason"] == "not-idle" and orphan.all_alive(), early
    elapse(h, clock, 61)
    reaped = deliver(h, orphan)
    assert reaped["action"] == "reap", reaped
    wait_for(orphan.none_alive, what="the idle launcher-exited tree to be reaped")
    finals = [r for r in h.audit()
              if r["key"]["root_pid"] == orphan.root and r["phase"] == "final"]
    assert [(r["decision"]["reason"], r["outcome"]) for r in finals][-1] == (
        "launcher-exited", "reaped"), finals
    assert all(r["signals"] == [] for r in finals[:-1])  # the refusals sent nothing


def test_a_busy_launcher_exited_tree_is_kept(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        events: ProcessEvents) -> None:
    """Someone's run left with `cmd &; exit` that still computes: kept, however long."""
    orphan = launcher_exited(trees, fake_gpu, events)
    fake_gpu.set_busy(0, orphan.holder, sm_util=80, mem_util=30)
    clock = FakeClock()
    h = lab(harness, events, clock)
    deliver(h, orphan)
    elapse(h, clock, 2 * HOUR)
    decision = deliver(h, orphan)
    assert (decision["action"], decision["reason"]) == ("ignore", "not-idle"), decision
    assert "used an SM 0s ago" in decision["detail"], decision
    assert orphan.all_alive()


def test_a_launcher_exited_tree_whose_idleness_is_unknown_is_kept(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        events: ProcessEvents) -> None:
    """NVML gives no per-process utilization (MIG, vGPU, an older GPU): missing evidence
    never kills, so the preset reaps nothing of this reason there."""
    orphan = launcher_exited(trees, fake_gpu, events)
    fake_gpu.set_not_supported(0, "processes_utilization")
    fake_gpu.set_not_supported(0, "process_utilization")
    clock = FakeClock()
    h = lab(harness, events, clock)
    deliver(h, orphan)
    elapse(h, clock, 2 * HOUR)
    decision = deliver(h, orphan)
    assert (decision["action"], decision["reason"]) == ("ignore", "idle-unknown"), decision
    assert "remediate.idle_reasons.launcher-exited" in decision["detail"], decision
    assert orphan.all_alive()
    assert {r["decision"]["reason"] for r in h.audit()
            if r["key"]["root_pid"] == orphan.root} == {"idle-unknown"}
