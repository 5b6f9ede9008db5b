"""The reap on Windows: hold, judge, write down, suspend, judge again, terminate, confirm.

The same ReapPlan in and ReapResult out as the Linux reaper (gpuguard/engine/reap/reaper.py), with
the same audit records, ledger marks, confirmations and refusals, over what Windows has
instead of signals (gpuguard/engine/windows/control.py): a handle held on every member since
its identity check, NtSuspendProcess for SIGSTOP, TerminateProcess for SIGKILL. Windows
has no SIGTERM for an arbitrary process, so there is no grace period: the tree is
suspended whole, judged again while nothing in it can run, and terminated.

1. Hold every planned member (root first): open, check its creation time against the
   plan's and its parent (read through the handle, never only a table row's) against the
   plan's, judge it (policy.member_refusal, and unless a person forced it,
   judge_windows_member over a fresh table).
2. The intent record names every member; no record, nothing is suspended
   (`audit-failed`). Alertmanager is asked (`confirm`).
3. Suspend root first, then every process a fresh table shows below a member (each
   held, its parent confirmed through the handle, judged and named in a `joined` record
   before its suspend), until none appears, the deadline passes or the reap is
   withdrawn. Each suspend sets that member's crash-ledger mark alone (Hands.suspend).
   A dry run reads one table and suspends nothing.
4. With the tree suspended, a new table: every member judged again (its parent still
   the one it was held with), nothing new below any member, then the tree classified
   again (recheck.recheck_frozen); anything protected, unknown or no longer identifiable
   resumes everything and refuses the reap. Alertmanager is asked again.
5. Terminate every member, each checked (identity) right before; confirm each gone.

Every way out resumes what the reap suspended and did not end (principle 2): an abort,
an exception, an Interrupted, a survivor of its terminate. NtSuspendProcess counts, so a
process its owner had suspended before the reap stays suspended after our resume.
The back-end is injected (ProcessControl): the real one is ctypes over kernel32 and ntdll
(gpuguard/host/windows/handles.py) and psutil's table; tests on Linux give a fake, since
no Windows kernel runs there, and the Wine tier (tests/windows/) runs the real one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.config.remediate import Remediate
from gpuguard.engine.decision.policy import member_refusal
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import LiveTree, Member
from gpuguard.engine.reap.audit import Phase
from gpuguard.engine.reap.outcome import SignalRecord
from gpuguard.engine.reap.reap_run import Abort, Holding, Journal, Spare, check_wanted
from gpuguard.engine.reap.recheck import Inspect
from gpuguard.engine.reap.skeleton import ReaperCore, ReapTexts
from gpuguard.engine.scan.inspection import HolderSource
from gpuguard.engine.windows.control import (
    SUSPEND,
    SUSPEND_CONFIRM_SECONDS,
    Handle,
    Hands,
    ProcessControl,
    WindowsControl,
    WinRun,
    WinTarget,
)
from gpuguard.engine.windows.inspection import inspect_windows_tree, windows_member
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.launchers import ExitSource
from gpuguard.host.windows.tree import WinProc, judge_windows_member, pids_by_parent
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.vocabulary import AnyReason, DecisionReason, Reason, Unheld

#: How long terminated members get to be gone before they count as survivors.
KILL_CONFIRM_SECONDS = 5.0


class WindowsReaper(ReaperCore[WinRun]):
    """Linux's Reaper on Windows: the same reap() (the skeleton's, ReaperCore.reap) and
    thaw_interrupted(), the same results and records (module doc), over handles,
    suspends and TerminateProcess. One reap at a time per instance."""

    TEXTS = ReapTexts(
        needs_journal="a reap that may suspend or terminate needs a journal",
        dry_run="dry run: nothing suspended or terminated",
        failed_before_kill="reap of %s failed before any kill; resuming what it suspended",
        failed_killing="reap of %s failed while terminating; resuming what it suspended",
        survived="{} process(es) survived TerminateProcess (resumed)",
        all_gone="every member is gone")

    def __init__(self, *, nvml: HolderSource, counters: Counters = COUNTERS,
                 control: ProcessControl | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.nvml = nvml
        self.counters = counters
        self._monotonic = monotonic
        self._hands = Hands(control if control is not None else WindowsControl(), monotonic)

    @property
    def control(self) -> ProcessControl:
        return self._hands.control

    def _open_run(self, plan: ReapPlan, *, policy: Remediate, rules: Rules,
                  protected: frozenset[int], journal: Journal | None, force: bool,
                  holding: Holding | None, events: ExitSource | None,
                  memory: LauncherMemory | None, spare: Spare | None) -> WinRun:
        if spare is not None:  # a keep mark this reap would not honour: refused, not ignored
            raise ValueError("the Windows reaper keeps no launcher marks (spare)")
        return WinRun(started=self._monotonic(), policy=policy, rules=rules,
                      protected=protected, journal=journal, force=force, holding=holding,
                      events=events, memory=memory)

    def thaw_interrupted(self, members: Iterable[tuple[int, int]]) -> tuple[SignalRecord, ...]:
        """Resume every (pid, creation time) that is still that process: crash recovery
        of a reap's held marks (gpuguard/engine/reap/recovery.py's rules; the caller
        audits first)."""
        run = WinRun(started=self._monotonic(), policy=Remediate(), rules=Rules(),
                     protected=frozenset(), journal=None)
        hands = self._hands
        for pid, start_time in members:
            handle, _why = hands.hold(WinProc(pid=pid, ppid=0, create_time=start_time))
            if handle is None:
                continue
            member = Member(pid=pid, ppid=0, start_time=start_time, uid=-1, user="", comm="")
            target = WinTarget(member, WinProc(pid, 0, start_time), handle, suspended=True)
            run.targets[pid] = target
        try:
            hands.resume(run, run.targets.values())
        finally:
            hands.close(run)
        return tuple(run.signals)

    # -- Windows' steps --------------------------------------------------------------

    def _collect_dry(self, run: WinRun) -> None:
        """One table: a tree that keeps spawning never keeps a dry run."""
        self._collect(run, suspend=False)

    def _thaw(self, run: WinRun) -> None:
        self._hands.resume(run, run.targets.values())

    def _close(self, run: WinRun) -> None:
        self._hands.close(run)

    def _hold(self, run: WinRun, plan: ReapPlan) -> None:
        """Hold and judge every planned member, root first, against a fresh table; a
        member's parent must be the one the plan named (a Windows ppid never changes)."""
        table = self.control.table()
        for member in plan.members:
            row = table.get(member.pid)
            handle: Handle | None = None
            if row is None:
                why: Unheld | str = Unheld.EXITED
            elif row.create_time != member.start_time:
                why = Unheld.REPLACED
            else:  # its parent, read through the handle, the one the plan named
                handle, why = self._hands.hold(row, parent=member.ppid)
            if handle is None:
                if member.pid == plan.key.root_pid and why in (Unheld.EXITED, Unheld.REPLACED):
                    raise Abort(DecisionReason.ROOT_GONE if why == Unheld.EXITED
                                else DecisionReason.ROOT_REPLACED,
                                f"root {member.pid} {why} before the reap")
                if why in (Unheld.EXITED, Unheld.REPLACED):
                    continue  # exited since the inspection: nothing to do for it
                raise Abort(Reason.MEMBER_UNKNOWN, f"member {member.pid} ({member.comm}) "
                            f"{why}: a process that cannot be held cannot be judged")
            assert row is not None
            if member.pid != plan.key.root_pid and row.ppid != member.ppid:
                handle.close()
                raise Abort(Reason.MEMBER_UNKNOWN, f"member {member.pid} ({member.comm}) "
                            f"has parent {row.ppid} now, {member.ppid} when inspected")
            self._admit(run, row, handle, table)

    def _admit(self, run: WinRun, row: WinProc, handle: Handle,
               table: Mapping[int, WinProc]) -> WinTarget:
        """Judge a held process on `table` and add it, or close it and abort."""
        member = windows_member(row)
        refused = refusal(run, member, table)
        if refused is not None:
            handle.close()
            raise Abort(*refused)
        target = WinTarget(member, row, handle)
        run.targets[member.pid] = target
        return target

    def _collect(self, run: WinRun, *, suspend: bool) -> list[WinTarget]:
        """Processes one fresh table shows below any member and not held yet: held (their
        parent confirmed through the handle), judged, recorded (`joined`) and (when
        freezing) suspended. One table only: the caller's loop is the bounded one."""
        table = self.control.table()
        joined: list[WinTarget] = []
        for row in unheld(run, table):
            handle, why = self._hands.hold(row, parent=row.ppid)
            if handle is None and why not in (Unheld.EXITED, Unheld.REPLACED):
                raise Abort(Reason.MEMBER_UNKNOWN, f"process {row.pid} below member "
                            f"{row.ppid} {why}: a process that cannot be held "
                            "cannot be judged")
            if handle is not None:
                joined.append(self._admit(run, row, handle, table))
        if suspend and joined:
            run.write(Phase.JOINED, joined)
            for target in joined:
                self._hands.suspend(run, target)
            refused_suspend(run)
        return joined

    def _freeze(self, run: WinRun, deadline: float, cancelled: Callable[[], bool]) -> None:
        """Suspend root first, then whatever appears below, until nothing new does (or the
        deadline passes, or the reap is withdrawn: each pass checks). Each pass first
        waits (bounded) for the suspends to take: a thread inside CreateProcess finishes
        it before it stops, and its child is in the table then. Still wanted at the end
        (check_wanted), or the reap is refused."""
        hands = self._hands
        for target in list(run.targets.values()):
            hands.suspend(run, target)
        refused_suspend(run)
        while True:
            hands.wait_suspended(run, min(SUSPEND_CONFIRM_SECONDS,
                                          max(0.0, deadline - self._monotonic())))
            if not self._collect(run, suspend=True):
                break
            if self._monotonic() > deadline:
                raise Abort(DecisionReason.WORKER_TIMEOUT,
                            "the tree kept growing while being suspended")
            check_wanted(cancelled, deadline, self._monotonic)
        # Windows asks once more with the tree whole and suspended, before the re-judging.
        check_wanted(cancelled, deadline, self._monotonic)

    def _rejudge(self, run: WinRun) -> None:
        """Every member again, on a table read with the tree suspended."""
        table = self.control.table()
        for target in list(run.targets.values()):
            if not self._hands.same(target):
                continue  # exited: nothing left of it to terminate
            row = table.get(target.member.pid)
            if row is None or row.create_time != target.member.start_time:
                raise Abort(Reason.MEMBER_UNKNOWN, f"member {target.member.pid} "
                            f"({target.member.comm}) runs but is not in the process table "
                            "read with the tree suspended: it cannot be judged")
            if row.ppid != target.row.ppid:  # a Windows ppid never changes: a mixed row
                raise Abort(Reason.MEMBER_UNKNOWN, f"member {target.member.pid} "
                            f"({target.member.comm}) has parent {row.ppid} in the table "
                            f"read with the tree suspended, {target.row.ppid} when it was "
                            "held: which process it is cannot be told")
            member = windows_member(row)
            refused = refusal(run, member, table)
            if refused is not None:
                raise Abort(*refused)
            target.member, target.row = member, row
        late = unheld(run, table)
        if late:
            raise Abort(Reason.MEMBER_UNKNOWN, f"process {late[0].pid} appeared below member "
                        f"{late[0].ppid} with the tree suspended: not judged, not terminated")

    def _terminate(self, run: WinRun) -> list[WinTarget]:
        """TerminateProcess every member, wait for each to be gone; the survivors are
        resumed (what the terminate did not end runs on) and returned."""
        hands = self._hands
        for target in list(run.targets.values()):
            hands.terminate(run, target)
        survivors = hands.wait_gone(run, KILL_CONFIRM_SECONDS)
        hands.resume(run, survivors)
        return survivors

    def _inspector(self, run: WinRun, plan: ReapPlan) -> Inspect:
        """recheck_frozen's inspection: the Windows one over this back-end's table."""
        def inspect(reading: GpuReading, gpus: set[str]) -> LiveTree:
            return inspect_windows_tree(plan.key, nvml=self.nvml, rules=run.rules,
                                        expected_gpus=gpus, reading=reading,
                                        table=self.control.table())
        return inspect


