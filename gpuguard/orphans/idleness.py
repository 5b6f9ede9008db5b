"""How long each GPU holder has gone without using an SM: a pure clock over NVML's samples.

NVML keeps per-process utilization samples for a few seconds only, and only for
processes that used something; so idleness is not read, it is observed: a holder is
idle since the later of when this observer first saw it and when a read last found it
busy. A read that cannot say (MIG, NOT_SUPPORTED, an error) makes the holder's idleness
unknown and restarts its clock: what happened while nobody could look is not idleness.
Keyed by process identity (pid, start time) and GPU; a holder that leaves the holder
list leaves the book, so it is bounded by the holders of the latest read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: (pid, start_time, GPU uuid): one process on one GPU.
HoldingKey = tuple[int, int, str]


@dataclass(frozen=True)
class UseSighting:
    """One holder on one GPU at one read: busy (smUtil > 0 in a sample since the previous
    read), not busy, or None when NVML could not say."""

    pid: int
    start_time: int
    gpu_uuid: str
    busy: bool | None

    @property
    def key(self) -> HoldingKey:
        return (self.pid, self.start_time, self.gpu_uuid)


@dataclass(frozen=True)
class IdleEntry:
    """What the observer knows of one holding; times on the observer's clock."""

    first_seen: float  # first read that saw it (since NVML last could not say)
    last_busy: float | None  # the last read that found it busy
    known: bool  # the latest read could say


@dataclass(frozen=True)
class IdleBook:
    """Every current holding's entry, and when the read that made them was taken."""

    entries: Mapping[HoldingKey, IdleEntry] = field(default_factory=dict)
    read_at: float | None = None

    def idle_seconds(self, key: HoldingKey, now: float) -> float | None:
        """now - max(first_seen, last_busy); None when unknown or never seen."""
        entry = self.entries.get(key)
        if entry is None or not entry.known:
            return None
        since = entry.first_seen if entry.last_busy is None else max(entry.first_seen,
                                                                     entry.last_busy)
        return max(0.0, now - since)

    def process_idle_seconds(self, pid: int, start_time: int, now: float) -> float | None:
        """The least idle of one process's holdings (any GPU it uses keeps it busy); None
        when any of them is unknown, or it has none."""
        values = [self.idle_seconds(k, now) for k in self.entries
                  if k[0] == pid and k[1] == start_time]
        if not values or any(v is None for v in values):
            return None
        return min(v for v in values if v is not None)

    def watched_seconds(self, key: HoldingKey, now: float) -> float | None:
        """How long the observer has been able to look at this holding, without a gap."""
        entry = self.entries.get(key)
        if entry is None or not entry.known:
            return None
        return max(0.0, now - entry.first_seen)


def observe(book: IdleBook, sightings: Iterable[UseSighting], now: float, *,
            max_gap: float | None = None) -> IdleBook:
    """The book after one read: holdings not sighted are dropped (bounded by the holder
    list); a busy sighting moves last_busy to `now` (the read, not the sample's own
    timestamp: never older than the truth, and on the observer's clock); an unknown one
    restarts the entry at `now`. A read more than `max_gap` seconds after the previous
    one restarts every entry: NVML keeps samples for seconds only, so what a holder did
    while the observer was not reading (stalled, stopped, a VM paused) is not idleness."""
    gap = max_gap is not None and book.read_at is not None and now - book.read_at > max_gap
    entries: dict[HoldingKey, IdleEntry] = {}
    for s in sightings:
        before = None if gap else book.entries.get(s.key)
        if s.busy is None:
            entries[s.key] = IdleEntry(first_seen=now, last_busy=None, known=False)
        elif before is None or not before.known:
            entries[s.key] = IdleEntry(first_seen=now, last_busy=now if s.busy else None,
                                       known=True)
        else:
            entries[s.key] = IdleEntry(first_seen=before.first_seen,
                                       last_busy=now if s.busy else before.last_busy,
                                       known=True)
    return IdleBook(entries, read_at=now)


def sightings_of(holders: Iterable[tuple[int, int | None, str]],
                 busy_by_gpu: Mapping[str, frozenset[int] | None]) -> list[UseSighting]:
    """One read's sightings: each (pid, start_time, GPU uuid) holder against its GPU's
    busy pids (None: NVML could not say); a holder whose start time is unknown (not in
    /proc) has no identity and is left out."""
    out: list[UseSighting] = []
    for pid, start_time, uuid in holders:
        if start_time is None:
            continue
        busy = busy_by_gpu.get(uuid)
        out.append(UseSighting(pid, start_time, uuid, None if busy is None else pid in busy))
    return out
