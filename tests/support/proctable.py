"""A synthetic process table for tests: `gpuguard.orphans.protections.ProcSource` with no I/O.

Write a scenario as a list of `FakeProc` rows, wrap it in a `SyntheticView`,
and hand that view to `classify()` (or, later, to the remediator)::

    view = SyntheticView([
        init(),
        leader(100, ppid=1, comm="bash"),
        proc(200, ppid=100, sid=100),
    ])
    view.exit(100)                      # bash dies; the kernel reparents 200 to PID 1
    trees = classify([holder(200)], view, Rules())

Defaults, chosen so that a row only spells out what a scenario is about:

- `pgid` defaults to the pid (every process leads its own job), `cmdline` to
  `comm`, `nspid` to `(pid,)` (the host PID namespace), `cgroup` to a logind
  session scope, `uid` to 1000, `state` to "S".
- `start_time` defaults to 100 ticks per level of depth in the table, so a
  parent is always older than its child (classify() calls a parent newer than
  its child "inconsistent"). Rows added later with `add()` are newer than
  everything already there, as a freshly forked process is.
- `comm` is truncated to 15 bytes in the `ProcInfo`, as the kernel does.

Every question asked of the view is appended to `calls` as `(method, pid)`, so
a test can assert what was (not) read: e.g. `view.calls_to("keep_marker")` is
the list of pids whose environment was read. `own_nspid_depth()` is recorded
as `("own_nspid_depth", 0)`.

The view also answers `children()` / `descendants()` like `procfs.ProcessView`,
and can be changed between calls (`add`, `remove`, `update`, `exit`) to play
races and process exits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.orphans.process import Holder, ProcInfo, ProcStatus, ProcUnreadable

SESSION_SCOPE = "/user.slice/user-1000.slice/session-1.scope"
INIT_SCOPE = "/init.scope"
TICKS_PER_LEVEL = 100
COMM_LEN = 15
GIB = 1 << 30


@dataclass(frozen=True)
class FakeProc:
    """One row of the synthetic table: what /proc/PID/{stat,cmdline,cgroup,status,...} say.

    `keep` is GPUGUARD_KEEP=1 in the environment; `daemon_io` is "cwd is / and
    stdin is /dev/null". `cgroup` may be given as one string.
    """

    pid: int
    ppid: int
    sid: int
    pgid: int | None = None  # None: the pid itself
    start_time: int | None = None  # None: by depth (see module doc)
    comm: str = "python"
    state: str = "S"
    uid: int = 1000
    cmdline: str | None = None  # None: comm ("" for a kernel thread)
    cgroup: tuple[str, ...] | str = (SESSION_SCOPE,)
    sighup_ignored: bool = False
    nspid: tuple[int, ...] | None = None  # None: (pid,)
    keep: bool = False
    #: GPUGUARD_RUN in the environment: the (pid, start_time) of a `gpuguard run`.
    run: tuple[int, int] | None = None
    #: The environment is unreadable although the rest is not (overwritten: no KEY=VALUE
    #: entry left, as setproctitle leaves it).
    environ_erased: bool = False
    #: Registrations by identity (gpuguard/host/marks.py): `gpuguard keep PID`, and a `gpuguard
    #: run` launcher's own.
    keep_registered: bool = False
    run_registered: bool = False
    daemon_io: bool = False
    kernel_thread: bool = False
    #: Other threads still run after the main one exited (stat then shows Z).
    threads_alive: bool = False

    def __post_init__(self) -> None:
        if self.pgid is None:
            object.__setattr__(self, "pgid", self.pid)
        if isinstance(self.cgroup, str):
            object.__setattr__(self, "cgroup", (self.cgroup,))
        else:
            object.__setattr__(self, "cgroup", tuple(self.cgroup))
        if self.cmdline is None:
            object.__setattr__(self, "cmdline", "" if self.kernel_thread else self.comm)
        if self.nspid is None:
            object.__setattr__(self, "nspid", (self.pid,))
        else:
            object.__setattr__(self, "nspid", tuple(self.nspid))

    def info(self) -> ProcInfo:
        """The `ProcInfo` that /proc/PID/stat would give (start_time must be resolved)."""
        if self.start_time is None:
            raise ValueError(f"pid {self.pid}: start_time not resolved; put it in a SyntheticView")
        assert self.pgid is not None
        return ProcInfo(
            pid=self.pid,
            ppid=self.ppid,
            pgid=self.pgid,
            sid=self.sid,
            start_time=self.start_time,
            state=self.state,
            uid=self.uid,
            comm=self.comm[:COMM_LEN],
        )

    def proc_status(self) -> ProcStatus:
        assert self.nspid is not None
        return ProcStatus(
            sighup_ignored=self.sighup_ignored,
            nspid=tuple(self.nspid),
            kernel_thread=self.kernel_thread,
        )


@dataclass(frozen=True)
class Exit:
    """An exit event, as gpuguard.orphans.protections.ExitEvent reads it."""

    signal: int | None
    status: int | None
    at: float


# -- builders -----------------------------------------------------------------------


def init(*, comm: str = "systemd", sid: int = 1, **kw) -> FakeProc:
    """PID 1: root-owned, in /init.scope, leading session 1 unless told otherwise."""
    kw.setdefault("uid", 0)
    kw.setdefault("cgroup", (INIT_SCOPE,))
    kw.setdefault("cmdline", "/sbin/init")
    return FakeProc(1, 0, sid, comm=comm, **kw)


def proc(pid: int, *, ppid: int, sid: int, **kw) -> FakeProc:
    """Any process; keyword arguments are `FakeProc` fields."""
    return FakeProc(pid, ppid, sid, **kw)


def leader(pid: int, *, ppid: int, **kw) -> FakeProc:
    """A session leader (it called setsid(): sid == pgid == pid)."""
    return FakeProc(pid, ppid, pid, **kw)


def chain(pids: Iterable[int], *, ppid: int, sid: int, **kw) -> list[FakeProc]:
    """A straight line of processes: the first is a child of `ppid`, each next one a
    child of the one before. All share `sid` and the other fields in `kw`."""
    out = []
    parent = ppid
    for pid in pids:
        out.append(FakeProc(pid, parent, sid, **kw))
        parent = pid
    return out


def holder(pid: int, gpu: int = 0, used: int | None = GIB, *, kind: str = "C") -> Holder:
    """An NVML holder record for `pid` on GPU index `gpu` (a fake, stable UUID per index)."""
    return Holder(
        pid=pid,
        gpu_uuid=f"GPU-{gpu:08x}-0000-4000-8000-000000000000",
        gpu_index=gpu,
        used_bytes=used,
        kind=kind,
    )


# -- the view -----------------------------------------------------------------------


def _resolve_start_times(procs: dict[int, FakeProc]) -> dict[int, FakeProc]:
    """Fill start_time = TICKS_PER_LEVEL * depth for rows that left it None."""
    depth: dict[int, int] = {}
    for pid in procs:
        path: list[int] = []
        on_path: set[int] = set()
        cur = pid
        while cur in procs and cur not in depth and cur not in on_path:
            path.append(cur)
            on_path.add(cur)
            cur = procs[cur].ppid
        base = depth.get(cur, 0) if cur not in on_path else 0  # a cycle starts from 0
        for level, member in enumerate(reversed(path), start=1):
            depth[member] = base + level
    return {
        pid: p if p.start_time is not None else replace(p, start_time=TICKS_PER_LEVEL * depth[pid])
        for pid, p in procs.items()
    }


class SyntheticView:
    """An in-memory `ProcSource` (and enough of `ProcessView` for the remediator).

    - `stat(pid)`: the row's `ProcInfo`, None when no such pid, or raises
      `ProcUnreadable` for pids in `unreadable`.
    - `opaque={pid, ...}`: stat answers, every other file (cmdline, status, environ,
      ...) is unreadable, as for another user's process when not root.
    - `vanish_after_reads={pid: n}`: the first n `stat(pid)` calls see the
      process; on the next one it is gone (removed, its children keep their
      now-stale ppid: the race a mid-walk exit produces). n=0: gone at once.
    - extras (`cmdline`, `cgroup`, `status`, `keep_marker`, `run_launcher`, `daemon_io`)
      answer None when the pid is unreadable, gone, or now holds a different process
      (start_time differs from the `ProcInfo` asked about).
    """

    def __init__(
        self,
        procs: Iterable[FakeProc],
        *,
        own_nspid_depth: int = 1,
        unreadable: Iterable[int] = (),
        opaque: Iterable[int] = (),
        vanish_after_reads: Mapping[int, int] | None = None,
        listener: bool = False,
        memory: LauncherMemory | None = None,
    ) -> None:
        table: dict[int, FakeProc] = {}
        for p in procs:
            if p.pid in table:
                raise ValueError(f"pid {p.pid} appears twice in the table")
            table[p.pid] = p
        self._procs = _resolve_start_times(table)
        self._own_nspid_depth = own_nspid_depth
        self.unreadable: set[int] = set(unreadable)
        self.opaque: set[int] = set(opaque)  # stat readable, every other file not
        self.vanish_after_reads: dict[int, int] = dict(vanish_after_reads or {})
        self._stat_reads: Counter[int] = Counter()
        self.exits: dict[int, Exit] = {}
        self.calls: list[tuple[str, int]] = []
        #: A process-event listener runs (record_exit turns it on); `memory`: the
        #: launcher memory (gpuguard/host/launcher_memory.py), None for none.
        self.listener = listener
        self.memory = memory

    # -- inspecting the table (not recorded) ------------------------------------------

    def __contains__(self, pid: object) -> bool:
        return pid in self._procs

    def __getitem__(self, pid: int) -> FakeProc:
        return self._procs[pid]

    def __len__(self) -> int:
        return len(self._procs)

    @property
    def procs(self) -> tuple[FakeProc, ...]:
        return tuple(self._procs.values())

    def info(self, pid: int) -> ProcInfo:
        """The ProcInfo of a row, for building expectations; not recorded as a call."""
        return self._procs[pid].info()

    # -- what was asked ----------------------------------------------------------------

    def calls_to(self, method: str) -> list[int]:
        """Pids passed to `method`, in call order, repeats kept."""
        return [pid for name, pid in self.calls if name == method]

    def touched(self) -> set[int]:
        """Every pid any per-process question was about."""
        return {pid for name, pid in self.calls if name != "own_nspid_depth"}

    def reset_calls(self) -> None:
        self.calls.clear()

    # -- ProcSource --------------------------------------------------------------------

    def begin_scan(self) -> None:
        """A scan starts (the Scanner calls this); a table has no memo to forget."""

    def stat(self, pid: int) -> ProcInfo | None:
        return self._stat("stat", pid)

    def fresh_stat(self, pid: int) -> ProcInfo | None:
        """As `stat`, recorded apart: the member walk's identity re-reads."""
        return self._stat("fresh_stat", pid)

    def _stat(self, method: str, pid: int) -> ProcInfo | None:
        self.calls.append((method, pid))
        if pid in self.unreadable:
            raise ProcUnreadable(f"/proc/{pid}/stat: Permission denied (synthetic)")
        limit = self.vanish_after_reads.get(pid)
        if limit is not None and self._stat_reads[pid] >= limit:
            self.remove(pid)
        self._stat_reads[pid] += 1
        p = self._procs.get(pid)
        return p.info() if p is not None else None

    def _current(self, method: str, info: ProcInfo) -> FakeProc | None:
        self.calls.append((method, info.pid))
        if info.pid in self.unreadable or info.pid in self.opaque:
            return None
        p = self._procs.get(info.pid)
        if p is None or p.start_time != info.start_time:
            return None
        return p

    def cmdline(self, info: ProcInfo) -> str | None:
        p = self._current("cmdline", info)
        return p.cmdline if p is not None else None

    def cgroup(self, info: ProcInfo) -> tuple[str, ...] | None:
        p = self._current("cgroup", info)
        return tuple(p.cgroup) if p is not None else None

    def status(self, info: ProcInfo) -> ProcStatus | None:
        p = self._current("status", info)
        return p.proc_status() if p is not None else None

    def keep_marker(self, info: ProcInfo) -> bool | None:
        p = self._current("keep_marker", info)
        return p.keep if p is not None and not p.environ_erased else None

    def run_launcher(self, info: ProcInfo) -> tuple[int, int] | None:
        p = self._current("run_launcher", info)
        return p.run if p is not None and not p.environ_erased else None

    def memo(self, info: ProcInfo, key: object, compute: Callable[[], Any]) -> Any:
        """No memo: every question is answered afresh (and recorded)."""
        return compute()

    def registered(self, kind: str, info: ProcInfo, directory: str) -> bool | None:
        """A registration is a file by identity: readable whatever /proc hides."""
        self.calls.append(("registered", info.pid))
        p = self._procs.get(info.pid)
        if p is None or p.start_time != info.start_time:
            return False
        return p.keep_registered if kind == "keep" else p.run_registered

    def listening(self) -> bool:
        return self.listener

    def recall_launcher(self, root: ProcInfo, reason: str, detail: str, *,
                        recorded: bool) -> tuple[str, str]:
        if self.memory is None:
            return reason, detail
        return self.memory.recall((root.pid, root.start_time, root.sid), reason, detail,
                                  recorded=recorded)

    def daemon_io(self, info: ProcInfo) -> bool | None:
        p = self._current("daemon_io", info)
        return p.daemon_io if p is not None else None

    def own_nspid_depth(self) -> int:
        self.calls.append(("own_nspid_depth", 0))
        return self._own_nspid_depth

    def launcher_exit(self, pid: int, after_start_time: int) -> Exit | None:
        """What the process-event listener saw of `pid`'s exit: see `record_exit`."""
        self.calls.append(("launcher_exit", pid))
        return self.exits.get(pid)

    def record_exit(self, pid: int, *, signal: int | None = None,
                    status: int | None = None) -> None:
        """`pid` exits as `exit()` does, and the listener saw how."""
        self.listener = True
        self.exits[pid] = Exit(signal=signal, status=status, at=0.0)
        self.exit(pid)

    # -- descendants, as ProcessView walks them ---------------------------------------

    def thread_states(self, pid: int) -> tuple[str, ...] | None:
        """The main thread's state, and "S" for the others when `threads_alive`."""
        self.calls.append(("thread_states", pid))
        p = self._procs.get(pid)
        if p is None:
            return None
        return (p.state, *(("S",) if p.threads_alive else ()))

    def children(self, pid: int) -> tuple[int, ...] | None:
        """Pids whose ppid is `pid`, or None when `pid` is gone."""
        self.calls.append(("children", pid))
        if pid not in self._procs:
            return None
        return tuple(p.pid for p in self._procs.values() if p.ppid == pid and p.pid != pid)

    def descendants(self, pid: int) -> tuple[int, ...]:
        """Every descendant of `pid` in the table, breadth first (not recorded)."""
        out: list[int] = []
        frontier = [pid]
        while frontier:
            frontier = [p.pid for p in self._procs.values()
                        if p.ppid in frontier and p.pid not in out and p.pid != pid]
            out += frontier
        return tuple(out)

    # -- changing the table ------------------------------------------------------------

    def add(self, p: FakeProc) -> FakeProc:
        """Insert a row; with no start_time it is newer than every row already there."""
        if p.pid in self._procs:
            raise ValueError(f"pid {p.pid} is already in the table")
        if p.start_time is None:
            newest = max((q.start_time or 0 for q in self._procs.values()), default=0)
            p = replace(p, start_time=newest + TICKS_PER_LEVEL)
        self._procs[p.pid] = p
        return p

    def remove(self, pid: int) -> None:
        """The pid is gone from /proc (reaped); children are left as they are."""
        self._procs.pop(pid, None)
        self.vanish_after_reads.pop(pid, None)

    def update(self, pid: int, **changes) -> FakeProc:
        """Change fields of a row in place (exec, setsid, a new SigIgn, ...)."""
        p = replace(self._procs[pid], **changes)
        self._procs[pid] = p
        return p

    def exit(self, pid: int, *, zombie: bool = False, reaper: int = 1) -> None:
        """`pid` exits: its children are reparented to `reaper` (PID 1 or the nearest
        subreaper, the caller says which); it stays as a zombie or is gone."""
        for child in [p for p in self._procs.values() if p.ppid == pid and p.pid != pid]:
            self._procs[child.pid] = replace(child, ppid=reaper)
        if zombie:
            self.update(pid, state="Z")
        else:
            self.remove(pid)
