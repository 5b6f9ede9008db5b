"""The Windows reaper's decisions (issue 30), over a fake process-control back-end.

No Windows kernel runs on Linux, so its process objects are modelled here (the one thing
these tests mock; the Wine tier, tests/windows/, runs the real ctypes back-end): a handle
names one process object and keeps naming it after the pid is reused, suspends count, a
terminated process is gone. Everything else is real: the reaper, the Windows rules
(gpuguard/host/windows/tree.py) judging a table that changes while the reap runs, the
recheck, the policy, the records. A second model names processes by pid at every call
(as a psutil-style back-end would), to show that the creation-time check before each step
is what keeps a reused pid safe there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from gpuguard.config.remediate import Mode, Remediate
from gpuguard.engine.decision.policy import Action, Decision
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import LiveTree, Member, TreeKey
from gpuguard.engine.reap.audit import Phase, audit_record
from gpuguard.engine.reap.outcome import KillPath, Outcome, SignalResult
from gpuguard.engine.reap.skeleton import Interrupted
from gpuguard.engine.windows.control import RESUME, SUSPEND, TERMINATE
from gpuguard.engine.windows.inspection import windows_member, windows_protected_pids
from gpuguard.engine.windows.reaper import WindowsReaper
from gpuguard.gpu.reading import GpuReading, GpuSample
from gpuguard.host.windows.tree import WinProc
from gpuguard.orphans.process import Holder
from gpuguard.orphans.rules_config import WINDOWS_ADOPTERS, WINDOWS_PROTECT, Rules

RULES = Rules(protect=WINDOWS_PROTECT, adopters=WINDOWS_ADOPTERS)
POLICY = Remediate(mode=Mode.ENFORCE, worker_timeout_seconds=30.0)
GPU = "GPU-0000"
USER = "BOX\\alice"
#: alice's SID: an ordinary account (what the owner is judged by, not the name).
USER_SID = "S-1-5-21-1004336348-1177238915-682003330-1001"
#: A launcher that exited: the root's ppid names no process (orphan, parent-gone).
DEAD_LAUNCHER = 999


def row(pid: int, ppid: int, at: int, *, cmd: str = "python.exe train.py",
        readable: bool = True) -> WinProc:
    return WinProc(pid=pid, ppid=ppid, create_time=at, cmdline=tuple(cmd.split()),
                   name=cmd.split()[0], username=USER, session_id=1, readable=readable,
                   user_sid=USER_SID)


# -- the model of Windows' process objects -----------------------------------------------

@dataclass(eq=False)
class Proc:
    row: WinProc
    suspends: int = 0
    alive: bool = True


@dataclass
class Kernel:
    """Processes by pid (the live one at each pid), every step in `log`, hooks that change
    the world at the Nth step of a kind (`at`: (step, N) -> callable(pid), called as the
    step begins)."""

    procs: dict[int, Proc] = field(default_factory=dict)
    log: list[tuple[str, int]] = field(default_factory=list)
    at: dict[tuple[str, int], Callable[[int], None]] = field(default_factory=dict)
    denied: set[int] = field(default_factory=set)
    hidden: set[int] = field(default_factory=set)  # live, but missing from the table
    fail: dict[str, BaseException] = field(default_factory=dict)  # "suspend:PID" -> raised
    by_pid: bool = False  # handles look the pid up again at each call (psutil-style)

    def add(self, *rows: WinProc, suspends: int = 0) -> None:
        for r in rows:
            self.procs[r.pid] = Proc(r, suspends)

    def replace(self, pid: int, at: int, cmd: str = "notepad.exe") -> Proc:
        """The process at `pid` exits and a later one gets its pid."""
        old = self.procs[pid]
        old.alive = False
        new = Proc(dataclasses.replace(old.row, create_time=at, cmdline=tuple(cmd.split()),
                                       name=cmd.split()[0], ppid=4242))
        self.procs[pid] = new
        return new

    def edit(self, pid: int, **changes: object) -> None:
        proc = self.procs[pid]
        proc.row = dataclasses.replace(proc.row, **changes)  # type: ignore[arg-type]

    def step(self, name: str, pid: int) -> None:
        self.log.append((name, pid))
        hook = self.at.pop((name, len(steps(self, name))), None)
        if hook is not None:
            hook(pid)
        failure = self.fail.pop(f"{name}:{pid}", None)
        if failure is not None:
            raise failure

    # ProcessControl
    def open(self, pid: int) -> FakeHandle | None:
        if pid in self.denied:
            raise PermissionError(13, "Access is denied")
        proc = self.procs.get(pid)
        if proc is None or not proc.alive:
            return None
        return FakeHandle(self, pid, proc)

    def table(self) -> dict[int, WinProc]:
        self.step("table", 0)
        return {pid: p.row for pid, p in self.procs.items()
                if p.alive and pid not in self.hidden}


@dataclass
class FakeHandle:
    kernel: Kernel
    pid: int
    proc: Proc
    closed: bool = False

    def _target(self) -> Proc:
        assert not self.closed, "a closed handle was used"
        if self.kernel.by_pid:
            return self.kernel.procs[self.pid]
        return self.proc

    def create_time(self) -> int:
        return self._target().row.create_time

    def parent_pid(self) -> int:
        """The process object's own parent (the real one reads it through the handle)."""
        return self._target().row.ppid

    def running(self) -> bool:
        return self._target().alive

    def wait(self, seconds: float) -> bool:
        return not self._target().alive

    def suspended(self) -> bool:
        return self._target().suspends > 0

    def suspend(self) -> None:
        target = self._target()
        self.kernel.step("suspend", self.pid)
        target.suspends += 1

    def resume(self) -> None:
        target = self._target()
        self.kernel.step("resume", self.pid)
        target.suspends = max(0, target.suspends - 1)

    def terminate(self, exit_code: int) -> None:
        target = self._target()
        self.kernel.step("terminate", self.pid)
        target.alive = False

    def close(self) -> None:
        self.closed = True


