"""Launcher SIGKILL -> orphan on /metrics: event-driven rescans against the interval alone.

Four exporters over the same fake GPU and the same 50 trees (launcher bash -> sh -> a
`sleep` GPU holder), side by side in one run: this checkout and BASELINE (issue 49's
base, before event-driven rescans; extracted with `git archive` into the temp dir), each
at --scan-interval 5 and 30. In order:

1. idle: each exporter's CPU over IDLE_S with the trees running and nothing scraped;
2. unrelated exits: ~1,000 `/bin/true` a second for STORM_S (none on a holder's chain):
   the scans each exporter ran meanwhile, and this checkout's early scans;
3. kills: the 50 launchers SIGKILLed one every KILL_STEP_S (wall clock taken just before
   each kill); a poller per exporter scrapes /metrics every POLL_S and, from the first
   response that shows the holder as `launcher-killed`, takes that snapshot's
   `gpuguard_last_scan_timestamp_seconds` (the end of the scan that published it): the
   latency is exact whatever the poll's pace, or an upper bound where a later scan
   replaced the first one before the poll; polling slowly keeps the measurement from
   loading the machine it measures;
4. chain storm: every orphan's sh and holder SIGKILLed, one every CHAIN_STEP_S (100 exits
   of watched pids): this checkout's early scans against the bound, 1/MIN_GAP_S a second.

    .venv/bin/python benchmarks/event_latency.py
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    PACKAGE_PATHS,
    REPO,
    FakeNvml,
    Result,
    Table,
    cpu_seconds,
    extract_commit,
    percentile,
    run_benchmark,
)
from benchmarks.procevents_cost import spawn_load  # noqa: E402
from gpuguard.base.periodic import MIN_GAP_S, SETTLE_S  # noqa: E402
from tests.support.proctree import Tree, Trees, reap_zombie_children, wait_for  # noqa: E402
from tests.support.servers import ServerProcess  # noqa: E402

BASELINE = "c6e6b9b"  # issue 49's base: scans at the interval only
LAUNCHERS = 50
INTERVALS = (5.0, 30.0)
IDLE_S = 20.0
STORM_S, STORM_RATE = 5.0, 1000
KILL_STEP_S = 0.6  # above MIN_GAP_S: each kill is its own early scan
CHAIN_STEP_S = 0.02
POLL_S, SLOW_POLL_S = 0.1, 0.25
GIB = 2**30
#: bash (the launcher, a session leader) -> sh -> sleep, the GPU holder.
TREE = "sh -c 'sleep 3600 </dev/null >/dev/null 2>&1 & echo $! > {dir}/worker; wait' & " \
       "echo $! > {dir}/sh; wait"
KILLED = re.compile(r'^gpuguard_gpu_process_info\{(?=[^}]*reason="launcher-killed")'
                    r'[^}]*[{,]?\bpid="(\d+)"', re.M)
LAST_SCAN = re.compile(r"^gpuguard_last_scan_timestamp_seconds (\S+)$", re.M)
SCAN_TOOK = re.compile(r"^gpuguard_scan_duration_seconds (\S+)$", re.M)
SAMPLE = re.compile(r"^(gpuguard_[a-z_]+)(\{[^}]*\})? (\S+)$", re.M)


def extract_baseline(dest: Path) -> Path | None:
    """The package at BASELINE (harness.extract_commit)."""
    return extract_commit(BASELINE, dest, *PACKAGE_PATHS)


class Watched:
    """One exporter, and the first time each holder showed as launcher-killed."""

    def __init__(self, label: str, code: Path, interval: float, fake: FakeNvml,
                 poll: float) -> None:
        self.label, self.interval, self.poll = label, interval, poll
        self.server = ServerProcess("gpuguard.exporter", ["--scan-interval", f"{interval:g}"],
                                    env={**fake.env(), "PYTHONPATH": str(code)}, cwd=code)
        self.url = f"http://127.0.0.1:{self.server.port}/metrics"
        self.seen: dict[int, float] = {}  # holder -> the end of the scan that showed it
        self.took: dict[int, float] = {}  # holder -> how long that scan took
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def text(self) -> str:
        return requests.get(self.url, timeout=10).text

    def value(self, name: str, labels: str = "") -> float | None:
        """The one sample of `name` whose label text contains `labels` (None: absent)."""
        for found, lbls, val in SAMPLE.findall(self.text()):
            if found == name and labels in lbls:
                return float(val)
        return None

    def ready(self) -> bool:
        """Listening to exits, with every holder listed."""
        text = self.text()
        return ("\ngpuguard_process_events_up 1.0" in text
                and len(re.findall(r"^gpuguard_gpu_process_info\{", text, re.M)) == LAUNCHERS)

    def start_polling(self) -> None:
        def poll() -> None:
            session = requests.Session()
            while not self._stop.is_set():
                try:
                    body = session.get(self.url, timeout=10).text
                except requests.RequestException:
                    continue
                stamp, took = LAST_SCAN.search(body), SCAN_TOOK.search(body)
                if stamp is None or took is None:
                    continue
                for pid in map(int, KILLED.findall(body)):
                    if pid not in self.seen:
                        self.seen[pid] = float(stamp.group(1))
                        self.took[pid] = float(took.group(1))
                self._stop.wait(self.poll)  # the poll's pace, not a synchronisation

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def stop_polling(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def stop(self) -> None:
        self.stop_polling()
        self.server.stop()


def body(result: Result, tmp: Path) -> None:
    global LAUNCHERS, IDLE_S, STORM_S
    if result.short:  # CI's run: fewer launchers, shorter windows, no baseline
        LAUNCHERS, IDLE_S, STORM_S = 10, 3.0, 2.0
    fake = FakeNvml(tmp)
    fake.world.add_gpu(0)
    baseline = None if result.short else extract_baseline(tmp / "baseline")
    trees = Trees(tmp / "trees")
    spawned = [trees.spawn(TREE) for _ in range(LAUNCHERS)]
    holders = [(t, t.pid("worker"), t.pid("sh")) for t in spawned]
    for _, worker, _ in holders:
        fake.world.add_process(0, worker, GIB)
    codes = [("this checkout", REPO, POLL_S)]
    if baseline is not None:
        codes.append((BASELINE, baseline, SLOW_POLL_S))
    exporters = [Watched(f"{label} @{interval:g}s", code, interval, fake, poll)
                 for interval in INTERVALS for label, code, poll in codes]
    try:
        for exp in exporters:
            wait_for(exp.ready, timeout=60, what=f"{exp.label}: every holder listed")
        measure(result, exporters, holders)
    finally:
        for exp in exporters:
            exp.stop()
        trees.cleanup()


def counters(exp: Watched) -> tuple[float, float | None, float]:
    return (exp.value("gpuguard_scans_total") or 0.0, exp.value("gpuguard_scans_early_total"),
            exp.value("gpuguard_process_events_total", 'kind="exit"') or 0.0)


def measure(result: Result, exporters: list[Watched],
            holders: list[tuple[Tree, int, int]]) -> None:
    new = [e for e in exporters if e.label.startswith("this checkout")]
    # 1. idle
    before = {e.label: cpu_seconds(e.server.proc.pid) for e in exporters}
    time.sleep(IDLE_S)  # the measured window
    idle = {e.label: (cpu_seconds(e.server.proc.pid) - before[e.label]) / IDLE_S * 100
            for e in exporters}
    print(f"idle CPU %: {idle}", flush=True)
    # 2. unrelated exits
    first = {e.label: counters(e) for e in exporters}
    made = spawn_load(STORM_S, STORM_RATE)
    time.sleep(MIN_GAP_S * 2)  # any early scan the storm caused would have started
    storm = {}
    for e in exporters:
        scans, early, exits = counters(e)
        s0, e0, x0 = first[e.label]
        storm[e.label] = (scans - s0, None if early is None else early - (e0 or 0.0), exits - x0)
    print(f"unrelated storm ({made} exits): {storm}", flush=True)
    # 3. kills
    for e in exporters:
        e.start_polling()
    killed: dict[int, float] = {}
    for tree, worker, _ in holders:
        killed[worker] = time.time()  # the scans' timestamps are wall-clock too
        os.kill(tree.launcher.pid, signal.SIGKILL)
        tree.launcher.wait(timeout=10)
        time.sleep(KILL_STEP_S)  # the kills' pace
    slowest = max(e.interval for e in exporters)
    wait_for(lambda: all(len(e.seen) >= LAUNCHERS for e in exporters), timeout=slowest + 15,
             interval=0.2, what="every orphan on every exporter")
    for e in exporters:
        e.stop_polling()
    latencies = {e.label: [e.seen[w] - at for w, at in killed.items() if w in e.seen]
                 for e in exporters}
    took = {e.label: list(e.took.values()) for e in exporters}
    # 4. chain storm
    chain_before = {e.label: counters(e) for e in new}
    began = time.monotonic()
    for _, worker, sh in holders:
        for pid in (sh, worker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            time.sleep(CHAIN_STEP_S)  # the storm's pace
        reap_zombie_children()
    lasted = time.monotonic() - began
    time.sleep(2 * MIN_GAP_S + 0.1)  # the last early scan is due by then
    chain = {e.label: (counters(e)[1] or 0.0) - (chain_before[e.label][1] or 0.0) for e in new}
    report(result, exporters, idle, storm, made, latencies, took, chain, lasted)


def storm_bound(lasted: float) -> float:
    """Early scans a storm of `lasted` seconds may cost: one every MIN_GAP_S over the storm
    and the one due after its last exit (MIN_GAP_S + SETTLE_S later), + 1."""
    return (lasted + MIN_GAP_S + SETTLE_S) / MIN_GAP_S + 1


def report(result: Result, exporters: list[Watched], idle: dict[str, float],
           storm: dict[str, tuple[float, float | None, float]], made: int,
           latencies: dict[str, list[float]], took: dict[str, list[float]],
           chain: dict[str, float], lasted: float) -> None:
    table = Table(f"Launcher SIGKILL -> orphan on /metrics, {LAUNCHERS} launchers",
                  ["exporter", "orphans seen", "p50 ms", "p99 ms", "max ms",
                   "p50 ms of it in the scan itself",
                   "idle CPU % of a core", f"scans in {STORM_S:g} s of unrelated exits",
                   "of them early"])
    for e in exporters:
        lat = latencies[e.label]
        scans, early, _ = storm[e.label]
        table.add(e.label, len(lat), percentile(lat, 50) * 1000, percentile(lat, 99) * 1000,
                  max(lat) * 1000 if lat else float("nan"),
                  percentile(took[e.label], 50) * 1000, idle[e.label], scans,
                  "n/a" if early is None else early)
    table.notes += [
        f"baseline {BASELINE}: issue 49's base (a scan every interval, nothing else).",
        f"latency: SIGKILL to the end of the scan that first published the holder as "
        f"launcher-killed (its gpuguard_last_scan_timestamp_seconds, read by polls every "
        f"{POLL_S * 1000:g} ms, baseline {SLOW_POLL_S * 1000:g} ms); kills "
        f"{KILL_STEP_S:g} s apart.",
        f"unrelated exits: {made:,} `/bin/true` in {STORM_S:g} s (target rate "
        f"{STORM_RATE:,}/s); scans counted are all scans, the regular ones included.",
        f"chain storm: {2 * LAUNCHERS} exits of watched pids (every orphan's sh and holder) "
        f"over {lasted:.2f} s: early scans "
        + ", ".join(f"{k}: {v:g}" for k, v in chain.items())
        + f"; bound {storm_bound(lasted):.1f} (one per {MIN_GAP_S * 1000:g} ms over the "
        f"storm and the scan after it, + 1).",
    ]
    result.tables.append(table)
    by = {e.label: e for e in exporters}
    for interval in INTERVALS:
        label = f"this checkout @{interval:g}s"
        lat = latencies[label]
        p50, p99 = percentile(lat, 50), percentile(lat, 99)
        complete = len(lat) == LAUNCHERS
        result.target(f"p50 @{interval:g}s", f"{p50 * 1000:.0f} ms", "<= 100 ms",
                      complete and p50 <= 0.1, absolute=True)
        result.target(f"p99 @{interval:g}s", f"{p99 * 1000:.0f} ms", "<= 1,000 ms",
                      complete and p99 <= 1.0, absolute=True)
        old = f"{BASELINE} @{interval:g}s"
        if old in by:
            ratio = idle[label] / idle[old] if idle[old] > 0 else float("nan")
            result.target(f"idle CPU @{interval:g}s vs {BASELINE}",
                          f"{idle[label]:.3f}% vs {idle[old]:.3f}% ({ratio:.2f}x)",
                          "within noise (<= 1.5x or +0.05 points)",
                          idle[label] <= max(1.5 * idle[old], idle[old] + 0.05),
                          absolute=True)
        early = storm[label][1]
        result.target(f"early scans from {made:,} unrelated exits @{interval:g}s",
                      f"{early:g}" if early is not None else "n/a", "0", early == 0)
        result.target(f"early scans in the chain storm @{interval:g}s", f"{chain[label]:g}",
                      f"<= {storm_bound(lasted):.1f} (4/s)",
                      chain[label] <= storm_bound(lasted))


if __name__ == "__main__":
    sys.exit(run_benchmark("event_latency", body))
