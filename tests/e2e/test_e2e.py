"""The whole loop through real binaries: exporter -> Prometheus -> Alertmanager -> remediator.

One stack per module: a fake GPU, three real orphaned trees (one to reap, one
silenced by on-call, one protected by nohup), the shipped rules with only their
durations shortened, and the shipped Alertmanager example with only its URLs,
token path and group timings replaced.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.dashboard import dashboard_exprs
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import CHAIN, Tree, Trees, alive, descendants_of, stat_fields, wait_for
from tests.support.promstack import (
    Alertmanager,
    Prometheus,
    WebhookRecorder,
    require_binaries,
    start_loop,
)
from tests.support.servers import LATE_REASON, Exporter, ServerProcess, child_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HOST = "e2e-node"
GIB = 2**30


@dataclass
class Stack:
    world: FakeGpuWorld
    trees: Trees
    exporter: Exporter
    remediator: ServerProcess
    alertmanager: Alertmanager
    prometheus: Prometheus
    recorder: WebhookRecorder
    audit_log: Path
    reaped: Tree
    reaped_root: int
    reaped_members: list[int]
    silenced: Tree
    silenced_root: int
    protected: Tree
    protected_worker: int
    suspect_worker: int
    started: float


def start_time(pid: int) -> str:
    fields = stat_fields(pid)
    assert fields is not None
    return str(fields["start_time"])


@pytest.fixture(scope="module")
def stack(fake_nvml_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_binaries()
    base = tmp_path_factory.mktemp("e2e")
    world = FakeGpuWorld(base / "nvml-state.txt")
    world.add_gpu(0)
    world.set_recovery_action(0, 0)  # none: the recovery panel has a row, nothing alerts
    trees = Trees(base / "trees")
    stopped: list = []
    try:
        reaped = trees.spawn(CHAIN)
        silenced = trees.spawn(CHAIN)
        protected = trees.spawn("nohup {holder} --pidfile {dir}/worker >/dev/null 2>&1 & wait")
        # A healthy holder whose argv[0] names a miner: the accounting panels' suspect.
        suspect = trees.spawn("exec -a xmrig {holder} --pidfile {dir}/worker & wait")
        for tree in (reaped, silenced, protected, suspect):
            world.add_process(0, tree.pid("worker"), 2 * GIB)
        reaped_root, silenced_root = reaped.pid("sh"), silenced.pid("sh")
        reaped_members = [reaped_root, reaped.pid("worker")]
        for tree in (reaped, silenced, protected):
            tree.kill_launcher()

        env = world.subprocess_env(fake_nvml_lib, child_env())

        def silence_one(am: Alertmanager) -> None:
            # On-call silences one tree before its alert can fire.
            am.silence({"alertname": "GPUOrphanTree", "hostname": HOST,
                        "root_pid": str(silenced_root),
                        "root_start_time": start_time(silenced_root)})

        started = time.monotonic()
        loop = start_loop(base, env, hostname=HOST, scan_interval=0.5, for_seconds=1,
                          orphan_age_seconds=1, term_timeout_seconds=2,
                          before_prometheus=silence_one,
                          # "*" is not root's (CI runs as root): name root too
                          exporter_config={"quotas": {"users": {"*": "64GiB",
                                                                "root": "64GiB"}}})
        stopped.append(loop)
        yield Stack(world, trees, loop.exporter, loop.remediator, loop.alertmanager,
                    loop.prometheus, loop.recorder, loop.audit_log, reaped, reaped_root,
                    reaped_members, silenced, silenced_root, protected, protected.pid("worker"),
                    suspect.pid("worker"), started)
    finally:
        for thing in reversed(stopped):
            thing.stop()
        trees.cleanup()


def test_orphan_is_reaped_and_the_alert_resolves(stack: Stack) -> None:
    prom, recorder = stack.prometheus, stack.recorder
    root = str(stack.reaped_root)

    # The answer that showed it firing: asked again, it may already be gone (the reap
    # follows within seconds and resolves it).
    (alert,) = wait_for(lambda: prom.firing("GPUOrphanTree", root_pid=root), timeout=60,
                        what="GPUOrphanTree firing in Prometheus")
    fired_at = time.monotonic()
    labels = alert["labels"]
    assert labels["hostname"] == HOST and labels["reason"] == LATE_REASON
    assert labels["comm"] == "sh" and labels["root_start_time"]
    assert labels["remediate"] == "true"
    assert "runbook_url" not in alert["annotations"]  # only `gpuguard assets --runbook-url-base`

    wait_for(lambda: not any(alive(p) for p in stack.reaped_members), timeout=60,
             what="the orphan tree to be reaped")
    reaped_at = time.monotonic()
    print(f"\norphaned->firing {fired_at - stack.started:.1f}s, "
          f"firing->reaped {reaped_at - fired_at:.1f}s")
    stack.world.remove_process(stack.reaped.pid("worker"))  # the driver frees the context

    wait_for(lambda: not prom.query(f'gpuguard_orphan_tree_age_seconds{{root_pid="{root}"}}'),
             timeout=30, what="the orphan series to disappear")
    wait_for(lambda: recorder.alerts(lambda a: a["status"] == "resolved"
                                     and a["labels"].get("root_pid") == root),
             timeout=60, what="the resolved notification")
    records = [line for line in stack.audit_log.read_text().splitlines() if root in line]
    assert records, "the reap left no audit record"


def test_silenced_tree_is_never_reaped(stack: Stack) -> None:
    prom, am = stack.prometheus, stack.alertmanager
    root = str(stack.silenced_root)
    wait_for(lambda: prom.firing("GPUOrphanTree", root_pid=root), timeout=60,
             what="the silenced tree's alert to fire in Prometheus")
    wait_for(lambda: [a for a in am.alerts(root_pid=root)
                      if a["status"]["state"] == "suppressed"], timeout=30,
             what="Alertmanager to hold the alert as suppressed")
    # Let the reaped tree's whole loop finish: by then any delivery would have happened.
    wait_for(lambda: not any(alive(p) for p in stack.reaped_members), timeout=60,
             what="the other tree's reap")
    members = [stack.silenced_root, *descendants_of(stack.silenced_root)]
    assert len(members) == 2 and all(alive(p) for p in members)
    assert not stack.recorder.alerts(lambda a: a["labels"].get("root_pid") == root)
    if stack.audit_log.exists():
        assert f'"root_pid": {root}' not in stack.audit_log.read_text()


def test_protected_tree_never_alerts(stack: Stack) -> None:
    prom = stack.prometheus
    worker = str(stack.protected_worker)
    wait_for(lambda: prom.query(f'gpuguard_gpu_process_info{{pid="{worker}"}}'), timeout=60,
             what="the protected holder to be scraped")
    (series,) = prom.query(f'gpuguard_gpu_process_info{{pid="{worker}"}}')
    assert series["metric"]["verdict"] == "protected"
    assert series["metric"]["reason"] == "ignores-sighup"
    wait_for(lambda: not any(alive(p) for p in stack.reaped_members), timeout=60,
             what="the other tree's reap")
    # Every GPUOrphanTree that ever existed (pending or firing) names one of the two
    # orphans planted on purpose, never the protected tree, whatever root it might get.
    ever = prom.query('max_over_time(ALERTS{alertname="GPUOrphanTree"}[10m])')
    roots = {series["metric"]["root_pid"] for series in ever}
    assert roots <= {str(stack.reaped_root), str(stack.silenced_root)}, roots
    assert alive(stack.protected_worker)


def test_a_suspect_alerts_people_and_is_never_reaped(stack: Stack) -> None:
    prom = stack.prometheus
    pid = str(stack.suspect_worker)
    wait_for(lambda: prom.firing("GPUSuspectProcess", pid=pid), timeout=60,
             what="GPUSuspectProcess firing in Prometheus")
    (alert,) = prom.firing("GPUSuspectProcess", pid=pid)
    labels = alert["labels"]
    assert (labels["why"], labels["hostname"], labels["severity"]) == ("cmdline-pattern", HOST,
                                                                       "critical")
    assert "remediate" not in labels
    wait_for(lambda: not any(alive(p) for p in stack.reaped_members), timeout=60,
             what="the other tree's reap")
    assert alive(stack.suspect_worker)
    if stack.audit_log.exists():
        assert f'"root_pid": {pid}' not in stack.audit_log.read_text()


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    wait_for(lambda: not any(alive(p) for p in stack.reaped_members), timeout=60,
             what="a reap, so remediator panels have data")
    # A counter born with the reap needs a second sample in range before increase() answers:
    # poll every query with a deadline, then name the ones that never returned data.
    pending = list(dashboard_exprs())

    def all_answer() -> bool:
        pending[:] = [expr for expr in pending if not stack.prometheus.query(expr)]
        return not pending

    try:
        wait_for(all_answer, timeout=30, interval=0.5, what="every panel query to return data")
    except AssertionError:
        raise AssertionError(f"panel queries without data: {pending}") from None
