"""What a thread-heavy orphan costs a scan (issue 48): every thread's children file read
every scan (the view the reaper and the remediator's inspection keep, and every scan's
before) against the exporter's scans, which read them in turns (SCAN_THREAD_TURNS a
scan, besides the main thread and new threads).

One orphan tree (sh -> a holder of N threads), N = 2,000 and 5,000; at each N two
scanners over the same tree, side by side, warm, measured alternately.

    .venv/bin/python benchmarks/thread_heavy.py
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    GIB,
    FakeNvml,
    Result,
    Table,
    median,
    ms,
    run_benchmark,
    timed,
)

LEVELS = (2000, 5000)
SCANS = 40
SHORT_LEVELS, SHORT_SCANS = (5000,), 16  # --short: the top level alone


def body(result: Result, tmp: Path) -> None:
    fake = FakeNvml(tmp)
    fake.load_here()
    fake.world.add_gpu(0)

    from gpuguard.base.counters import Counters
    from gpuguard.engine.scan.scanner import Scanner
    from gpuguard.gpu.nvml import Nvml
    from gpuguard.host.procfs import SCAN_THREAD_TURNS, ProcessView
    from gpuguard.orphans.rules_config import Rules
    from tests.support.proctree import Trees, wait_for

    trees = Trees(tmp / "trees")
    levels = result.pick(LEVELS, SHORT_LEVELS)
    scans = result.pick(SCANS, SHORT_SCANS)
    turn_reads: dict[int, float] = {}
    table = Table("Warm scan of one orphan tree whose holder has N threads",
                  ["threads", "children reads/scan, every thread", "in turns",
                   f"scan p50 ms, every thread (n={scans})", "in turns", "every / in turns"])
    table.notes.append(f"in turns: SCAN_THREAD_TURNS = {SCAN_THREAD_TURNS} threads a scan "
                       "besides the main thread and new ones; every thread is read again "
                       "within threads / SCAN_THREAD_TURNS scans. Both scanners over the "
                       "same tree, measured alternately in one run.")
    ratios: dict[int, float] = {}
    try:
        for threads in levels:
            tree = trees.spawn(f"sh -c '{{holder}} --threads {threads} --pidfile {{dir}}/w' "
                               "& wait")
            holder = tree.pid("w")
            wait_for(lambda h=holder, n=threads: len(os.listdir(f"/proc/{h}/task")) > n,
                     timeout=120, what=f"{threads} threads")
            fake.world.add_process(0, holder, GIB)
            tree.kill_launcher()
            scanners = {}
            for name, turns in (("every", None), ("turns", SCAN_THREAD_TURNS)):
                counters = Counters()
                scanners[name] = (Scanner(rules=Rules(), nvml=Nvml(counters=counters),
                                          counters=counters,
                                          view=ProcessView(counters=counters,
                                                           thread_turns=turns)), counters)
                scanners[name][0].scan_once()  # warm: the first scan reads every thread
            samples: dict[str, list[float]] = {"every": [], "turns": []}
            children = dict.fromkeys(samples, 0)
            for name in ("every", "turns") * 4:  # alternately, SCANS each in all
                scanner, counters = scanners[name]
                gc.collect()
                before = counters.snapshot()["proc_children"].proc_reads
                samples[name] += timed(scanner.scan_once, scans // 4)
                children[name] += counters.snapshot()["proc_children"].proc_reads - before
                if any(t.verdict != "orphan" for t in scanner.latest.trees):
                    raise RuntimeError("the tree is not an orphan")
            p50 = {name: median(values) for name, values in samples.items()}
            reads = {name: n / scans for name, n in children.items()}
            ratios[threads] = p50["every"] / p50["turns"]
            turn_reads[threads] = reads["turns"]
            table.add(f"{threads:,}", f"{reads['every']:.0f}", f"{reads['turns']:.0f}",
                      ms(p50["every"]), ms(p50["turns"]), f"{ratios[threads]:.1f}x")
            print(f"  {threads} threads: {ms(p50['every']):.2f} ms every thread, "
                  f"{ms(p50['turns']):.2f} ms in turns", flush=True)
            fake.world.remove_process(holder)
            trees.cleanup()
    finally:
        trees.cleanup()
    result.tables.append(table)
    top = levels[-1]
    result.timed_ratio(f"scan time, every thread / in turns, at {top:,} threads", ratios[top],
                       at_least=5, digits=1)
    # The turns themselves: the main thread, the new ones (none here) and SCAN_THREAD_TURNS
    # others a scan, whatever the thread count.
    bound = SCAN_THREAD_TURNS + 4
    result.target(f"children reads a scan in turns, at {top:,} threads", f"{turn_reads[top]:.0f}",
                  f"<= {bound} (SCAN_THREAD_TURNS + 4)", turn_reads[top] <= bound)


if __name__ == "__main__":
    sys.exit(run_benchmark("thread_heavy", body))
