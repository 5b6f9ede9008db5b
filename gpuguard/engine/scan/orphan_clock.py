"""Each orphan root's first sighting (orphan since), kept across exporter restarts.

`gpuguard_orphan_tree_age_seconds` counts from the first scan that saw a tree orphaned.
Kept only in memory, a restart (an upgrade) set every age back to 0: each firing
`GPUOrphanTree` (`age > 300`, `for: 1m`) resolved and fired again six minutes later,
notifying people twice. Here the sightings live next to the launcher memory
(`--state-dir`, `orphans.json`), in the same style: this boot's entries only (the boot
clock, on which they count, restarts with the machine), at most MAX_ENTRIES, written
whole and atomically (a temporary file, fsync, rename) when the set of roots changes,
never on a scan that changes nothing. A tree leaves the clock when a complete scan no
longer sees it orphaned (as before); a scan NVML could not finish forgets no one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from gpuguard.host.boot_rows import read_rows, write_rows

log = logging.getLogger("gpuguard.exporter")

ORPHAN_CLOCK_FILE = "orphans.json"  # in the exporter's state directory
#: The most roots kept (and written); beyond it the latest sightings are not kept.
MAX_ENTRIES = 4096
Key = tuple[int, int]  # root pid, root start time


class OrphanClock:
    """First sightings on the boot clock by root identity; used by the scan thread only."""

    def __init__(self, path: str | None = None, *, boot: str = "") -> None:
        self._path = path
        self._boot = boot
        self._since: dict[Key, float] = {}
        if path is not None and boot:
            self._since = self._load(path)

    def ages(self, seen: Iterable[Key], now: float, *, complete: bool = True) -> dict[Key, float]:
        """Each root in `seen` (orphans of this scan) with its age at `now` (boot clock),
        from its first sighting; `complete`: the scan saw every holder, so a root it did
        not see is no longer an orphan and is forgotten."""
        keys = list(dict.fromkeys(seen))
        before = set(self._since)
        for key in keys:
            if key not in self._since and len(self._since) < MAX_ENTRIES:
                self._since[key] = now
        if complete:
            wanted = set(keys)
            self._since = {k: v for k, v in self._since.items() if k in wanted}
        if set(self._since) != before:
            self._save()
        return {k: max(0.0, now - min(self._since.get(k, now), now)) for k in keys}

    def __len__(self) -> int:
        return len(self._since)

    def _load(self, path: str) -> dict[Key, float]:
        try:
            rows = read_rows(path, self._boot)
        except (OSError, ValueError) as exc:
            log.warning("orphan clock %s unreadable (%s): every orphan's age starts again",
                        path, exc)
            return {}
        out: dict[Key, float] = {}
        for row in rows[:MAX_ENTRIES]:
            try:
                pid, start, since = row
                if math.isfinite(float(since)):
                    out[(int(pid), int(start))] = float(since)
            except (TypeError, ValueError):
                continue
        return out

    def _save(self) -> None:
        if self._path is None or not self._boot:
            return
        rows = [[pid, start, since] for (pid, start), since in self._since.items()]
        try:
            write_rows(self._path, self._boot, rows)
        except OSError as exc:
            log.warning("cannot write orphan clock %s: %s (kept in memory)",
                        self._path, exc.strerror)
