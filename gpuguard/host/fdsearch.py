"""The unlisted-holder search: which processes have a GPU's device file open.

NVML lists only the processes of the host PID namespace it can name; memory held by
anything else (a process in another PID namespace, a driver client NVML does not list)
shows only as memory that no listed process accounts for. Who holds it can then be
found only the slow way, by looking at every process's open files. This module is that
look, and the one place outside the scan's rules that lists /proc: the scanner calls it
only while some GPU's unattributed memory is above `accounting.unlisted_threshold_bytes`
(docs/accounting.md, Holders NVML does not list), never otherwise.

Bounded (principle 3): one step examines at most a budget of processes and of time,
then stops; the next step resumes where this one stopped, at the same file descriptor
of the same process when a process with many files used up a budget alone.

Matched by what the file IS, never by its name: each /proc/PID/fd/N is stat()ed, which
follows the kernel's magic link to the open file itself. readlink() gives only a path
string, which lies: a deleted or renamed node reads "/dev/nvidia0 (deleted)" or its new
name, a path is resolved in the holder's own mount namespace (a container's /dev), and
a regular file that someone named /dev/nvidia0 in a chroot reads the same as the GPU. A
character device is matched by its device number (st_rdev), since the same GPU is
reached through any node with that number (Docker's `--device` makes a node of its own
in the container's /dev, another inode); any other file by (st_dev, st_ino), the inode
itself (the files the tests point `accounting.device_files` at).
"""

from __future__ import annotations

import bisect
import glob
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuguard.base.counters import COUNTERS, Counters

#: How many descriptors of one process are stat()ed between two looks at the clock.
CLOCK_EVERY = 64
#: A step looks at no fewer than 1/PROGRESS_SHARE of one process's descriptors.
PROGRESS_SHARE = 16


@dataclass(frozen=True)
class DeviceFile:
    """One file the search looks for, as it was when its pattern was expanded."""

    path: str
    dev: int
    ino: int
    rdev: int | None  # a character device's number; None for any other file

    @property
    def key(self) -> tuple[int, ...]:
        return file_key(self.dev, self.ino, self.rdev)


def file_key(dev: int, ino: int, rdev: int | None) -> tuple[int, ...]:
    """What makes two open files the same GPU file: the device number of a character
    device, the inode of anything else (module docstring)."""
    return (0, rdev) if rdev is not None else (1, dev, ino)


def device_files(patterns: Sequence[str]) -> tuple[DeviceFile, ...]:
    """The files `patterns` (globs) name now, each stat()ed (links followed); a file that
    cannot be stat()ed is left out (it cannot be open either, as far as we can tell)."""
    found: dict[str, DeviceFile] = {}
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if path in found:
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            rdev = st.st_rdev if stat.S_ISCHR(st.st_mode) else None
            found[path] = DeviceFile(path, st.st_dev, st.st_ino, rdev)
    return tuple(found.values())


@dataclass(frozen=True)
class SearchStep:
    """What one step of the search knows: every process found holding a file (pid ->
    the file's path), over the pass in progress and the last complete one."""

    found: dict[int, str]
    #: pid -> its start time when it was found (None: not told, or unreadable then): a
    #: pid reused since names another process, which the caller leaves out.
    started: dict[int, int | None]
    examined: int  # processes examined by this step
    complete: bool  # this step finished a pass over the process table
    passes: int  # complete passes since the search (re)started
    unreadable: int  # processes whose descriptors could not be read, this pass so far


