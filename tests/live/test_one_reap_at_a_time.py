"""One reap at a time on a host, whichever path starts it, and the brakes on every path
(issue 47): the remediator's worker, `gpuguard reap --apply` and MCP `gpu_reap` share one
reap lock (STATE_DIR/reap.lock) and one rate-limit window, and the paths without an alert
need the remediator's record of the tree's age. Real trees, the real console, the
in-process remediator over the fake NVML."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from gpuguard.console.contract import EXIT_REFUSED
from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.state.ledger import Ledger
from gpuguard.engine.state.reap_lock import ReapLock
from gpuguard.host.procfs import boottime
from tests.live.test_kill_safety import freeze_and_crash
from tests.live.test_restart_recovery import stopped
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, stat_fields, wait_for
from tests.support.remediator_harness import (
    GIB,
    STUBBORN,
    Harness,
    Orphan,
    Run,
    payload,
    spawn_orphan,
    start_time_of,
    write_config,
)
from tests.support.servers import REPO, child_env


def audit(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reap_args(orphan: Orphan, config: Path, *flags: str) -> list[str]:
    # The fake NVML reports this namespace's pids (CI runs the suite in its own namespace).
    return ["reap", str(orphan.root), "--config", str(config), "--json",
            "--allow-pid-namespace", "--apply", "--start-time", str(orphan.root_start), *flags]


def console(fake_gpu: FakeGpuWorld, fake_nvml_lib: Path, args: list[str]) -> subprocess.Popen:
    """`gpuguard ARGS` started, not waited for."""
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env(NO_COLOR="1"))
    return subprocess.Popen([sys.executable, "-m", "gpuguard.console", *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


#: An orphan whose root is its holder and ignores SIGTERM: a reap holds it for all of
#: term_timeout_seconds between its SIGTERM and its SIGKILL.
IGNORES_TERM = "{holder} --ignore-term --pidfile {dir}/holder & echo $! > {dir}/root; wait"


def stubborn_root(trees: Trees, fake_gpu: FakeGpuWorld) -> Orphan:
    tree = trees.spawn(IGNORES_TERM)
    holder = tree.pid("holder")
    fake_gpu.add_process(0, holder, GIB)
    tree.kill_launcher()
    return Orphan(tree, holder, start_time_of(holder), holder)


def untouched(orphan: Orphan) -> bool:
    """Alive and never stopped: nothing signalled it."""
    return all(alive(p) and (stat_fields(p) or {}).get("state") in ("S", "R")
               for p in orphan.members)


def test_the_remediator_never_reaps_a_tree_a_manual_reap_holds(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
        harness: Any) -> None:
    """The review's critical finding: the daemon judged a tree on the freeze of a
    `gpuguard reap --apply` and went on signalling it. Now the daemon's reap waits for the
    host's reap lock (`reap-in-progress`, audited, nothing signalled) while the manual reap
    runs: the holder ignores SIGTERM, so the console holds the tree for its whole
    term_timeout_seconds before its SIGKILL."""
    h: Harness = harness(term_timeout_seconds=6)
    config = tmp_path / "gpuguard.yml"
    orphan = stubborn_root(trees, fake_gpu)
    manual = console(fake_gpu, fake_nvml_lib, reap_args(orphan, config))
    try:
        wait_for(lambda: [r for r in audit(h.audit_path)
                          if r.get("manual") and r["phase"] == "intent"],
                 timeout=30, what="the manual reap's intent record")
        assert h.post(payload(orphan.alert())).status_code == 200
        h.settle()
        waited = [r for r in audit(h.audit_path)
                  if not r.get("manual") and r["decision"]["reason"] == "reap-in-progress"]
        assert len(waited) == 1, [(d.get("reason"), d.get("detail"))
                                  for d in h.decisions(orphan.root)]
        assert "gpuguard reap by" in waited[0]["decision"]["detail"]
        out, err = manual.communicate(timeout=60)
    finally:
        if manual.poll() is None:
            manual.kill()
            manual.wait()
    assert manual.returncode == 0, (out, err)
    assert json.loads(out)["outcome"] == "reaped"
    wait_for(orphan.none_alive, what="the tree to be gone")
    # The daemon sent nothing: its only records are the wait (no intent, no signals).
    own = [r for r in audit(h.audit_path) if not r.get("manual")]
    assert [r["phase"] for r in own] == ["final"] and own[0]["signals"] == []


def test_a_manual_reap_is_refused_while_the_remediator_reaps(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run,
        harness: Any) -> None:
    """The other direction, and on another tree: while the daemon's reap holds the lock
    (its stubborn holder waits out term_timeout_seconds), `gpuguard reap --apply` is
    refused with `reap-in-progress`, names the daemon, and signals nothing."""
    h: Harness = harness(term_timeout_seconds=6)
    config = tmp_path / "gpuguard.yml"
    busy = spawn_orphan(trees, fake_gpu, STUBBORN, gpu_bytes=GIB)
    other = spawn_orphan(trees, fake_gpu, gpu_bytes=GIB)
    assert h.post(payload(busy.alert())).status_code == 200
    wait_for(lambda: [r for r in audit(h.audit_path) if r["phase"] == "intent"],
             timeout=30, what="the remediator's intent record")
    proc = gpuguard(*reap_args(other, config))
    doc = json.loads(proc.stdout)
    assert proc.returncode == EXIT_REFUSED, doc
    assert doc["decision"]["reason"] == "reap-in-progress"
    assert "gpuguard-remediator" in doc["decision"]["detail"]
    assert untouched(other) and doc["signals"] == []
    h.settle()
    wait_for(busy.none_alive, what="the remediator's tree to be gone")


def test_max_reaps_zero_holds_for_a_person_and_an_agent_alike(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    """`rate_limit.max_reaps: 0` ("reaping is off") refused the remediator's reaps only:
    `gpuguard reap --apply` (and MCP, the same ManualReap) reaped anyway. A person may
    lift it with --override-brakes, audited; nothing else lifts it."""
    config = write_config(tmp_path, rate_limit={"max_reaps": 0, "per_seconds": 3600})
    orphan = spawn_orphan(trees, fake_gpu, gpu_bytes=GIB)
    proc = gpuguard(*reap_args(orphan, config))
    doc = json.loads(proc.stdout)
    assert proc.returncode == EXIT_REFUSED, doc
    assert doc["decision"]["reason"] == "rate-limited" and "reaping is off" in (
        doc["decision"]["detail"])
    assert untouched(orphan) and doc["signals"] == []
    proc = gpuguard(*reap_args(orphan, config, "--override-brakes"))
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0 and doc["outcome"] == "reaped", doc
    final = [r for r in audit(Path(tmp_path / "audit.jsonl")) if r["phase"] == "final"][-1]
    assert final["manual"]["override_brakes"] is True
    assert final["manual"]["brakes_overridden"] == ["rate_limit"]


def test_a_manual_reap_needs_the_remediators_record_of_the_trees_age(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    """The review's agent reaped a tree orphaned 0.8 s earlier under min_age_seconds 300.
    Without an alert, the age is the remediator's own first sighting (its state file)."""
    config = write_config(tmp_path, min_age_seconds=300)
    orphan = spawn_orphan(trees, fake_gpu, gpu_bytes=GIB)
    proc = gpuguard(*reap_args(orphan, config))
    doc = json.loads(proc.stdout)
    assert proc.returncode == EXIT_REFUSED and doc["decision"]["reason"] == "too-young", doc
    assert untouched(orphan)
    # The remediator saw it an orphan 400 s ago (its ledger, as a delivery would leave it).
    state_dir = yaml.safe_load(config.read_text())["remediate"]["state_dir"]
    hostname = doc["key"]["hostname"]
    Ledger(state_dir).note_first_seen(TreeKey(hostname, orphan.root, orphan.root_start),
                                      boottime() - 400)
    proc = gpuguard(*reap_args(orphan, config))
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0 and doc["outcome"] == "reaped", doc


