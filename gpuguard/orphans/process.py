"""A process as the classifier sees it: the records every process source gives, and the
pure checks over them (identity, liveness, the member walk) that each platform shares."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass
from typing import Protocol, TypeVar


class ProcUnreadable(Exception):
    """/proc/PID exists but could not be read (permissions, a malformed file)."""


#: The most of an exception's message a reason carries: what a process wrote may be in it.
FAILURE_CAP = 200


def failure(exc: BaseException) -> str:
    """An exception as a verdict's detail says it: its type and the start of its message."""
    return f"{type(exc).__name__}: {str(exc)[:FAILURE_CAP]}"


#: State letters of a task that has exited: zombie, dead.
EXITED_STATES = frozenset({"Z", "X", "x"})
#: State letters of a stopped task: by a signal (SIGSTOP, a freeze), by a tracer.
STOPPED_STATES = frozenset({"T", "t"})
#: ProcessView.thread_states: the state of every thread of a pid; None when it is gone.
ThreadStates = Callable[[int], tuple[str, ...] | None]


@dataclass(frozen=True)
class ProcInfo:
    """One process as /proc/PID/stat showed it; (pid, start_time) is its identity."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    start_time: int  # field 22 of /proc/PID/stat, clock ticks since boot
    state: str
    uid: int
    comm: str

    @property
    def identity(self) -> tuple[int, int]:
        return (self.pid, self.start_time)

    @property
    def is_zombie(self) -> bool:
        return self.state in EXITED_STATES

    @property
    def is_stopped(self) -> bool:
        return self.state in STOPPED_STATES

    @property
    def is_session_leader(self) -> bool:
        return self.sid == self.pid

    def is_live(self, thread_states: ThreadStates) -> bool:
        """Whether this process, as read now, still runs: it is not a zombie, or it is a
        zombie main thread with a thread still running.

        A main thread that called pthread_exit() shows state Z in /proc/PID/stat while
        the process runs on in its other threads, holding its GPU memory, its children
        and its signal dispositions: it is alive wherever gpuguard asks (the member walk,
        member judgement, the reaper, `gpuguard run`) and gone only once every thread
        is. `thread_states` is ProcessView.thread_states: None means the process is
        gone; threads that cannot be read raise ProcUnreadable, never read as gone.
        """
        if not self.is_zombie:
            return True
        states = thread_states(self.pid)
        return states is not None and any(state not in EXITED_STATES for state in states)


@dataclass(frozen=True)
class ProcStatus:
    """The parts of /proc/PID/status gpuguard uses."""

    sighup_ignored: bool
    nspid: tuple[int, ...]  # this pid in each PID namespace, outermost first
    kernel_thread: bool
    owner: int | None = None  # owner_uid() of its Uid line; None when it had none
    tgid: int | None = None  # the process a thread id belongs to (itself for a process)


_ROOT = 0


def owner_uid(real: int, effective: int) -> int:
    """Whose process this is, from /proc/PID/status' Uid line (real, effective, ...).

    The effective uid, as /proc/PID's own inode, `ps` and SO_PEERCRED say (the registrar
    compares the two), except that a process with root in either id is root's: a
    setuid-root program its user started, or a root daemon acting as a user for a while,
    keeps the root-owned guard it had. Never the inode of /proc/PID/stat: the kernel
    gives it to root for any non-dumpable process (prctl(PR_SET_DUMPABLE, 0), as
    ssh-agent does) and for a main thread that called pthread_exit(), whoever runs them.
    """
    return _ROOT if _ROOT in (real, effective) else effective


class Truncated(str):
    """A command line cut at CMDLINE_CAP: what was not read may hold anything (a protect
    pattern's match included), so a miss in it proves nothing."""

    __slots__ = ()


@dataclass(frozen=True)
class Holder:
    """One process with a GPU context on one GPU."""

    pid: int
    gpu_uuid: str
    gpu_index: int
    used_bytes: int | None  # None when the driver cannot say (pynvml gives None)
    kind: str  # "C", "G" or "C+G"


def walk_members(root: ProcInfo, children: Callable[[int], tuple[int, ...] | None],
                 stat: Callable[[int], ProcInfo | None],
                 stat_now: Callable[[int], ProcInfo | None],
                 thread_states: ThreadStates, *,
                 limit: int = 100_000) -> tuple[ProcInfo, ...]:
    """The root and every live descendant, each collected by identity.

    A pid read from a parent's children file counts only if `stat` shows a live
    process (ProcInfo.is_live, asking `thread_states`: a zombie main thread with a
    live thread is a member) whose ppid is that parent and which is not older than
    it, and the parent, re-read with `stat_now` after its children, is still the
    process the walk saw (same start time): a pid reused between the two reads names
    someone else, and so do its children.
    """
    return breadth_first(root, lambda parent, seen: live_children(
        parent, children, stat, stat_now, thread_states, skip=seen), limit=limit)


class _Process(Protocol):
    @property
    def pid(self) -> int: ...


P = TypeVar("P", bound=_Process)


def breadth_first(root: P, children: Callable[[P, Set[int]], Iterable[P]], *,
                  limit: int) -> tuple[P, ...]:
    """The root and its descendants, root first, breadth first, each once, at most
    `limit` generations' worth: every platform's member walk (`children` gives a
    process's children as that platform can tell them, skipping the pids seen)."""
    out = [root]
    seen = {root.pid}
    frontier = [root]
    while frontier and len(out) < limit:
        nxt: list[P] = []
        for parent in frontier:
            for child in children(parent, seen):
                if child.pid in seen:
                    continue
                seen.add(child.pid)
                out.append(child)
                nxt.append(child)
        frontier = nxt
    return tuple(out)


def live_children(parent: ProcInfo, children: Callable[[int], tuple[int, ...] | None],
                  stat: Callable[[int], ProcInfo | None],
                  stat_now: Callable[[int], ProcInfo | None],
                  thread_states: ThreadStates, *,
                  skip: Set[int] = frozenset()) -> tuple[ProcInfo, ...]:
    """`parent`'s live children, each by identity (one level of `walk_members`); none
    when `parent`, re-read with `stat_now` after its children file, is no longer the
    process read: its pid was reused, and those children are someone else's."""
    found: list[ProcInfo] = []
    for pid in children(parent.pid) or ():
        if pid in skip:
            continue
        child = stat(pid)
        if is_child_of(child, parent, thread_states):
            assert child is not None
            found.append(child)
    if not found or not still_same(stat_now(parent.pid), parent):
        return ()
    return tuple(found)


def is_child_of(child: ProcInfo | None, parent: ProcInfo, thread_states: ThreadStates) -> bool:
    """`child` (as read now) is a live child of `parent` (ProcInfo.is_live) and not older
    than it."""
    return (child is not None and child.ppid == parent.pid
            and child.start_time >= parent.start_time and child.is_live(thread_states))


def still_same(now: ProcInfo | None, then: ProcInfo) -> bool:
    """The pid still names the process read earlier (a zombie of it still holds the pid)."""
    return now is not None and now.start_time == then.start_time
