"""Issue 24: the kill path on every way out. Real trees, the fake NVML, real signals.

Every freeze thaws (docs/design.md, Principles, 2): a person's Ctrl-C, a SIGTERM or a hangup of
`gpuguard reap --apply` mid-freeze, and a driver that hangs while the tree is stopped,
all end with no process stopped by us and a record saying why. A member that detaches
after its SIGTERM is not SIGKILLed; a root that leaves its session before the freeze is
not reaped; the manual path audits where the remediator would; `--apply` names the
process, not only the pid; crash recovery continues only what the reap held stopped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.base.counters import Counters
from gpuguard.config.remediate import Remediate, UserFilter
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import Member, TreeKey
from gpuguard.engine.platforms import inspect_tree
from gpuguard.engine.reap.outcome import ReapResult
from gpuguard.engine.reap.reaper import Reaper
from gpuguard.gpu.nvml import Nvml
from gpuguard.orphans.rules_config import Rules
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, stat_fields, wait_for
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

POLICY = Remediate(mode="enforce", term_timeout_seconds=2, allow_root_owned=True,
                   users=UserFilter(allow=("*",), deny=()))

#: A holder that, on SIGTERM, starts ignoring SIGHUP and runs on (it detaches when asked
#: to stop): judged reapable before SIGTERM, protected after it.
HUP_ON_TERM = ('sh -c "{holder} --hup-on-term --pidfile {dir}/holder" & echo $! > {dir}/root; '
               'wait')
#: The root is a python that calls setsid() on SIGUSR2 while it waits for its child, the
#: GPU holder.
SETSID_ROOT = ('{holder} --depth=1 --setsid-on-usr2 --pidfile {dir}/holder & echo $! > '
               '{dir}/root; wait')
#: A holder that forks a cleanup child on SIGTERM and runs on.
FORKS_ON_TERM = ('sh -c "{holder} --fork-on-term --pidfile {dir}/holder" & echo $! > '
                 '{dir}/root; wait')


def stopped(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields["state"] in ("T", "t")


def sent(result: ReapResult) -> list[tuple[int, str]]:
    return [(s.pid, s.signal) for s in result.signals if s.result == "sent"]


@pytest.fixture
def nvml(fake_gpu: FakeGpuWorld) -> Iterator[Nvml]:
    real = Nvml(counters=Counters())
    yield real
    fake_gpu.set_delay_ms(0)  # a read the reaper gave up on finishes: close() can take the lock
    real.close()


def plan_for(orphan: Orphan, nvml: Nvml) -> ReapPlan:
    key = TreeKey(HOST, orphan.root, orphan.root_start)
    live = inspect_tree(key, nvml=nvml, rules=Rules(), counters=Counters())
    assert live.tree_found and live.verdict == "orphan", live
    return ReapPlan(key, live.members, live.holders, live.gpu_bytes, False, gpus=live.gpus)


def reap(plan: ReapPlan, nvml: Nvml, *, deadline: float | None = None,
         journal: Callable[[str, tuple[Member, ...]], None] | None = None,
         policy: Remediate = POLICY) -> ReapResult:
    return Reaper(nvml=nvml, counters=Counters()).reap(
        plan, policy=policy, rules=Rules(), protected_pids=frozenset({1, os.getpid()}),
        deadline=deadline if deadline is not None else time.monotonic() + 30,
        journal=journal if journal is not None else (lambda phase, members: None))


# -- 1. a signal to `gpuguard reap --apply` mid-freeze ------------------------------------


def audit_records(config: Path) -> list[dict[str, Any]]:
    path = Path(yaml.safe_load(config.read_text())["remediate"]["audit_log"])
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(("sig", "first"), [
    (signal.SIGINT, None), (signal.SIGTERM, None), (signal.SIGHUP, None),
    # Ctrl-Z first: a reaper stopped by its terminal would hold the tree frozen for as
    # long as it stays stopped (the thaw guardian acts on its death only), and would
    # handle the SIGINT after it only once continued.
    (signal.SIGINT, signal.SIGTSTP)], ids=["SIGINT", "SIGTERM", "SIGHUP", "SIGTSTP-SIGINT"])
def test_a_signal_to_reap_apply_mid_freeze_thaws_the_tree_and_the_audit_says_why(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
        sig: signal.Signals, first: signal.Signals | None) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    config = write_config(tmp_path, mode="dry-run")  # --apply reaps regardless
    # Every NVML call takes 0.2 s: a read (about 11 calls) keeps the tree frozen for about
    # 2 s while the reaper re-checks the holders; once the tree is seen frozen, the driver
    # hangs (a minute a call), and the signal comes.
    fake_gpu.set_delay_ms(200)
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env(NO_COLOR="1"))
    with subprocess.Popen(
            [sys.executable, "-m", "gpuguard.console", "reap", str(orphan.root),
             "--apply", "--start-time", str(orphan.root_start), "--allow-pid-namespace",
             "--config", str(config), "--json"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True) as proc:
        try:
            wait_for(lambda: all(stopped(p) for p in orphan.members), timeout=30,
                     interval=0.005, what="the reap to freeze the tree")
            fake_gpu.set_delay_ms(60_000)
            if first is not None:
                proc.send_signal(first)
            proc.send_signal(sig)
            # Thawed promptly: not when the hung-looking read would have finished.
            wait_for(lambda: not any(stopped(p) for p in orphan.members), timeout=1.5,
                     interval=0.01, what="every member to be continued")
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert orphan.all_alive()
    assert proc.returncode == 128 + sig, (out, err)
    doc = json.loads(out)
    assert (doc["outcome"], doc["reason"]) == ("aborted", "interrupted"), doc
    assert sig.name in doc["detail"] and doc["exit_code"] == 128 + sig
    assert {s["signal"] for s in doc["signals"] if s["result"] == "sent"} == {"SIGSTOP",
                                                                             "SIGCONT"}
    assert f"interrupted by {sig.name}" in err
    intent, final = audit_records(config)
    assert (intent["phase"], final["phase"]) == ("intent", "final")
    assert final["decision"]["reason"] == "interrupted" and final["outcome"] == "aborted"
    assert final["outcome_reason"] == "interrupted"
    assert f"{sig.name} received" in final["outcome_detail"]
    assert "continued" in final["outcome_detail"]


# -- 2. a driver that hangs while the tree is frozen -------------------------------------


def test_nvml_hanging_under_the_freeze_is_waited_for_no_longer_than_the_deadline(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    fake_gpu.set_delay_ms(3000)  # from now on the driver takes 3 s a call (33 s a read)
    limit = 1.0
    began = time.monotonic()
    result = reap(plan, nvml, deadline=began + limit)
    took = time.monotonic() - began
    assert (result.outcome, result.reason) == ("aborted", "nvml-timeout"), result
    assert took < limit + 1.0, f"the tree stayed frozen {took:.1f}s against a {limit}s deadline"
    assert sent(result) == [(orphan.root, "SIGSTOP"), (orphan.holder, "SIGSTOP"),
                            (orphan.root, "SIGCONT"), (orphan.holder, "SIGCONT")]
    assert orphan.all_alive() and not any(stopped(p) for p in orphan.members)


# -- 3a. a member that detaches after its SIGTERM -----------------------------------------


def test_a_member_that_starts_ignoring_sighup_after_sigterm_is_not_sigkilled(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    orphan = spawn_orphan(trees, fake_gpu, HUP_ON_TERM)
    h = harness(term_timeout_seconds=0.5)
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    (final,) = [r for r in h.audit() if r["phase"] == "final"]
    assert final["outcome"] == "failed" and final["outcome_reason"] == "member-protected", final
    assert "ignores SIGHUP" in final["outcome_detail"]
    assert "no SIGKILL was sent" in final["outcome_detail"]
    signals = {(s["pid"], s["signal"]) for s in final["signals"] if s["result"] == "sent"}
    assert (orphan.holder, "SIGTERM") in signals
    assert not any(name == "SIGKILL" for _, name in signals), signals
    assert alive(orphan.holder) and not stopped(orphan.holder)
    assert orphan.holder in final["survivors"]


# -- 3b. the verdict derived again once frozen ---------------------------------------------


def test_a_root_that_leaves_its_session_before_the_freeze_is_not_reaped(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu, SETSID_ROOT)
    plan = plan_for(orphan, nvml)

    def setsid_at_intent(phase: str, members: tuple[Member, ...]) -> None:
        if phase == "intent":  # between the inspection and the first SIGSTOP
            os.kill(orphan.root, signal.SIGUSR2)
            wait_for(lambda: (stat_fields(orphan.root) or {}).get("sid") == orphan.root,
                     what="the root to lead a session of its own")

    result = reap(plan, nvml, journal=setsid_at_intent)
    assert (result.outcome, result.reason) == ("aborted", "tree-not-found"), result
    assert "classified again with the tree frozen" in result.detail
    assert not any(name in ("SIGTERM", "SIGKILL") for _, name in sent(result))
    assert orphan.all_alive() and not any(stopped(p) for p in orphan.members)


def test_the_verdict_derived_again_must_carry_an_allowed_reason(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    plan = dataclasses.replace(plan_for(orphan, nvml), reasons=("launcher-killed",))
    result = reap(plan, nvml)  # no process events here: the leader's death reads session-ended
    assert (result.outcome, result.reason) == ("aborted", "reason-not-allowed"), result
    assert orphan.all_alive() and not any(stopped(p) for p in orphan.members)


# -- 3c, 3d. `gpuguard reap`: the audit log's directory, and the identity it reaps ----------


def console(fake_gpu: FakeGpuWorld, lib: Path, *args: str) -> subprocess.CompletedProcess:
    env = fake_gpu.subprocess_env(lib, child_env(NO_COLOR="1"))
    return subprocess.run([sys.executable, "-m", "gpuguard.console", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("how", ["group-writable", "symlink"])
def test_reap_apply_refuses_an_audit_directory_the_remediator_would_refuse(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
        how: str) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    real = tmp_path / "logs"
    real.mkdir()
    if how == "group-writable":
        real.chmod(0o777)
        where = real
    else:
        where = tmp_path / "link"
        where.symlink_to(real)
    config = write_config(tmp_path, audit_log=str(where / "audit.jsonl"))
    done = console(fake_gpu, fake_nvml_lib, "reap", str(orphan.root), "--apply",
                   "--start-time", str(orphan.root_start), "--allow-pid-namespace",
                   "--config", str(config), "--json")
    assert done.returncode == 6, (done.stdout, done.stderr)
    doc = json.loads(done.stdout)
    assert (doc["outcome"], doc["reason"]) == ("refused", "audit-unsafe"), doc
    assert doc["signals"] == [] and doc["audit_log"] is None and doc["audit_error"]
    assert "not audited" in done.stderr
    assert orphan.all_alive() and not (real / "audit.jsonl").exists()


def test_a_dry_run_creates_no_directory(tmp_path: Path, trees: Trees,
                                        fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """Without --apply nothing is signalled and nothing of the system's is made: an audit
    log whose folder does not exist (a first try, before any install) stays absent."""
    orphan = spawn_orphan(trees, fake_gpu)
    missing = tmp_path / "var" / "log" / "gpuguard"
    config = write_config(tmp_path, audit_log=str(missing / "audit.jsonl"))
    dry = console(fake_gpu, fake_nvml_lib, "reap", str(orphan.root), "--config", str(config),
                  "--json")
    assert dry.returncode == 0, dry.stderr
    assert not (tmp_path / "var").exists() and orphan.all_alive()
    assert json.loads(dry.stdout)["audit_log"] is None


def test_reap_apply_needs_the_start_time_of_the_process_it_reaps(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    config = write_config(tmp_path)
    done = console(fake_gpu, fake_nvml_lib, "reap", str(orphan.root), "--apply",
                   "--allow-pid-namespace", "--config", str(config))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith("gpuguard: --apply needs --start-time START_TIME of the process")
    assert done.stdout == "" and orphan.all_alive()
    # The dry run names the process: what --apply then needs.
    dry = console(fake_gpu, fake_nvml_lib, "reap", str(orphan.root), "--config", str(config))
    assert dry.returncode == 0, dry.stderr
    assert f"--apply --start-time {orphan.root_start}" in dry.stdout
    assert orphan.all_alive()


# -- 3e. crash recovery continues only what the reap held stopped ---------------------------


class Crash(BaseException):
    """Stands for the remediator dying (SIGKILL, OOM): after it, nothing is sent."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_recovery_leaves_a_member_its_owner_stopped_after_the_reap_had_continued_it(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    orphan = spawn_orphan(trees, fake_gpu, FORKS_ON_TERM)
    known = set(orphan.members)
    crashed: list[int] = []

    def open_until_a_joiner(pid: int) -> int:
        if pid not in known:  # the cleanup child born after SIGTERM: the crash comes here
            crashed.append(pid)
            raise Crash()
        return os.pidfd_open(pid)

    def send_until_crashed(fd: int, sig: int) -> None:
        if crashed:
            raise Crash()
        signal.pidfd_send_signal(fd, sig)

    h = harness(term_timeout_seconds=5,
                reaper_kw={"pidfd_open": open_until_a_joiner, "pidfd_send": send_until_crashed})
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(lambda: not h.service.healthy()[0], what="the worker to die mid-reap")
    assert crashed and alive(orphan.holder) and not stopped(orphan.holder)
    # After the crash the holder's owner stops it (Ctrl-Z, a scheduler): not ours.
    os.kill(orphan.holder, signal.SIGSTOP)
    wait_for(lambda: stopped(orphan.holder), what="the owner's stop")
    h.service.stop()
    try:
        again = harness()  # the restart
        finals = wait_for(lambda: [r for r in again.audit() if r["phase"] == "final"
                                   and r["decision"]["reason"].startswith("interrupted")],
                          what="the recovery's record")
        (record,) = finals  # type: ignore[misc]
        assert not any(s["signal"] == "SIGCONT" for s in record["signals"]), record
        assert stopped(orphan.holder), "recovery continued a stop that was not the reap's"
        assert account(again.post(payload(orphan.alert())))["status"] == "duplicate"
    finally:
        os.kill(orphan.holder, signal.SIGCONT)
