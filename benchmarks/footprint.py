"""The exporter's own CPU and memory on a busy host, at two scan intervals side by side.

8 fake GPUs, 64 GPU-holding sleeping processes (16 trees of 4, 6 trees
orphaned), 5,000 unrelated sleeping processes. Two real exporters run at the
same time over the same window, one with --scan-interval 5 (the default) and
one with --scan-interval 1, each scraped every 15 s like Prometheus. CPU is
utime + stime from /proc/PID/stat over the window (start-up excluded).

    .venv/bin/python benchmarks/footprint.py
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    FakeNvml,
    Result,
    Sleepers,
    Table,
    cpu_seconds,
    host_process_count,
    hwm_mib,
    rss_mib,
    run_benchmark,
    spawn_gpu_trees,
)

GPUS = 8
TREES, PER_TREE, ORPHANED = 16, 4, 6
UNRELATED = 5000
WINDOW_S = 60.0
SCRAPE_EVERY_S = 15.0
INTERVALS = (5.0, 1.0)
CPU_TARGET_PCT = 1.0
#: --short: fewer unrelated processes and a 10 s window scraped every 5 s.
SHORT_UNRELATED, SHORT_WINDOW_S, SHORT_SCRAPE_EVERY_S = 500, 10.0, 5.0

_SAMPLE = re.compile(r"^(gpuguard_scans_total|gpuguard_orphan_trees|"
                     r"gpuguard_scan_duration_seconds|"
                     r"gpuguard_inspector_proc_reads_total\{callsite=\"\w+\"\}) (\S+)$",
                     re.MULTILINE)


def sample(url: str) -> dict[str, float]:
    """One scrape like Prometheus's; returns the few samples we report."""
    resp = requests.get(url, timeout=10)
    resp.raise_for_status()
    out: dict[str, float] = {"proc_reads": 0.0}
    for name, value in _SAMPLE.findall(resp.text):
        if name.startswith("gpuguard_inspector_proc_reads_total"):
            out["proc_reads"] += float(value)
        else:
            out[name] = float(value)
    return out


def body(result: Result, tmp: Path) -> None:
    from tests.support.proctree import Trees, wait_for
    from tests.support.servers import Exporter

    fake = FakeNvml(tmp)
    for index in range(GPUS):
        fake.world.add_gpu(index)
    trees = Trees(tmp / "trees")
    crowd: Sleepers | None = None
    exporters: dict[float, Exporter] = {}
    try:
        holders = spawn_gpu_trees(trees, fake.world, count=TREES, per_tree=PER_TREE,
                                  orphaned=ORPHANED, gpus=GPUS)
        unrelated = result.pick(UNRELATED, SHORT_UNRELATED)
        window_s = result.pick(WINDOW_S, SHORT_WINDOW_S)
        every_s = result.pick(SCRAPE_EVERY_S, SHORT_SCRAPE_EVERY_S)
        crowd = Sleepers(unrelated)
        host_procs = host_process_count()
        for interval in INTERVALS:
            exporters[interval] = Exporter(env=fake.env(), scan_interval=interval)
        urls = {i: f"{e.url}/metrics" for i, e in exporters.items()}
        for url in urls.values():
            wait_for(lambda u=url: sample(u).get("gpuguard_orphan_trees") == ORPHANED,
                     timeout=30, interval=0.25, what=f"{ORPHANED} orphan trees at {url}")
        time.sleep(2.0)  # let start-up settle; it is not part of the window

        pids = {i: e.proc.pid for i, e in exporters.items()}
        cpu0 = {i: cpu_seconds(p) for i, p in pids.items()}
        first = {i: sample(u) for i, u in urls.items()}  # the window's first scrape
        start = time.monotonic()
        scrapes = 1
        print(f"  measuring {window_s:.0f} s window ({host_procs:,} host processes)", flush=True)
        while True:
            due = start + scrapes * every_s
            if due >= start + window_s:
                break
            time.sleep(max(0.0, due - time.monotonic()))
            for url in urls.values():
                sample(url)
            scrapes += 1
        time.sleep(max(0.0, start + window_s - time.monotonic()))
        window = time.monotonic() - start
        cpu1 = {i: cpu_seconds(p) for i, p in pids.items()}
        last = {i: sample(u) for i, u in urls.items()}

        table = Table(
            f"Exporter footprint: {GPUS} GPUs, {TREES * PER_TREE} holders ({ORPHANED} of "
            f"{TREES} trees orphaned), {unrelated:,} unrelated processes, {window:.0f} s window",
            ["--scan-interval", "scans in window", "CPU s in window", "CPU s per hour",
             "% of one core", "CPU ms per scan", "last scan duration ms", "/proc reads per scan",
             "RSS MiB", "peak RSS MiB"])
        for interval in INTERVALS:
            cpu = cpu1[interval] - cpu0[interval]
            scans = last[interval]["gpuguard_scans_total"] - first[interval][
                "gpuguard_scans_total"]
            reads = last[interval]["proc_reads"] - first[interval]["proc_reads"]
            pct = 100 * cpu / window
            table.add(f"{interval:g} s", int(scans), cpu, cpu / window * 3600, f"{pct:.2f}%",
                      1000 * cpu / scans if scans else float("nan"),
                      1000 * last[interval]["gpuguard_scan_duration_seconds"],
                      reads / scans if scans else float("nan"),
                      rss_mib(pids[interval]), hwm_mib(pids[interval]))
            if interval == INTERVALS[0]:
                result.target(f"CPU at --scan-interval {interval:g}", f"{pct:.2f}% of one core",
                              f"< {CPU_TARGET_PCT:g}%", pct < CPU_TARGET_PCT, absolute=True)
            else:
                result.target(f"CPU at --scan-interval {interval:g}", f"{pct:.2f}% of one core",
                              "scaling (informational)", pct < CPU_TARGET_PCT,
                              informational=True)
        table.notes.append(f"both exporters ran at the same time over the same window, each "
                           f"scraped every {every_s:g} s ({scrapes} scrapes); CPU = "
                           "utime+stime (10 ms ticks), whole process")
        table.notes.append(f"host had {host_procs:,} processes; holders: "
                           f"{sum(len(h) for h in holders)} sleeping processes")
        result.tables.append(table)
    finally:
        for exporter in exporters.values():
            exporter.stop()
        if crowd is not None:
            crowd.stop()
        trees.cleanup()


if __name__ == "__main__":
    sys.exit(run_benchmark("footprint", body))