class Nvml:
    """NVML as the reaper reads it: one GPU, the given holders (until they are gone)."""

    def __init__(self, kernel: Kernel, holders: tuple[int, ...]) -> None:
        self.kernel, self.holders = kernel, holders

    def read(self) -> GpuReading:
        gpu = GpuSample(0, GPU, "fake", 8 << 30, 1 << 30, 0.5, 40.0, 100.0)
        alive = [pid for pid in self.holders
                 if pid in self.kernel.procs and self.kernel.procs[pid].alive]
        return GpuReading(True, "555.0", (gpu,),
                           tuple(Holder(pid, GPU, 0, 1 << 20, "C") for pid in alive), ())


# -- a reap -----------------------------------------------------------------------------

ROOT, CHILD, SIDE, WORKER = 100, 104, 112, 108
#: The plan's members: root first, then breadth first.
MEMBERS = (ROOT, CHILD, SIDE, WORKER)


def world(**kw: object) -> Kernel:
    """An orphan tree: ROOT (its launcher gone) -> CHILD -> WORKER (the GPU holder), and
    ROOT -> SIDE (a helper off the holder's chain)."""
    kernel = Kernel(**kw)  # type: ignore[arg-type]
    kernel.add(row(ROOT, DEAD_LAUNCHER, 1_000), row(CHILD, ROOT, 1_010),
               row(SIDE, ROOT, 1_030, cmd="helper.exe"), row(WORKER, CHILD, 1_020))
    return kernel


def plan_of(kernel: Kernel, *, dry_run: bool = False) -> ReapPlan:
    members = tuple(windows_member(kernel.procs[pid].row) for pid in MEMBERS)
    return ReapPlan(key=TreeKey("box", ROOT, 1_000), members=members,
                    holders=(Holder(WORKER, GPU, 0, 1 << 20, "C"),), gpu_bytes=1 << 20,
                    dry_run=dry_run, gpus=(GPU,), reasons=None)


