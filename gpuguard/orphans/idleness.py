"""How long each GPU holder has gone without using the GPU: a pure clock over NVML's samples.

NVML keeps per-process utilization samples for a few seconds only, and only for
processes that used something; so idleness is not read, it is observed: a holder is
idle since the later of when this observer first saw it and when a read last found it
busy (any of SM, memory controller, encoder or decoder use above 0). A read that cannot
say (MIG, NOT_SUPPORTED, an error, a wall-clock step) makes the holder's idleness unknown
and restarts its clock: what happened while nobody could look is not idleness. Keyed by
process identity (pid, start time) and GPU; a holder that leaves the holder list leaves
the book, so it is bounded by the holders of the latest read.

NVML answers the samples newer than a mark on the wall clock it stamps them with
(`lastSeenTimeStamp`), so a step of that clock can hide every new sample behind the mark:
`SampleMark` ties the mark to the wall time of the read that left it, and a step voids it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: (pid, start_time, GPU uuid): one process on one GPU.
HoldingKey = tuple[int, int, str]


#: How far the wall clock may move against the boot clock between two reads before a
#: reader calls it a step. NTP slews at most 500 ppm (7.5 ms over a 15 s period); a step
#: back smaller than this hides a busy holder's samples for less than one read period.
STEP_TOLERANCE_SECONDS = 0.25


@dataclass(frozen=True)
class SampleMark:
    """Where one GPU's next utilization read starts: NVML's `lastSeenTimeStamp`
    (`since_us`, microseconds on the wall clock NVML stamps samples with), and the wall
    clock's offset from the boot clock at the read that left it."""

    since_us: int
    wall_minus_boot: float

    def stepped(self, wall: float, boot: float) -> bool:
        """Whether the wall clock stepped since this mark's read: the wall-minus-boot
        offset moved by more than the tolerance, or the mark is ahead of the wall clock.
        NVML's answer from such a mark means nothing: after a step back every new sample
        is older than the mark, and NOT_FOUND would read as "no use"."""
        return (abs((wall - boot) - self.wall_minus_boot) > STEP_TOLERANCE_SECONDS
                or self.since_us > (wall + STEP_TOLERANCE_SECONDS) * 1_000_000)


def rebased_mark(wall: float, boot: float) -> SampleMark:
    """The mark after a step: the new wall time, so samples stamped after it are seen."""
    return SampleMark(int(wall * 1_000_000), wall - boot)


def next_mark(since_us: int, stamps: Iterable[int], wall: float, boot: float) -> SampleMark:
    """The mark after a read that answered (`stamps`: its samples' timestamps; none for
    NOT_FOUND): the newest stamp, never past the wall time read after the call. A sample
    stamped in the future is asked for again (and counts as use) until the clock passes
    it, rather than hiding every sample stamped before it."""
    newest = max(since_us, max(stamps, default=since_us))
    return SampleMark(min(newest, int(wall * 1_000_000)), wall - boot)


@dataclass(frozen=True)
class UseSighting:
    """One holder on one GPU at one read: busy (a sample since the previous read with SM,
    memory-controller, encoder or decoder use), not busy, or None when NVML could not
    say."""

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
