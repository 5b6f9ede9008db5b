"""The Windows reaper against a hostile process table (review of issue 30's kill path).

Over the same model of Windows' process objects as test_windows_reaper.py (the one thing
mocked: no Windows kernel runs here): a table row that mixes a dead process's ppid with
a stranger's identity (psutil takes the ppids from one snapshot and each process's
identity later), a table that spawns on every read, an owner's own suspension and a
crash between the marks and the suspends, and owners that only a SID names.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import pytest

from gpuguard.config.remediate import Mode, Remediate
from gpuguard.engine.decision.policy import Action, Decision, member_refusal
from gpuguard.engine.decision.tree import LiveTree
from gpuguard.engine.reap.audit import audit_record
from gpuguard.engine.reap.outcome import Outcome, SignalResult
from gpuguard.engine.windows.control import RESUME, SUSPEND
from gpuguard.engine.windows.inspection import root_owned_sid, windows_member
from gpuguard.engine.windows.reaper import WindowsReaper
from gpuguard.host.windows.tree import WinProc
from tests.windows.synthetic.test_windows_reaper import (
    CHILD,
    MEMBERS,
    POLICY,
    ROOT,
    RULES,
    SIDE,
    WORKER,
    Kernel,
    Nvml,
    Reap,
    no_one_left_suspended,
    plan_of,
    row,
    steps,
    world,
)

#: A live process of someone else's (an explorer.exe under System).
EXPLORER = 4242
STRANGER = 200


def mixed(kernel: Kernel, pid: int, ppid: int, *, reads: Callable[[int], bool]) -> list[int]:
    """From now on the table shows `pid` with `ppid` (a dead process's, from the snapshot)
    on the reads `reads` picks (counted from 1), whatever the process at `pid` is: the row
    psutil builds when the pid is reused between its ppid snapshot and its other reads.
    Returns the read counter."""
    real = kernel.table
    count = [0]

    def table() -> dict[int, WinProc]:
        out = dict(real())
        count[0] += 1
        if pid in out and reads(count[0]):
            out[pid] = dataclasses.replace(out[pid], ppid=ppid)
        return out

    kernel.table = table  # type: ignore[method-assign]
    return count


def audited(result: object, kernel: Kernel) -> dict[str, object]:
    return audit_record("box", 0.0, Decision(Action.REAP, "parent-gone", "", None),
                        LiveTree(root=None), result, key=plan_of(kernel).key,  # type: ignore[arg-type]
                        mode=Mode.ENFORCE)


# -- 1. a row that mixes two processes -------------------------------------------------------

def test_a_stranger_whose_row_names_a_dead_members_pid_as_parent_is_never_held() -> None:
    """The reviewer's case: a stranger (its parent a live explorer.exe) gets a pid whose
    row, read while the tree is being suspended, carries WORKER as its ppid. Its handle
    says who its parent is: the reap refuses before suspending it, and resumes the rest."""
    kernel = world()
    kernel.add(row(EXPLORER, 4, 10, cmd="explorer.exe"))
    kernel.add(row(STRANGER, EXPLORER, 5_000, cmd="python.exe other.py"))
    mixed(kernel, STRANGER, WORKER, reads=lambda n: n == 2)  # the first read of the freeze
    reap = Reap(kernel)
    result = reap.run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "member-unknown"), result
    assert f"has parent {EXPLORER} by its handle, not {WORKER}" in result.detail
    assert STRANGER not in steps(kernel, "suspend")
    assert steps(kernel, "terminate") == []
    no_one_left_suspended(kernel)
    assert sorted(steps(kernel, "resume")) == sorted(MEMBERS)
    assert reap.held == dict.fromkeys(MEMBERS, False)
    record = audited(result, kernel)
    assert (record["outcome"], record["outcome_reason"]) == ("aborted", "member-unknown")


def test_a_root_whose_row_carries_a_dead_launchers_pid_is_checked_by_its_handle() -> None:
    """The inspection itself read a mixed row: the root's ppid from the snapshot names a
    dead launcher, but the process at the root's pid (the one judged: same creation
    time) was started by a live explorer.exe. Nothing is suspended."""
    kernel = world()
    kernel.add(row(EXPLORER, 4, 10, cmd="explorer.exe"))
    plan = plan_of(kernel)  # what the (fooled) inspection planned: ROOT under the dead 999
    kernel.edit(ROOT, ppid=EXPLORER)
    mixed(kernel, ROOT, plan.members[0].ppid, reads=lambda n: True)
    reaper = WindowsReaper(nvml=Nvml(kernel, (WORKER,)), control=kernel)
    result = reaper.reap(plan, policy=POLICY, rules=RULES, protected_pids=frozenset({0, 4}),
                         deadline=1e12, journal=lambda phase, members: None)
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "member-unknown"), result
    assert f"has parent {EXPLORER} by its handle" in result.detail
    assert steps(kernel, "suspend") == [] and steps(kernel, "terminate") == []


def test_a_member_whose_parent_changes_in_the_suspended_table_refuses() -> None:
    """A Windows ppid never changes: a member whose row in the table read with the tree
    suspended names another parent than the row it was held with is not known to be the
    process judged, even where the tree would still classify (SIDE is off the holder's
    chain, so the recheck alone would not notice and would terminate it)."""
    kernel = world()
    reap = Reap(kernel)
    kernel.at[("suspend", 4)] = lambda pid: mixed(kernel, SIDE, EXPLORER, reads=lambda n: True)
    result = reap.run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "member-unknown"), result
    assert f"has parent {EXPLORER} in the table read with the tree suspended" in result.detail
    assert steps(kernel, "terminate") == []
    no_one_left_suspended(kernel)


def test_a_child_created_before_its_parent_is_never_joined() -> None:
    """A row whose ppid names WORKER but which is older than WORKER is the child of an
    earlier process at that pid: not held, not suspended, not terminated."""
    kernel = world()
    kernel.add(row(STRANGER, WORKER, 1_015, cmd="python.exe older.py"))  # WORKER: 1_020
    dry = Reap(kernel).run(dry_run=True)
    assert STRANGER not in [m.pid for m in dry.members]
    result = Reap(kernel).run()
    assert result.outcome == Outcome.REAPED, result
    assert STRANGER not in steps(kernel, "suspend") + steps(kernel, "terminate")
    assert kernel.procs[STRANGER].alive and kernel.procs[STRANGER].suspends == 0


# -- 3. every loop bounded -------------------------------------------------------------------

def spawning(kernel: Kernel, limit: int = 200) -> list[int]:
    """Before every table read the worker starts a short-lived child (the previous one
    has exited); past `limit` reads the test fails instead of hanging."""
    real = kernel.table
    count = [0]

    def table() -> dict[int, WinProc]:
        count[0] += 1
        assert count[0] <= limit, f"still reading tables after {limit}"
        for proc in kernel.procs.values():
            if proc.row.pid >= 1000:
                proc.alive = False
        kernel.add(row(1000 + 4 * count[0], WORKER, 2_000 + count[0]))
        return real()

    kernel.table = table  # type: ignore[method-assign]
    return count


def test_a_dry_run_of_a_tree_that_keeps_spawning_reads_one_table_more() -> None:
    kernel = world()
    reads = spawning(kernel)
    result = Reap(kernel).run(dry_run=True)
    assert result.outcome == Outcome.DRY_RUN, result
    assert reads[0] == 2  # the planned members' table, and one for the processes below
    assert steps(kernel, "suspend") == []


def test_a_tree_that_keeps_spawning_while_suspended_stops_when_the_reap_is_withdrawn() -> None:
    kernel = world()
    reads = spawning(kernel)
    reap = Reap(kernel)
    reaper = WindowsReaper(nvml=Nvml(kernel, (WORKER,)), control=kernel)
    result = reaper.reap(plan_of(kernel), policy=POLICY, rules=RULES,
                         protected_pids=frozenset({0, 4}), deadline=1e12,
                         journal=reap.write, holding=reap.holding,
                         cancelled=lambda: reads[0] >= 5)
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "cancelled"), result
    assert reads[0] == 5
    assert steps(kernel, "terminate") == []
    no_one_left_suspended(kernel)


def test_a_tree_that_keeps_spawning_while_suspended_stops_at_the_deadline() -> None:
    kernel = world()
    reads = spawning(kernel)
    reap = Reap(kernel)
    clock = itertools.count()  # one second per look at the clock
    reaper = WindowsReaper(nvml=Nvml(kernel, (WORKER,)), control=kernel,
                           monotonic=lambda: float(next(clock)))
    result = reaper.reap(plan_of(kernel), policy=POLICY, rules=RULES,
                         protected_pids=frozenset({0, 4}), deadline=60.0,
                         journal=reap.write, holding=reap.holding)
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "worker-timeout"), result
    assert reads[0] < 60
    no_one_left_suspended(kernel)


# -- 7. the crash ledger's marks, one member at a time ---------------------------------------

def test_each_mark_is_set_for_its_own_suspend_so_a_crash_resumes_only_what_was_suspended(
) -> None:
    """SIDE was suspended by its owner before the reap. At each suspend (where a crash
    may land) the ledger marks name only members the reap has suspended, and the member
    being suspended only if it runs: crash recovery then resumes exactly the reap's own
    suspensions, and SIDE stays suspended as its owner left it."""
    kernel = world()
    kernel.procs[SIDE].suspends = 1
    reap = Reap(kernel)
    crashes: list[tuple[int, dict[int, bool], dict[int, int]]] = []
    for n in range(1, len(MEMBERS) + 1):
        kernel.at[("suspend", n)] = lambda pid: crashes.append(
            (pid, dict(reap.held), {p: kernel.procs[p].suspends for p in MEMBERS}))
    assert reap.run().outcome == Outcome.REAPED
    assert [pid for pid, _, _ in crashes] == list(MEMBERS)
    for pid, held, counts in crashes:
        before = MEMBERS[:MEMBERS.index(pid)]
        expected = {*before, *([pid] if pid != SIDE else [])}
        assert {p for p, on in held.items() if on} == expected, (pid, held)
        # What crash recovery does with those marks, on the process objects as they were.
        after = world()
        for p, count in counts.items():
            after.procs[p].suspends = count
        thawed = WindowsReaper(nvml=Nvml(after, ()), control=after).thaw_interrupted(
            [(p, after.procs[p].row.create_time) for p, on in held.items() if on])
        assert all(r.signal == RESUME for r in thawed)
        assert {p: after.procs[p].suspends for p in MEMBERS} == {
            CHILD: 0, ROOT: 0, WORKER: 0, SIDE: 1}, pid


def test_a_failed_suspend_clears_its_own_mark() -> None:
    kernel = world()
    kernel.fail[f"suspend:{CHILD}"] = PermissionError(13, "Access is denied")
    reap = Reap(kernel)
    result = reap.run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "signal-failed"), result
    assert reap.held == dict.fromkeys(MEMBERS, False)  # CHILD's cleared at its failure
    no_one_left_suspended(kernel)
    assert [(s.pid, s.signal) for s in result.signals][:2] == [(ROOT, SUSPEND), (CHILD, SUSPEND)]
    assert result.signals[1].result.startswith(SignalResult.ERROR)


# -- 2. owners by SID ------------------------------------------------------------------------

@pytest.mark.parametrize(("sid", "root"), [
    ("S-1-5-18", True),  # LocalSystem, whatever the name's language
    ("S-1-5-19", True), ("S-1-5-20", True),  # LOCAL SERVICE, NETWORK SERVICE
    ("S-1-5-80-956008885-3418522649-1831038044-1853292631-2271478464", True),  # NT SERVICE
    ("S-1-5-82-3006700770-424185619-1745488364-794895919-4004696415", True),  # IIS APPPOOL
    ("S-1-5-90-0-1", True),  # Window Manager\DWM-1
    ("S-1-5-96-0-0", True),  # Font Driver Host\UMFD-0
    ("s-1-5-18", True),
    (None, True), ("", True), ("NT AUTHORITY\\SYSTEM", True),  # unknown: fail closed
    ("S-1-5-21-1004336348-1177238915-682003330-1001", False),  # an ordinary account
    ("S-1-5-21-1004336348-1177238915-682003330-500", False),  # an administrator: a person
    ("S-1-5-180", False), ("S-1-5-800-1", False),  # no prefix match by digits alone
])
def test_the_owner_is_judged_by_sid(sid: str | None, root: bool) -> None:
    assert root_owned_sid(sid) is root


@pytest.mark.parametrize(("name", "sid"), [
    ("NT-AUTORITÄT\\SYSTEM", "S-1-5-18"),
    ("AUTORITE NT\\SERVICE RÉSEAU", "S-1-5-20"),
    ("Window Manager\\DWM-1", "S-1-5-90-0-1"),
    ("Font Driver Host\\UMFD-0", "S-1-5-96-0-0"),
    ("NT SERVICE\\MSSQLSERVER", "S-1-5-80-3880718306-3832830129-1677859214-2598158968-1052248003"),
    ("IIS APPPOOL\\DefaultAppPool",
     "S-1-5-82-3006700770-424185619-1745488364-794895919-4004696415"),
    ("BOX\\alice", None),  # the token could not be read
])
def test_what_windows_runs_is_root_owned_whatever_its_name(name: str, sid: str | None) -> None:
    member = windows_member(dataclasses.replace(row(10, 9, 1), username=name, user_sid=sid))
    assert member.uid == 0 and member.user_name == name
    refused = member_refusal(member, Remediate(), frozenset())
    assert refused is not None and refused[0] == "root-owned"
    assert member_refusal(member, Remediate(allow_root_owned=True), frozenset()) is None


def test_a_virtual_accounts_process_that_joins_refuses_the_reap() -> None:
    kernel = world()
    kernel.at[("suspend", 1)] = lambda pid: kernel.add(dataclasses.replace(
        row(STRANGER, WORKER, 1_100, cmd="dwm.exe"), username="Window Manager\\DWM-1",
        user_sid="S-1-5-90-0-1"))
    result = Reap(kernel).run()
    assert (result.outcome, result.reason) == (Outcome.ABORTED, "root-owned"), result
    assert STRANGER not in steps(kernel, "suspend")
    no_one_left_suspended(kernel)
