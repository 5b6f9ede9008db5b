"""Alertmanager at kill time, through the real binaries (issue 10).

Three loops (exporter -> Prometheus -> Alertmanager -> remediator, all real):

- webhook with `remediate.alertmanager`: every reap asks Alertmanager right before
  its first signal; a silence or an inhibition added after the delivery, during
  `min_age_seconds`, cancels it; Alertmanager down refuses it, and once it is back
  the next delivery reaps;
- webhook without it: a too-young tree waits for the next delivery, which a silence
  prevents;
- pull mode: no webhook at all; the remediator polls for its own host's alerts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import CHAIN, Tree, Trees, alive, stat_fields, wait_for
from tests.support.promstack import Loop, require_binaries, start_loop
from tests.support.servers import child_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HOST = "e2e-am-node"
GIB = 2**30
TOKEN = "loop-secret-token"
MIN_AGE = 8


@dataclass
class Orphan:
    tree: Tree
    root: int
    worker: int

    @property
    def start(self) -> str:
        fields = stat_fields(self.root)
        assert fields is not None
        return str(fields["start_time"])

    def alive(self) -> bool:
        return alive(self.root) and alive(self.worker)

    def gone(self) -> bool:
        return not alive(self.root) and not alive(self.worker)

    def matchers(self) -> dict[str, str]:
        return {"alertname": "GPUOrphanTree", "hostname": HOST, "root_pid": str(self.root),
                "root_start_time": self.start}


@dataclass
class World:
    base: Path
    gpu: FakeGpuWorld
    trees: Trees
    env: dict[str, str]

    def orphan(self) -> Orphan:
        tree = self.trees.spawn(CHAIN)
        worker, root = tree.pid("worker"), tree.pid("sh")
        self.gpu.add_process(0, worker, 2 * GIB)
        tree.kill_launcher()
        return Orphan(tree, root, worker)


@pytest.fixture
def world(fake_nvml_lib: Path, tmp_path: Path) -> Iterator[World]:
    require_binaries()
    gpu = FakeGpuWorld(tmp_path / "nvml-state.txt")
    gpu.add_gpu(0)
    trees = Trees(tmp_path / "trees")
    try:
        yield World(tmp_path, gpu, trees, gpu.subprocess_env(fake_nvml_lib, child_env()))
    finally:
        trees.cleanup()


@pytest.fixture
def loop(world: World) -> Iterator[Callable[..., Loop]]:
    loops: list[Loop] = []

    def start(**kw: Any) -> Loop:
        started = start_loop(world.base, world.env, hostname=HOST, scan_interval=0.5,
                             for_seconds=1, orphan_age_seconds=1, term_timeout_seconds=2, **kw)
        loops.append(started)
        return started

    yield start
    for started in loops:
        started.stop()


def decisions(loop: Loop, orphan: Orphan) -> list[dict[str, Any]]:
    state = requests.get(f"{loop.remediator.url}/state", timeout=5,
                         headers={"Authorization": f"Bearer {TOKEN}"}).json()
    return [d for d in state["recent_decisions"]
            if d["key"] and d["key"].split("/")[1] == str(orphan.root)]


def too_young(loop: Loop, orphan: Orphan) -> dict[str, Any]:
    """The first check's deferral (waits for it): says when the tree is old enough."""
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        found[:] = [d for d in decisions(loop, orphan) if d["reason"] == "too-young"]
        return bool(found)

    wait_for(seen, timeout=60, interval=0.1, what=f"the first check of {orphan.root}")
    return found[-1]


def audit(loop: Loop) -> list[dict[str, Any]]:
    """The complete records so far. The remediator appends while the tests poll: a last
    line without its newline is still being written, and is read on the next look."""
    if not loop.audit_log.exists():
        return []
    *complete, _being_written = loop.audit_log.read_text().split("\n")
    return [json.loads(line) for line in complete]


def finals(loop: Loop, orphan: Orphan) -> list[dict[str, Any]]:
    return [r for r in audit(loop)
            if r["key"]["root_pid"] == orphan.root and r["phase"] == "final"]


def final(loop: Loop, orphan: Orphan, reason: str) -> dict[str, Any]:
    wait_for(lambda: any(r["decision"]["reason"] == reason for r in finals(loop, orphan)),
             timeout=60, interval=0.1, what=f"an audited {reason} for {orphan.root}")
    return [r for r in finals(loop, orphan) if r["decision"]["reason"] == reason][-1]


def reap_record(loop: Loop, orphan: Orphan) -> dict[str, Any]:
    """The final record of the tree's reap. The remediator's worker writes it after the
    tree is gone, so it may not be there yet when the processes are: wait for it."""

    def reaps() -> list[dict[str, Any]]:
        return [r for r in finals(loop, orphan) if r["decision"]["action"] == "reap"]

    wait_for(reaps, timeout=30, interval=0.1, what=f"the audited reap of {orphan.root}")
    (record,) = reaps()
    return record


def reaped_not_before(loop: Loop, orphan: Orphan, deferral: dict[str, Any]) -> dict[str, Any]:
    wait_for(orphan.gone, timeout=60, what=f"the reap of {orphan.root}")
    record = reap_record(loop, orphan)
    assert record["ts"] >= deferral["recheck_at"], "reaped before min_age_seconds"
    return record


