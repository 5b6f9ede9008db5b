"""remediate.require_idle_seconds: the remediator reaps an orphan only when its own watch
has seen every holder idle that long; real trees over the fake NVML, which serves fresh
samples for a busy process and none for an idle one."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuguard.console.contract import EXIT_REFUSED
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, wait_for
from tests.support.remediator_harness import (
    FakeClock,
    Harness,
    Orphan,
    Run,
    account,
    payload,
    spawn_orphan,
    write_config,
)

REQUIRED = 60


def deliver(h: Harness, orphan: Orphan) -> dict[str, Any]:
    """One delivery for `orphan`, the worker finished; the decision it made."""
    answer = account(h.post(payload(orphan.alert())))
    assert answer["status"] == "accepted", answer
    h.settle()
    (decision,) = [d for d in h.service.snapshot()["recent_decisions"]
                   if d["fingerprint"] == answer["fingerprint"] and d["action"] != "accept"]
    return decision


def elapse(h: Harness, clock: FakeClock, seconds: float, step: float = 1.0, *,
           driver: FakeGpuWorld | None = None) -> None:
    """Let `seconds` pass on the remediator's clock with its watch reading along the way
    (as its thread does, every period): a jump with no read is a stall, which restarts
    every idle clock (see test_a_stalled_watch_restarts_the_clock). With `driver`, the
    fake NVML's clock (which stamps its busy samples) reads the same wall clock."""
    left = seconds
    while left > 0:
        clock.now += min(step, left)
        left -= step
        if driver is not None:
            driver.set_clock(clock.now)
        h.service.idle.read()
    h.service.wake()


