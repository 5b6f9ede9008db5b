"""The reaper on real process trees: identity checks, freeze, TERM/KILL, kill paths."""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.base.counters import Counters
from gpuguard.config.remediate import Remediate, UserFilter
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import Member, TreeKey
from gpuguard.engine.platforms import inspect_tree
from gpuguard.engine.reap.outcome import KillPath, ReapResult
from gpuguard.engine.reap.reap_run import Journal
from gpuguard.engine.reap.reaper import Reaper
from gpuguard.engine.scan.inspection import member_of
from gpuguard.gpu.nvml import Nvml
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.marks import Marks
from gpuguard.host.procfs import ProcessView
from gpuguard.launch.teardown.keeping import spare_for
from gpuguard.orphans.process import walk_members
from gpuguard.orphans.protections import KEEP_REGISTRATION
from gpuguard.orphans.rules_config import KEEP_MARK, Rules
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, live_threads, stat_fields, wait_for, zombie_leader
from tests.support.remediator_harness import (
    GIB,
    HOST,
    STUBBORN,
    Orphan,
    spawn_orphan,
    start_time_of,
)

#: Lets the tests' own processes through whoever runs them (CI runs as root).
RULES = Rules()
POLICY = Remediate(mode="enforce", term_timeout_seconds=2, allow_root_owned=True,
                   users=UserFilter(allow=("*",), deny=()))


class DriverLikeNvml:
    """The real Nvml over the fake library, minus holders that have exited (as a driver does)."""

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml

    def read(self) -> GpuReading:
        reading = self.nvml.read()
        live = tuple(h for h in reading.holders if alive(h.pid))
        return dataclasses.replace(reading, holders=live)


@pytest.fixture
def nvml(fake_gpu: FakeGpuWorld) -> Iterator[DriverLikeNvml]:
    real = Nvml(counters=Counters())
    yield DriverLikeNvml(real)
    real.close()


def plan_for(orphan: Orphan, nvml: DriverLikeNvml, *, dry_run: bool = False,
             extra: tuple[int, ...] = ()) -> ReapPlan:
    """The plan the worker would make now; `extra`: members besides root and holder."""
    key = TreeKey(HOST, orphan.root, orphan.root_start)
    live = inspect_tree(key, nvml=nvml, rules=Rules(), counters=Counters())
    assert live.tree_found and live.verdict == "orphan", live
    assert sorted(m.pid for m in live.members) == sorted([*orphan.members, *extra])
    return ReapPlan(key, live.members, live.holders, live.gpu_bytes, dry_run, gpus=live.gpus)


def reap(plan: ReapPlan, nvml: DriverLikeNvml, *, policy: Remediate = POLICY,
         protected: frozenset[int] = frozenset({1, os.getpid()}), deadline: float | None = None,
         journal: Journal | None = None, rules: Rules = RULES,
         **reaper_kw: object) -> ReapResult:
    reaper = Reaper(nvml=nvml, counters=Counters(), **reaper_kw)  # type: ignore[arg-type]
    return reaper.reap(plan, policy=policy, rules=rules, protected_pids=protected,
                       deadline=deadline if deadline is not None else time.monotonic() + 30,
                       journal=journal if journal is not None else Written())


class Written:
    """A journal that keeps what it was asked to write, in order."""

    def __init__(self) -> None:
        self.records: list[tuple[str, tuple[int, ...]]] = []

    def __call__(self, phase: str, members: tuple[Member, ...]) -> None:
        self.records.append((phase, tuple(m.pid for m in members)))


def sent(result: ReapResult) -> list[tuple[int, str]]:
    return [(s.pid, s.signal) for s in result.signals if s.result == "sent"]


def test_term_ignoring_member_gets_sigkill_through_its_pidfd(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu, STUBBORN)
    policy = dataclasses.replace(POLICY, term_timeout_seconds=0.3)
    result = reap(plan_for(orphan, nvml), nvml, policy=policy)
    assert (result.outcome, result.kill_path) == ("reaped", KillPath.PIDFD), result
    assert orphan.none_alive()
    signals = sent(result)
    assert signals[:2] == [(orphan.root, "SIGSTOP"), (orphan.holder, "SIGSTOP")]
    assert (orphan.holder, "SIGTERM") in signals and (orphan.holder, "SIGKILL") in signals
    assert signals.index((orphan.root, "SIGTERM")) < signals.index((orphan.root, "SIGCONT"))
    assert result.reclaimed_bytes == 2 * GIB and result.gpu_bytes_after == 0
    assert result.killed == 2 and result.survivors == ()


