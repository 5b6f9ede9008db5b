"""procfs: parsing, identity caching, and the children walk, against the real /proc."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuguard.base.counters import Counters
from gpuguard.host.procfs import (
    CMDLINE_CAP,
    ENVIRON_CAP,
    EnvironMarkers,
    ProcessView,
    parse_environ_markers,
    parse_stat,
    parse_status,
)
from gpuguard.orphans.process import ProcInfo, ProcUnreadable, Truncated, walk_members
from tests.support.proctree import (
    HOLDER,
    Trees,
    children_of,
    environment_in_place,
    live_threads,
    stat_fields,
    wait_for,
    zombie_leader,
)


def test_parse_stat_survives_hostile_comm() -> None:
    text = "4242 (a) b) (c ) S 1 4242 4242 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 987654 0 0\n"
    info = parse_stat(text, uid=1000)
    assert (info.pid, info.comm, info.state, info.ppid, info.pgid, info.sid) == (
        4242, "a) b) (c ", "S", 1, 4242, 4242)
    assert info.start_time == 987654 and info.is_session_leader


def test_parse_status_reads_sighup_and_nspid() -> None:
    status = parse_status("Name:\tx\nSigIgn:\t0000000000000001\nNSpid:\t812\t1\nKthread:\t0\n")
    assert status.sighup_ignored and status.nspid == (812, 1) and not status.kernel_thread
    assert not parse_status("SigIgn:\t0000000000001000\n").sighup_ignored


def test_stat_of_self_matches_os() -> None:
    view = ProcessView(counters=Counters())
    me = view.stat(os.getpid())
    assert me is not None
    assert (me.pid, me.ppid, me.sid, me.pgid, me.uid) == (
        os.getpid(), os.getppid(), os.getsid(0), os.getpgid(0), os.getuid())
    assert view.stat(4_000_000) is None


def test_stat_read_once_per_scan_and_extras_cached_by_identity() -> None:
    counters = Counters()
    view = ProcessView(counters=counters)
    view.begin_scan()
    me = view.stat(os.getpid())
    assert me is not None
    view.stat(os.getpid())
    view.cmdline(me)
    view.cgroup(me)
    view.cmdline(me)
    snap = counters.snapshot()
    assert snap["proc_stat"].proc_reads == 1
    assert snap["proc_cmdline"].proc_reads == 1 and snap["proc_cgroup"].proc_reads == 1
    view.begin_scan()
    again = view.stat(os.getpid())
    assert again is not None and again.identity == me.identity
    assert view.cmdline(again) and "pytest" in (view.cmdline(again) or "")
    snap = counters.snapshot()
    assert snap["proc_stat"].proc_reads == 2
    assert snap["proc_cmdline"].proc_reads == 1  # cached across scans by (pid, start_time)


def test_extras_of_unreadable_or_gone_processes_are_none() -> None:
    view = ProcessView(counters=Counters())
    me = view.stat(os.getpid())
    assert me is not None
    ghost = type(me)(**{**me.__dict__, "pid": 4_000_000})
    assert view.cmdline(ghost) is None and view.status(ghost) is None


def test_malformed_stat_is_unreadable(tmp_path) -> None:
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "stat").write_text("garbage")
    view = ProcessView(proc_root=str(tmp_path), counters=Counters())
    with pytest.raises(ProcUnreadable, match="/proc/77/stat"):
        view.stat(77)


def test_member_walk_reads_children_files(trees: Trees) -> None:
    tree = trees.spawn("{holder} --pidfile {dir}/worker --children 3 & wait")
    worker = tree.pid("worker")
    counters = Counters()
    view = ProcessView(counters=counters)
    launcher = view.stat(tree.launcher.pid)
    assert launcher is not None
    members = walk_members(launcher, view.children, view.stat, view.fresh_stat,
                           view.thread_states)
    kids = [m.pid for m in members[1:]]
    assert members[0] == launcher and worker in kids and len(kids) == 4  # + its 3 children
    assert counters.snapshot()["proc_children"].proc_reads >= 5


def test_thread_states_cover_every_thread(trees: Trees) -> None:
    import signal as sig

    from tests.support.proctree import wait_for

    tree = trees.spawn("{holder} --pidfile {dir}/worker --threads 2 & wait")
    worker = tree.pid("worker")
    counters = Counters()
    view = ProcessView(counters=counters)
    states = view.thread_states(worker)
    assert states is not None and len(states) == 3 and all(s in "SR" for s in states)
    os.kill(worker, sig.SIGSTOP)
    wait_for(lambda: set(view.thread_states(worker) or ()) == {"T"}, what="every thread stopped")
    os.kill(worker, sig.SIGCONT)
    assert view.thread_states(4_000_000) is None
    assert counters.snapshot()["proc_task_stat"].proc_reads >= 4


def test_member_walk_lists_a_child_whose_main_thread_exited(tmp_path: Path) -> None:
    """pthread_exit() in the main thread: /proc/PID/stat shows Z while another thread
    runs. That process is a live member: walked, and read through its live thread (its
    own cmdline reads empty, its environ fails); once every thread is gone it is not."""
    pidfile = tmp_path / "worker"
    # Our own child, not waited for until the end: once dead it stays a real zombie.
    proc = subprocess.Popen([sys.executable, str(HOLDER), "--zombie-leader", "--pidfile",
                             str(pidfile)], env={**os.environ, "GPUGUARD_KEEP": "1"})
    try:
        wait_for(pidfile.exists, what="the worker's main thread to exit")
        assert zombie_leader(proc.pid)
        counters = Counters()
        view = ProcessView(counters=counters)
        me = view.stat(os.getpid())
        assert me is not None
        members = walk_members(me, view.children, view.stat, view.fresh_stat,
                               view.thread_states)
        (worker,) = [m for m in members if m.pid == proc.pid]
        assert worker.state == "Z" and worker.is_live(view.thread_states)
        assert counters.snapshot()["proc_task_stat"].proc_reads >= 2
        assert Path(f"/proc/{proc.pid}/cmdline").read_bytes() == b""
        cmdline = view.cmdline(worker)
        assert cmdline is not None and "--zombie-leader" in cmdline
        assert view.keep_marker(worker) is True

        proc.kill()
        wait_for(lambda: (stat_fields(proc.pid) or {}).get("state") == "Z"
                 and not live_threads(proc.pid), what="every thread of the worker to exit")
        view = ProcessView(counters=Counters())
        me = view.stat(os.getpid())
        assert me is not None
        members = walk_members(me, view.children, view.stat, view.fresh_stat,
                               view.thread_states)
        assert proc.pid in children_of(os.getpid())  # a real zombie, still our child
        assert proc.pid not in [m.pid for m in members]
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_threads_that_cannot_be_read_are_never_taken_for_gone(tmp_path: Path) -> None:
    """A zombie main thread whose threads cannot be listed may still run: unknown."""
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "task").write_text("")  # listdir fails (ENOTDIR), not ENOENT
    view = ProcessView(proc_root=str(tmp_path), counters=Counters())
    zombie = ProcInfo(77, 1, 77, 77, start_time=5, state="Z", uid=0, comm="x")
    with pytest.raises(ProcUnreadable, match="/proc/77/task"):
        view.thread_states(77)
    with pytest.raises(ProcUnreadable):
        zombie.is_live(view.thread_states)
    assert view.thread_states(78) is None and not dataclasses.replace(zombie, pid=78).is_live(
        view.thread_states)  # no such process: gone
    assert dataclasses.replace(zombie, state="S").is_live(view.thread_states)  # not read


def test_member_walk_drops_children_of_a_pid_that_was_reused() -> None:
    """The parent is re-read after its children: a new process at its pid disowns them."""
    root = ProcInfo(10, 1, 10, 10, start_time=100, state="S", uid=1000, comm="sh")
    member = ProcInfo(20, 10, 10, 10, start_time=200, state="S", uid=1000, comm="python")
    stranger_child = ProcInfo(30, 20, 30, 30, start_time=400, state="S", uid=0, comm="x")
    table = {10: root, 20: member, 30: stranger_child}
    kids = {10: (20,), 20: (30,)}

    def no_threads(pid: int) -> tuple[str, ...] | None:
        raise AssertionError(f"no zombie here: thread states of {pid} not needed")

    def walk(now_20: ProcInfo | None) -> list[int]:
        def stat_now(pid: int) -> ProcInfo | None:
            return now_20 if pid == 20 else table.get(pid)
        return [m.pid for m in walk_members(root, kids.get, table.get, stat_now, no_threads)]

    assert walk(member) == [10, 20, 30]  # 20 is still 20: its child is a member
    # A stale children file: 30 now has another parent (reparented after 20's read).
    table[30] = ProcInfo(30, 1, 30, 30, start_time=400, state="S", uid=0, comm="x")
    assert walk(member) == [10, 20]
    table[30] = stranger_child
    reused = ProcInfo(20, 1, 20, 20, start_time=300, state="S", uid=0, comm="other")
    assert walk(reused) == [10, 20]  # pid 20 names another process now: 30 is not ours
    assert walk(None) == [10, 20]


def test_own_pid_namespace_depth_is_read_once_through_the_counted_reader(tmp_path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "status").write_text("Name:\tpython\nNSpid:\t4242\t17\n")
    counters = Counters()
    view = ProcessView(proc_root=str(tmp_path), counters=counters)
    assert view.own_nspid_depth() == 2 and view.own_nspid_depth() == 2
    assert counters.snapshot()["proc_status"].proc_reads == 1
    # Unreadable: depth 1, so a holder in any PID namespace reads `container` (normal).
    missing = ProcessView(proc_root=str(tmp_path / "nowhere"), counters=Counters())
    assert missing.own_nspid_depth() == 1


@pytest.mark.parametrize(("raw", "keep", "run"), [
    (b"A=1\0GPUGUARD_RUN=4242:987654\0B=2\0", False, (4242, 987654)),
    (b"GPUGUARD_KEEP=1\0GPUGUARD_RUN=7:8\0", True, (7, 8)),
    (b"GPUGUARD_RUN=7:8\0GPUGUARD_RUN=9:10\0", False, (7, 8)),  # the first, as getenv()
    (b"GPUGUARD_RUN=7\0", False, None),
    (b"GPUGUARD_RUN=7:8x\0", False, None),
    (b"GPUGUARD_RUN=-7:8\0", False, None),
    (b"GPUGUARD_RUN=\0GPUGUARD_KEEP=10\0", False, None),
    (b"XGPUGUARD_RUN=7:8\0", False, None),
])
def test_environ_markers_are_parsed_strictly(raw: bytes, keep: bool, run) -> None:
    assert parse_environ_markers(raw) == EnvironMarkers(keep=keep, run=run)


@pytest.mark.parametrize("raw", [
    b"",  # a zombie leader's, or an emptied environment
    b"\0" * 4096,  # zero-filled by setproctitle
    b"python train.py --lr=0.1\0\0\0",  # a title spilled over the erased area
    b"=1\0 GPUGUARD_KEEP=1\0",  # nothing that getenv() would find
])
def test_an_environment_without_a_key_value_entry_is_unreadable(raw: bytes) -> None:
    """None, not "no marker": a marker the process held cannot be ruled out."""
    assert parse_environ_markers(raw) is None


def test_a_zero_filled_environment_reads_unreadable_live(trees: Trees) -> None:
    tree = trees.spawn("GPUGUARD_KEEP=1 {holder} --erase-environ --pidfile {dir}/holder & wait")
    pid = tree.pid("holder")
    view = ProcessView(counters=Counters())
    info = view.fresh_stat(pid)
    assert info is not None and view.keep_marker(info) is None
    assert view.run_launcher(info) is None


def test_both_environ_markers_come_from_one_read(trees: Trees) -> None:
    tree = trees.spawn("GPUGUARD_KEEP=1 GPUGUARD_RUN=11:22 sleep 3600 & wait")
    counters = Counters()
    view = ProcessView(counters=counters)

    def exec_done() -> ProcInfo | None:
        """The child once exec has placed its environment: a new comm comes first, and a
        read between the two finds it empty, so wait for what the test means."""
        for pid in children_of(tree.launcher.pid):
            info = view.fresh_stat(pid)
            if info is not None and info.comm == "sleep" and environment_in_place(pid):
                return info
        return None

    info = wait_for(exec_done, what="the child to exec sleep with its environment")
    assert isinstance(info, ProcInfo)
    assert view.keep_marker(info) is True and view.run_launcher(info) == (11, 22)
    assert counters.snapshot()["proc_environ"].proc_reads == 1


def test_a_command_line_is_read_up_to_the_cap(trees: Trees) -> None:
    """Any user can make a command line as large as the kernel allows (and share it
    across forked children): each read stops at CMDLINE_CAP and says it was cut."""
    tree = trees.spawn("x=$(head -c 100000 /dev/zero | tr '\\0' a); "
                       "{holder} --pidfile {dir}/holder $x $x & wait")
    pid = tree.pid("holder")
    view = ProcessView(counters=Counters())
    info = view.fresh_stat(pid)
    assert info is not None
    cmd = view.cmdline(info)
    assert isinstance(cmd, Truncated) and len(cmd) <= CMDLINE_CAP
    short = view.cmdline(view.fresh_stat(tree.launcher.pid) or info)
    assert short is not None and not isinstance(short, Truncated)


def test_an_environment_is_read_up_to_its_cap() -> None:
    """Any user can make an environment huge and share it across a tree: a cut one
    answers only with a keep marker found in what was read; otherwise unreadable."""
    kept = b"GPUGUARD_KEEP=1\0GPUGUARD_RUN=7:8\0" + b"A=" + b"a" * 100 + b"\0"
    assert parse_environ_markers(kept, complete=False) == EnvironMarkers(keep=True, run=None)
    assert parse_environ_markers(b"A=1\0GPUGUARD_RUN=7:8\0", complete=False) is None
    assert ENVIRON_CAP >= 64 * 1024


def _fake_proc(root: Path, pid: int, *, comm: str, environ: bytes) -> None:
    """/proc/PID/stat and environ of one process, as a synthetic proc root."""
    (root / str(pid)).mkdir(exist_ok=True)
    fields = ["S", "1", str(pid), str(pid)] + ["0"] * 15 + ["4242"]  # state..starttime
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
    (root / str(pid) / "environ").write_bytes(environ)


def test_a_process_caught_mid_exec_reads_unknown_then_right_one_scan_later(
        tmp_path: Path) -> None:
    """execve() sets the new comm before the new environment is in place: a read in
    that window finds an empty environ. That reads unreadable (never "unmarked"), and
    is not kept across scans: the next scan reads the marker exec put there."""
    _fake_proc(tmp_path, 77, comm="sleep", environ=b"")
    counters = Counters()
    view = ProcessView(proc_root=str(tmp_path), counters=counters)
    view.begin_scan()
    caught = view.stat(77)
    assert caught is not None and caught.comm == "sleep"
    assert view.keep_marker(caught) is None and view.run_launcher(caught) is None
    _fake_proc(tmp_path, 77, comm="sleep", environ=b"GPUGUARD_KEEP=1\0GPUGUARD_RUN=11:22\0")
    view.begin_scan()
    later = view.stat(77)
    assert later is not None and later.identity == caught.identity
    assert view.keep_marker(later) is True and view.run_launcher(later) == (11, 22)
    view.begin_scan()  # a whole environment, once read, is kept for the identity
    assert view.keep_marker(view.stat(77) or later) is True
    assert counters.snapshot()["proc_environ"].proc_reads == 2
