"""What the DRM back-end's search of /proc costs a read, and what it costs a host without
DRM render nodes: nothing.

A synthetic /proc of N processes (each with a stat, 8 plain descriptors and their fdinfo)
under a temporary directory, with 16 DRM clients on two devices (xe and amdgpu, fdinfo
captured from the kernel's examples), read by the real `Drm` source, which takes its
/proc, /sys and /dev roots as parameters (tests/support/drmtree.py; built in /dev/shm
where it exists). Side by side at 1,000 and 10,000 processes: a fresh source's first read,
the reads until its first complete pass, a steady read between passes (known clients
re-read, nothing else), a read while a later pass goes on in turns, and one read with no
budget (the whole pass at once, what the budget saves); and a host with no render node.
Synthetic files are served by tmpfs, not by procfs' own code, so the absolute times
are a guide only; the read counts are exact.

    .venv/bin/python benchmarks/drm_cost.py
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import Result, Table, median, ms, run_benchmark, timed  # noqa: E402

LEVELS, SHORT_LEVELS = (1000, 10000), (300, 2000)
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
    from gpuguard.gpu.drm.search import MAX_PROCESSES, MAX_SECONDS
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
                  f"{MAX_PROCESSES:,} processes or {MAX_SECONDS * 1000:.0f} ms a read)",
                  ["processes", "read", "/proc reads", "processes examined", "time ms"])
    table.notes += [
        f"{CLIENTS} DRM clients (two descriptors each, on two devices) among the processes; "
        "each process has 8 other descriptors. Steady: median of "
        f"{steady_reads} reads after the first complete pass.",
        "no render node: a host whose /dev/dri has none, at the top level: the back-end is "
        "not even chosen (its probe lists /dev/dri), and a source made anyway reads no /proc.",
        "no budget: one read that examines every process, as a search without a budget "
        "would on every read."]
    table.add(levels[-1], "no render node (10 reads)", no_nodes, 0, "-")
    steady_ms: dict[int, float] = {}
    steady_fdinfo: dict[int, float] = {}
    steady_other: dict[int, float] = {}
    pass_ms: dict[int, float] = {}
    unbounded_ms = 0.0
    worst_examined = 0
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
        holders = {h.pid for h in first.holders}
        if holders != clients:
            raise RuntimeError(f"found {sorted(holders)}, expected {sorted(clients)}")
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
    result.tables.append(table)
    top = levels[-1]
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


if __name__ == "__main__":
    sys.exit(run_benchmark("drm_cost", body))
