"""What the search for holders NVML does not list costs a scan, and what it costs when
nothing is unattributed: nothing.

One scanner, one orphan holder NVML lists (1 GiB) and a holder it does not list (a
process with the configured device file open), at 0 and 5,000 unrelated processes (run it
in a PID namespace of its own to count only these: `unshare --pid --fork --mount-proc`).
Side by side at each level: scans with every byte of used memory accounted for (the
search off: no /proc listing, no descriptor read) and scans with 2 GiB unattributed (the
search on, at its default budget of 2,000 processes or 50 ms a scan, resuming).

    .venv/bin/python benchmarks/unlisted_cost.py
"""

from __future__ import annotations

import gc
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    GIB,
    FakeNvml,
    Result,
    Sleepers,
    Table,
    host_process_count,
    median,
    ms,
    run_benchmark,
    timed,
)

LEVELS = (0, 5000)
SCANS = 60
#: --short: 1,000 unrelated processes, 20 timed scans; the growth goal gets the same room
#: as scan_cost's short run.
SHORT_LEVELS, SHORT_SCANS = (0, 1000), 20
GROWTH_GOAL, SHORT_GROWTH_GOAL = 1.25, 1.5


def body(result: Result, tmp: Path) -> None:
    fake = FakeNvml(tmp)
    fake.load_here()
    fake.world.add_gpu(0)

    from gpuguard.base.counters import Counters
    from gpuguard.config.accounting import UnlistedSettings
    from gpuguard.engine.scan.scanner import Scanner
    from gpuguard.gpu.nvml import Nvml
    from gpuguard.host.procfs import ProcessView
    from gpuguard.orphans.rules_config import Rules
    from tests.support.proctree import Trees

    trees = Trees(tmp / "trees")
    node = tmp / "dev" / "nvidia0"
    node.parent.mkdir()
    node.write_text("")
    listed = trees.spawn("sh -c '{holder} --pidfile {dir}/worker & wait' & wait")
    fake.world.add_process(0, listed.pid("worker"), GIB)
    listed.kill_launcher()
    hidden = trees.spawn(f"sh -c '{{holder}} --pidfile {{dir}}/worker 3<{node} & wait' & wait")
    hidden_pid = hidden.pid("worker")

    counters = Counters()
    settings = UnlistedSettings(device_files=(str(tmp / "dev" / "nvidia[0-9]*"),))
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters), counters=counters,
                      view=ProcessView(counters=counters), unlisted=settings)

    def search_reads() -> tuple[int, int]:
        snap = counters.snapshot()
        return (snap["proc_list"].calls,
                snap["proc_list"].proc_reads + snap["proc_fd_search"].proc_reads)

    levels = result.pick(LEVELS, SHORT_LEVELS)
    scans = result.pick(SCANS, SHORT_SCANS)
    table = Table(
        "Scan time with and without unattributed memory (1 listed orphan, 1 unlisted holder)",
        ["unrelated procs", "host procs", "unattributed", f"scan p50 ms (n={scans})",
         "/proc listings per scan", "search reads per scan", "scans per pass (holder found)",
         "vs accounted-for at 0"])
    table.notes.append("accounted-for: the fake GPU's used memory equals what NVML's "
                       "holder holds; unattributed: 2 GiB more, above the 128 MiB default "
                       "threshold. Each pair measured back to back on the same scanner.")
    p50: dict[tuple[int, bool], float] = {}
    reads: dict[tuple[int, bool], float] = {}
    crowd: list[Sleepers] = []
    pass_at_top: int | None = None
    try:
        spawned = 0
        for level in levels:
            if level > spawned:
                crowd.append(Sleepers(level - spawned))
                spawned = level
            for unattributed in (False, True):
                fake.world.update_gpu(0, memory_used=(3 if unattributed else 1) * GIB)
                scanner.scan_once()  # the change seen; the search forgotten or started
                scanner.search.reset()
                pass_scans = None  # scans until the search's first complete pass
                for n in range(1, 1000):
                    snap = scanner.scan_once()
                    if snap.search is None or not snap.search.active:
                        break
                    if snap.search.passes:
                        pass_scans = n
                        break
                if unattributed and (pass_scans is None or
                                     all(u.pid != hidden_pid for u in snap.unlisted)):
                    raise RuntimeError("the unlisted holder was not found in a pass")
                gc.collect()
                lists0, reads0 = search_reads()
                p50[level, unattributed] = median(timed(scanner.scan_once, scans))
                lists1, reads1 = search_reads()
                reads[level, unattributed] = (reads1 - reads0) / scans
                if unattributed and level == levels[-1]:
                    pass_at_top = pass_scans
                table.add(level, host_process_count(), "2 GiB" if unattributed else "0",
                          ms(p50[level, unattributed]), f"{(lists1 - lists0) / scans:.2f}",
                          f"{reads[level, unattributed]:.0f}",
                          pass_scans if pass_scans is not None else "-",
                          f"{p50[level, unattributed] / p50[0, False]:.2f}x")
                print(f"  {level:>5} unrelated, unattributed={unattributed}: "
                      f"{ms(p50[level, unattributed]):.3f} ms, {reads[level, unattributed]:.0f} "
                      f"search reads/scan, a pass in {pass_scans} scans", flush=True)
    finally:
        for sleepers in crowd:
            sleepers.stop()
        trees.cleanup()

    top = levels[-1]
    result.tables.append(table)
    idle = p50[top, False] / p50[0, False]
    goal = result.pick(GROWTH_GOAL, SHORT_GROWTH_GOAL)
    result.timed_ratio(f"accounted-for scan at {top:,} vs at 0", idle, at_most=goal)
    zero = reads[0, False] + reads[top, False]
    result.target("search reads per scan with nothing unattributed", f"{zero:.0f}", "0",
                  zero == 0)
    busy = p50[top, True] - p50[top, False]
    result.target(f"what the search adds to a scan at {top:,}", f"{ms(busy):.1f} ms",
                  "<= the 50 ms budget + one process's files (10 ms)", busy <= 0.060,
                  absolute=True)
    least = math.ceil(top / 2000)
    result.target(f"scans per complete pass at {top:,}", str(pass_at_top),
                  f">= {least} (2,000 processes a scan), bounded by the 50 ms budget",
                  pass_at_top is not None and pass_at_top >= least, informational=True)


if __name__ == "__main__":
    sys.exit(run_benchmark("unlisted_cost", body))
