"""What a reap may signal: real trees, fake NVML, the in-process remediator.

Each test here is a case an adversarial review reproduced against the first
release (issue 9): a process the rules protect, or could not judge, or judged
on stale facts, was signalled; or a signal went out with no audit record, or
safety state was lost. Each asserts that nothing the rules protect is touched
and that the refusal is written down with its reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuguard.base.counters import Counters
from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.state.ledger import Ledger
from gpuguard.host.procfs import PROC_PID_INIT_INO, ProcessView, in_host_pid_namespace
from gpuguard.orphans.classify import classify
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.vocabulary import Reason, Verdict
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, stat_fields, wait_for, zombie_leader
from tests.support.remediator_harness import (
    GIB,
    HOST,
    FakeClock,
    Harness,
    Orphan,
    Run,
    account,
    payload,
    spawn_orphan,
    write_config,
)

REPO = Path(__file__).resolve().parents[2]

#: Under the orphan root sh: the GPU holder and a nohup'd sibling that holds no GPU.
NOHUP_SIBLING = ('sh -c "{holder} --pidfile {dir}/holder & nohup sleep 3600 >/dev/null 2>&1 & '
                 'echo \\$! > {dir}/sibling; wait" & echo $! > {dir}/root; wait')
#: ... a sibling whose command line says jupyter-lab (a protect pattern).
#: (The name reaches the sibling through the environment, so no chain member's command line,
#: the root's included, carries it: only the sibling can be what protects the tree.)
JUPYTER_SIBLING = ('export NAME=jupyter-lab; sh -c "{holder} --pidfile {dir}/holder & '
                   '{holder} --pidfile {dir}/sibling \\$NAME & wait" & echo $! > {dir}/root; '
                   'wait')
#: ... the holder carries GPUGUARD_KEEP=1; the root does not.
KEEP_HOLDER = ('sh -c "GPUGUARD_KEEP=1 {holder} --pidfile {dir}/holder" & echo $! > {dir}/root; '
               'wait')
#: ... a second holder three processes further down (deeper than max_depth allows).
DEEP_HOLDER = ('sh -c "{holder} --pidfile {dir}/holder & {holder} --pidfile {dir}/deep '
               '--depth=3 & wait" & echo $! > {dir}/root; wait')
#: ... a holder that starts ignoring SIGHUP when told (SIGUSR1).
LATE_NOHUP = ('sh -c "{holder} --hup-on-usr1 --pidfile {dir}/holder" & echo $! > {dir}/root; '
              'wait')


def final(h: Harness, orphan: Orphan) -> dict[str, Any]:
    (record,) = [r for r in h.audit()
                 if r["key"]["root_pid"] == orphan.root and r["phase"] == "final"]
    return record


def stopped(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields["state"] in ("T", "t")


def deliver(h: Harness, orphan: Orphan) -> dict[str, Any]:
    answer = account(h.post(payload(orphan.alert())))
    assert answer["status"] == "accepted", answer
    h.settle()
    return final(h, orphan)


def check_twice(h: Harness, clock: FakeClock, orphan: Orphan, *,
                between: Callable[[], None]) -> dict[str, Any]:
    """Deliver; let the first check find the tree too young; change the world; deliver
    again once it is old enough (min_age_seconds=60) and return that check's record."""
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(lambda: any(d["reason"] == "too-young" for d in h.decisions(orphan.root)),
             what="the first (too young) check")
    between()
    clock.now += 61
    return deliver(h, orphan)


# -- 1. members the rules never judged ----------------------------------------------