def refusal(run: WinRun, member: Member,
             table: Mapping[int, WinProc]) -> tuple[AnyReason, str] | None:
    """The policy's refusals, then (unless forced) the Windows member rules."""
    refused = member_refusal(member, run.policy, run.protected)
    if refused is None and not run.force:
        judged = judge_windows_member(table, member.pid, run.rules,
                                      create_time=member.start_time)
        if judged is not None:
            refused = (judged.reason, judged.evidence.detail)
    return refused


def unheld(run: WinRun, table: Mapping[int, WinProc]) -> list[WinProc]:
    """Rows of `table` below any member and not held yet: a row is a child of a member
    when its ppid names it and it was not created before it (windows_members' rule),
    walked from every member, one that exited included (its children keep its pid as
    their ppid). Once a later process holds an exited member's pid, a row created
    after that process is its child, not the member's; a row whose creation time is
    unknown is taken (fail closed: as a member it cannot be judged, and refuses)."""
    children = pids_by_parent(table)
    found: dict[int, WinProc] = {}
    frontier = [t.row for t in run.targets.values()]
    while frontier:
        nxt: list[WinProc] = []
        for parent in frontier:
            now = table.get(parent.pid)
            reused = now.create_time if now is not None and now.identity != parent.identity \
                else None
            for pid in children.get(parent.pid, ()):
                child = table.get(pid)  # gone since the snapshot: no row
                if child is None or child.pid in run.targets or child.pid in found:
                    continue
                if child.timed and parent.timed and child.create_time < parent.create_time:
                    continue  # an older process: the child of an earlier one at the pid
                if reused is not None and child.timed and child.create_time >= reused:
                    continue  # the child of the later process at the member's pid
                found[child.pid] = child
                nxt.append(child)
        frontier = nxt
    return list(found.values())


def refused_suspend(run: WinRun) -> None:
    """A suspend Windows refused ends the reap before any terminate."""
    for record in run.signals:
        if record.signal == SUSPEND and record.failed:
            raise Abort(DecisionReason.SIGNAL_FAILED, f"suspending {record.pid} failed "
                        f"({record.error}): the remediator may not act on this tree "
                        "(another user's processes need an administrator); nothing was "
                        "terminated")
