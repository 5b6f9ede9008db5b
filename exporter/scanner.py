"""The background scan loop: NVML holders -> classify() -> immutable Snapshot.

HTTP never waits for a scan: scrapes render the last Snapshot, which is
replaced atomically (one reference assignment) when a scan finishes.
"""

from __future__ import annotations

import logging
import pwd
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuguard.exporter.classify import ORPHAN, UNKNOWN, Rules, Tree, classify
from gpuguard.exporter.counters import COUNTERS, Counters
from gpuguard.exporter.nvml import Nvml, NvmlReading
from gpuguard.exporter.periodic import Periodic
from gpuguard.exporter.procfs import ProcessView

log = logging.getLogger(__name__)

#: Stages of gpuguard_scan_errors_total; fixed so every series exists from the start.
ERROR_STAGES = ("nvml_init", "nvml_device", "nvml_processes", "procfs", "scan")


@dataclass(frozen=True)
class OrphanInfo:
    """What the scanner adds to an orphan tree: how long, and how big."""

    first_seen: float  # wall-clock time of the first scan that saw it orphaned
    age_seconds: float
    processes: int  # the root and all its descendants


@dataclass(frozen=True)
class Snapshot:
    taken_at: float  # wall-clock end of the scan
    duration_seconds: float
    reading: NvmlReading
    trees: tuple[Tree, ...]
    orphans: dict[tuple[int, int], OrphanInfo] = field(default_factory=dict)
    proc_reads: int = 0  # /proc reads made by this scan
    errors: tuple[tuple[str, str], ...] = ()


def user_name(uid: int | None, _cache: dict[int, str] = {}) -> str:  # noqa: B006
    """Name for a uid, cached: /etc/passwd lookups are cheap but not free."""
    if uid is None:
        return ""
    if uid not in _cache:
        try:
            _cache[uid] = pwd.getpwuid(uid).pw_name
        except KeyError:
            _cache[uid] = str(uid)
    return _cache[uid]


class Scanner:
    """Runs scans; keeps the orphan first-seen clock and cumulative scan counters."""

    def __init__(
        self,
        *,
        rules: Rules,
        nvml: Nvml,
        view: ProcessView | None = None,
        counters: Counters = COUNTERS,
        interval: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.rules = rules
        self.nvml = nvml
        self.counters = counters
        self.view = view if view is not None else ProcessView(counters=counters)
        self.interval = interval
        self._clock = clock
        self._first_seen: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()
        self._latest: Snapshot | None = None
        self.scans_total = 0
        self.errors_total = dict.fromkeys(ERROR_STAGES, 0)
        self._loop: Periodic | None = None

    @property
    def latest(self) -> Snapshot | None:
        return self._latest

    def scan_once(self) -> Snapshot:
        start = time.perf_counter()
        reads_before = self.counters.proc_reads()
        errors: list[tuple[str, str]] = []
        try:
            reading = self.nvml.read()
        except Exception as exc:  # Nvml.read reports failures itself; this is the last net
            log.exception("NVML read failed")
            reading = NvmlReading(False, None, (), (), (("scan", f"NVML: {exc}"),))
        errors.extend(reading.errors)
        trees: list[Tree] = []
        orphans: dict[tuple[int, int], OrphanInfo] = {}
        now = self._clock()
        try:
            self.view.begin_scan()
            trees = classify(reading.holders, self.view, self.rules)
            for tree in trees:
                if tree.verdict == UNKNOWN and tree.reason in ("not-visible", "unreadable"):
                    errors.append(("procfs", f"holder {tree.root_pid}: {tree.evidence.detail}"))
            seen: set[tuple[int, int]] = set()
            for tree in trees:
                if tree.verdict != ORPHAN or tree.root is None:
                    continue
                key = tree.root.identity
                seen.add(key)
                first = self._first_seen.setdefault(key, now)
                orphans[key] = OrphanInfo(first, max(0.0, now - first), len(tree.members))
            self._first_seen = {k: v for k, v in self._first_seen.items() if k in seen}
        except Exception as exc:  # a scan bug must not kill the loop; it is counted instead
            log.exception("scan failed")
            errors.append(("scan", f"{type(exc).__name__}: {exc}"))
        snapshot = Snapshot(
            taken_at=self._clock(),
            duration_seconds=time.perf_counter() - start,
            reading=reading,
            trees=tuple(trees),
            orphans=orphans,
            proc_reads=self.counters.proc_reads() - reads_before,
            errors=tuple(errors),
        )
        with self._lock:
            self.scans_total += 1
            for stage, _ in errors:
                self.errors_total[stage] = self.errors_total.get(stage, 0) + 1
            self._latest = snapshot
        return snapshot

    def counts(self) -> tuple[int, dict[str, int]]:
        with self._lock:
            return self.scans_total, dict(self.errors_total)

    # -- background loop -------------------------------------------------------------

    def start(self) -> None:
        self._loop = Periodic("gpuguard-scanner", self.interval, self.scan_once)
        self._loop.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None:
            self._loop.stop(timeout)

    def alive(self) -> bool:
        return self._loop is not None and self._loop.alive()
