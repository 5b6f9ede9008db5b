"""The only module that reads /proc.

A scan asks for a handful of pids (GPU holders, their ancestors, their session
leaders) and nothing else: there is deliberately no way here to enumerate the
process table. Everything but /proc/PID/stat is cached by process identity
(pid, start_time), so a warm scan costs one stat read per process it touches.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.host.identity_cache import IdentityCache, ThreadTurns
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.launchers import RUN_MARKER, ExitSource
from gpuguard.host.marks import Marks
from gpuguard.orphans.process import (
    EXITED_STATES,
    ProcInfo,
    ProcStatus,
    ProcUnreadable,
    Truncated,
    failure,
    owner_uid,
)

PROC = "/proc"
#: Inode of the initial (host) PID namespace: PROC_PID_INIT_INO in the kernel.
PROC_PID_INIT_INO = 0xEFFFFFFC


@functools.cache
def clock_ticks() -> int:
    """Clock ticks per second: the unit of /proc/PID/stat's start time."""
    return os.sysconf("SC_CLK_TCK")


class UnheardExits:
    """The exit source of a process that listens to no process events itself (the console,
    `gpuguard mcp`) on a host where a daemon may: an exit it has no record of is one it
    missed, so a gone launcher reads launcher-unrecorded (or what the daemon's launcher
    memory recorded), never session-ended, whose evidence is that nothing could listen."""

    available = True

    def exit_of(self, pid: int, *, after: float) -> None:
        return None




@dataclass(frozen=True)
class EnvironMarkers:
    """What gpuguard reads in a process's environment."""

    keep: bool  # GPUGUARD_KEEP=1: keep this tree (README "What a reap may signal")
    run: tuple[int, int] | None  # GPUGUARD_RUN's (pid, start_time) of a `gpuguard run`


_ENV_ENTRY = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*=")
#: The most digits a number in a marker may have: a 64-bit count (a start time in clock
#: ticks) has 20. Any user writes the environment; a longer run of digits is no marker,
#: and never reaches int() (which refuses 4,300 digits and up, and is quadratic below).
MARKER_DIGITS = 20


#: The most digits a pid has (PID_MAX_LIMIT is 2**22: 7).
PID_DIGITS = 10


def pid_number(text: bytes) -> int:
    """A pid as the kernel writes it: ASCII digits, PID_DIGITS at most; ValueError else."""
    if not 0 < len(text) <= PID_DIGITS or not text.isdigit():
        raise ValueError(f"not a pid: {text[:PID_DIGITS + 1]!r}")
    return int(text)


def marker_number(text: bytes) -> int | None:
    """A marker's decimal number, ASCII digits only (bytes.isdigit() knows no others), at
    most MARKER_DIGITS of them; None for anything else."""
    return int(text) if 0 < len(text) <= MARKER_DIGITS and text.isdigit() else None


def parse_environ_markers(raw: bytes, *, complete: bool = True) -> EnvironMarkers | None:
    """The markers in /proc/PID/environ's NUL-separated bytes; None when no entry is a
    well-formed KEY=VALUE: the process overwrote the area (setproctitle zero-fills it)
    or had it emptied, and a marker it held cannot be told from none. `complete` False:
    only the first ENVIRON_CAP bytes were read; then only a keep marker found in them
    answers, anything else is None (what was not read may hold one)."""
    keep = False
    run: bytes | None = None
    well_formed = False
    prefix = RUN_MARKER.encode() + b"="
    for entry in raw.split(b"\0"):
        if not _ENV_ENTRY.match(entry):
            continue
        well_formed = True
        if entry == b"GPUGUARD_KEEP=1":
            keep = True
        elif entry.startswith(prefix) and run is None:  # the first, as getenv() reads it
            run = entry[len(prefix):]
    if not well_formed or not (complete or keep):
        return None
    if not complete:
        run = None  # a later, different GPUGUARD_RUN cannot be ruled out either way
    pid, sep, start = (run or b"").partition(b":")
    pid_n, start_n = marker_number(pid), marker_number(start)
    named = (pid_n, start_n) if sep and pid_n is not None and start_n is not None else None
    return EnvironMarkers(keep=keep, run=named)


def parse_stat(text: str, *, uid: int) -> ProcInfo:
    """Parse /proc/PID/stat; comm may hold spaces and parentheses, so split after the last ')'."""
    open_paren = text.index("(")
    close_paren = text.rindex(")")
    pid = int(text[:open_paren])
    comm = text[open_paren + 1 : close_paren]
    fields = text[close_paren + 2 :].split()
    # fields[0] is field 3 (state); field N lives at fields[N - 3].
    return ProcInfo(
        pid=pid,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        start_time=int(fields[19]),
        state=fields[0],
        uid=uid,
        comm=comm,
    )