@dataclass
class Reap:
    kernel: Kernel
    journal: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    held: dict[int, bool] = field(default_factory=dict)
    audit_fails: bool = False
    on_confirm: list[Callable[[], None]] = field(default_factory=list)

    def write(self, phase: Phase, members: tuple[Member, ...]) -> None:
        if self.audit_fails:
            raise OSError(28, "No space left on device")
        self.journal.append((str(phase), tuple(m.pid for m in members)))
        self.kernel.log.append((f"audit:{phase}", 0))
        self.kernel.log.extend(("audited", m.pid) for m in members)

    def holding(self, members: tuple[tuple[int, int], ...], held: bool) -> None:
        for pid, _start in members:
            self.held[pid] = held

    def confirm(self) -> tuple[str, str] | None:
        if self.on_confirm:
            self.on_confirm.pop(0)()
        return None

    def run(self, *, dry_run: bool = False, force: bool = False):  # noqa: ANN201
        reaper = WindowsReaper(nvml=Nvml(self.kernel, (WORKER,)), control=self.kernel)
        return reaper.reap(plan_of(self.kernel, dry_run=dry_run), policy=POLICY, rules=RULES,
                           protected_pids=frozenset({0, 4}), deadline=1e12,
                           journal=None if dry_run else self.write, confirm=self.confirm,
                           holding=self.holding, force=force)


def steps(kernel: Kernel, name: str) -> list[int]:
    return [pid for step, pid in kernel.log if step == name]


def no_one_left_suspended(kernel: Kernel, *, before: dict[int, int] | None = None) -> None:
    """Every freeze thaws: each process is as suspended as it was before the reap."""
    for pid, proc in kernel.procs.items():
        assert proc.suspends == (before or {}).get(pid, 0), (pid, proc.suspends)


# -- the tests --------------------------------------------------------------------------

@pytest.mark.parametrize("by_pid", [False, True])
def test_an_orphan_tree_is_suspended_whole_then_terminated_root_first(by_pid: bool) -> None:
    kernel = world(by_pid=by_pid)
    reap = Reap(kernel)
    result = reap.run()
    assert (result.outcome, result.reason, result.kill_path) == (Outcome.REAPED, "",
                                                                 KillPath.HANDLE), result
    assert steps(kernel, "suspend") == list(MEMBERS)
    assert steps(kernel, "terminate") == list(MEMBERS)
    assert not any(p.alive for p in kernel.procs.values())
    first_terminate = kernel.log.index(("terminate", ROOT))
    assert all(kernel.log.index(("suspend", pid)) < first_terminate for pid in MEMBERS)
    assert reap.journal == [("intent", MEMBERS)]
    assert [s.signal for s in result.signals] == [SUSPEND] * 4 + [TERMINATE] * 4
    assert all(s.result == SignalResult.SENT for s in result.signals)
    assert reap.held == dict.fromkeys(MEMBERS, True)  # marked before the suspends


def test_a_keep_mark_it_cannot_honour_refuses_the_reap_before_any_step() -> None:
    """The skeleton's reap() takes `spare` (the launcher's keep marks, Linux's); the
    Windows reaper has none to honour, so it refuses the reap rather than ignore them."""
    kernel = world()
    reaper = WindowsReaper(nvml=Nvml(kernel, (WORKER,)), control=kernel)
    with pytest.raises(ValueError, match="keeps no launcher marks"):
        reaper.reap(plan_of(kernel), policy=POLICY, rules=RULES,
                    protected_pids=frozenset({0, 4}), deadline=1e12,
                    journal=lambda _phase, _members: None, spare=lambda _info, _view: "kept")
    assert kernel.log == []  # not even the table was read


@pytest.mark.parametrize("by_pid", [False, True])
def test_a_member_replaced_before_its_suspend_is_never_touched(by_pid: bool) -> None:
    kernel = world(by_pid=by_pid)
    reap = Reap(kernel)
    later: list[Proc] = []
    # Right after the intent record (before any suspend) SIDE exits and a later
    # process gets its pid.
    reap.on_confirm.append(lambda: later.append(kernel.replace(SIDE, 5_000)))
    result = reap.run()
    assert result.outcome == Outcome.REAPED, result
    assert later[0].alive and later[0].suspends == 0  # the pid's new owner: untouched
    assert ("terminate", SIDE) not in kernel.log and ("suspend", SIDE) not in kernel.log
    assert [(s.pid, s.signal, s.result) for s in result.signals if s.pid == SIDE] == [
        (SIDE, SUSPEND, SignalResult.GONE), (SIDE, TERMINATE, SignalResult.GONE)]
    assert not any(kernel.procs[pid].alive for pid in (ROOT, CHILD, WORKER))


