"""Which processes have a DRM device open, found the only way the kernel allows: by looking
at their open files in /proc. The DRM back-end's one look at the process table.

Bounded and resumable, under the scan's cost rules (docs/design.md, Cost rules), as the
unlisted-holder search (host/fdsearch.py) is: each step lists /proc once and examines at
most a budget of processes and of time, resuming at the next step where this one stopped,
so a pass over a large host takes several scans and costs each of them no more than its
budget. What a pass found is kept by identity, (pid, start time) -> the DRM descriptors,
so that every step re-reads only those descriptors' fdinfo (and the process's stat, to
see it is still the same process), never the whole descriptor table of a known client.
A new pass starts PASS_EVERY seconds after the last one started (at once when the last
one took longer): between passes a step lists nothing and examines no one, and a process
that opened a device since it was last examined is found by the next pass.

A process with a huge descriptor table is itself examined in shares: the step stops
part-way through its /proc/PID/fd (the clock is read every CLOCK_EVERY descriptors) and
the next step goes on from there, through the same open directory, after checking the
process's start time. Unlike the unlisted-holder search, no share lists the table again:
the kernel makes each entry it lists (19,000 descriptors: 25 ms warm, 85 ms cold),
so a listing a share would cost more than the share's stat()s.

A source's FIRST step has a larger budget (FIRST_MAX_PROCESSES, FIRST_MAX_SECONDS): it
makes a whole pass on any ordinary host, so that a one-shot command, which reads a fresh
source about once, sees a complete list; only past that cap does its reading stay
incomplete (and a reap's check refuse). Later steps keep the budget.

A descriptor is a DRM one when what it IS (stat() through /proc/PID/fd/N, which follows
the kernel's link to the open file) is one of the device nodes (host/fdsearch.py, file
keys: a character device by its number), never by the path readlink() shows.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from gpuguard.base.counters import Counters
from gpuguard.host.fdsearch import CLOCK_EVERY, file_key
from gpuguard.host.procfs import parse_stat

#: The default budget of one step: as the unlisted-holder search's.
MAX_PROCESSES = 2000
MAX_SECONDS = 0.05
#: The budget of a source's first step: a whole pass on hosts up to about this size
#: (benchmarks/drm_cost.py: 1.1 s at 10,000 processes of nine descriptors each).
FIRST_MAX_PROCESSES = 20000
FIRST_MAX_SECONDS = 2.0
#: Seconds from the start of one pass to the start of the next (module docstring): a new
#: GPU client is found within about this long, plus the pass itself.
PASS_EVERY = 60.0


@dataclass(frozen=True)
class Known:
    """A process found holding DRM descriptors: its start time and (descriptor, node) pairs."""

    start_time: int
    fds: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class Opened:
    """One DRM descriptor held now: whose, which node, and its fdinfo (None: unreadable)."""

    pid: int
    start_time: int
    fd: int
    node: str
    fdinfo: str | None


@dataclass(frozen=True)
class Step:
    """What one step knows: every DRM descriptor of every known process, read now."""

    opened: tuple[Opened, ...]
    examined: int  # processes examined by this step's share of the pass
    complete: bool  # this step finished a pass
    passes: int  # complete passes since the search started
    listed: int  # processes /proc listed by the latest listing
    #: processes whose descriptors could not be read in the last complete pass (0 before
    #: the first): while above 0, DRM clients may be held unseen.
    unreadable: int


@dataclass
class _Partial:
    """A process the last step stopped part-way through: its descriptor directory, still
    open, and what it has shown so far."""

    pid: int
    start_time: int | None  # read when the step stops in it
    entries: Iterator[os.DirEntry[str]]
    close: Callable[[], None]
    found: list[tuple[int, str]]


class DrmSearch:
    """The search's state between steps (one step per read of the DRM back-end)."""

    def __init__(self, *, proc_root: str, counters: Counters,
                 max_processes: int = MAX_PROCESSES, max_seconds: float = MAX_SECONDS,
                 first_max_processes: int = FIRST_MAX_PROCESSES,
                 first_max_seconds: float = FIRST_MAX_SECONDS,
                 pass_every: float = PASS_EVERY,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._root = proc_root
        self._counters = counters
        self._budget = (max_processes, max_seconds)
        self._first_budget: tuple[int, float] | None = (first_max_processes, first_max_seconds)
        self._pass_every = pass_every
        self._clock = clock
        self._known: dict[int, Known] = {}
        self._next_pid = 0
        self._pass_started: float | None = None  # None: between passes
        self._last_start: float | None = None
        self._passes = 0
        self._unreadable = 0  # in the pass in progress
        self._last_unreadable = 0  # in the last complete pass
        self._listed = 0
        self._partial: _Partial | None = None
        self._self = os.getpid()

    @property
    def passes(self) -> int:
        return self._passes

    def step(self, nodes: Mapping[tuple[int, ...], str]) -> Step:
        """Examine the next share of the pass (`nodes`: file key -> node name, the DRM
        device nodes to look for), then read every known descriptor's fdinfo."""
        start = self._clock()
        max_processes, max_seconds = self._first_budget or self._budget
        self._first_budget = None
        if self._pass_started is None:
            if self._last_start is not None and start - self._last_start < self._pass_every:
                opened = [o for pid in sorted(self._known)
                          for o in self._reread(pid, False, nodes)]
                return Step(tuple(opened), 0, False, self._passes, self._listed,
                            self._last_unreadable)
            self._pass_started = self._last_start = start
        pids = self._listing()
        self._listed = len(pids)
        live = set(pids)
        self._known = {pid: k for pid, k in self._known.items() if pid in live}
        examined = 0
        complete = True
        fresh: set[int] = set()
        for pid in pids:
            if pid < self._next_pid or pid == self._self:
                continue
            if examined >= max_processes or (
                    examined and self._clock() - start >= max_seconds):
                self._next_pid = pid
                complete = False
                break
            examined += 1
            if not self._examine(pid, nodes, start + max_seconds):
                self._next_pid = pid  # out of time inside it: the next step goes on there
                complete = False
                break
            fresh.add(pid)
        if complete:
            self._drop_partial()  # its process has gone from the listing
            self._passes += 1
            self._next_pid = 0
            self._pass_started = None
            self._last_unreadable, self._unreadable = self._unreadable, 0
        opened = [o for pid in sorted(self._known)
                  for o in self._reread(pid, pid in fresh, nodes)]
        return Step(tuple(opened), examined, complete, self._passes, len(pids),
                    self._last_unreadable)

    def close(self) -> None:
        """Close the descriptor directory of a process a step stopped part-way through
        (the next step examines it from its first descriptor again)."""
        self._drop_partial()

    def _drop_partial(self) -> None:
        if self._partial is not None:
            self._partial.close()
            self._partial = None

    def _listing(self) -> list[int]:
        with self._counters.track("drm_list", proc_reads=1):
            try:
                names = os.listdir(self._root)
            except OSError:
                return []
        return sorted(int(n) for n in names if n.isascii() and n.isdigit() and len(n) <= 10)

    def _examine(self, pid: int, nodes: Mapping[tuple[int, ...], str], deadline: float) -> bool:
        """Look at `pid`'s descriptors, stat()ing each, from where the last step stopped in
        it (if it did, and it is still the same process); remember it when any is a DRM
        node. False when the clock passed `deadline` first: the directory is kept open for
        the next step, and what the last pass knew of `pid` stands until then."""
        reads = 0
        t0 = self._clock()
        try:
            partial, self._partial = self._partial, None
            if partial is not None and partial.pid == pid:
                reads += 1  # still the process whose table it has half read?
                if self._start_time(pid) != partial.start_time:
                    partial.close()
                    partial = None
            elif partial is not None:
                partial.close()  # its process is no longer listed
                partial = None
            if partial is None:
                reads += 1
                try:
                    listing = os.scandir(f"{self._root}/{pid}/fd")
                except (FileNotFoundError, ProcessLookupError):
                    self._known.pop(pid, None)  # gone since the listing
                    return True
                except OSError:
                    self._unreadable += 1  # not ours to read: its clients are not seen
                    self._known.pop(pid, None)
                    return True
                partial = _Partial(pid, None, listing, listing.close, [])
            done = 0
            try:
                for entry in partial.entries:
                    reads += self._check(pid, entry.name, nodes, partial.found)
                    done += 1
                    if done % CLOCK_EVERY == 0 and self._clock() >= deadline:
                        if partial.start_time is None:
                            reads += 1
                            partial.start_time = self._start_time(pid)
                        if partial.start_time is None:  # gone: nothing to go on with
                            break
                        self._partial = partial
                        return False
            except (FileNotFoundError, ProcessLookupError):
                pass  # it exited while its table was read: the stat below says so
            except OSError:
                partial.close()
                self._unreadable += 1
                self._known.pop(pid, None)
                return True
            partial.close()
            if not partial.found:
                self._known.pop(pid, None)
                return True
            reads += 1
            started = self._start_time(pid)
            if started is None:
                self._known.pop(pid, None)
            else:
                self._known[pid] = Known(started, tuple(sorted(partial.found)))
            return True
        finally:
            self._counters.add("drm_fd_search", seconds=self._clock() - t0, proc_reads=reads)

    def _check(self, pid: int, name: str, nodes: Mapping[tuple[int, ...], str],
               found: list[tuple[int, str]]) -> int:
        """stat() descriptor `name` of `pid` and add it to `found` when it is a DRM node;
        the reads it made (0: `name` is no descriptor number)."""
        if not (name.isascii() and name.isdigit() and len(name) <= 10):
            return 0
        try:
            st = os.stat(f"{self._root}/{pid}/fd/{name}")
        except OSError:
            return 1  # closed since the listing, or not ours to stat
        rdev = st.st_rdev if stat.S_ISCHR(st.st_mode) else None
        node = nodes.get(file_key(st.st_dev, st.st_ino, rdev))
        if node is not None:
            found.append((int(name), node))
        return 1

    def _start_time(self, pid: int) -> int | None:
        try:
            with open(f"{self._root}/{pid}/stat", encoding="utf-8", errors="replace") as fh:
                return parse_stat(fh.read(), uid=-1).start_time
        except (OSError, ValueError, IndexError):
            return None

    def _still_drm(self, pid: int, fd: int, nodes: Mapping[tuple[int, ...], str]) -> bool:
        try:
            st = os.stat(f"{self._root}/{pid}/fd/{fd}")
        except OSError:
            return False
        rdev = st.st_rdev if stat.S_ISCHR(st.st_mode) else None
        return file_key(st.st_dev, st.st_ino, rdev) in nodes

    def _reread(self, pid: int, fresh: bool,
                nodes: Mapping[tuple[int, ...], str]) -> list[Opened]:
        """The known descriptors of `pid` read now. Its identity is checked first (one stat
        read) unless this step examined it: a pid that names another process now is
        forgotten, and examined afresh when the pass reaches it. A descriptor whose fdinfo
        names no DRM driver is stat()ed again (one more read): its number may have been
        closed and reused for another file, which is no client."""
        known = self._known[pid]
        reads = 0
        t0 = self._clock()
        try:
            if not fresh:
                reads += 1
                if self._start_time(pid) != known.start_time:
                    del self._known[pid]
                    return []
            out = []
            kept = []
            for fd, node in known.fds:
                reads += 1
                try:
                    with open(f"{self._root}/{pid}/fdinfo/{fd}", encoding="utf-8",
                              errors="replace") as fh:
                        text: str | None = fh.read()
                except (FileNotFoundError, ProcessLookupError):
                    continue  # closed: no longer a client (a reused number is found anew)
                except OSError:
                    text = None  # held, but its stats cannot be read
                if text is None or "drm-driver:" not in text:
                    reads += 1
                    if not self._still_drm(pid, fd, nodes):
                        continue
                kept.append((fd, node))
                out.append(Opened(pid, known.start_time, fd, node, text))
            if kept:
                self._known[pid] = Known(known.start_time, tuple(kept))
            else:
                del self._known[pid]
            return out
        finally:
            self._counters.add("drm_fdinfo", seconds=self._clock() - t0, proc_reads=reads)