def parse_status(text: str) -> ProcStatus:
    sig_ign = 0
    nspid: tuple[int, ...] = ()
    kthread = False
    owner: int | None = None
    tgid: int | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "SigIgn":
            sig_ign = int(value.strip(), 16)
        elif key == "NSpid":
            nspid = tuple(int(v) for v in value.split())
        elif key == "Kthread":
            kthread = value.strip() == "1"
        elif key == "Uid":
            ids = value.split()  # real, effective, saved, filesystem
            if len(ids) >= 2 and ids[0].isdigit() and ids[1].isdigit():
                owner = owner_uid(int(ids[0]), int(ids[1]))
        elif key == "Tgid" and value.strip().isdigit():
            tgid = int(value.strip())
    return ProcStatus(sighup_ignored=bool(sig_ign & (1 << 0)), nspid=nspid, kernel_thread=kthread,
                      owner=owner, tgid=tgid)


def cgroup_paths(text: str) -> tuple[str, ...]:
    """The paths of /proc/PID/cgroup's lines, v1 ("N:ctrl:/p", one per hierarchy) and v2
    ("0::/p") alike."""
    paths = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths.append(parts[2])
    return tuple(paths)


BOOT_ID = "/proc/sys/kernel/random/boot_id"


def read_boot_id() -> str:
    """The kernel's random id of this boot: unlike any clock estimate, it never drifts.
    Raises OSError when it cannot be read."""
    with open(BOOT_ID, encoding="ascii") as fh:
        return fh.read().strip()


@functools.cache
def boot_id() -> str:
    """This boot's id, read once: what ties a pid and start time, or a boot clock
    reading, to one boot ("" when unreadable: then nothing persisted matches it)."""
    try:
        return read_boot_id()
    except OSError:
        return ""


def boottime() -> float:
    """The boot clock: seconds since boot (CLOCK_BOOTTIME, suspend included). No step of
    the wall clock moves it; it starts again at 0 with every boot (see boot_id). Windows
    has no CLOCK_BOOTTIME: its monotonic clock (QueryPerformanceCounter, from boot) there."""
    if not hasattr(time, "CLOCK_BOOTTIME"):
        return time.monotonic()
    return time.clock_gettime(time.CLOCK_BOOTTIME)


#: Threads of one process whose children files an exporter scan reads afresh (the rest
#: in turns: ThreadTurns); a process of up to this many threads has every one read.
SCAN_THREAD_TURNS = 256

#: The most of a command line read: any user may make one as large as the kernel allows
#: (and share one across many forked processes), and each read is cached per process.
CMDLINE_CAP = 64 * 1024
#: The same for the environment (read for the markers): a cut one answers only with a
#: keep marker found in what was read.
ENVIRON_CAP = 256 * 1024


def unparsable(pid: int, name: str, exc: Exception) -> ProcUnreadable:
    """/proc/PID/NAME read but not understood: the process that wrote it cannot be judged."""
    return ProcUnreadable(f"/proc/{pid}/{name}: could not be parsed ({failure(exc)})")


def _tid_order(name: str) -> tuple[int, str]:
    """Thread ids in numeric order (the main thread, the lowest, first)."""
    return (len(name), name)


def _vanished(exc: OSError) -> bool:
    return exc.errno in (errno.ENOENT, errno.ESRCH)


class _Empty:
    """What an empty /proc/PID/environ read gives: unreadable for now, not cached."""


EMPTY_ENVIRON = _Empty()