def test_a_middle_member_gone_before_the_suspend_changes_the_tree_and_refuses() -> None:
    kernel = world()
    reap = Reap(kernel)
    # CHILD exits, its pid goes to a later process: WORKER's parent is now "reused", so
    # WORKER roots a tree of its own and ROOT's is not the tree the decision was made on.
    reap.on_confirm.append(lambda: kernel.replace(CHILD, 5_000))
    result = reap.run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "tree-not-found"), result
    assert steps(kernel, "terminate") == []
    no_one_left_suspended(kernel)


def test_the_root_replaced_before_the_suspend_refuses_and_resumes_everything() -> None:
    kernel = world()
    reap = Reap(kernel)
    later: list[Proc] = []
    reap.on_confirm.append(lambda: later.append(kernel.replace(ROOT, 5_000)))
    result = reap.run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "root-replaced"), result
    assert steps(kernel, "terminate") == []
    assert later[0].suspends == 0 and later[0].alive
    no_one_left_suspended(kernel)
    assert sorted(steps(kernel, "resume")) == sorted((CHILD, SIDE, WORKER))
    # ROOT's pid names a later process, never suspended: never marked either.
    assert reap.held == {CHILD: False, SIDE: False, WORKER: False}


@pytest.mark.parametrize("by_pid", [False, True])
def test_a_member_replaced_right_before_the_terminate_is_not_terminated(by_pid: bool) -> None:
    kernel = world(by_pid=by_pid)
    reap = Reap(kernel)
    later: list[Proc] = []
    reap.on_confirm.append(lambda: None)  # the first question, before the suspends
    # The second question comes right before the first terminate.
    reap.on_confirm.append(lambda: later.append(kernel.replace(WORKER, 9_000)))
    result = reap.run()
    assert result.outcome == Outcome.REAPED, result
    assert steps(kernel, "terminate") == [ROOT, CHILD, SIDE]
    assert later[0].alive
    assert (WORKER, TERMINATE, SignalResult.GONE) in [(s.pid, s.signal, s.result)
                                                      for s in result.signals]


@pytest.mark.parametrize(("change", "reason"), [
    ({"cmdline": ("jupyter-lab.exe",), "name": "jupyter-lab.exe"}, "member-protected"),
    ({"readable": False}, "member-unknown"),
])
def test_a_member_judged_again_under_suspension_refuses_and_resumes_all(
        change: dict[str, object], reason: str) -> None:
    kernel = world()
    kernel.add(row(300, DEAD_LAUNCHER, 50), suspends=1)  # suspended by its owner: stays so
    reap = Reap(kernel)

    # At the last suspend, before the table is read again.
    kernel.at[("suspend", 4)] = lambda pid: kernel.edit(CHILD, **change)
    result = reap.run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, reason), result
    assert steps(kernel, "terminate") == []
    assert sorted(steps(kernel, "resume")) == sorted(MEMBERS)
    no_one_left_suspended(kernel, before={300: 1})
    assert reap.held == dict.fromkeys(MEMBERS, False)
    # Audited: the final record the worker writes names the refusal.
    record = audit_record("box", 0.0, Decision(Action.REAP, "parent-gone", "", None),
                          LiveTree(root=None), result, key=plan_of(kernel).key,
                          mode=Mode.ENFORCE)
    assert (record["outcome"], record["outcome_reason"]) == ("aborted", reason)
    assert [s["signal"] for s in record["signals"]].count(RESUME) == 4