def test_an_idle_orphan_is_reaped_once_watched_long_enough(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    clock = FakeClock()
    h = harness(clock=clock, require_idle_seconds=REQUIRED)
    orphan = spawn_orphan(trees, fake_gpu)
    first = deliver(h, orphan)
    # The watch has only just seen it: not yet evidence of an idle minute.
    assert (first["action"], first["reason"]) == ("ignore", "not-idle"), first
    assert "watched for only" in first["detail"]
    assert orphan.all_alive()
    elapse(h, clock, REQUIRED + 1)
    reaped = deliver(h, orphan)
    assert reaped["action"] == "reap", reaped
    wait_for(orphan.none_alive, what="the idle orphan to be reaped")
    finals = [r for r in h.audit()
              if r["key"]["root_pid"] == orphan.root and r["phase"] == "final"]
    # The refusal was audited (no signal), then the reap.
    assert [(r["decision"]["reason"], r["outcome"]) for r in finals] == [
        ("not-idle", None), ("session-ended", "reaped")]
    assert finals[0]["signals"] == []


def test_a_refusal_for_a_short_requirement_does_not_hold_the_tree_for_a_minute(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """A refused tree is re-inspected no sooner than a minute later, unless its refusal
    says when it could pass: a 5 s requirement reaps on the delivery 6 s later."""
    clock = FakeClock()
    h = harness(clock=clock, require_idle_seconds=5)
    orphan = spawn_orphan(trees, fake_gpu)
    assert deliver(h, orphan)["reason"] == "not-idle"
    elapse(h, clock, 6, step=0.5)
    assert deliver(h, orphan)["action"] == "reap"
    wait_for(orphan.none_alive, what="the idle orphan to be reaped")


def test_a_busy_orphan_is_refused(harness: Callable[..., Harness], trees: Trees,
                                  fake_gpu: FakeGpuWorld) -> None:
    clock = FakeClock()
    h = harness(clock=clock, require_idle_seconds=REQUIRED)
    orphan = spawn_orphan(trees, fake_gpu)
    fake_gpu.set_busy(0, orphan.holder)
    deliver(h, orphan)
    elapse(h, clock, REQUIRED + 1)
    decision = deliver(h, orphan)
    assert (decision["action"], decision["reason"]) == ("ignore", "not-idle"), decision
    assert "used an SM 0s ago" in decision["detail"]
    assert orphan.all_alive()


def test_a_wall_clock_step_back_never_makes_a_busy_holder_idle(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """gpuguard issue 47: NTP steps a fast clock back an hour while a holder computes at
    100% SM. NVML stamps its samples with the wall clock, so every new one is older than
    the newest the watch had seen; asked for samples newer than that, NVML answered
    NOT_FOUND, which read as "no SM used", and the busy holder was reaped as idle a
    minute later. The step makes every holder unknown and the watch starts again, asking
    from the new wall time: the holder reads busy again, never idle."""
    clock = FakeClock()
    fake_gpu.set_clock(clock.now)
    h = harness(clock=clock, require_idle_seconds=REQUIRED)
    orphan = spawn_orphan(trees, fake_gpu)
    fake_gpu.set_busy(0, orphan.holder, sm_util=100, mem_util=0)
    assert deliver(h, orphan)["reason"] == "not-idle"
    elapse(h, clock, 10, driver=fake_gpu)
    clock.step(-3600)
    fake_gpu.set_clock(clock.now)
    elapse(h, clock, REQUIRED + 1, driver=fake_gpu)
    decision = deliver(h, orphan)
    assert (decision["action"], decision["reason"]) == ("ignore", "not-idle"), decision
    assert "used an SM 0s ago" in decision["detail"], decision
    assert orphan.all_alive()
    elapse(h, clock, 2 * REQUIRED, driver=fake_gpu)  # and for as long as it computes
    assert deliver(h, orphan)["reason"] == "not-idle"
    assert orphan.all_alive()
    assert [r["decision"]["reason"] for r in h.audit()
            if r["key"]["root_pid"] == orphan.root] == ["not-idle"]


def test_the_read_that_sees_a_step_makes_every_holder_unknown(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """An idle holder watched past the requirement, then the clock steps (either way):
    the kill-time read is the first after the step, so nothing NVML answers there can be
    trusted (idle-unknown), and its clock starts again from the next read."""
    required = 2 * REQUIRED
    clock = FakeClock()
    fake_gpu.set_clock(clock.now)
    h = harness(clock=clock, require_idle_seconds=required)
    orphan = spawn_orphan(trees, fake_gpu)
    assert deliver(h, orphan)["reason"] == "not-idle"
    elapse(h, clock, required + 1, driver=fake_gpu)
    clock.step(+600)
    fake_gpu.set_clock(clock.now)
    h.service.wake()
    assert deliver(h, orphan)["reason"] == "idle-unknown"
    # A refusal without a time it could pass holds the tree for a minute: decide after it.
    elapse(h, clock, REQUIRED + 1, driver=fake_gpu)
    decision = deliver(h, orphan)
    assert (decision["reason"], orphan.all_alive()) == ("not-idle", True), decision
    watched = re.search(r"watched for only (\d+)s", decision["detail"])
    assert watched is not None and int(watched.group(1)) <= REQUIRED + 1, decision


@pytest.mark.parametrize("use", [
    {"mem_util": 95}, {"enc_util": 60}, {"dec_util": 60}],
    ids=["memory-controller", "encoder", "decoder"])
def test_a_holder_busy_without_an_sm_is_not_idle(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        use: dict[str, int]) -> None:
    """Copies (the memory controller) or NVENC/NVDEC with no kernel running are use: a
    holder doing only that was read idle (SM only) and reaped."""
    clock = FakeClock()
    h = harness(clock=clock, require_idle_seconds=REQUIRED)
    orphan = spawn_orphan(trees, fake_gpu)
    fake_gpu.set_busy(0, orphan.holder, **{"sm_util": 0, "mem_util": 0, **use})
    deliver(h, orphan)
    elapse(h, clock, REQUIRED + 1)
    decision = deliver(h, orphan)
    assert (decision["action"], decision["reason"]) == ("ignore", "not-idle"), decision
    assert orphan.all_alive()


def test_unknown_utilization_refuses(harness: Callable[..., Harness], trees: Trees,
                                     fake_gpu: FakeGpuWorld) -> None:
    clock = FakeClock()
    h = harness(clock=clock, require_idle_seconds=REQUIRED)
    orphan = spawn_orphan(trees, fake_gpu)
    fake_gpu.set_not_supported(0, "processes_utilization")
    fake_gpu.set_not_supported(0, "process_utilization")
    deliver(h, orphan)
    elapse(h, clock, REQUIRED + 1)
    decision = deliver(h, orphan)
    assert (decision["action"], decision["reason"]) == ("ignore", "idle-unknown"), decision
    assert orphan.all_alive()
    assert [r["decision"]["reason"] for r in h.audit()
            if r["key"]["root_pid"] == orphan.root] == ["idle-unknown"]


def test_without_the_key_idleness_is_not_asked(harness: Callable[..., Harness], trees: Trees,
                                               fake_gpu: FakeGpuWorld) -> None:
    """The default (0): a busy orphan is reaped as before."""
    h = harness()
    orphan = spawn_orphan(trees, fake_gpu)
    fake_gpu.set_busy(0, orphan.holder)
    assert deliver(h, orphan)["action"] == "reap"
    wait_for(orphan.none_alive, what="the orphan to be reaped")


def test_a_stalled_watch_restarts_the_clock(harness: Callable[..., Harness], trees: Trees,
                                            fake_gpu: FakeGpuWorld) -> None:
    """An hour with no read (the remediator stopped, its thread starved, a VM paused):
    NVML keeps samples for seconds only, so the holder may have computed all that time
    unseen; the next read starts its idle clock again and the reap is refused."""
    clock = FakeClock()
    h = harness(clock=clock, require_idle_seconds=REQUIRED)
    orphan = spawn_orphan(trees, fake_gpu)
    assert deliver(h, orphan)["reason"] == "not-idle"
    clock.now += 3600  # no read in between
    h.service.wake()
    decision = deliver(h, orphan)
    assert (decision["action"], decision["reason"]) == ("ignore", "not-idle"), decision
    assert "watched for only 0s" in decision["detail"]
    assert orphan.all_alive()


@pytest.mark.parametrize(("policy", "key"), [
    ({"require_idle_seconds": REQUIRED}, "require_idle_seconds"),
    # issue 50: the reason's own requirement (remediate.idle_reasons), the same refusal
    ({"reasons": ["launcher-killed"], "idle_reasons": {
        "session-ended": REQUIRED, "launcher-unrecorded": REQUIRED}}, "idle_reasons."),
], ids=["require_idle_seconds", "idle_reasons"])
def test_gpuguard_reap_refuses_while_idleness_is_required(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run,
        policy: dict[str, Any], key: str) -> None:
    """`gpuguard reap --apply` (and MCP's gpu_reap, through the same refusal) reads NVML
    once and keeps no watch: with an idle requirement for the tree's reason it cannot show
    a holder idle that long, so it refuses (idle-unknown) unless a person passes --force."""
    orphan = spawn_orphan(trees, fake_gpu)
    config = write_config(tmp_path, **policy)
    argv = ["reap", str(orphan.root), "--config", str(config), "--json",
            "--allow-pid-namespace", "--apply", "--start-time", str(orphan.root_start)]
    proc = gpuguard(*argv)
    doc = json.loads(proc.stdout)
    assert proc.returncode == EXIT_REFUSED, doc
    assert doc["reason"] == "idle-unknown" and key in doc["detail"], doc
    assert orphan.all_alive()
    forced = gpuguard(*argv, "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    wait_for(orphan.none_alive, what="the forced reap")
