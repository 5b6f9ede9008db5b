"""The Windows process table, through psutil: the rows gpuguard/host/windows/tree.py judges.

One system snapshot of every pid and its ppid per scan (`read_table`), each row read
only when the classifier asks for it (`ProcessTable`): a scan reads the holders, their
ancestors and their trees, never every process's command line and owner. Or one process
(`read_one`, the reaper's re-checks). Each row says what psutil could read, and no more:

- a process psutil lists but cannot open (AccessDenied: SYSTEM's, the services',
  another user's without the privilege) is a row with `readable=False`: its pid and
  ppid (both from the system's process snapshot, which needs no access), and whatever
  else psutil still gave (the name, the creation time); the classifier never calls a
  chain through such a row an orphan;
- the name is optional: Wine 8's `name()` raises OSError 87; `display_name` falls back
  to the basename of the command line's program;
- the creation time is `encode_create_time`'s integer milliseconds, the one encoding of
  `root_start_time` on Windows; unreadable, it is UNKNOWN_CREATE_TIME and the row is
  unreadable;
- a process gone between the listing and its read is no row: it is gone;
- the owner is the token's user SID (`user_sid`, accounts.py), not the localised name.

psutil is imported on first use, never at import: it is a dependency on Windows only
(pyproject.toml), and on Linux this module imports (for tests) without it.
`os.getppid()` is never used: it aborts Python >= 3.12 under Wine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gpuguard.host.windows.accounts import process_sid
from gpuguard.host.windows.tree import UNKNOWN_CREATE_TIME, WinProc, encode_create_time
from gpuguard.host.windows.winapi import dll


def _psutil() -> Any:
    """psutil, imported on first use (see the module doc)."""
    return importlib.import_module("psutil")


def _ppid_map(psutil: Any) -> Mapping[int, int] | None:
    """Every process's ppid from one system snapshot, or None where psutil has no such
    call (then each process's ppid() is asked: one snapshot per process on Windows)."""
    snapshot: Callable[[], Mapping[int, int]] | None = getattr(psutil, "_ppid_map", None)
    if snapshot is None:
        return None
    try:
        return dict(snapshot())
    except (OSError, psutil.Error):
        return None


def session_id(pid: int) -> int | None:
    """The Terminal Services session of `pid` (0: the services'), None when it cannot be
    read (access denied, gone, or not on Windows): ProcessIdToSessionId."""
    import ctypes
    from ctypes import wintypes

    try:
        kernel32 = dll("kernel32")  # OSError off Windows
    except OSError:
        return None
    out = wintypes.DWORD()
    if not kernel32.ProcessIdToSessionId(wintypes.DWORD(pid), ctypes.byref(out)):
        return None
    return int(out.value)


def row_of(process: Any, ppid: int, *, psutil: Any,
           session: Callable[[int], int | None] = session_id,
           sid: Callable[[int], str | None] = process_sid) -> WinProc | None:
    """One psutil.Process as a row (`ppid` from the snapshot); None when it is gone.

    Reads under `oneshot()`; AccessDenied on the creation time or the command line makes
    the row unreadable, on the name or the user only leaves them unknown (None). The
    user SID is read from the process's token (accounts.process_sid; None: unknown).
    """
    gone = (psutil.NoSuchProcess, getattr(psutil, "ZombieProcess", psutil.NoSuchProcess))
    denied = (psutil.AccessDenied, OSError)
    readable = True
    with process.oneshot():
        try:
            create_time = encode_create_time(process.create_time())
        except gone:
            return None
        except (*denied, ValueError, OverflowError):
            create_time, readable = UNKNOWN_CREATE_TIME, False
        try:
            cmdline = tuple(str(arg) for arg in process.cmdline() or ())
        except gone:
            return None
        except denied:
            cmdline, readable = (), False
        name = _optional(process.name, gone, denied)
        username = _optional(process.username, gone, denied)
    if name is _GONE or username is _GONE:
        return None
    pid = int(process.pid)
    return WinProc(pid=pid, ppid=ppid, create_time=create_time, cmdline=cmdline,
                   name=name or None, username=username or None, session_id=session(pid),
                   readable=readable, user_sid=sid(pid))


_GONE: Any = object()


def _optional(read: Callable[[], Any], gone: tuple[type[BaseException], ...],
              denied: tuple[type[BaseException], ...]) -> Any:
    """A field that may be unknown: its string, None when it cannot be read, _GONE when
    the process went away meanwhile."""
    try:
        value = read()
    except gone:
        return _GONE
    except denied:
        return None
    return str(value) if value else None


class ProcessTable(Mapping[int, WinProc]):
    """The processes of one snapshot, by pid; each row read from psutil on first access
    and kept (host.windows.tree.ParentIndexed: `ppids` answers without reading a row).
    A pid listed but gone by its read has no row. Iterating reads every row."""

    def __init__(self, psutil: Any, ppids: Mapping[int, int]) -> None:
        self._psutil = psutil
        self._ppids = dict(ppids)
        self._rows: dict[int, WinProc | None] = {}

    @property
    def ppids(self) -> Mapping[int, int]:
        return self._ppids

    @property
    def read_pids(self) -> frozenset[int]:
        """The pids whose rows this table has read (the cost a scan paid)."""
        return frozenset(self._rows)

    def __getitem__(self, pid: int) -> WinProc:
        if pid not in self._ppids:
            raise KeyError(pid)
        if pid not in self._rows:
            self._rows[pid] = _read(self._psutil, pid, self._ppids[pid])
        row = self._rows[pid]
        if row is None:
            raise KeyError(pid)
        return row

    def __iter__(self) -> Iterator[int]:
        return iter([pid for pid in self._ppids if pid in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def read_table() -> Mapping[int, WinProc]:
    """Every process psutil lists now, by pid (see the module doc for what a row holds):
    a ProcessTable over one snapshot, or, where psutil has no snapshot call, every row
    read now."""
    psutil = _psutil()
    ppids = _ppid_map(psutil)
    if ppids is not None:
        return ProcessTable(psutil, ppids)
    table: dict[int, WinProc] = {}
    for pid in psutil.pids():
        row = _read(psutil, pid, None)
        if row is not None:
            table[row.pid] = row
    return table


def read_one(pid: int) -> WinProc | None:
    """Process `pid` as a row now, or None when there is none."""
    return _read(_psutil(), pid, None)


def _read(psutil: Any, pid: int, ppid: int | None) -> WinProc | None:
    try:
        process = psutil.Process(pid)
        if ppid is None:
            ppid = int(process.ppid())
    except (psutil.NoSuchProcess, getattr(psutil, "ZombieProcess", psutil.NoSuchProcess)):
        return None
    except (psutil.AccessDenied, OSError, ValueError):
        return None if ppid is None else WinProc(pid, ppid, UNKNOWN_CREATE_TIME,
                                                  readable=False)
    return row_of(process, ppid, psutil=psutil)