def test_the_resume_never_reaches_a_later_process_at_a_members_pid() -> None:
    kernel = world(by_pid=True)  # handles that name processes by pid at each call
    later: list[Proc] = []

    def swap(pid: int) -> None:  # SIDE, suspended, exits; a suspended stranger gets its pid
        later.append(kernel.replace(SIDE, 5_000))
        later[0].suspends = 1
        kernel.edit(CHILD, cmdline=("jupyter-lab.exe",))  # and the reap will refuse

    kernel.at[("suspend", 4)] = swap
    result = Reap(kernel).run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "member-protected"), result
    assert later[0].suspends == 1  # the stranger's own suspension stands
    assert (SIDE, RESUME, SignalResult.GONE) in [(s.pid, s.signal, s.result)
                                                 for s in result.signals]


def test_a_member_that_runs_but_left_the_table_cannot_be_judged() -> None:
    kernel = world()
    kernel.at[("suspend", 4)] = lambda pid: kernel.hidden.add(SIDE)  # psutil misses it
    result = Reap(kernel).run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "member-unknown"), result
    assert "not in the process table" in result.detail
    no_one_left_suspended(kernel)


@pytest.mark.parametrize("raised", [RuntimeError("driver bug"), Interrupted("SIGINT received"),
                                    KeyboardInterrupt()])
def test_an_exception_mid_suspend_resumes_everything_suspended(raised: BaseException) -> None:
    kernel = world()
    kernel.fail[f"suspend:{CHILD}"] = raised
    reap = Reap(kernel)
    if isinstance(raised, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            reap.run()
    else:
        result = reap.run()
        assert result.outcome == Outcome.ABORTED
        assert result.reason == ("interrupted" if isinstance(raised, Interrupted)
                                 else "internal-error"), result
    assert steps(kernel, "suspend") == [ROOT, CHILD]
    assert steps(kernel, "terminate") == []
    no_one_left_suspended(kernel)
    # CHILD's suspend raised as it began (the fake raises before the count goes up); the
    # reap cannot tell whether it took, so it resumes CHILD too, which changes nothing.
    assert steps(kernel, "resume") == [ROOT, CHILD]


def test_an_audit_record_names_every_process_before_its_terminate() -> None:
    kernel = world()
    reap = Reap(kernel)
    # While the tree is being suspended, WORKER starts a helper: it joins the reap.
    kernel.at[("suspend", 2)] = lambda pid: kernel.add(row(200, WORKER, 1_100,
                                                           cmd="helper.exe"))
    result = reap.run()
    assert result.outcome == Outcome.REAPED, result
    assert reap.journal == [("intent", MEMBERS), ("joined", (200,))]
    assert steps(kernel, "terminate") == [*MEMBERS, 200]
    for step, pid in kernel.log:
        if step in ("suspend", "terminate"):
            assert kernel.log.index(("audited", pid)) < kernel.log.index((step, pid)), pid


def test_no_record_no_suspend() -> None:
    kernel = world()
    reap = Reap(kernel, audit_fails=True)
    result = reap.run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "audit-failed"), result
    assert steps(kernel, "suspend") == [] and steps(kernel, "terminate") == []


def test_a_protected_process_that_joins_refuses_the_reap() -> None:
    kernel = world()
    reap = Reap(kernel)
    kernel.at[("suspend", 1)] = lambda pid: kernel.add(row(200, ROOT, 1_100, cmd="code.exe ."))
    result = reap.run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "member-protected"), result
    assert 200 not in steps(kernel, "suspend")
    no_one_left_suspended(kernel)


def test_a_joiner_that_cannot_be_opened_refuses_the_reap() -> None:
    kernel = world()
    kernel.add(row(200, WORKER, 1_100))
    kernel.denied.add(200)
    result = Reap(kernel).run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "member-unknown"), result
    assert "could not be opened" in result.detail
    no_one_left_suspended(kernel)