class FdSearch:
    """The search's state between scans: where the pass stopped, and what it found."""

    def __init__(self, *, proc_root: str = "/proc", counters: Counters = COUNTERS,
                 clock: Callable[[], float] = time.perf_counter,
                 exclude: frozenset[int] | None = None) -> None:
        """`exclude`: pids never reported (default: this process, whose own NVML has the
        device nodes open)."""
        self._root = proc_root
        self._counters = counters
        self._clock = clock
        self._exclude = exclude if exclude is not None else frozenset({os.getpid()})
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next step starts a new pass at the lowest pid."""
        self._next_pid = 0  # the pass goes on at the first pid >= this
        self._next_fd = 0  # ... at the first descriptor >= this of exactly that pid
        self._found: dict[int, str] = {}
        self._started: dict[int, int | None] = {}
        self._passes = 0
        self._unreadable = 0
        self._identify: Callable[[int], int | None] | None = None

    def step(self, files: Sequence[DeviceFile], *, max_processes: int,
             max_seconds: float,
             identify: Callable[[int], int | None] | None = None) -> SearchStep:
        """Examine processes from where the last step stopped, until `max_processes` have
        been examined or `max_seconds` have passed (at least one descriptor is always
        looked at, so a pass always ends); a finished pass starts over next time.
        `identify`: a pid's start time, asked for each process found holding a file."""
        start = self._clock()
        self._identify = identify
        keys = {f.key: f.path for f in files}
        pids = self._listing()
        live = set(pids)
        self._found = {pid: path for pid, path in self._found.items() if pid in live}
        self._started = {pid: t for pid, t in self._started.items() if pid in self._found}
        examined = 0
        complete = True
        for pid in pids:
            if pid < self._next_pid or pid in self._exclude:
                continue
            if examined >= max_processes or (examined and self._clock() - start >= max_seconds):
                self._next_pid, self._next_fd = pid, 0
                complete = False
                break
            offset = self._next_fd if pid == self._next_pid else 0
            done = self._examine(pid, keys, offset, start, max_seconds)
            examined += 1
            if done is not None:  # out of time inside this process: resume at its fd
                self._next_pid, self._next_fd = pid, done
                complete = False
                break
        if complete:
            self._passes += 1
            unreadable, self._unreadable = self._unreadable, 0
            self._next_pid, self._next_fd = 0, 0
        else:
            unreadable = self._unreadable
        return SearchStep(dict(self._found), dict(self._started), examined, complete,
                          self._passes, unreadable)

    def _listing(self) -> list[int]:
        """The numeric entries of /proc, in order: the one listing of the process table
        gpuguard makes, counted under its own callsite."""
        with self._counters.track("proc_list", proc_reads=1):
            try:
                names = os.listdir(self._root)
            except OSError:
                return []
        return sorted(int(name) for name in names if _number(name))

    def _examine(self, pid: int, keys: dict[tuple[int, ...], str], offset: int,
                 start: float, max_seconds: float) -> int | None:
        """Look at `pid`'s descriptors numbered `offset` and up; record or forget it.
        Returns the descriptor to resume at when time ran out first, else None (what the last pass
        knew of `pid` then stands until its descriptors have all been looked at: the ones
        before `offset` held no such file, or the look would have stopped there)."""
        reads = 1
        t0 = self._clock()
        try:
            try:
                fds = sorted(int(n) for n in os.listdir(f"{self._root}/{pid}/fd") if _number(n))
            except (FileNotFoundError, ProcessLookupError):
                self._found.pop(pid, None)  # gone between the listing and now
                return None
            except OSError:
                self._unreadable += 1  # not ours to read (no CAP_SYS_PTRACE): unknown
                self._found.pop(pid, None)
                return None
            hit = None
            first = bisect.bisect_left(fds, offset)  # resume by descriptor number: the
            # listing is fresh each step, and descriptors opened or closed since move indexes
            # At least a 16th of the descriptors per step: the listing costs about as much
            # as that many stats, so a process with a huge table is still passed in 16
            # steps, not one step per CLOCK_EVERY descriptors.
            least = max(CLOCK_EVERY, len(fds) // PROGRESS_SHARE)
            for i in range(first, len(fds)):
                done = i - first
                if done >= least and done % CLOCK_EVERY == 0 and \
                        self._clock() - start >= max_seconds:
                    return fds[i]
                reads += 1
                try:
                    st = os.stat(f"{self._root}/{pid}/fd/{fds[i]}")
                except OSError:
                    continue  # closed since the listing, or not ours to stat
                rdev = st.st_rdev if stat.S_ISCHR(st.st_mode) else None
                path = keys.get(file_key(st.st_dev, st.st_ino, rdev))
                if path is not None:
                    hit = path
                    break
            if hit is None:
                self._found.pop(pid, None)
                self._started.pop(pid, None)
            else:
                self._found[pid] = hit
                self._started[pid] = self._identify(pid) if self._identify else None
            return None
        finally:
            self._counters.add("proc_fd_search", seconds=self._clock() - t0, proc_reads=reads)


def _number(name: str) -> bool:
    """Whether a /proc entry's name is a pid or a descriptor number: ASCII digits, ten at
    most (str.isdigit() alone takes '²', which int() refuses)."""
    return 0 < len(name) <= 10 and name.isascii() and name.isdigit()
