"""Peak memory of the exporter when a user shares one huge command line across a tree.

One GPU-holding orphan root with 100 forked children, all sharing one ~1.7 MiB argv
(14 arguments of 120,000 bytes: the kernel's per-argument cap is 128 KiB): the owner
pays it once, every member shows it in /proc/PID/cmdline. Two real exporters run side
by side over the same host: one whose fake NVML names the root as a GPU holder (so it
classifies the tree and judges all 101 members), one whose fake NVML names nothing. The
exporter reads at most 64 KiB of each command line (gpuguard/host/procfs.py CMDLINE_CAP) and
caches protect matches per process, not per text; before that, the first exporter's
peak RSS went from 43 to 215 MiB.

    .venv/bin/python benchmarks/shared_argv.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import FakeNvml, Result, Table, hwm_mib, rss_mib, run_benchmark  # noqa: E402

CHILDREN = 100
ARGS, ARG_BYTES = 14, 120_000
SCANS, SHORT_SCANS = 10, 4  # scans each exporter makes before the peak RSS is read
GIB = 2**30
#: Peak RSS with the tree may exceed the one without by at most this much.
EXTRA_TARGET_MIB = 16.0


def body(result: Result, tmp: Path) -> None:
    from tests.support.proctree import Trees, wait_for
    from tests.support.servers import Exporter, find

    seen, blind = FakeNvml(tmp / "seen"), FakeNvml(tmp / "blind")
    for fake in (seen, blind):
        fake.world.add_gpu(0)
    trees = Trees(tmp / "trees")
    exporters: list[Exporter] = []
    try:
        words = " ".join(['"$x"'] * ARGS)
        tree = trees.spawn(f"x=$(head -c {ARG_BYTES} /dev/zero | tr '\\0' a); "
                           f"{{holder}} --children {CHILDREN} --pidfile {{dir}}/holder {words} "
                           "& wait")
        root = tree.pid("holder")
        argv = len(Path(f"/proc/{root}/cmdline").read_bytes())
        tree.kill_launcher()
        seen.world.add_process(0, root, GIB)
        with_tree = Exporter(env=seen.env(), scan_interval=0.5)
        exporters.append(with_tree)
        without = Exporter(env=blind.env(), scan_interval=0.5)
        exporters.append(without)

        def scans(exp: Exporter) -> float:
            return sum(v for _, v in find(exp.scrape(), "gpuguard_scans_total"))

        def info() -> list:
            return find(with_tree.scrape(), "gpuguard_gpu_process_info", pid=str(root))

        wait_for(info, timeout=60, interval=0.25, what="the exporter to classify the root")
        more = result.pick(SCANS, SHORT_SCANS)
        for exp in exporters:
            start = scans(exp)
            wait_for(lambda e=exp, s=start: scans(e) >= s + more, timeout=120,
                     interval=0.25, what=f"{more} more scans")
        time.sleep(0.5)
        labels = info()[0][0]
        peak_with, peak_without = hwm_mib(with_tree.proc.pid), hwm_mib(without.proc.pid)
        table = Table(
            f"Exporter memory with one orphan tree of {CHILDREN + 1} processes sharing a "
            f"{ARGS * ARG_BYTES / 2**20:.1f} MiB command line ({more}+ scans each, side by "
            "side)",
            ["exporter", "root's verdict (reason)", "RSS MiB", "peak RSS MiB"])
        table.add("its NVML names the root", f"{labels['verdict']} ({labels['reason']})",
                  rss_mib(with_tree.proc.pid), peak_with)
        table.add("its NVML names nothing", "-", rss_mib(without.proc.pid), peak_without)
        table.notes.append(f"/proc/{root}/cmdline: {argv:,} bytes in every member; each read "
                           "is capped at 64 KiB, and a cut command line that no protect "
                           "pattern matched makes its process unknown (member-unknown: never "
                           "reaped on what was not read)")
        result.tables.append(table)
        extra = peak_with - peak_without
        result.target("peak RSS with the shared-argv tree minus without",
                      f"{extra:+.1f} MiB ({peak_with / peak_without:.2f}x)",
                      f"< {EXTRA_TARGET_MIB:g} MiB", extra < EXTRA_TARGET_MIB)
    finally:
        for exp in exporters:
            exp.stop()
        trees.cleanup()


if __name__ == "__main__":
    sys.exit(run_benchmark("shared_argv", body))