class ProcessView:
    """Lazy, counted, identity-cached reads of /proc for the pids a scan asks about.

    `begin_scan()` starts a new scan: within one scan each pid's stat is read at
    most once; across scans the extras (cmdline, cgroup, status, ...) are reused
    while (pid, start_time) and comm are unchanged. `thread_turns` (the exporter's
    scans): a thread-heavy process's children files are read in turns (ThreadTurns),
    not every thread's every scan.
    """

    def __init__(self, *, proc_root: str = PROC, counters: Counters = COUNTERS,
                 events: ExitSource | None = None,
                 memory: LauncherMemory | None = None,
                 thread_turns: int | None = None) -> None:
        self._root = proc_root
        self._counters = counters
        self._events = events
        self._caught_up = False  # the listener was asked to catch up this scan
        self._memory = memory
        self._boot_wall: float | None = None
        self._lock = threading.RLock()
        self._scan_stat: dict[int, ProcInfo | None] = {}
        self._extras = IdentityCache(self._lock)
        self._own_nspid_depth: int | None = None
        self._marks: dict[str, Marks] = {}
        self._turns = ThreadTurns(thread_turns) if thread_turns is not None else None

    # -- scan lifecycle -------------------------------------------------------------

    def begin_scan(self) -> None:
        """Forget this scan's stat reads; drop extras of processes not seen last scan."""
        with self._lock:
            seen = {info.identity for info in self._scan_stat.values() if info is not None}
            self._extras.keep_only(seen)
            if self._turns is not None:
                self._turns.keep_only(seen)
            self._scan_stat = {}
            self._caught_up = False

    # -- stat: one read per pid per scan ---------------------------------------------

    def stat(self, pid: int) -> ProcInfo | None:
        """The process now at `pid`, or None when no such process is visible."""
        with self._lock:
            if pid in self._scan_stat:
                return self._scan_stat[pid]
            info = self._read_stat(pid)
            if info is not None:
                self._extras.saw(info)
                info = self._owned(info)
            self._scan_stat[pid] = info
            return info

    def _owned(self, info: ProcInfo) -> ProcInfo:
        """`info` with its owner right. The inode of /proc/PID/stat (read with it, free) is
        the effective uid of a dumpable process, but root's for any non-dumpable one and
        for a main thread that called pthread_exit(), whoever runs them: where it says
        root, the owner is /proc/PID/status' (orphans.process.owner_uid), read once per
        process identity with the rest of status. Unreadable: root, as read."""
        if info.uid != 0:
            return info
        status = self.status(info)
        if status is None or status.owner is None or status.owner == info.uid:
            return info
        return replace(info, uid=status.owner)

    def _read_stat(self, pid: int) -> ProcInfo | None:
        with self._counters.track("proc_stat", proc_reads=1):
            try:
                fd = os.open(f"{self._root}/{pid}/stat", os.O_RDONLY)
            except OSError as exc:
                if _vanished(exc):
                    return None
                raise ProcUnreadable(f"/proc/{pid}/stat: {exc.strerror}") from exc
            try:
                uid = os.fstat(fd).st_uid
                data = os.read(fd, 4096)
            except OSError as exc:
                if _vanished(exc):
                    return None
                raise ProcUnreadable(f"/proc/{pid}/stat: {exc.strerror}") from exc
            finally:
                os.close(fd)
        if not data:
            return None
        try:
            return parse_stat(data.decode("utf-8", "replace"), uid=uid)
        except (ValueError, IndexError) as exc:
            raise ProcUnreadable(f"/proc/{pid}/stat: malformed ({exc})") from exc

    def fresh_stat(self, pid: int) -> ProcInfo | None:
        """Re-read stat now, bypassing this scan's memo (the reaper's identity checks)."""
        with self._lock:
            self._scan_stat.pop(pid, None)
        return self.stat(pid)

    # -- extras: cached by identity --------------------------------------------------

    def _extra(self, info: ProcInfo, key: str, callsite: str, read,
               settled: Callable[[Any], bool] | None = None) -> object:
        """A cached fact of `info`; None when gone or not ours to read (the caller decides
        what None means). What the process wrote that a parser could not take (any other
        exception) is ProcUnreadable, never the scan's: that one process reads unknown."""
        def counted() -> object:
            with self._counters.track(callsite, proc_reads=1):
                try:
                    return read()
                except OSError:
                    return None
                except Exception as exc:
                    raise unparsable(info.pid, key, exc) from exc

        return self._extras.get(info, key, counted, settled)

    def _read_text(self, pid: int | str, name: str) -> str:
        with open(f"{self._root}/{pid}/{name}", "rb") as fh:
            return fh.read().decode("utf-8", "replace")

    def _own_dir(self, info: ProcInfo) -> str:
        """Where what lives in the process's memory, files and cwd (cmdline, environ, cwd,
        fd/) is read: /proc/PID, or for a zombie main thread (pthread_exit()) with a live
        thread, that thread's /proc/PID/task/TID. The main thread let go of its own when
        it exited (cmdline reads empty, environ fails with ESRCH, cwd and fd/ fail); the
        process's are still there, shared by its live threads."""
        base = f"{self._root}/{info.pid}"
        tid = self._live_tid(info.pid) if info.is_zombie else None
        return f"{base}/task/{tid}" if tid is not None else base

    def cmdline(self, info: ProcInfo) -> str | None:
        """The command line joined by spaces, at most CMDLINE_CAP bytes of it (then a
        `Truncated`); None when unreadable or gone."""

        def read() -> str:
            with open(f"{self._own_dir(info)}/cmdline", "rb") as fh:
                raw = fh.read(CMDLINE_CAP + 1)
            text = raw[:CMDLINE_CAP].decode("utf-8", "replace").replace("\0", " ").strip()
            return Truncated(text) if len(raw) > CMDLINE_CAP else text

        return self._extra(info, "cmdline", "proc_cmdline", read)  # type: ignore[return-value]

    def cgroup(self, info: ProcInfo) -> tuple[str, ...] | None:
        """Every cgroup path of the process (v1 has one per hierarchy, v2 one)."""

        def read() -> tuple[str, ...]:
            return cgroup_paths(self._read_text(info.pid, "cgroup"))

        return self._extra(info, "cgroup", "proc_cgroup", read)  # type: ignore[return-value]

    def status(self, info: ProcInfo) -> ProcStatus | None:
        def read() -> ProcStatus:
            return parse_status(self._read_text(info.pid, "status"))

        return self._extra(info, "status", "proc_status", read)  # type: ignore[return-value]

    def _markers(self, info: ProcInfo) -> EnvironMarkers | None:
        """gpuguard's markers in the environment (one read serves both); None: unreadable,
        or overwritten (no KEY=VALUE entry left)."""

        def read() -> EnvironMarkers | None | _Empty:
            with open(f"{self._own_dir(info)}/environ", "rb") as fh:
                raw = fh.read(ENVIRON_CAP + 1)
            if not raw:
                return EMPTY_ENVIRON
            return parse_environ_markers(raw[:ENVIRON_CAP], complete=len(raw) <= ENVIRON_CAP)

        # An empty environment is what a read finds while execve() is between setting the
        # new comm and placing the new environment: unreadable now, and read again next
        # scan (a process started with no environment at all costs one read a scan).
        markers = self._extra(info, "environ", "proc_environ", read,
                              settled=lambda value: value is not EMPTY_ENVIRON)
        return None if markers is EMPTY_ENVIRON else markers  # type: ignore[return-value]

    def keep_marker(self, info: ProcInfo) -> bool | None:
        """True when the environment holds GPUGUARD_KEEP=1; None when unreadable."""
        markers = self._markers(info)
        return None if markers is None else markers.keep

    def run_launcher(self, info: ProcInfo) -> tuple[int, int] | None:
        """(pid, start_time) of the `gpuguard run` launcher named by GPUGUARD_RUN in the
        environment; None when absent, malformed or unreadable."""
        markers = self._markers(info)
        return None if markers is None else markers.run

    def memo(self, info: ProcInfo, key: object, compute: Callable[[], Any]) -> Any:
        """`compute()` once per process identity (dropped with its other extras): what a
        pure rule derives from this process's facts, a protect match say, is cached by
        the process it is about, never by its (user-sized) text."""
        return self._extras.get(info, key, compute)

    def registered(self, kind: str, info: ProcInfo, directory: str) -> bool | None:
        """Whether `directory` holds a trusted registration of `kind` (gpuguard/host/marks.py)
        for this process; None when it cannot be read. Never cached: a registration
        made or removed since the last scan counts at once."""
        marks = self._marks.get(directory)
        if marks is None:
            marks = self._marks.setdefault(directory, Marks(directory, boot_id(),
                                                            self._counters))
        return marks.has(kind, info.pid, info.start_time, info.uid)

    def daemon_io(self, info: ProcInfo) -> bool | None:
        """True when cwd is / and stdin is /dev/null (the detach-on-purpose recipe)."""

        def read() -> bool:
            own = self._own_dir(info)
            cwd = os.readlink(f"{own}/cwd")
            try:
                stdin = os.readlink(f"{own}/fd/0")
            except FileNotFoundError:
                stdin = "/dev/null"  # a closed stdin is as detached as /dev/null
            return cwd == "/" and stdin == "/dev/null"

        return self._extra(info, "daemon_io", "proc_fd", read)  # type: ignore[return-value]

    def launcher_exit(self, pid: int, after_start_time: int) -> Any:
        """The kernel's record of `pid`'s exit after a process started at `after_start_time`
        (ticks since boot) did, from the process-event listener; None if none or no listener."""
        if self._events is None:
            return None
        found = self._events.exit_of(pid, after=self.wall_time(after_start_time))
        if found is None and not self._caught_up:
            # The listener reads in paced batches: a launcher that died a moment ago may
            # still be queued in its socket. Once a scan (or an inspection), let it read
            # everything queued before this, then ask again: a first reading of an orphan
            # pins its launcher reason (launcher_memory.py), so it must not be early.
            self._caught_up = True
            caught_up = getattr(self._events, "caught_up", None)
            if caught_up is not None and caught_up():
                found = self._events.exit_of(pid, after=self.wall_time(after_start_time))
        return found

    def listening(self) -> bool:
        """Whether a process-event listener records exits: then a launcher's exit it has
        no record of is one it missed (before it started, evicted, dropped), not one
        that never happened."""
        return self._events is not None and bool(self._events.available)

    def recall_launcher(self, root: ProcInfo, reason: str, detail: str, *,
                        recorded: bool) -> tuple[str, str]:
        """The launcher reason first established for this orphan root (see
        gpuguard/host/launcher_memory.py); `reason` itself without a memory."""
        if self._memory is None:
            return reason, detail
        return self._memory.recall((root.pid, root.start_time, root.sid), reason, detail,
                                   recorded=recorded)

    def wall_time(self, start_time: int) -> float:
        """Unix time of a start time in clock ticks since boot (btime from /proc/stat)."""
        if self._boot_wall is None:
            with open(f"{self._root}/stat", encoding="ascii") as fh:
                btime = next(line for line in fh if line.startswith("btime "))
            self._boot_wall = float(btime.split()[1])
        return self._boot_wall + start_time / clock_ticks()

    def own_nspid_depth(self) -> int:
        """How many PID namespaces this process sits in (1 on the host)."""
        if self._own_nspid_depth is None:
            with self._counters.track("proc_status", proc_reads=1):
                try:
                    status = parse_status(self._read_text("self", "status"))
                    self._own_nspid_depth = max(1, len(status.nspid))
                except OSError:
                    # Depth 1: every holder in a PID namespace then reads `container`
                    # (normal), never an orphan on a guess.
                    self._own_nspid_depth = 1
        return self._own_nspid_depth

    # -- descendants: walked downward, never by scanning the table -------------------

    def _per_thread(self, pid: int, name: str, callsite: str, *, strict: bool = False,
                    turns: tuple[int, int] | None = None) -> list[tuple[str, bytes]] | None:
        """(TID, /proc/PID/task/TID/NAME) for every thread; None when the process is gone.
        `strict`: what exists but cannot be read raises ProcUnreadable instead of reading
        as gone (a thread that exits between listdir and open is skipped either way).
        `turns`: the process's identity, whose threads are read in turns (ThreadTurns)."""
        start = time.perf_counter()
        reads = 1
        contents: list[tuple[str, bytes]] = []
        try:
            try:
                tids = sorted(os.listdir(f"{self._root}/{pid}/task"), key=_tid_order)
            except OSError as exc:
                if strict and not _vanished(exc):
                    raise ProcUnreadable(f"/proc/{pid}/task: {exc.strerror}") from exc
                tids = None
            wanted = tids or []
            if turns is not None and self._turns is not None and tids:
                wanted = self._turns.pick(turns, tids)
            for tid in wanted:
                reads += 1
                try:
                    with open(f"{self._root}/{pid}/task/{tid}/{name}", "rb") as fh:
                        contents.append((tid, fh.read()))
                except OSError as exc:
                    if strict and not _vanished(exc):
                        raise ProcUnreadable(f"/proc/{pid}/task/{tid}/{name}: "
                                             f"{exc.strerror}") from exc
                    continue  # the thread exited between listdir and open
            if turns is not None and self._turns is not None and tids:
                contents = self._turns.merge(turns, tids, contents)
        finally:
            self._counters.add(callsite, seconds=time.perf_counter() - start, proc_reads=reads)
        return None if tids is None else contents

    def children(self, pid: int) -> tuple[int, ...] | None:
        """Children of every thread of `pid`, or None when the process is gone. With
        `thread_turns`, a thread-heavy process read this scan has its threads' children
        files read in turns (ThreadTurns); the member walk still checks every child's
        stat, so a child that exited or a pid reused since is never taken."""
        info = self._scan_stat.get(pid)
        files = self._per_thread(pid, "children", "proc_children",
                                 turns=info.identity if info is not None else None)
        if files is None:
            return None
        try:
            return tuple(dict.fromkeys(pid_number(k) for _, data in files for k in data.split()))
        except ValueError as exc:
            raise unparsable(pid, "task/*/children", exc) from exc

    def _thread_states(self, pid: int) -> list[tuple[str, str]] | None:
        """(TID, state letter) of every thread of `pid`; None when the process is gone;
        ProcUnreadable when its threads exist but cannot be read."""
        files = self._per_thread(pid, "stat", "proc_task_stat", strict=True)
        if files is None:
            return None
        states = []
        for tid, data in files:
            text = data.decode("utf-8", "replace")
            fields = text[text.rfind(")") + 2 :].split(maxsplit=1)
            if fields:
                states.append((tid, fields[0]))
        return states

    def thread_states(self, pid: int) -> tuple[str, ...] | None:
        """The state letter of every thread of `pid`; None when the process is gone;
        ProcUnreadable when its threads exist but cannot be read (never taken for gone).

        SIGSTOP stops a thread group one thread at a time: a thread still inside
        fork() links its child before it stops, so a freeze is complete only when
        every thread, not just the main one, shows T. A main thread that called
        pthread_exit() shows Z while the others run (ProcInfo.is_live).
        """
        states = self._thread_states(pid)
        return None if states is None else tuple(state for _, state in states)

    def _live_tid(self, pid: int) -> str | None:
        """A thread of `pid` that has not exited (ProcInfo.is_live's test), or None."""
        return next((tid for tid, state in self._thread_states(pid) or ()
                     if state not in EXITED_STATES), None)