def test_manual_reaps_count_in_the_remediators_window_by_owner(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run,
        harness: Any) -> None:
    """A manual reap takes a slot in the window the remediator counts (its owner's share
    of it too): with max_reaps 2 (a share of 1 each), the remediator refuses the same
    owner's next tree, and says whose reaps fill the window."""
    h: Harness = harness(rate_limit={"max_reaps": 2, "per_seconds": 3600})
    config = tmp_path / "gpuguard.yml"
    first = spawn_orphan(trees, fake_gpu, gpu_bytes=GIB)
    proc = gpuguard(*reap_args(first, config))
    assert proc.returncode == 0, proc.stdout
    second = spawn_orphan(trees, fake_gpu, gpu_bytes=GIB)
    assert h.post(payload(second.alert())).status_code == 200
    h.settle()
    (decision,) = [r["decision"] for r in audit(h.audit_path) if not r.get("manual")]
    assert decision["reason"] == "rate-limited", decision
    owner = json.loads(proc.stdout)["members"][0]["user"]
    assert f"1 reaps of {owner}'s trees" in decision["detail"]
    assert untouched(second)
    window = h.service.snapshot()["rate_limit"]  # GET /state counts it too
    assert (window["used"], window["per_user"], window["by_owner"]) == (1, 1, {owner: 1})