def test_without_pidfd_it_refuses_unless_the_policy_opts_in(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    refused = reap(plan, nvml, pidfd_open=None)
    assert (refused.outcome, refused.reason, refused.kill_path) == ("aborted", "no-pidfd", None)
    assert refused.signals == () and orphan.all_alive()

    def enosys(pid: int) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    refused = reap(plan, nvml, pidfd_open=enosys)
    assert (refused.outcome, refused.reason) == ("aborted", "no-pidfd") and orphan.all_alive()

    weaker = dataclasses.replace(POLICY, allow_without_pidfd=True)
    result = reap(plan, nvml, policy=weaker, pidfd_open=enosys)
    assert (result.outcome, result.kill_path) == ("reaped", KillPath.PID)
    assert orphan.none_alive()


def test_root_replaced_since_the_decision_is_not_touched(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    root = dataclasses.replace(plan.members[0], start_time=plan.members[0].start_time - 1)
    result = reap(dataclasses.replace(plan, members=(root, *plan.members[1:])), nvml)
    assert (result.outcome, result.reason) == ("aborted", "root-replaced")
    assert result.signals == () and orphan.all_alive()


def test_a_refused_process_joining_during_the_freeze_aborts_and_thaws(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    only_root = dataclasses.replace(plan, members=plan.members[:1])
    result = reap(only_root, nvml, protected=frozenset({1, os.getpid(), orphan.holder}))
    assert (result.outcome, result.reason) == ("aborted", "protected-pid")
    assert sent(result) == [(orphan.root, "SIGSTOP"), (orphan.root, "SIGCONT")]
    assert orphan.all_alive()
    for pid in orphan.members:
        fields = stat_fields(pid)
        assert fields is not None and fields["state"] != "T", f"{pid} left stopped"


def test_dry_run_and_timeout_send_nothing(trees: Trees, fake_gpu: FakeGpuWorld,
                                          nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    dry = reap(plan_for(orphan, nvml, dry_run=True), nvml)
    assert dry.outcome == "dry-run" and dry.signals == () and dry.killed == 0
    assert [m.pid for m in dry.members] == orphan.members
    late = reap(plan_for(orphan, nvml), nvml, deadline=time.monotonic() - 1)
    assert (late.outcome, late.reason, late.signals) == ("aborted", "worker-timeout", ())
    assert orphan.all_alive()


# -- judged when it can no longer change; nothing left behind stopped --------------------

#: Under the orphan root sh: the GPU holder, and a sibling that starts ignoring SIGHUP (or
#: forks a cleanup child on SIGTERM) when told.
WITH_SIBLING = ('sh -c "{holder} --pidfile {dir}/holder & {holder} --pidfile {dir}/sibling '
                '--hup-on-usr1 --fork-on-term & wait" & echo $! > {dir}/root; wait')


def sighup_ignored(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    return bool(int(status.split("SigIgn:")[1].split()[0], 16) & 1)


def stopped(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields["state"] in ("T", "t")


def test_a_member_that_detaches_after_it_was_judged_is_not_killed(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    """Judged, then it starts ignoring SIGHUP before its SIGSTOP lands: judged again,
    frozen, it is protected; the reap aborts and continues the tree."""
    orphan = spawn_orphan(trees, fake_gpu, WITH_SIBLING)
    sibling = orphan.tree.pid("sibling")
    plan = plan_for(orphan, nvml, extra=(sibling,))

    def detach_at_intent(phase: str, members: tuple[Member, ...]) -> None:
        if phase == "intent":  # between the first judgement and the first SIGSTOP
            os.kill(sibling, signal.SIGUSR1)
            wait_for(lambda: sighup_ignored(sibling), what="the sibling to ignore SIGHUP")

    result = reap(plan, nvml, journal=detach_at_intent)
    assert (result.outcome, result.reason) == ("aborted", "member-protected"), result
    assert str(sibling) in result.detail
    assert not any(s.signal in ("SIGTERM", "SIGKILL") for s in result.signals)
    assert orphan.all_alive() and alive(sibling)
    assert not any(stopped(p) for p in (*orphan.members, sibling))


def test_a_process_its_owner_had_stopped_stays_stopped_when_a_reap_aborts(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    """A stop the reap did not make refuses the tree before any signal (issue 47: it
    was "ours to kill", and the reap went on to its abort here, the sibling detaching at
    the intent record); the owner's stop stays (tests/live/test_stopped_members.py)."""
    orphan = spawn_orphan(trees, fake_gpu, WITH_SIBLING)
    sibling = orphan.tree.pid("sibling")
    plan = plan_for(orphan, nvml, extra=(sibling,))
    os.kill(orphan.holder, signal.SIGSTOP)  # Ctrl-Z, a scheduler: not the reaper's doing
    wait_for(lambda: stopped(orphan.holder), what="the holder to stop")
    journal = Written()

    result = reap(plan, nvml, journal=journal)
    assert (result.outcome, result.reason) == ("aborted", "member-stopped"), result
    assert result.signals == () and journal.records == []  # refused before the intent
    assert stopped(orphan.holder), "the reap continued a process it had not stopped"
    assert not stopped(orphan.root) and not stopped(sibling)
    os.kill(orphan.holder, signal.SIGCONT)


def test_a_gpu_holder_nobody_judged_aborts_the_frozen_reap(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu, WITH_SIBLING)
    sibling = orphan.tree.pid("sibling")
    plan = plan_for(orphan, nvml, extra=(sibling,))
    fake_gpu.add_process(0, sibling, GIB)  # a context opened after the classification
    result = reap(plan, nvml)
    assert (result.outcome, result.reason) == ("aborted", "member-unknown"), result
    assert orphan.all_alive() and alive(sibling)
    assert not any(stopped(p) for p in (*orphan.members, sibling))


def test_a_gpu_that_disappears_before_the_freeze_aborts_the_reap(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    fake_gpu.add_gpu(1)
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    assert len(plan.gpus) == 2
    fake_gpu.remove_gpu(1)  # no error: just one GPU fewer, whose holders nobody can see
    result = reap(plan, nvml)
    assert (result.outcome, result.reason) == ("aborted", "nvml-incomplete"), result
    assert orphan.all_alive() and not any(stopped(p) for p in orphan.members)


def test_a_child_born_during_the_term_wait_is_recorded_before_it_is_signalled(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu, WITH_SIBLING)
    sibling = orphan.tree.pid("sibling")
    written = Written()
    result = reap(plan_for(orphan, nvml, extra=(sibling,)), nvml, journal=written,
                  # The sibling's handler must fork within the TERM wait: 3 s of margin
                  # on a loaded runner (it ignores TERM after, so the test waits it out).
                  policy=dataclasses.replace(POLICY, term_timeout_seconds=3.0))
    child = int(wait_for(lambda: Path(f"{orphan.tree.dir}/sibling.child").read_text()
                         if Path(f"{orphan.tree.dir}/sibling.child").exists() else "",
                         what="the cleanup child's pid"))
    assert result.outcome == "reaped", result
    phases = [phase for phase, pids in written.records if child in pids]
    assert phases == ["joined"], written.records
    assert (child, "SIGSTOP") in sent(result) and not alive(child)


def test_a_member_that_cannot_be_held_refuses_the_reap(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)

    def out_of_fds(pid: int) -> int:
        if pid == orphan.holder:
            raise OSError(errno.EMFILE, "Too many open files")
        return os.pidfd_open(pid)

    result = reap(plan, nvml, pidfd_open=out_of_fds)
    # Out of descriptors is a tree too large for this process, said so (issue 43).
    assert (result.outcome, result.reason) == ("aborted", "tree-too-large"), result
    assert f"member {orphan.holder} " in result.detail and "LimitNOFILE" in result.detail
    assert result.signals == () and orphan.all_alive()

    def refused(pid: int) -> int:
        if pid == orphan.holder:
            raise OSError(errno.EACCES, "Permission denied")
        return os.pidfd_open(pid)

    result = reap(plan, nvml, pidfd_open=refused)
    assert (result.outcome, result.reason) == ("aborted", "member-unknown"), result
    assert result.signals == () and orphan.all_alive()


def test_a_failure_after_the_freeze_leaves_nothing_stopped(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)

    def broken_at_term(fd: int, sig: int) -> None:
        if sig == signal.SIGTERM:
            raise RuntimeError("a bug in the kill phase")
        signal.pidfd_send_signal(fd, sig)

    result = reap(plan_for(orphan, nvml), nvml, pidfd_send=broken_at_term)
    assert (result.outcome, result.reason) == ("failed", "internal-error"), result
    assert orphan.all_alive() and not any(stopped(p) for p in orphan.members)


def test_a_reap_withdrawn_while_alertmanager_is_asked_sends_nothing(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    withdrawn: list[bool] = []

    def slow_confirm() -> tuple[str, str] | None:
        withdrawn.append(True)  # the resolved delivery arrives during the question
        return None  # and Alertmanager still said "firing" when it answered

    reaper = Reaper(nvml=nvml, counters=Counters())
    result = reaper.reap(plan_for(orphan, nvml), policy=POLICY, rules=RULES,
                         protected_pids=frozenset({1, os.getpid()}),
                         deadline=time.monotonic() + 30, journal=Written(),
                         confirm=slow_confirm, cancelled=lambda: bool(withdrawn))
    assert (result.outcome, result.reason) == ("aborted", "cancelled"), result
    assert result.signals == () and orphan.all_alive()


# -- a process whose main thread exited (pthread_exit) while another thread runs ------------

#: Under the orphan root sh: the GPU holder, and a GPU holder that ignores SIGTERM and
#: whose main thread called pthread_exit(): /proc/PID/stat shows Z while it runs on.
ZOMBIE_LEADER_STUBBORN = ('sh -c "{holder} --pidfile {dir}/holder & {holder} --zombie-leader '
                          '--ignore-term --pidfile {dir}/zl & wait" & echo $! > {dir}/root; '
                          'wait')
#: ... the same, nohup'd (SIGHUP ignored: it protects its tree), without a GPU context.
NOHUP_ZOMBIE_LEADER = ('sh -c "{holder} --pidfile {dir}/holder & nohup {holder} --zombie-leader '
                       '--pidfile {dir}/zl >/dev/null 2>&1 & wait" & echo $! > {dir}/root; '
                       'wait')


def test_a_member_whose_main_thread_exited_is_killed_and_counted_gone_with_its_threads(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    """Issue 24: a zombie main thread is not a gone process. It is a member, signalled
    like any other (this one needs SIGKILL), and the reap is `reaped` only once every
    thread of it has exited."""
    orphan = spawn_orphan(trees, fake_gpu, ZOMBIE_LEADER_STUBBORN)
    zl = orphan.tree.pid("zl")
    assert zombie_leader(zl)
    fake_gpu.add_process(0, zl, GIB)
    plan = plan_for(orphan, nvml, extra=(zl,))
    assert zl in {h.pid for h in plan.holders}
    result = reap(plan, nvml, policy=dataclasses.replace(POLICY, term_timeout_seconds=0.3))
    assert not live_threads(zl), "reported before every thread of it was gone"
    assert (result.outcome, result.survivors) == ("reaped", ()), result
    signals = sent(result)
    assert {(zl, "SIGSTOP"), (zl, "SIGTERM"), (zl, "SIGKILL")} <= set(signals), signals
    assert orphan.none_alive() and not alive(zl)
    assert result.killed == 3 and result.reclaimed_bytes == 3 * GIB


def test_a_nohup_member_whose_main_thread_exited_found_at_the_freeze_aborts_and_thaws(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    """A plan that misses such a member (made by a walk that dropped it): the freeze's
    re-collection holds and judges it, and its ignored SIGHUP refuses the whole reap
    before any SIGTERM; what was stopped is continued."""
    orphan = spawn_orphan(trees, fake_gpu, NOHUP_ZOMBIE_LEADER)
    zl = orphan.tree.pid("zl")
    assert zombie_leader(zl) and sighup_ignored(zl)
    view = ProcessView(counters=Counters())
    infos = [view.fresh_stat(pid) for pid in orphan.members]
    members = tuple(member_of(info, view) for info in infos if info is not None)
    reading = nvml.read()
    plan = ReapPlan(TreeKey(HOST, orphan.root, orphan.root_start), members,
                    tuple(h for h in reading.holders if h.pid == orphan.holder), 2 * GIB,
                    False, gpus=tuple(gpu.uuid for gpu in reading.gpus))
    result = reap(plan, nvml)
    assert (result.outcome, result.reason) == ("aborted", "member-protected"), result
    assert f"member {zl} " in result.detail and "SIGHUP" in result.detail
    assert {sig for _, sig in sent(result)} <= {"SIGSTOP", "SIGCONT"}
    assert zl not in {pid for pid, _ in sent(result)}
    assert orphan.all_alive() and zombie_leader(zl)
    assert not any(stopped(p) for p in (*orphan.members, zl))


def test_crash_recovery_continues_a_stopped_process_whose_main_thread_exited(
        trees: Trees, nvml: DriverLikeNvml) -> None:
    """Review finding: recovery looked at the main thread's state only; a zombie main
    thread (pthread_exit()) shows Z while its live threads stay stopped, and they stayed
    stopped for good. Every freeze thaws."""
    tree = trees.spawn("{holder} --zombie-leader --pidfile {dir}/zl & wait")
    pid = tree.pid("zl")
    assert zombie_leader(pid)
    start = int(str((stat_fields(pid) or {})["start_time"]))
    os.kill(pid, signal.SIGSTOP)  # as the crashed reap left it

    def threads_stopped() -> bool:
        return all((Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                    .rsplit(")", 1)[1].split()[0]) in ("T", "t") for tid in live_threads(pid))

    wait_for(threads_stopped, what="its live threads to stop")
    signals = Reaper(nvml=nvml, counters=Counters()).thaw_interrupted([(pid, start)])
    assert [(s.pid, s.signal, s.result) for s in signals] == [(pid, "SIGCONT", "sent")]
    wait_for(lambda: not threads_stopped(), what="its threads to run again")
    assert zombie_leader(pid)


def test_a_member_marked_to_keep_once_frozen_is_continued_and_let_go_of_with_its_children(
        trees: Trees, nvml: DriverLikeNvml, tmp_path: Path) -> None:
    """`spare` (gpuguard run's keep marks, gpuguard/launch/teardown/keeping.py) is asked
    again of the frozen tree: a member registered to keep after it was held is continued
    and let go of with what is below it, never sent SIGTERM; the rest is reaped."""
    tree = trees.spawn("sleep 3600 & echo $! > {dir}/other; "
                       "bash -c 'sleep 3600 & echo $! > {dir}/below; wait' & "
                       "echo $! > {dir}/kept; wait")
    other, kept, below = tree.pid("other"), tree.pid("kept"), tree.pid("below")
    root = tree.launcher.pid
    marks = tmp_path / "marks"
    marks.mkdir(mode=0o755)
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    view = ProcessView(counters=Counters())
    info = view.fresh_stat(root)
    assert info is not None
    members = walk_members(info, view.children, view.stat, view.fresh_stat, view.thread_states)
    plan = ReapPlan(TreeKey(HOST, root, info.start_time),
                    tuple(member_of(m, view) for m in members), (), 0, False, classified=False)
    assert {m.pid for m in plan.members} >= {root, other, kept, below}
    asked: list[None] = []

    def confirm() -> None:
        """Asked after every member was held and judged, right before the first SIGSTOP."""
        if not asked:
            Marks(str(marks), boot).register(KEEP_MARK, kept, start_time_of(kept))
        asked.append(None)

    result = Reaper(nvml=nvml, counters=Counters()).reap(
        plan, policy=POLICY, rules=RULES, protected_pids=frozenset({1, os.getpid()}),
        deadline=time.monotonic() + 30, journal=Written(), confirm=confirm, force=True,
        spare=spare_for((KEEP_REGISTRATION,), Rules(marks_dir=str(marks))))
    assert result.outcome == "reaped", result
    assert [(k.member.pid, k.why) for k in result.kept] == [
        (kept, "is registered to keep (`gpuguard keep`)")]
    assert not alive(root) and not alive(other)
    for pid in (kept, below):  # running again, never terminated
        assert alive(pid) and (stat_fields(pid) or {}).get("state") != "T", pid
        assert [s for p, s in sent(result) if p == pid] == ["SIGSTOP", "SIGCONT"]
    assert {m.pid for m in result.members} == {root, other}