@pytest.mark.parametrize(("script", "why"), [
    (NOHUP_SIBLING, "ignores SIGHUP"),
    (JUPYTER_SIBLING, "matches protect by command line"),
    (KEEP_HOLDER, "GPUGUARD_KEEP=1"),
], ids=["nohup-sibling", "jupyter-sibling", "keep-marked-holder"])
def test_a_protected_member_anywhere_in_the_tree_refuses_the_reap(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        script: str, why: str) -> None:
    orphan = spawn_orphan(trees, fake_gpu, script)
    extra = orphan.tree.pid("sibling") if script != KEEP_HOLDER else orphan.holder
    h = harness()
    holders = h.nvml.read().holders
    (tree,) = [t for t in classify(holders, ProcessView(counters=Counters()), Rules())
               if t.root_pid == orphan.root]
    # The exporter already shows it as not reapable, so alert and remediator agree.
    assert (tree.verdict, tree.reason) == ("protected", Reason.MEMBER_PROTECTED), tree.evidence
    assert extra in tree.evidence.pids and why in tree.evidence.detail

    record = deliver(h, orphan)
    assert record["decision"]["reason"] == Reason.MEMBER_PROTECTED and why in record["decision"][
        "detail"]
    assert record["signals"] == [] and orphan.all_alive() and alive(extra)