def test_recovery_waits_while_another_reap_holds_the_lock(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, harness: Any) -> None:
    """Crash recovery's SIGCONTs are signals too: while another reaper holds the host's
    reap lock (it may hold these very processes stopped, and a SIGCONT would undo its
    freeze), recovery waits; the worker settles it once the lock is free."""
    orphan = spawn_orphan(trees, fake_gpu, gpu_bytes=GIB)
    freeze_and_crash(tmp_path, orphan)  # the remediator died with the tree frozen
    other = ReapLock(tmp_path / "state")
    other.acquire({"by": "gpuguard reap by someone", "key": "elsewhere"})
    try:
        h: Harness = harness()
        assert h.service.interrupted.unsettled and h.service.interrupted.waiting
        assert "gpuguard reap by someone" in h.service.interrupted.waiting
        assert all(stopped(p) for p in orphan.members)  # not continued under its feet
        # ...and says so: processes left stopped are an operator's business.
        answer = h.client.get("/healthz")
        assert (answer.status_code, answer.get_data(as_text=True).strip()) == (
            503, "recovery-waiting")
        assert "gpuguard reap by someone" in h.service.snapshot()["recovery_waiting"]
        assert "gpuguard_remediator_recovery_waiting 1.0" in h.client.get(
            "/metrics").get_data(as_text=True)
    finally:
        other.release()
    wait_for(lambda: not any(stopped(p) for p in orphan.members), what="the thaw")
    wait_for(lambda: not h.service.interrupted.unsettled, what="recovery settled")
    assert h.client.get("/healthz").status_code == 200
    assert h.service.snapshot()["recovery_waiting"] is None
    assert "gpuguard_remediator_recovery_waiting 0.0" in h.client.get(
        "/metrics").get_data(as_text=True)
    settled = [r for r in audit(h.audit_path) if r["phase"] == "final"]
    assert settled and settled[-1]["decision"]["reason"] == "interrupted-thawed"


def test_a_reaper_with_a_config_of_its_own_still_meets_the_remediators_lock(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run,
        harness: Any) -> None:
    """The review's bypass: `gpuguard reap --apply --config` with a copy of the config
    whose state_dir (and audit log) lie elsewhere took a lock of its own and reaped while
    the remediator held the tree. The lock is also taken in the daemons' runtime
    directory (the parent of classify.marks_dir, /run/gpuguard by default), which does
    not depend on the state directory."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    classify = {"marks_dir": str(run_dir / "marks")}
    h: Harness = harness(term_timeout_seconds=6, classify=classify)
    busy = spawn_orphan(trees, fake_gpu, STUBBORN, gpu_bytes=GIB)
    other = spawn_orphan(trees, fake_gpu, gpu_bytes=GIB)
    mine = tmp_path / "mine"
    mine.mkdir()
    config = write_config(mine, classify=classify)  # its own state_dir and audit log
    assert h.post(payload(busy.alert())).status_code == 200
    wait_for(lambda: [r for r in audit(h.audit_path) if r["phase"] == "intent"],
             timeout=30, what="the remediator's intent record")
    proc = gpuguard(*reap_args(other, config))
    doc = json.loads(proc.stdout)
    assert proc.returncode == EXIT_REFUSED, doc
    assert doc["decision"]["reason"] == "reap-in-progress"
    assert str(run_dir / "reap.lock") in doc["decision"]["detail"]
    assert untouched(other)
    h.settle()


def test_a_window_file_that_cannot_be_read_never_keeps_the_lock(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, harness: Any) -> None:
    """A manual-reaps.json that is not UTF-8 (or nests too deep) raised past the worker's
    handler after it took the lock, which it then held for good: every later reap and
    every `gpuguard reap --apply` was refused. It is a refusal (`state-failed`, nothing
    signalled) and the lock is let go."""
    h: Harness = harness()
    (tmp_path / "state" / "manual-reaps.json").write_bytes(b"\xff\xfe not json")
    orphan = spawn_orphan(trees, fake_gpu, gpu_bytes=GIB)
    assert h.post(payload(orphan.alert())).status_code == 200
    h.settle()
    (decision,) = [r["decision"] for r in audit(h.audit_path)]
    assert decision["reason"] == "state-failed", decision
    assert untouched(orphan)
    free = ReapLock(tmp_path / "state")
    free.acquire({"by": "the test"})  # raises reap-in-progress while the worker holds it
    free.release()