def test_the_child_of_a_later_process_at_a_dead_members_pid_is_not_taken() -> None:
    kernel = world()
    reap = Reap(kernel)

    def reuse() -> None:  # SIDE exits; its pid goes to a stranger, who starts a child
        kernel.add(row(116, SIDE, 1_040, cmd="helper.exe --child"))  # SIDE's own child
        kernel.replace(SIDE, 5_000)
        kernel.add(row(208, SIDE, 5_010, cmd="stranger.exe"))

    reap.on_confirm.append(reuse)
    result = reap.run()
    assert result.outcome == Outcome.REAPED, result
    assert kernel.procs[208].alive and kernel.procs[208].suspends == 0
    # SIDE's own child is the tree's (its parent left it behind), the stranger's is not.
    assert steps(kernel, "terminate") == [ROOT, CHILD, WORKER, 116]


def test_a_survivor_of_its_terminate_is_resumed_and_reported() -> None:
    kernel = world()
    kernel.fail[f"terminate:{WORKER}"] = PermissionError(13, "Access is denied")
    result = Reap(kernel).run()
    assert (result.outcome, result.reason, result.survivors) == (
        Outcome.FAILED, "survivors", (WORKER,)), result
    assert kernel.procs[WORKER].alive and kernel.procs[WORKER].suspends == 0


def test_a_dry_run_holds_and_judges_but_suspends_nothing() -> None:
    kernel = world()
    kernel.add(row(200, WORKER, 1_100))
    reap = Reap(kernel)
    result = reap.run(dry_run=True)
    assert result.outcome == Outcome.DRY_RUN, result
    assert [m.pid for m in result.members] == [*MEMBERS, 200]
    assert steps(kernel, "suspend") == [] and steps(kernel, "terminate") == []
    assert reap.journal == []


def test_the_tree_classified_again_must_still_be_an_orphan() -> None:
    kernel = world()
    reap = Reap(kernel)
    # The launcher was only hidden: with the tree suspended the table shows it again.
    reap.on_confirm.append(lambda: kernel.add(row(DEAD_LAUNCHER, 4, 10, cmd="cmd.exe")))
    result = reap.run()
    # The chain now reaches System through the launcher: normal, rooted above ROOT.
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "tree-not-found"), result
    assert steps(kernel, "terminate") == []
    no_one_left_suspended(kernel)


def test_force_skips_the_rules_but_never_the_policy() -> None:
    kernel = world()
    kernel.edit(CHILD, cmdline=("jupyter-lab.exe",), name="jupyter-lab.exe")
    assert Reap(kernel).run().reason == "member-protected"
    kernel = world()
    kernel.edit(CHILD, username="NT AUTHORITY\\SYSTEM", user_sid="S-1-5-18")
    result = Reap(kernel).run(force=True)
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "root-owned"), result


def test_crash_recovery_resumes_only_the_same_processes() -> None:
    kernel = world()
    for pid in (ROOT, CHILD):
        kernel.procs[pid].suspends = 1
    later = kernel.replace(CHILD, 5_000)
    later.suspends = 1  # someone else's suspended process now holds CHILD's pid
    reaper = WindowsReaper(nvml=Nvml(kernel, ()), control=kernel)
    records = reaper.thaw_interrupted([(ROOT, 1_000), (CHILD, 1_010), (777, 1)])
    assert [(r.pid, r.signal, r.result) for r in records] == [(ROOT, RESUME, SignalResult.SENT)]
    assert kernel.procs[ROOT].suspends == 0 and later.suspends == 1


def test_members_are_named_by_account_and_service_accounts_count_as_root() -> None:
    assert windows_member(row(10, 9, 1)).uid == -1
    assert windows_member(row(10, 9, 1)).user_name == USER
    system = dataclasses.replace(row(10, 9, 1), username="NT AUTHORITY\\SYSTEM",
                                 user_sid="S-1-5-18")
    assert windows_member(system).uid == 0
    assert windows_member(dataclasses.replace(row(10, 9, 1), username=None)).user_name is None
    assert windows_member(row(12, 4, 1)).kernel_thread  # started by System itself


def test_protected_pids_are_system_this_process_and_its_real_ancestors() -> None:
    table = {r.pid: r for r in (row(50, 40, 100), row(40, 30, 90), row(30, 20, 200),
                                row(20, 4, 10))}
    # 30 was created after its child 40: a later process at the parent's pid, no ancestor.
    assert windows_protected_pids(table, pid=lambda: 50) == {0, 4, 50, 40}