def test_with_kill_time_confirmation(world: World, loop: Callable[..., Loop]) -> None:
    reap, silence, inhibit = world.orphan(), world.orphan(), world.orphan()
    lp = loop(confirm=True, repeat_interval="2s", remediate={"min_age_seconds": MIN_AGE},
              inhibit_rules=[{"source_matchers": ['alertname="GPUNodeMaintenance"'],
                              "target_matchers": ['alertname="GPUOrphanTree"'],
                              "equal": ["hostname", "root_pid"]}])
    deferral = too_young(lp, reap)
    too_young(lp, silence)
    too_young(lp, inhibit)
    # Delivered and pending; on-call acts in the minutes before the kill.
    sid = lp.alertmanager.silence(silence.matchers())
    lp.alertmanager.post_alert({"alertname": "GPUNodeMaintenance", "hostname": HOST,
                                "root_pid": str(inhibit.root), "severity": "warning"})

    record = reaped_not_before(lp, reap, deferral)
    assert record["alertmanager"]["state"] == "firing"
    # Asked twice: before the first SIGSTOP and, with the tree frozen, before the first
    # SIGTERM; confirmed_ms is the last answer.
    first_term = min(s["at_ms"] for s in record["signals"] if s["signal"] == "SIGTERM")
    window = first_term - record["confirmed_ms"]
    print(f"\nlast confirmation -> first SIGTERM: {window:.2f} ms")
    assert 0 <= window < 1000

    cancelled = final(lp, silence, "silenced")
    assert cancelled["decision"]["action"] == "cancel" and cancelled["signals"] == []
    assert sid in cancelled["decision"]["detail"] and "gpuguard-e2e" in cancelled["decision"][
        "detail"]
    assert cancelled["alertmanager"]["silenced_by"] == [sid]
    assert final(lp, inhibit, "inhibited")["signals"] == []
    assert silence.alive() and inhibit.alive()

    # Alertmanager down between the delivery and the kill: nothing is signalled.
    late = world.orphan()
    too_young(lp, late)
    lp.alertmanager.stop()
    refused = final(lp, late, "alertmanager-unreachable")
    assert refused["signals"] == [] and late.alive()
    metrics = requests.get(f"{lp.remediator.url}/metrics", timeout=5).text
    assert 'gpuguard_remediator_alertmanager_requests_total{result="error"}' in metrics
    # Back again: the next delivery (repeat_interval) reaps it. Silences are kept on disk;
    # the injected maintenance alert is not (alerts live in memory), so only the silenced
    # tree is still sure to be spared.
    back = lp.alertmanager.restarted()
    lp.started.append(back)
    wait_for(late.gone, timeout=60, what="the reap once Alertmanager answers again")
    assert silence.alive()


def test_without_confirmation_only_a_delivery_reaps(world: World,
                                                    loop: Callable[..., Loop]) -> None:
    reap, silence = world.orphan(), world.orphan()
    lp = loop(repeat_interval="2s", remediate={"min_age_seconds": MIN_AGE})
    deferral = too_young(lp, reap)
    too_young(lp, silence)
    lp.alertmanager.silence(silence.matchers())
    record = reaped_not_before(lp, reap, deferral)
    assert "alertmanager" not in record
    # The window left in this mode: from the delivery that found the tree old enough to the
    # intent record written just before the first signal.
    accepted = max(datetime.fromisoformat(d["time"]).timestamp()
                   for d in decisions(lp, reap) if d["source"] == "http")
    intent = next(r for r in audit(lp) if r["phase"] == "intent"
                  and r["key"]["root_pid"] == reap.root)
    print(f"\ndelivery -> intent record: {(intent['ts'] - accepted) * 1000:.1f} ms")
    # Give the silenced tree every chance a wrong implementation would take: well past its
    # min_age and several repeat intervals.
    later = time.monotonic() + MIN_AGE
    wait_for(lambda: time.monotonic() > later, timeout=MIN_AGE + 5, interval=0.5,
             what="the silenced tree's min_age to pass")
    assert silence.alive() and finals(lp, silence) == []


def test_pull_mode_needs_no_webhook(world: World, loop: Callable[..., Loop]) -> None:
    reap, silence, elsewhere = world.orphan(), world.orphan(), world.orphan()

    def on_call(am: Any) -> None:
        am.silence(silence.matchers())
        # elsewhere's own alert is silenced; an alert naming it for another host stays:
        # only the hostname screen stands between it and a reap.
        am.silence(elsewhere.matchers())
        am.post_alert({**elsewhere.matchers(), "hostname": "other-node", "remediate": "true",
                       "severity": "warning"})

    began = time.monotonic()
    lp = loop(pull=True, before_prometheus=on_call)
    assert "webhook_configs" not in next(r for r in lp.alertmanager.config["receivers"]
                                         if r["name"] == "gpuguard-remediator")
    wait_for(lambda: lp.alertmanager.alerts(root_pid=str(reap.root)), timeout=60,
             interval=0.05, what="the alert to reach Alertmanager")
    in_alertmanager = time.monotonic()
    wait_for(reap.gone, timeout=60, what="the pull-mode reap")
    print(f"\npull mode: alert in Alertmanager -> reaped "
          f"{time.monotonic() - in_alertmanager:.2f}s (pull_interval_seconds 1); orphaned -> "
          f"reaped {time.monotonic() - began:.1f}s with the stack's start")
    assert {d["source"] for d in decisions(lp, reap)} == {"pull", "worker"}  # no "http"
    record = reap_record(lp, reap)
    assert record["alertmanager"]["state"] == "firing"
    # A few more polls: neither the silenced tree nor the other host's alert is acted on.
    polls = time.monotonic() + 4
    wait_for(lambda: time.monotonic() > polls, timeout=10, interval=0.5, what="more polls")
    assert silence.alive() and elsewhere.alive()
    assert finals(lp, silence) == [] and finals(lp, elsewhere) == []