def in_host_pid_namespace() -> bool | None:
    """Whether this process sees the host's PID namespace (None: cannot tell).

    NVML reports host pids; a process in a child PID namespace (a container without
    hostPID, `unshare --pid`) would match them against its own, different pids. The
    kernel gives the initial PID namespace the fixed inode PROC_PID_INIT_INO.
    """
    try:
        return os.stat(f"{PROC}/self/ns/pid").st_ino == PROC_PID_INIT_INO
    except OSError:
        return None


#: Capability bits (linux/capability.h). Another user's /proc/PID/environ (mode 0400) and
#: fd/ (0500) need a DAC bypass and ptrace read access; signalling them needs CAP_KILL.
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_KILL, CAP_SYS_PTRACE = 1, 2, 5, 19


def effective_capabilities() -> int | None:
    """This process's effective capability set (CapEff), or None when unreadable."""
    try:
        with open(f"{PROC}/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return None


def other_users_problem(*, signal: bool = False) -> str | None:
    """What this process lacks to inspect (with `signal`: to signal) other users' processes.

    The kernel's rules, read off CapEff: another user's /proc/PID/environ and fd/ need
    CAP_SYS_PTRACE (ptrace read access) and CAP_DAC_READ_SEARCH or CAP_DAC_OVERRIDE
    (modes 0400 and 0500); a signal needs CAP_KILL. Root without them (capabilities
    dropped) is no better off. Otherwise a daemon short of them shows it only as every
    foreign tree reading unknown, or as reaps that abort.
    """
    caps = effective_capabilities()
    if caps is None:
        return None

    def has(bit: int) -> bool:
        return bool(caps >> bit & 1)

    missing = [name for name, ok in (
        ("CAP_SYS_PTRACE", has(CAP_SYS_PTRACE)),
        ("CAP_DAC_READ_SEARCH", has(CAP_DAC_READ_SEARCH) or has(CAP_DAC_OVERRIDE)),
    ) if not ok]
    problems = []
    if missing:
        problems.append(f"cannot read other users' /proc/PID/environ (missing "
                        f"{' and '.join(missing)}): their GPU trees read unknown "
                        "(member-unknown) and are never reaped")
    if signal and not has(CAP_KILL):
        problems.append("cannot signal other users' processes (missing CAP_KILL): a reap of "
                        "their trees aborts (signal-failed)")
    if not problems:
        return None
    return "; ".join(problems) + "; run as root or with the capabilities of deploy/systemd/"


def identity_alive(pid: int, start_time: int, *, proc_root: str = PROC) -> bool:
    """Whether `pid` still names the process that started at `start_time` (True when its
    stat cannot be read: what is remembered about it is kept, not dropped on a guess)."""
    try:
        info = ProcessView(proc_root=proc_root, counters=Counters()).fresh_stat(pid)
    except ProcUnreadable:
        return True
    return info is not None and info.start_time == start_time
