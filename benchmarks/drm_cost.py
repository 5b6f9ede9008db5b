"""What the DRM back-end's search of /proc costs a read, and what it costs a host without
DRM render nodes: nothing.

A synthetic /proc of N processes (each with a stat, 8 plain descriptors and their fdinfo)
under a temporary directory, with 16 DRM clients on two devices (xe and amdgpu, fdinfo
captured from the kernel's examples), read by the real `Drm` source, which takes its
/proc, /sys and /dev roots as parameters (tests/support/drmtree.py; built in /dev/shm
where it exists). Side by side at 1,000 and 10,000 processes: a fresh source's first read
(a whole pass, up to its larger cap), a steady read between passes (known clients
re-read, nothing else), a read while a later pass goes on in turns, and one read with no
budget (the whole pass at once, what the budget saves); a host with no render node; and
one process with 200,000 descriptors, which a later pass examines in shares of the time
budget. Synthetic files are served by tmpfs, not by procfs' own code, so the absolute
times are a guide only; the read counts are exact.

    .venv/bin/python benchmarks/drm_cost.py
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    Result,
    Table,
    median,
    ms,
    run_benchmark,
    timed,
)

LEVELS, SHORT_LEVELS = (1000, 10000), (300, 2000)
WIDE, SHORT_WIDE = 200_000, 20_000  # descriptors of the one process with a huge table
STEADY, SHORT_STEADY = 40, 10
CLIENTS = 16  # processes holding DRM descriptors, each with two (one per device)
XE, AMD = "0000:03:00.0", "0000:04:00.0"


def body(result: Result, tmp: Path) -> None:
    shm = Path("/dev/shm")
    if shm.is_dir():
        tree = Path(tempfile.mkdtemp(prefix="gpuguard-bench-drm-", dir=shm))
        try:
            measure(result, tree)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    else:
        measure(result, tmp)


def measure(result: Result, tmp: Path) -> None:
    from gpuguard.base.counters import Counters
    from gpuguard.gpu.drm import Drm
    from gpuguard.gpu.drm.search import (
        FIRST_MAX_PROCESSES,
        FIRST_MAX_SECONDS,
        MAX_PROCESSES,
        MAX_SECONDS,
    )
    from tests.pure.test_drm_fdinfo import AMDGPU, XE_DOC
    from tests.support.drmtree import DrmHost

    levels = result.pick(LEVELS, SHORT_LEVELS)
    steady_reads = result.pick(STEADY, SHORT_STEADY)

    def proc_reads(counters: Counters) -> int:
        return sum(c.proc_reads for site, c in counters.snapshot().items()
                   if site.startswith("drm_"))

    def examined(counters: Counters) -> int:
        return counters.snapshot()["drm_fd_search"].calls

    bare = DrmHost(tmp / "bare")
    for pid in range(1000, 1000 + levels[-1]):
        bare.process(pid, others=8)
    nothing = Counters()
    for _ in range(10):
        Drm(nothing, **bare.roots()).read()
    no_nodes = proc_reads(nothing)

    table = Table("DRM back-end: one read (budget: "
                  f"{MAX_PROCESSES:,} processes or {MAX_SECONDS * 1000:.0f} ms a read; a "
                  f"source's first read: {FIRST_MAX_PROCESSES:,} or {FIRST_MAX_SECONDS:g} s)",
                  ["processes", "read", "/proc reads", "processes examined", "time ms"])
    table.notes += [
        f"{CLIENTS} DRM clients (two descriptors each, on two devices) among the processes; "
        "each process has 8 other descriptors. Steady: median of "
        f"{steady_reads} reads after the first complete pass.",
        "no render node: a host whose /dev/dri has none, at the top level: the back-end is "
        "not even chosen (its probe lists /dev/dri), and a source made anyway reads no /proc.",
        "no budget: one read that examines every process, as a search without a budget "
        "would on every read.",
        "first (cold): a fresh source's first read, which makes a whole pass up to its cap "
        "(a one-shot command reads about once); later passes go in turns."]
    table.add(levels[-1], "no render node (10 reads)", no_nodes, 0, "-")
    steady_ms: dict[int, float] = {}
    steady_fdinfo: dict[int, float] = {}
    steady_other: dict[int, float] = {}
    pass_ms: dict[int, float] = {}
    unbounded_ms = 0.0
    worst_examined = 0
    first_ms: dict[int, float] = {}
    first_reads: dict[int, int] = {}
    for level in levels:
        host = DrmHost(tmp / f"host{level}")
        host.gpu(XE, "xe", card=0, render=128, files={"vendor": "0x8086", "device": "0x56a0"})
        host.gpu(AMD, "amdgpu", card=1, render=129, files={
            "mem_info_vram_total": str(48 << 30), "mem_info_vram_used": str(2 << 30)})
        step = level // CLIENTS
        clients = {1000 + i * step for i in range(CLIENTS)}
        for pid in range(1000, 1000 + level):
            if pid in clients:
                host.process(pid, others=8, fds={20: "renderD128", 21: "card1"},
                             fdinfo={20: XE_DOC.replace("client-id:  3", f"client-id:  {pid}"),
                                     21: AMDGPU.replace("client-id:\t4", f"client-id:\t{pid}")})
            else:
                host.process(pid, others=8)
        gc.collect()
        counters = Counters()
        drm = Drm(counters, **host.roots())
        t0 = time.perf_counter()
        first = drm.read()
        first_s = time.perf_counter() - t0
        table.add(level, "first (cold)", proc_reads(counters), examined(counters), ms(first_s))
        reads_to_pass = 1
        while first.errors:
            first = drm.read()
            reads_to_pass += 1
        first_ms[level], first_reads[level] = first_s, reads_to_pass
        holders = {h.pid for h in first.holders}
        if holders != clients:
            raise RuntimeError(f"found {sorted(holders)}, expected {sorted(clients)}")
        if reads_to_pass > 1:
            table.add(level, f"until the first pass ends ({reads_to_pass} reads)",
                      proc_reads(counters), examined(counters), "-")
        before_reads, before_examined = proc_reads(counters), examined(counters)
        before_fdinfo = counters.snapshot()["drm_fdinfo"].proc_reads
        steady_ms[level] = median(timed(drm.read, steady_reads))
        steady_fdinfo[level] = (counters.snapshot()["drm_fdinfo"].proc_reads
                                - before_fdinfo) / steady_reads
        steady_other[level] = (proc_reads(counters) - before_reads) / steady_reads \
            - steady_fdinfo[level]
        table.add(level, "steady, between passes",
                  round((proc_reads(counters) - before_reads) / steady_reads),
                  round((examined(counters) - before_examined) / steady_reads),
                  ms(steady_ms[level]))
        busy = Counters()
        passing = Drm(busy, pass_every=0, **host.roots())
        while passing.read().errors:
            pass
        before_reads, before_examined = proc_reads(busy), examined(busy)
        pass_ms[level] = median(timed(passing.read, steady_reads))
        per_read = (examined(busy) - before_examined) / steady_reads
        worst_examined = max(worst_examined, int(per_read + 0.999))
        table.add(level, "during a later pass",
                  round((proc_reads(busy) - before_reads) / steady_reads), round(per_read),
                  ms(pass_ms[level]))
        whole = Counters()
        t0 = time.perf_counter()
        Drm(whole, max_processes=10**9, max_seconds=float("inf"), **host.roots()).read()
        unbounded_ms = time.perf_counter() - t0
        table.add(level, "no budget (whole pass)", proc_reads(whole), examined(whole),
                  ms(unbounded_ms))
        print(f"  {level:>6}: first {ms(first_s):.1f} ms, pass in {reads_to_pass} reads, steady "
              f"{ms(steady_ms[level]):.2f} ms, during a pass {ms(pass_ms[level]):.1f} ms, "
              f"whole pass {ms(unbounded_ms):.1f} ms", flush=True)
        shutil.rmtree(host.root, ignore_errors=True)
    wide_fds = result.pick(WIDE, SHORT_WIDE)
    wide = wide_table(tmp, wide_fds)
    result.tables.append(table)
    result.tables.append(wide.table)
    top = levels[-1]
    result.target(f"reads until a fresh source's first pass ends at {top:,}",
                  str(first_reads[top]), "1 (a whole pass in the first read)",
                  first_reads[top] == 1, absolute=True)  # its cap is time too
    result.target(f"a fresh source's first read at {top:,}", f"{ms(first_ms[top]):,.0f} ms",
                  f"<= its {FIRST_MAX_SECONDS:g} s cap", first_ms[top] <= FIRST_MAX_SECONDS,
                  absolute=True)
    result.target(f"the slowest read during a later pass through {wide_fds:,} descriptors",
                  f"{ms(wide.slowest):.1f} ms",
                  f"<= the {MAX_SECONDS * 1000:.0f} ms budget + 25 ms",
                  wide.slowest <= MAX_SECONDS + 0.025, absolute=True)
    result.target("/proc reads with no DRM render node", str(no_nodes), "0", no_nodes == 0)
    result.target("processes examined per read (the most, any level)", str(worst_examined),
                  f"<= {MAX_PROCESSES:,}", worst_examined <= MAX_PROCESSES)
    want = 3 * CLIENTS  # two fdinfo and one stat (identity) per known client
    result.target(f"/proc reads per steady read at {top:,} (between passes)",
                  f"{steady_fdinfo[top]:.0f} fdinfo and stat + {steady_other[top]:.0f} other",
                  f"{want} (3 per known client) + 0", steady_fdinfo[top] <= want
                  and steady_other[top] == 0)
    result.target(f"a read during a pass at {top:,}", f"{ms(pass_ms[top]):.1f} ms",
                  f"<= the {MAX_SECONDS * 1000:.0f} ms budget + 25 ms (listing, known clients)",
                  pass_ms[top] <= MAX_SECONDS + 0.025, absolute=True)
    result.timed_ratio(f"a whole pass at once vs a read during a pass at {top:,}",
                       unbounded_ms / pass_ms[top], at_least=result.pick(5.0, 2.0))



@dataclass(frozen=True)
class Wide:
    """The table of the one process with a huge descriptor table, and its slowest read."""

    table: Table
    slowest: float


def wide_table(tmp: Path, fds: int) -> Wide:
    """One process with `fds` plain descriptors and a DRM client (its highest one), beside
    a few small ones: a fresh source's first read, the reads of later passes (a new pass
    each time the last one ends), and one read with no budget."""
    from gpuguard.base.counters import Counters
    from gpuguard.gpu.drm import Drm
    from tests.pure.test_drm_fdinfo import XE_DOC
    from tests.support.drmtree import DrmHost

    host = DrmHost(tmp / "wide")
    host.gpu(XE, "xe", card=0, render=128, files={"vendor": "0x8086", "device": "0x56a0"})
    for pid in range(1000, 1010):
        host.process(pid, others=8)
    pid = 2000
    host.process(pid, others=0, fds={fds: "renderD128"}, fdinfo={fds: XE_DOC})
    plain = host.root / "plain"
    for n in range(fds):
        os.symlink(plain, host.proc / str(pid) / "fd" / str(n))
    gc.collect()
    table = Table(f"DRM back-end: a process with {fds:,} descriptors",
                  ["read", "reads", "/proc reads (later: the most in a read)",
                   "time ms (later: the slowest)"])
    counters = Counters()
    drm = Drm(counters, pass_every=0, **host.roots())
    t0 = time.perf_counter()
    first = drm.read()
    first_s = time.perf_counter() - t0
    first_reads = 1
    while first.errors:  # past the first read's cap: the pass goes on in turns
        first = drm.read()
        first_reads += 1
    if {h.pid for h in first.holders} != {pid}:
        raise RuntimeError(f"first pass: {first.holders}")
    whole_reads = sum(c.proc_reads for c in counters.snapshot().values())
    table.add("first (cold)" if first_reads == 1 else
              f"first (cold, past its cap) and the rest of its pass ({first_reads} reads)",
              first_reads, whole_reads, ms(first_s))
    times: list[float] = []
    reads_each: list[int] = []
    while sum(reads_each) < 2 * whole_reads:  # two later passes' worth, in turns
        before = sum(c.proc_reads for c in counters.snapshot().values())
        t0 = time.perf_counter()
        reading = drm.read()
        times.append(time.perf_counter() - t0)
        reads_each.append(sum(c.proc_reads for c in counters.snapshot().values()) - before)
        if pid not in {h.pid for h in reading.holders}:
            raise RuntimeError("the wide process's client was lost mid-pass")
    table.add("later passes (two passes' reads, in turns)", len(times), max(reads_each),
              ms(max(times)))
    whole = Counters()
    t0 = time.perf_counter()
    Drm(whole, max_processes=10**9, max_seconds=float("inf"),
        first_max_seconds=float("inf"), **host.roots()).read()
    whole_s = time.perf_counter() - t0
    table.add("no budget (whole pass)", 1, sum(c.proc_reads for c in whole.snapshot().values()),
              ms(whole_s))
    table.notes.append(f"median read during the later passes: {ms(median(times)):.1f} ms")
    print(f"  wide {fds:,}: first {ms(first_s):.0f} ms, later reads {len(times)} (slowest "
          f"{ms(max(times)):.1f} ms), whole {ms(whole_s):.0f} ms", flush=True)
    shutil.rmtree(host.root, ignore_errors=True)
    return Wide(table, max(times))


if __name__ == "__main__":
    sys.exit(run_benchmark("drm_cost", body))
