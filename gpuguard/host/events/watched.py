"""The exits that matter, kept apart from the general ring: a fork storm cannot erase them.

The general ring (exit_store.py) keeps every exit, and any user's short-lived processes
push a launcher's record out of it (65,536 records: ~180 exits a second for 6 minutes,
which a busy build host makes alone) before the first delivery of an alert. So each
daemon publishes the pids whose exit matters: the exporter its GPU holders, their
ancestors and the session leaders of both (gpuguard/orphans/chain.py `chain_set`, which
also wakes its early rescans), the remediator the session ids of its holders' live chain
members, the only exits read as launcher evidence (`session_set`). The listener tests
each exit against that set (one frozenset lookup, the set swapped whole on publish) and
keeps a watched pid's latest exit here, where only other watched exits take room.

A record stays while its pid is in the published set, whatever its age: while a process
whose session id is that pid lives, the kernel gives the pid to no one else, so an exit
at or after that process's start can only be its leader's. A record whose pid left the
set is kept for the ring's retention, then dropped. Bounded by MAX_RECORDS; a record of a
still-watched pid dropped for room (impossible while the published set is smaller) is
counted (gpuguard_process_events_evicted_total{store="watched"}).

Room is made fairly: the exit event names no uid, so a publisher may charge each pid to
an owner (the uid of the holder whose chain named it), and a full store drops the oldest
record of the owner that holds the most, never another user's first: a user with many
GPU holders whose chains die (hundreds of them, 64 deep) evicts only their own records.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from gpuguard.host.events.exit_store import Exit, ExitStore, Row, split_exit_code

log = logging.getLogger("gpuguard.host.procevents")

#: Records kept at most: above any chain set a scan publishes (holders x chain depth x 2
#: for their session leaders), and ~3 MiB at worst.
MAX_RECORDS = 16384
#: The owner of a pid published without one (a plain set of pids).
UNCHARGED = -1


class WatchedExits:
    """The published chain set and the latest exit of each pid in it; thread-safe.

    `pids` is read without a lock by the listener's reader (a reference to a frozenset
    that publish() replaces, never mutates).
    """

    def __init__(self, *, retention: float, clock: Callable[[], float],
                 max_records: int = MAX_RECORDS) -> None:
        if max_records < 1 or retention <= 0:
            raise ValueError("max_records and retention must be positive")
        self.pids: frozenset[int] = frozenset()
        self.retention = retention
        self.max_records = max_records
        self._clock = clock
        self._lock = threading.Lock()
        self._owners: Mapping[int, int] = {}  # watched pid -> the uid charged for its record
        self._rows: dict[int, Row] = {}  # pid -> its latest exit; insertion = arrival order
        self._released: dict[int, None] = {}  # pids of held rows no longer watched, in order
        #: Held rows of watched pids by owner, each in arrival order: whom room is taken from.
        self._charged: dict[int, dict[int, None]] = {}
        self._charged_to: dict[int, int] = {}  # pid -> the owner its held row is charged to
        #: Records of still-watched pids dropped to make room: lost launcher evidence.
        self.evicted = 0
        self._last_warning = -float("inf")

    def publish(self, pids: Iterable[int] | Mapping[int, int],
                ring: ExitStore | None = None) -> None:
        """Watch `pids` from now on; a mapping charges each pid's record to its value (a
        uid: see _make_room), a plain iterable charges them all to UNCHARGED. A newly
        watched pid whose exit `ring` still holds (it died before this publish: a tree
        orphaned between two scans) has that record taken in, so nothing heard is lost
        between the scan and the publish: the reader adds to the ring before it reads the
        set, and this swaps the set before it reads the ring."""
        owners = dict(pids) if isinstance(pids, Mapping) else {}
        new = frozenset(p for p in pids if p > 1)
        old, self.pids = self.pids, new
        taken = []
        if ring is not None:
            for pid in new - old:
                found = ring.exit_of(pid, after=0)
                if found is not None:
                    taken.append((found.pid, found.exit_code, found.parent_pid or 0, found.at))
        with self._lock:
            self._owners = owners
            for pid in [p for p in self._rows if p not in new]:
                self._released.setdefault(pid, None)
            self._charged, self._charged_to = {}, {}
            for pid in self._rows:  # in arrival order
                if pid in new:
                    self._released.pop(pid, None)
                    self._charge(pid)
            self._add(taken)
            self._expire(self._clock())

    def add_rows(self, rows: list[Row]) -> None:
        """Record exits of watched pids (the reader has tested them against `pids`)."""
        with self._lock:
            self._add(rows)

    def exit_of(self, pid: int, *, after: float) -> Exit | None:
        """`pid`'s latest exit if it is at or after `after`; a pid no longer watched only
        within the retention, as the ring would."""
        with self._lock:
            row = self._rows.get(pid)
            if row is None or row[3] < after:
                return None
            if pid in self._released and row[3] < self._clock() - self.retention:
                return None
        code = row[1]
        signal, status = split_exit_code(code)
        return Exit(pid, code, signal, status, row[2] or None, row[3])

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)

    def _add(self, rows: Iterable[Row]) -> None:
        watched = self.pids
        for row in rows:
            pid = row[0]
            held = self._rows.get(pid)
            if held is not None and held[3] > row[3]:
                continue  # an older record of the same pid (the ring's copy, read late)
            self._rows.pop(pid, None)
            self._rows[pid] = row
            self._uncharge(pid)
            if pid not in watched:
                self._released.setdefault(pid, None)
            else:
                self._released.pop(pid, None)
                self._charge(pid)
        while len(self._rows) > self.max_records:
            self._make_room()

    def _charge(self, pid: int) -> None:
        """Count `pid`'s held row against its owner, as the newest of theirs."""
        owner = self._owners.get(pid, UNCHARGED)
        self._charged.setdefault(owner, {})[pid] = None
        self._charged_to[pid] = owner

    def _uncharge(self, pid: int) -> None:
        owner = self._charged_to.pop(pid, None)
        if owner is not None:
            charged = self._charged[owner]
            del charged[pid]
            if not charged:
                del self._charged[owner]

    def _make_room(self) -> None:
        """Drop the oldest released record, else the oldest record of the owner holding
        the most (counted: evidence the published set was too large to keep). Never the
        oldest of all: that is the first launcher to die, most likely another user's."""
        if self._released:
            pid = next(iter(self._released))
            del self._released[pid]
        else:
            owner = max(self._charged, key=lambda o: len(self._charged[o]))
            held = len(self._charged[owner])
            pid = next(iter(self._charged[owner]))
            self._uncharge(pid)
            self.evicted += 1
            self._warn(owner, held)
        del self._rows[pid]

    def _warn(self, owner: int, held: int) -> None:
        """Name whose evidence went, at most once a minute (the runbook reads it)."""
        now = time.monotonic()
        if now - self._last_warning >= 60.0:
            self._last_warning = now
            who = "pids published without an owner" if owner == UNCHARGED else f"uid {owner}"
            log.warning("watched exits: the store is full (%d records); dropped the oldest "
                        "record of %s, who held the most (%d): their GPU holders' chains "
                        "name more pids than it keeps", self.max_records, who, held)

    def _expire(self, now: float) -> None:
        """Released records past the retention go."""
        oldest = now - self.retention
        for pid in [p for p in self._released if self._rows[p][3] < oldest]:
            del self._released[pid]
            del self._rows[pid]
