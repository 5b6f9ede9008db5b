"""The process-event listener's memory of exits: a ring bounded by count and by age.

Flat arrays of about 20 bytes a record, reserved up front (65,536 records by default:
1.3 MiB), so it never grows past that with uptime. They are anonymous mappings, whose
pages the kernel hands out as records first reach them: a quiet host, which sees few
exits in the retention window, keeps only a few pages of it resident.
"""

from __future__ import annotations

import mmap
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from gpuguard.base.compat import StrEnum


class EvictionCause(StrEnum):
    """Why records left the store."""

    COUNT = "count"  # room for newer ones
    AGE = "age"  # older than retention


EVICTION_CAUSES: tuple[EvictionCause, ...] = tuple(EvictionCause)

Row = tuple[int, int, int, float]  # pid, exit_code, parent pid (0: unknown), at
_I32 = struct.Struct("=i")


@dataclass(frozen=True, slots=True)
class Exit:
    """One process's exit as the kernel reported it; `at` is Unix time."""

    pid: int
    exit_code: int  # the raw wait status
    signal: int | None  # the signal that killed it; None when it exited by itself
    status: int | None  # its exit status; None when a signal killed it
    parent_pid: int | None  # its parent (parent_tgid); None: reaped before the event was made
    at: float


def _zeroed(size: int) -> mmap.mmap:
    """`size` zero bytes that take memory only where written (an anonymous mapping)."""
    return mmap.mmap(-1, size)


def split_exit_code(code: int) -> tuple[int | None, int | None]:
    """(signal, status) of a wait status: killed when the low 7 bits are set."""
    sig = code & 0x7F
    if sig:
        return sig, None
    return None, (code >> 8) & 0xFF


class ExitStore:
    """Exits in a ring of fixed size, bounded by count and by age (oldest evicted first).

    Columns in flat arrays (a dict of objects would take ten times the memory). A query
    is rare (a launcher per orphan tree per scan) and finds a pid's latest record with
    one rfind over the packed pids.
    """

    def __init__(self, *, max_records: int, retention: float,
                 clock: Callable[[], float]) -> None:
        if max_records < 1 or retention <= 0:
            raise ValueError("max_records and retention must be positive")
        self.max_records = max_records
        self.retention = retention
        self._clock = clock
        self._lock = threading.Lock()
        self._pids = _zeroed(4 * max_records)  # native i32, searched with rfind
        self._codes = memoryview(_zeroed(4 * max_records)).cast("I")
        self._parents = memoryview(_zeroed(4 * max_records)).cast("i")
        self._at = memoryview(_zeroed(8 * max_records)).cast("d")
        self._next = 0  # records ever added; record n lives in slot n % max_records
        self._first = 0  # the oldest record still held
        #: Records dropped to make room (count) or for their age: what the launcher
        #: memory (gpuguard/host/launcher_memory.py) answers for after they are gone.
        self.evicted = dict.fromkeys(EVICTION_CAUSES, 0)

    def add(self, *exits: Exit) -> None:
        self.add_rows([(e.pid, e.exit_code, e.parent_pid or 0, e.at) for e in exits])

    def add_rows(self, rows: list[Row]) -> None:
        """Record (pid, exit_code, parent pid or 0, at) rows: the reader's form, no objects."""
        with self._lock:
            size, n = self.max_records, self._next
            pids, codes, parents, ats, pack = (self._pids, self._codes, self._parents,
                                               self._at, _I32.pack_into)
            for pid, code, parent, at in rows:
                slot = n % size
                pack(pids, 4 * slot, pid)
                codes[slot], parents[slot], ats[slot] = code, parent, at
                n += 1
            self._next = n
            if n - size > self._first:
                self.evicted[EvictionCause.COUNT] += n - size - self._first
                self._first = n - size
            self._evict(self._clock())

    def exit_of(self, pid: int, *, after: float) -> Exit | None:
        """The latest record of `pid` if it is at or after `after`: if the latest is older,
        every earlier one is too."""
        with self._lock:
            now = self._clock()
            self._evict(now)
            slot = self._latest_slot(pid)
            # Eviction goes in arrival order; a record can be older than one before it.
            if slot is None or self._at[slot] < max(after, now - self.retention):
                return None
            return self._record(slot)

    def records(self) -> list[Exit]:
        """Every record still held, oldest first."""
        with self._lock:
            self._evict(self._clock())
            size = self.max_records
            return [self._record(n % size) for n in range(self._first, self._next)]

    def evictions(self) -> dict[EvictionCause, int]:
        """Records dropped since the store was made, by cause."""
        with self._lock:
            return dict(self.evicted)

    def __len__(self) -> int:
        with self._lock:
            return self._next - self._first

    def _evict(self, now: float) -> None:
        """Drop records older than retention from the old end (arrival order)."""
        oldest, size = now - self.retention, self.max_records
        first = self._first
        while first < self._next and self._at[first % size] < oldest:
            first += 1
        self.evicted[EvictionCause.AGE] += first - self._first
        self._first = first

    def _latest_slot(self, pid: int) -> int | None:
        held = self._next - self._first
        if held <= 0:
            return None
        size = self.max_records
        start, stop = self._first % size, self._next % size or size
        # Newest first: [0, stop) then [start, size) when the held range wraps.
        segments = [(start, stop)] if start < stop else [(0, stop), (start, size)]
        needle = _I32.pack(pid)
        for lo, hi in segments:
            end = 4 * hi
            while True:
                at = self._pids.rfind(needle, 4 * lo, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    return at // 4
                end = at + 3  # straddles two pids: look further back
        return None

    def _record(self, slot: int) -> Exit:
        code = self._codes[slot]
        signal, status = split_exit_code(code)
        return Exit(_I32.unpack_from(self._pids, 4 * slot)[0], code, signal, status,
                    self._parents[slot] or None, self._at[slot])