def test_a_holder_below_the_root_that_is_unknown_refuses_the_reap(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    orphan = spawn_orphan(trees, fake_gpu, DEEP_HOLDER)
    deep = orphan.tree.pid("deep")
    fake_gpu.add_process(0, deep, GIB)
    # max_depth admits the first holder's chain (to PID 1) and not the one 3 levels deeper.
    levels, pid = 0, orphan.holder
    while pid != 1:
        fields = stat_fields(pid)
        assert fields is not None
        pid, levels = int(fields["ppid"]), levels + 1  # type: ignore[arg-type]
    h = harness(classify={"max_depth": levels})
    trees_now = classify(h.nvml.read().holders, ProcessView(counters=Counters()),
                         Rules(max_depth=levels))
    by_root = {t.root_pid: t for t in trees_now}
    assert by_root[deep].verdict == "unknown" and by_root[deep].reason == "too-deep"
    assert (by_root[orphan.root].verdict, by_root[orphan.root].reason) == (
        "unknown", "member-unknown")

    record = deliver(h, orphan)
    assert record["decision"]["reason"] == "member-unknown", record["decision"]
    assert orphan.all_alive() and alive(deep)


#: ... a nohup'd sibling whose main thread called pthread_exit() (stat shows Z) while
#: another thread runs on.
NOHUP_ZOMBIE_LEADER = ('sh -c "{holder} --pidfile {dir}/holder & nohup {holder} --zombie-leader '
                       '--pidfile {dir}/kept >/dev/null 2>&1 & wait" & echo $! > {dir}/root; '
                       'wait')


@pytest.mark.parametrize("holds_gpu", [True, False], ids=["gpu-holder", "no-gpu"])
def test_a_nohup_member_whose_main_thread_exited_still_refuses_the_reap(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        holds_gpu: bool) -> None:
    """Issue 24: state Z in /proc/PID/stat is not gone while a thread runs. Such a
    nohup'd process keeps its tree (and its GPU memory): no signal to anyone."""
    orphan = spawn_orphan(trees, fake_gpu, NOHUP_ZOMBIE_LEADER)
    kept = orphan.tree.pid("kept")
    assert zombie_leader(kept)
    assert int(Path(f"/proc/{kept}/status").read_text().split("SigIgn:")[1].split()[0], 16) & 1
    if holds_gpu:
        fake_gpu.add_process(0, kept, GIB)
    h = harness()
    (tree,) = [t for t in classify(h.nvml.read().holders, ProcessView(counters=Counters()),
                                   Rules()) if t.root_pid == orphan.root]
    # A GPU holder that ignores SIGHUP protects its tree by itself (rule 4); any other
    # member does as a member.
    want = "ignores-sighup" if holds_gpu else Reason.MEMBER_PROTECTED
    assert (tree.verdict, tree.reason) == ("protected", want), tree.evidence
    assert kept in tree.evidence.pids and "ignores SIGHUP" in tree.evidence.detail
    assert kept in [m.pid for m in tree.members or tree.members_seen]

    record = deliver(h, orphan)
    assert record["decision"]["reason"] in (Reason.MEMBER_PROTECTED, "not-orphan:protected"), record
    assert "ignores" in record["decision"]["detail"].lower()
    assert record["signals"] == [] and orphan.all_alive() and zombie_leader(kept)
    assert not any(stopped(p) for p in (*orphan.members, kept))


# -- 3. facts read afresh at every check --------------------------------------------


def test_a_holder_that_starts_ignoring_sighup_after_the_first_check_is_not_reaped(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    clock = FakeClock()
    h = harness(clock=clock, min_age_seconds=60)
    orphan = spawn_orphan(trees, fake_gpu, LATE_NOHUP)

    def detach_late() -> None:
        os.kill(orphan.holder, signal.SIGUSR1)
        wait_for(lambda: int(Path(f"/proc/{orphan.holder}/status").read_text()
                             .split("SigIgn:")[1].split()[0], 16) & 1,
                 what="the holder to ignore SIGHUP")

    record = check_twice(h, clock, orphan, between=detach_late)
    assert record["decision"]["reason"] == "not-orphan:protected", record["decision"]
    assert "ignores-sighup" in record["decision"]["detail"]
    assert orphan.all_alive()


# -- 4. NVML must be as complete as at the first check ------------------------------


def test_a_lost_gpu_hiding_a_protected_holder_refuses_the_reap(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    fake_gpu.add_gpu(1)
    script = ('sh -c "{holder} --pidfile {dir}/holder & nohup {holder} --pidfile {dir}/kept '
              '>/dev/null 2>&1 & wait" & echo $! > {dir}/root; wait')
    orphan = spawn_orphan(trees, fake_gpu, script)
    kept = orphan.tree.pid("kept")
    fake_gpu.add_process(1, kept, GIB)
    fake_gpu.set_gpu_lost(1)
    h = harness()
    record = deliver(h, orphan)
    assert record["decision"]["reason"] == "nvml-incomplete", record["decision"]
    assert orphan.all_alive() and alive(kept)


def test_a_gpu_gone_since_the_first_check_refuses_the_reap(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    fake_gpu.add_gpu(1)
    clock = FakeClock()
    h = harness(clock=clock, min_age_seconds=60)
    orphan = spawn_orphan(trees, fake_gpu)
    # No error at all in between: the device list is just shorter.
    record = check_twice(h, clock, orphan, between=lambda: fake_gpu.remove_gpu(1))
    assert record["decision"]["reason"] == "nvml-incomplete", record["decision"]
    assert "reported at the first check" in record["decision"]["detail"]
    assert orphan.all_alive()


# -- 6. write-ahead audit -----------------------------------------------------------


def test_no_signal_without_an_audit_record_and_the_remediator_says_so(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        full_disk: Path) -> None:
    h = harness(audit_log=str(full_disk / "audit.jsonl"))
    orphan = spawn_orphan(trees, fake_gpu)
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    assert orphan.all_alive() and not any(stopped(p) for p in orphan.members)
    health = h.client.get("/healthz")
    assert health.status_code == 503 and health.get_data(as_text=True) == (
        "audit-log-unwritable\n")
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert "gpuguard_remediator_audit_ok 0.0" in metrics
    assert "gpuguard_remediator_audit_write_failures_total 2.0" in metrics  # intent, final
    assert [d["reason"] for d in h.decisions(orphan.root)][0] == "audit-failed"

    (full_disk / "filler").unlink()  # space again: the next delivery reaps, and is audited
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(orphan.none_alive, what="the reap once the audit log is writable")
    h.settle()
    # The refused reap's final record was owed (issue 47): written first, as made.
    refused, intent, final = h.audit()
    assert (refused["phase"], refused["decision"]["reason"]) == ("final", "audit-failed")
    assert refused["signals"] == [] and "retried_at" in refused
    assert [r["phase"] for r in (intent, final)] == ["intent", "final"]
    assert "retried_at" not in final
    assert h.client.get("/healthz").status_code == 200


def test_manual_reap_refuses_when_the_audit_log_cannot_be_written(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run,
        full_disk: Path) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    config = write_config(tmp_path, audit_log=str(full_disk / "audit.jsonl"))
    done = gpuguard("reap", str(orphan.root), "--apply", "--start-time", str(orphan.root_start),
                    "--allow-pid-namespace", "--config", str(config), "--json")
    assert done.returncode == 6, (done.stdout, done.stderr)
    assert '"reason": "audit-failed"' in done.stdout
    assert orphan.all_alive() and not any(stopped(p) for p in orphan.members)


# -- 7. boot identity, not clocks ---------------------------------------------------


def test_a_wall_clock_step_keeps_every_key(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    key = TreeKey(HOST, 4242, 99)
    ledger = Ledger(tmp_path)
    ledger.begin_reap(key, "enforce", "fp")
    ledger.finish_reap(key, "reaped", signalled=True)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)  # NTP at boot, a VM resumed
    again = Ledger(tmp_path)
    assert again.done_modes() == {key: "enforce"}


# -- 8. a crash mid-reap leaves nothing frozen ---------------------------------------


class Crash(BaseException):
    """Stands for the remediator dying (SIGKILL, OOM) between freeze and kill."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_crash_after_the_freeze_is_thawed_at_restart_and_never_re_killed(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    crashed: list[int] = []

    def die_at_sigterm(fd: int, sig: int) -> None:
        # A dead process sends nothing more: not even the SIGCONTs of the reaper's own
        # cleanup, which an exception in a live process would run (and thaw the tree).
        if crashed or sig == signal.SIGTERM:
            crashed.append(sig)
            raise Crash()
        signal.pidfd_send_signal(fd, sig)

    h = harness(reaper_kw={"pidfd_send": die_at_sigterm})
    orphan = spawn_orphan(trees, fake_gpu)
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(lambda: not h.service.healthy()[0], what="the worker to die mid-reap")
    assert all(stopped(p) for p in orphan.members)  # left frozen by the "crash"
    h.service.stop()

    again = harness()  # the restart
    wait_for(lambda: not any(stopped(p) for p in orphan.members), what="the thaw")
    assert orphan.all_alive()
    records = [r for r in again.audit()
               if r["decision"]["reason"] in ("interrupted", "interrupted-thawed")]
    assert [(r["phase"], r["decision"]["reason"]) for r in records] == [
        ("intent", "interrupted"), ("final", "interrupted-thawed")]
    assert sorted(m["pid"] for m in records[0]["tree"]["members"]) == sorted(orphan.members)
    assert {(s["pid"], s["signal"], s["result"]) for s in records[1]["signals"]} == {
        (p, "SIGCONT", "sent") for p in orphan.members}
    assert account(again.post(payload(orphan.alert())))["status"] == "duplicate"


# -- 9. the host PID namespace --------------------------------------------------------


def test_namespace_check_reads_the_kernel_inode() -> None:
    assert in_host_pid_namespace() == (os.stat("/proc/self/ns/pid").st_ino == PROC_PID_INIT_INO)


def test_the_remediator_refuses_to_start_outside_the_host_pid_namespace(
        tmp_path: Path) -> None:
    from tests.support.remediator_harness import write_config

    config = write_config(tmp_path)
    argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable,
            "-m", "gpuguard.remediator",
            "--config", str(config), "--insecure-no-auth", "--listen", "127.0.0.1:0"]
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                      capture_output=True, check=False).returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("unshare --pid is not permitted")
        pytest.skip("unshare --pid is not permitted here")
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("gpuguard-remediator: refusing to start outside the host PID "
                           "namespace")
    assert "--allow-pid-namespace" in line
    # With the flag it starts: bounded by a timeout, it serves until stopped.
    with subprocess.Popen([*argv, "--allow-pid-namespace"], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("listening on 127.0.0.1:")
        finally:
            proc.kill()  # unshare ignores SIGTERM; --kill-child takes the server down with it
            proc.wait(timeout=30)


def test_an_orphan_with_only_plain_members_is_still_reaped(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """The new rules refuse what they must and nothing else."""
    orphan = spawn_orphan(trees, fake_gpu, 'sh -c "{holder} --pidfile {dir}/holder & '
                          'sleep 3600 & wait" & echo $! > {dir}/root; wait')
    h = harness()
    record = deliver(h, orphan)
    assert record["decision"]["action"] == "reap" and record["outcome"] == "reaped"
    assert len(record["tree"]["members"]) == 3 and orphan.none_alive()
    assert Verdict.ORPHAN == record["tree"]["verdict"]


# -- 5. pid reuse during the descendant walk ------------------------------------------


def test_a_reused_pid_does_not_bring_its_children_into_the_reap(
        fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """Played for real in a fresh PID namespace: see tests/support/pid_reuse.py."""
    from tests.support.servers import child_env

    argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable,
            "-m", "tests.support.pid_reuse"]
    if subprocess.run(argv[:5] + ["true"], capture_output=True, check=False).returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("unshare --pid is not permitted")
        pytest.skip("unshare --pid is not permitted here")
    done = subprocess.run(argv, cwd=REPO, env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["q"] == result["member"], result  # the race happened: M's pid is Q's now
    signalled = {pid for pid, _, outcome in result["signals"] if outcome == "sent"}
    assert result["c"] not in signalled and result["c_alive"], result
    assert result["outcome"] == "reaped"


# -- 8 (continued). recovery trusts ids, not clocks, and retries until it can audit ------------


def freeze_and_crash(tmp_path: Path, orphan: Orphan) -> tuple[TreeKey, Ledger]:
    """What a crash between the first SIGSTOP and the kill leaves: a REAPING key whose
    members are recorded (not stopped before the reap) and really stopped."""
    key = TreeKey(HOST, orphan.root, orphan.root_start)
    ledger = Ledger(tmp_path / "state")
    ledger.begin_reap(key, "enforce", "fp-crashed")
    ids = [(p, int(stat_fields(p)["start_time"])) for p in orphan.members]  # type: ignore[call-overload]
    ledger.add_members(key, [(p, start, False) for p, start in ids])
    ledger.mark_held(key, ids, True)  # as the reaper marks them, right before its SIGSTOP
    for pid in orphan.members:
        os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: all(stopped(p) for p in orphan.members), what="the frozen tree")
    return key, ledger


def test_recovery_does_not_mistake_an_earlier_attempts_record_for_this_reap(
        tmp_path: Path, harness: Callable[..., Harness], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    key = TreeKey(HOST, orphan.root, orphan.root_start)
    earlier = Ledger(tmp_path / "state")
    first = earlier.begin_reap(key, "enforce", "fp-1")
    earlier.finish_reap(key, "aborted", signalled=False)  # frees the key for a new attempt
    # The earlier attempt's final record carries a later time (the clock stepped back since).
    (tmp_path / "audit.jsonl").write_text(json.dumps({
        "phase": "final", "reap_id": first, "ts": time.time() + 3600,
        "key": {"hostname": HOST, "root_pid": orphan.root,
                "root_start_time": orphan.root_start}}) + "\n")
    freeze_and_crash(tmp_path, orphan)
    h = harness()
    wait_for(lambda: not any(stopped(p) for p in orphan.members), what="the thaw")
    assert any(r.get("decision", {}).get("reason") == "interrupted-thawed" for r in h.audit())


def test_an_interrupted_reap_that_cannot_be_audited_is_retried_and_reported(
        tmp_path: Path, harness: Callable[..., Harness], trees: Trees,
        fake_gpu: FakeGpuWorld, full_disk: Path) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    freeze_and_crash(tmp_path, orphan)
    h = harness(audit_log=str(full_disk / "audit.jsonl"))
    health = h.client.get("/healthz")
    assert (health.status_code, health.get_data(as_text=True)) == (
        503, "audit-log-unwritable\n")
    # Every freeze thaws: continued at once, its records owed until the disk has room.
    assert not any(stopped(p) for p in orphan.members) and orphan.all_alive()
    assert len(h.service.ledger.owed()) == 2  # settled, its records owed (issue 47)
    (full_disk / "filler").unlink()
    wait_for(lambda: h.client.get("/healthz").status_code == 200, what="health back")
    # The intent record could not precede the SIGCONTs (the disk was full; the reap's
    # own intent named these members): it follows them, as made, then the final one
    # says what was continued.
    intent, final = h.audit()
    assert (intent["phase"], final["phase"]) == ("intent", "final")
    assert intent["ts"] <= final["ts"] and "retried_at" in intent and "retried_at" in final
    assert final["decision"]["reason"] == "interrupted-thawed", final["decision"]
    assert {(s["pid"], s["signal"]) for s in final["signals"]} == {
        (p, "SIGCONT") for p in orphan.members}
