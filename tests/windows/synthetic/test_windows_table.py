"""gpuguard/host/windows/processes.py: psutil's table as WinProc rows.

psutil is a Windows-only dependency: the module must import without it (Linux), and the
tests that read through it run where it is installed (the `bench` extra, and the Wine
tier's Windows Python). Reading this host's real processes checks the plumbing; what
only a Windows kernel does (AccessDenied on SYSTEM's rows, Wine's OSError 87 on names)
is played by a stand-in process object raising psutil's own exceptions.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from gpuguard.config.classify import default_rules
from gpuguard.host import platform
from gpuguard.host.windows import processes
from gpuguard.host.windows.tree import (
    UNKNOWN_CREATE_TIME,
    ParentIndexed,
    WinProc,
    classify_windows,
    encode_create_time,
    windows_members,
)
from tests.support.ci import require
from tests.support.proctree import wait_for


def test_the_table_source_imports_without_psutil_and_the_platform_is_linux_here() -> None:
    windows = sys.platform == "win32"
    assert platform.PLATFORM is platform.BACKENDS["windows" if windows else "linux"]
    assert platform.PLATFORM.name == ("windows" if windows else "linux")
    assert "psutil" not in processes.__dict__  # imported on first use only
    assert processes.session_id(os.getpid()) is None or windows


@pytest.fixture
def psutil() -> Any:
    require(importlib.util.find_spec("psutil"), "psutil is not installed: pip install -e '.[test]'")
    import psutil

    return psutil


def test_read_one_reads_this_process_as_psutil_does(psutil: Any) -> None:
    me = psutil.Process()
    row = processes.read_one(os.getpid())
    assert row is not None and row.readable
    assert (row.pid, row.ppid) == (os.getpid(), me.ppid())
    assert row.create_time == encode_create_time(me.create_time())
    assert row.cmdline == tuple(me.cmdline()) and row.name == me.name()
    assert row.username == me.username()


def test_read_table_holds_a_child_by_its_parent_and_not_a_reaped_one(psutil: Any) -> None:
    script = "import sys; sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE)
    try:
        # Popen returns once exec has closed the child's descriptors, which can be before
        # exec has placed the new command line (it reads empty until then): wait for it.
        wait_for(lambda: psutil.Process(child.pid).cmdline()[-1:] == [script],
                 what="the child's command line")
        table = processes.read_table()
        row = table[child.pid]
        assert row.ppid == os.getpid() and row.create_time >= table[os.getpid()].create_time
        assert row.cmdline[-1] == script
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    assert processes.read_one(child.pid) is None


class StandIn:
    """A psutil.Process whose reads raise what Windows (or Wine) makes psutil raise."""

    def __init__(self, pid: int = 7004, **raises: BaseException) -> None:
        self.pid = pid
        self._raises = raises

    @contextlib.contextmanager
    def oneshot(self) -> Iterator[None]:
        yield

    def _read(self, what: str, value: Any) -> Any:
        if what in self._raises:
            raise self._raises[what]
        return value

    def create_time(self) -> float:
        return float(self._read("create_time", 1_733_000_003.25))

    def cmdline(self) -> list[str]:
        return list(self._read("cmdline", ["C:\\Python311\\python.exe", "train.py"]))

    def name(self) -> str:
        return str(self._read("name", "python.exe"))

    def username(self) -> str:
        return str(self._read("username", "WIN-A\\alice"))


def row_of(psutil: Any, **raises: BaseException) -> Any:
    return processes.row_of(StandIn(**raises), 6000, psutil=psutil,
                            session=lambda pid: 1, sid=lambda pid: ALICE_SID)


ALICE_SID = "S-1-5-21-1004336348-1177238915-682003330-1001"


def test_a_readable_process_is_a_full_row(psutil: Any) -> None:
    row = row_of(psutil)
    assert (row.pid, row.ppid, row.create_time, row.readable) == (7004, 6000,
                                                                  1_733_000_003_250, True)
    assert row.cmdline == ("C:\\Python311\\python.exe", "train.py")
    assert (row.name, row.username, row.session_id) == ("python.exe", "WIN-A\\alice", 1)
    assert row.user_sid == ALICE_SID


def test_access_denied_on_the_command_line_makes_an_unreadable_row(psutil: Any) -> None:
    """SYSTEM's and the services' processes: the name and the time still come."""
    row = row_of(psutil, cmdline=psutil.AccessDenied(7004), username=psutil.AccessDenied(7004))
    assert (row.readable, row.cmdline, row.username) == (False, (), None)
    assert (row.name, row.create_time) == ("python.exe", 1_733_000_003_250)


def test_access_denied_on_the_creation_time_leaves_it_unknown(psutil: Any) -> None:
    row = row_of(psutil, create_time=psutil.AccessDenied(7004))
    assert (row.readable, row.create_time) == (False, UNKNOWN_CREATE_TIME)


def test_wine_8s_name_error_leaves_the_name_unknown_and_the_row_readable(psutil: Any) -> None:
    row = row_of(psutil, name=OSError(87, "The parameter is incorrect"))
    assert (row.readable, row.name) == (True, None)


@pytest.mark.parametrize("what", ["create_time", "cmdline", "name", "username"])
def test_a_process_gone_while_read_is_no_row(psutil: Any, what: str) -> None:
    assert row_of(psutil, **{what: psutil.NoSuchProcess(7004)}) is None


def test_a_scan_reads_the_rows_of_its_holders_chain_and_no_others(psutil: Any) -> None:
    """The cost rule on Windows: one snapshot of pids and ppids, then rows only for what
    the rules walk. A sibling of the holder (here a child of this process beside it)
    is listed but never read: no command line, owner or token of a bystander."""
    holder, bystander = (subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                          stdin=subprocess.PIPE) for _ in range(2))
    try:
        table = processes.read_table()
        assert isinstance(table, processes.ProcessTable)
        assert {holder.pid, bystander.pid} <= set(table.ppids)
        windows = platform.BACKENDS[platform.WINDOWS].defaults
        [tree] = classify_windows(table, [holder.pid], default_rules(windows))
        assert holder.pid in {h.pid for h in tree.holders}
        assert {holder.pid, os.getpid()} <= table.read_pids
        assert bystander.pid not in table.read_pids
        assert len(table.read_pids) < len(table.ppids)
    finally:
        for child in (holder, bystander):
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=30)


class CountingTable(Mapping[int, WinProc]):
    """A ParentIndexed table over fixed rows that records which rows were read."""

    def __init__(self, rows: list[WinProc]) -> None:
        self._rows = {row.pid: row for row in rows}
        self.ppids = {row.pid: row.ppid for row in rows}
        self.read: set[int] = set()

    def __getitem__(self, pid: int) -> WinProc:
        self.read.add(pid)
        return self._rows[pid]

    def __iter__(self) -> Iterator[int]:
        raise AssertionError("the walk iterated the whole table")

    def __len__(self) -> int:
        raise AssertionError("the walk sized the whole table")


def test_the_member_walk_reads_only_the_rows_below_the_root() -> None:
    root = WinProc(100, 90, 1_000, ("python.exe", "launch.py"))
    rows = [root, WinProc(101, 100, 1_001, ("python.exe", "worker.py")),
            WinProc(102, 101, 1_002, ("python.exe", "leaf.py")),
            *(WinProc(500 + i, 4, 900, ("svchost.exe",)) for i in range(50))]
    table = CountingTable(rows)
    assert isinstance(table, ParentIndexed)
    members = windows_members(table, root)
    assert [m.pid for m in members] == [100, 101, 102]
    assert table.read <= {100, 101, 102}
