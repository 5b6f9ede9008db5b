"""What a restart after a crash mid-reap does (issue 43): a state directory that cannot
be written never keeps a frozen tree frozen; a key is closed only once something was
signalled; the records say what was really continued, and what was really signalled.

Real trees over the fake NVML; the crash is either a real one of the worker (a
BaseException from the kernel's edge, as in test_kill_safety) or the state it leaves,
built with the ledger as the reaper writes it (freeze_and_crash).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.state.ledger import Ledger
from tests.e2e.test_alertmanager_client import FakeAlertmanager, api_alert, tree
from tests.live.test_kill_safety import Crash, freeze_and_crash
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, stat_fields, wait_for
from tests.support.remediator_harness import (
    HOST,
    Harness,
    Orphan,
    account,
    payload,
    spawn_orphan,
    write_config,
)
from tests.support.servers import REPO, child_env


def stopped(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields["state"] in ("T", "t")


def finals(h: Harness, orphan: Orphan) -> list[dict[str, Any]]:
    return [r for r in h.audit() if r["key"]["root_pid"] == orphan.root
            and r["phase"] == "final"]


# -- a key is closed only once something was signalled -------------------------------


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_crash_before_the_first_signal_lets_a_later_delivery_decide_again(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """The worker dies holding the key as "reaping" before it has a single pidfd (so
    before any signal); the restart must not read that key as done."""

    def die_at_open(pid: int, flags: int = 0) -> int:
        raise Crash()

    h = harness(reaper_kw={"pidfd_open": die_at_open})
    orphan = spawn_orphan(trees, fake_gpu)
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(lambda: not h.service.healthy()[0], what="the worker to die mid-reap")
    h.service.stop()
    assert orphan.all_alive() and not any(stopped(p) for p in orphan.members)

    again = harness()  # the restart
    (settled,) = finals(again, orphan)
    assert settled["decision"]["reason"] == "interrupted" and settled["signals"] == []
    assert "nothing was signalled" in settled["decision"]["detail"]
    assert account(again.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(orphan.none_alive, what="the reap the later delivery decided")


def test_a_restart_after_an_intent_with_no_signal_frees_the_key(
        tmp_path: Path, harness: Callable[..., Harness], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    """Members named (the intent), none marked held (no SIGSTOP was ever about to go
    out): a crash there left nothing signalled, and the key is free again."""
    orphan = spawn_orphan(trees, fake_gpu)
    key = TreeKey(HOST, orphan.root, orphan.root_start)
    ledger = Ledger(tmp_path / "state")
    ledger.begin_reap(key, "enforce", "fp-crashed")
    ledger.add_members(key, [(p, int(stat_fields(p)["start_time"]), False)  # type: ignore[call-overload]
                             for p in orphan.members])
    h = harness()
    (settled,) = finals(h, orphan)
    assert settled["decision"]["reason"] == "interrupted" and settled["signals"] == []
    assert h.service.ledger.done_modes() == {}
    assert h.service.ledger.reap_times("enforce") == ()  # its rate-limit slot too
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(orphan.none_alive, what="the reap the later delivery decided")


# -- the records say what was continued and what was signalled -------------------------


def test_interrupted_thawed_only_when_something_was_continued(
        tmp_path: Path, harness: Callable[..., Harness], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    """Marked held (the crash came right after the mark, before the SIGSTOP landed, or
    someone continued the tree since): nothing is stopped, nothing is continued, and the
    record says so instead of `interrupted-thawed`. The key stays closed: a signal may
    have gone out."""
    orphan = spawn_orphan(trees, fake_gpu)
    key = TreeKey(HOST, orphan.root, orphan.root_start)
    ledger = Ledger(tmp_path / "state")
    ledger.begin_reap(key, "enforce", "fp-crashed")
    ids = [(p, int(stat_fields(p)["start_time"])) for p in orphan.members]  # type: ignore[call-overload]
    ledger.add_members(key, [(p, start, False) for p, start in ids])
    ledger.mark_held(key, ids, True)
    h = harness()
    (settled,) = finals(h, orphan)
    assert settled["decision"]["reason"] == "interrupted", settled["decision"]
    assert settled["signals"] == []
    assert "nothing was continued" in settled["decision"]["detail"]
    assert orphan.all_alive()
    assert account(h.post(payload(orphan.alert())))["status"] == "duplicate"


def test_interrupted_thawed_names_what_it_continued(
        tmp_path: Path, harness: Callable[..., Harness], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    freeze_and_crash(tmp_path, orphan)
    os.kill(orphan.holder, signal.SIGCONT)  # one of the two continued since by someone
    wait_for(lambda: not stopped(orphan.holder), what="the holder running")
    h = harness()
    wait_for(lambda: not stopped(orphan.root), what="the thaw")
    (settled,) = finals(h, orphan)
    assert settled["decision"]["reason"] == "interrupted-thawed"
    assert [(s["pid"], s["signal"]) for s in settled["signals"]] == [(orphan.root, "SIGCONT")]
    assert "continued (SIGCONT) 1 of the 2" in settled["decision"]["detail"], settled["decision"]


@pytest.fixture
def flaky_alertmanager() -> Iterator[Callable[[Orphan], FakeAlertmanager]]:
    """Answers "firing" to the first question, then 503: unreachable once the tree is
    frozen (the second question, right before SIGTERM)."""
    started: list[FakeAlertmanager] = []

    def start(orphan: Orphan) -> FakeAlertmanager:
        import json

        firing = json.dumps([api_alert({**tree(HOST, str(orphan.root), str(orphan.root_start)),
                                        "remediate": "true"})]).encode()
        server: FakeAlertmanager

        def route(handler: Any) -> tuple[int, bytes, dict[str, str]]:
            if len(server.requests) == 1:
                return 200, firing, {}
            return 503, b"overloaded", {}

        server = FakeAlertmanager(route)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def test_the_final_record_says_what_was_signalled(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        flaky_alertmanager: Callable[[Orphan], FakeAlertmanager]) -> None:
    """Frozen, then Alertmanager cannot confirm: the tree was stopped and continued, so
    the record must not say "nothing signalled"."""
    orphan = spawn_orphan(trees, fake_gpu)
    server = flaky_alertmanager(orphan)
    h = harness(alertmanager={"url": server.url, "timeout_seconds": 2})
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    (final,) = finals(h, orphan)
    assert final["decision"]["reason"] == "alertmanager-unreachable", final["decision"]
    sent = {(s["pid"], s["signal"]) for s in final["signals"] if s["result"] == "sent"}
    assert sent == {(p, sig) for p in orphan.members for sig in ("SIGSTOP", "SIGCONT")}
    for detail in (final["decision"]["detail"], final["outcome_detail"]):
        assert "nothing signalled" not in detail and "nothing was signalled" not in detail
        assert "stopped (SIGSTOP) and continued (SIGCONT) 2 member(s)" in detail, detail
    assert orphan.all_alive() and not any(stopped(p) for p in orphan.members)


def test_an_abort_before_any_signal_still_says_nothing_was_signalled(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        flaky_alertmanager: Callable[[Orphan], FakeAlertmanager]) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    server = flaky_alertmanager(orphan)
    server.requests.append(("(the firing answer is used up)", None))
    h = harness(alertmanager={"url": server.url, "timeout_seconds": 2})
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    (final,) = finals(h, orphan)
    assert final["decision"]["reason"] == "alertmanager-unreachable" and final["signals"] == []
    assert "nothing was signalled" in final["decision"]["detail"], final["decision"]


# -- a state directory that cannot be written ----------------------------------------


def mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"mount {' '.join(args)}: {done.stderr.strip()}")
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    made: list[Path] = []
    yield made
    for where in reversed(made):
        subprocess.run(["umount", "-l", str(where)], check=False)


def unwritable(state: Path, how: str, mounts: list[Path]) -> None:
    """Make `state` (holding the ledger) read-only, or full, for real."""
    if how == "read-only":
        mount("--bind", str(state), str(state))
        mounts.append(state)
        mount("-o", "remount,bind,ro", str(state))
        return
    filler = state / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass  # ENOSPC
    finally:
        os.close(fd)


def start_remediator(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuguard.remediator", "--config", str(config),
                           "--insecure-no-auth", "--listen", "127.0.0.1:0",
                           "--allow-pid-namespace"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("how", ["read-only", "full"])
def test_an_unwritable_state_dir_at_restart_still_continues_the_frozen_tree(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
        mounts: list[Path], how: str) -> None:
    """The review's run: the restart could not rewrite its state file, exited 2 (which
    the unit never restarts) and left the interrupted reap's members stopped. Now
    recovery runs on what could be read (audited), then the remediator exits 3, which
    the unit restarts; a second start does not continue anything twice."""
    state = tmp_path / "state"
    if how == "full":
        state.mkdir(mode=0o700)
        mount("-t", "tmpfs", "-o", "size=64k,nr_inodes=64,mode=0700", "tmpfs", str(state))
        mounts.append(state)
    orphan = spawn_orphan(trees, fake_gpu)
    freeze_and_crash(tmp_path, orphan)
    unwritable(state, how, mounts)
    config = write_config(tmp_path)
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())

    done = start_remediator(config, env)
    assert done.returncode == 3, done.stderr
    assert not any(stopped(p) for p in orphan.members) and orphan.all_alive()
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("gpuguard-remediator: ")]
    assert "state" in line and "restart" in line, line
    from gpuguard.engine.reap.audit import AuditLog

    records = AuditLog(tmp_path / "audit.jsonl").records()
    assert [(r["phase"], r["decision"]["reason"]) for r in records] == [
        ("intent", "interrupted"), ("final", "interrupted-thawed")]
    assert {(s["pid"], s["signal"], s["result"]) for s in records[1]["signals"]} == {
        (p, "SIGCONT", "sent") for p in orphan.members}

    again = start_remediator(config, env)  # the unit's restart, the disk still unwritable
    assert again.returncode == 3, again.stderr
    assert len(AuditLog(tmp_path / "audit.jsonl").records()) == 2  # settled once only


def test_an_unwritable_audit_log_too_still_continues_the_frozen_tree(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
        mounts: list[Path]) -> None:
    """Every freeze thaws: with the audit log unwritable, the restart still continues what
    the interrupted reap stopped (its intent record named them), says so in the log, and
    exits 3; the next restart continues nothing twice; the records follow once the log
    can be written."""
    logs = tmp_path / "log"
    logs.mkdir(mode=0o700)
    config = write_config(tmp_path, audit_log=str(logs / "audit.jsonl"))
    orphan = spawn_orphan(trees, fake_gpu)
    freeze_and_crash(tmp_path, orphan)
    (logs / "audit.jsonl").touch(mode=0o600)
    unwritable(logs, "read-only", mounts)
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())

    done = start_remediator(config, env)
    assert done.returncode == 3, done.stderr
    assert not any(stopped(p) for p in orphan.members) and orphan.all_alive(), done.stderr
    assert "continuing the 2 member(s) it stopped anyway" in done.stderr, done.stderr
    # Its owner stops the job meanwhile (Ctrl-Z); the unit's restart, the log still
    # read-only, must not continue it again: the state file says it was let go.
    os.kill(orphan.holder, signal.SIGSTOP)
    wait_for(lambda: stopped(orphan.holder), what="the owner's stop")
    again = start_remediator(config, env)
    assert again.returncode == 3, again.stderr
    assert stopped(orphan.holder), again.stderr
    os.kill(orphan.holder, signal.SIGCONT)
    # The records the first start owed (issue 47): once the log can be written, the next
    # start writes them as they were made, saying what that start really continued.
    subprocess.run(["umount", str(logs)], check=True)
    mounts.remove(logs)
    owed = json.loads((tmp_path / "state" / "remediator-state.json").read_text())["owed"]
    assert [r["phase"] for r in owed] == ["intent", "final"]
    third = subprocess.Popen([sys.executable, "-m", "gpuguard.remediator", "--config",
                              str(config), "--insecure-no-auth", "--listen", "127.0.0.1:0",
                              "--allow-pid-namespace"], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        from gpuguard.engine.reap.audit import AuditLog

        log = AuditLog(logs / "audit.jsonl")
        wait_for(lambda: len(log.records()) == 2, what="the owed records written")
    finally:
        third.send_signal(signal.SIGTERM)
        third.communicate(timeout=60)
    intent, final = log.records()
    assert [(r["phase"], r["decision"]["reason"]) for r in (intent, final)] == [
        ("intent", "interrupted"), ("final", "interrupted-thawed")]
    assert [r for r in (intent, final) if "retried_at" not in r] == []
    assert {(s["pid"], s["signal"], s["result"]) for s in final["signals"]} == {
        (p, "SIGCONT", "sent") for p in orphan.members}
    assert {k: v for k, v in final.items() if k != "retried_at"} == owed[1]


def test_an_audit_log_that_cannot_be_read_still_lets_recovery_continue_the_tree(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """Recovery first asks the log whether the reap's final record made it; an I/O error
    there (a failing disk: here the path is a directory, EISDIR) must not keep the tree
    stopped: it is continued, and the remediator exits 3."""
    logs = tmp_path / "log"
    logs.mkdir(mode=0o700)
    (logs / "audit.jsonl").mkdir()
    config = write_config(tmp_path, audit_log=str(logs / "audit.jsonl"))
    orphan = spawn_orphan(trees, fake_gpu)
    freeze_and_crash(tmp_path, orphan)
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    done = start_remediator(config, env)
    assert done.returncode == 3, done.stderr
    assert not any(stopped(p) for p in orphan.members) and orphan.all_alive(), done.stderr
    assert "cannot be read" in done.stderr, done.stderr
