"""The process-event listener's CPU cost: ~1,000 process exits per second vs none.

A child process runs nothing but gpuguard.host.events.listener.ProcessEvents; its CPU time
(utime+stime from /proc/PID/stat, and the scheduler's ns-precise runtime from
/proc/PID/schedstat) is measured over an idle window and over a window in which
this process spawns and reaps ~1,000 `/bin/true` a second, side by side in one
run. Where it can (root, util-linux), a second listener runs in a child PID
namespace at the same time: there the kernel cannot filter the stream to exits
(it ignores that listener's request), so forks and execs arrive too.

The listener in this namespace watches a chain set of WATCHED pids (issue 48: one set
lookup per exit). With `--baseline REF` the listener as of git commit REF (e.g. the one
before a change to the hot path) runs beside it over the same windows, from an export of
that commit: the ratio of the two is the change's cost, measured side by side. Last, the
remediator's chain watch (the same set kept fresh from NVML between deliveries) is timed
over 8 fake GPUs and 64 holders.

    .venv/bin/python benchmarks/procevents_cost.py [--baseline REF]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    REPO,
    Result,
    Table,
    cpu_seconds,
    descendants,
    extract_commit,
    reap,
    run_benchmark,
)
from tests.support.servers import child_env  # noqa: E402

WINDOW_S = 10.0
SHORT_WINDOW_S = 3.0  # --short
RATE = 1000  # exits per second in the loaded window
TICK_S = 0.01
TRUE = shutil.which("true") or "/bin/true"
#: Pids the listener in this namespace watches: a chain set well above a busy host's
#: (64 holders with chains of ~6 and their session leaders are a few hundred). Above
#: pid_max (4,194,304): none of them exits, so every exit takes the miss path.
WATCHED = 1024
WATCHED_BASE = 5_000_000
#: The chain watch: its fake host, and how many refreshes are timed.
CHAIN_GPUS, CHAIN_TREES, CHAIN_PER_TREE, CHAIN_REFRESHES = 8, 16, 4, 50
BASELINE: str | None = None  # --baseline REF, taken off argv before run_benchmark


def listen(allow_pid_namespace: bool, watched: int = 0) -> int:
    """The measured child: a listener, answering "counts" lines on stdin until EOF."""
    from gpuguard.host.events.listener import ProcessEvents

    events = ProcessEvents(allow_pid_namespace=allow_pid_namespace)
    if watched:
        events.watch(range(WATCHED_BASE, WATCHED_BASE + watched))
    events.start()
    print(json.dumps({"available": events.available, "reason": events.unavailable_reason,
                      "filtered": events.filtered}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(events.counts()), flush=True)
    events.stop()
    return 0


def runtime_ns(pid: int) -> int | None:
    """Time on CPU in ns, all live threads (/proc/PID/task/TID/schedstat, first field)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        for tid in tids:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total


@dataclass
class Listener:
    """One listener child; `pid` is the process that runs the listener itself."""

    name: str
    proc: subprocess.Popen[str]
    pid: int
    filtered: bool

    @classmethod
    def start(cls, where: str, wrapper: list[str], *, tree: Path = REPO,
              extra: tuple[str, ...] = ()) -> Listener | str:
        """A listener in `where` (allowed in a child PID namespace: nothing queries it),
        run from the source tree `tree` (this checkout, or a baseline's export)."""
        cmd = [*wrapper, sys.executable, str(tree / "benchmarks" / "procevents_cost.py"),
               "--listener", "--allow-pid-namespace", *extra]
        proc = subprocess.Popen(cmd, cwd=tree, env=child_env(), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        try:
            hello = json.loads(line)
        except ValueError:
            proc.kill()
            proc.wait()
            return f"{where}: listener did not start ({line.strip()!r})"
        if not hello["available"]:
            proc.kill()
            proc.wait()
            return f"{where}: {hello['reason']}"
        # Under `unshare --fork` the listener is the wrapper's only descendant python.
        pid = proc.pid
        if wrapper:
            pid = next(p for p in descendants(proc.pid)
                       if Path(f"/proc/{p}/exe").resolve() == Path(sys.executable).resolve())
        kind = "kernel filters to exits" if hello["filtered"] else "unfiltered: every kind"
        return cls(f"{where} ({kind})", proc, pid, hello["filtered"])

    def counts(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("counts\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def sample(self) -> tuple[float, int | None, dict[str, int]]:
        return cpu_seconds(self.pid), runtime_ns(self.pid), self.counts()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def spawn_load(seconds: float, rate: int) -> int:
    """Spawn and reap `rate` `true` processes a second for `seconds`; how many exited."""
    per_tick = max(1, round(rate * TICK_S))
    done = 0
    start = time.monotonic()
    tick = 0
    while True:
        now = time.monotonic()
        if now - start >= seconds:
            return done
        pids = [os.posix_spawn(TRUE, [TRUE], {}) for _ in range(per_tick)]
        reap(pids)
        done += len(pids)
        tick += 1
        delay = start + tick * TICK_S - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing the load, not synchronising with anything


def export(ref: str, dest: Path) -> Path:
    """The tree of commit `ref` of this checkout, written under `dest`."""
    tree = extract_commit(ref, dest / "tree")
    if tree is None:
        raise SystemExit(f"procevents_cost: --baseline {ref}: git cannot give it")
    return tree


def body(result: Result, tmp: Path) -> None:
    listeners: list[Listener] = []
    skipped: list[str] = []
    chain_watch_cost(result, tmp)
    starts: list[tuple[str, list[str], Path, tuple[str, ...]]] = [
        (f"this PID namespace, {WATCHED:,} pids watched", [], REPO,
         ("--watch", str(WATCHED)))]
    if BASELINE is not None:
        starts.append((f"this PID namespace, baseline {BASELINE}", [],
                       export(BASELINE, tmp / "baseline"), ()))
    starts.append(("a child PID namespace", ["unshare", "--pid", "--fork", "--mount-proc"],
                   REPO, ()))
    try:
        for where, wrapper, tree, extra in starts:
            if wrapper and shutil.which(wrapper[0]) is None:
                skipped.append(f"{where}: {wrapper[0]} not installed")
                continue
            started = Listener.start(where, wrapper, tree=tree, extra=extra)
            if isinstance(started, str):
                skipped.append(started)
            else:
                listeners.append(started)
        if not listeners:
            raise RuntimeError("no listener could start: " + "; ".join(skipped))

        window_s = result.pick(WINDOW_S, SHORT_WINDOW_S)
        table = Table(
            f"Process-event listener CPU, {window_s:.0f} s per window",
            ["listener", "load", "exits/s generated", "exit events read", "other events read",
             "dropped", "CPU ms (utime+stime)", "CPU ms (schedstat)", "% of one core",
             "µs CPU per event read"])
        table.notes.append("load: this process posix_spawns and reaps `true` in ticks of "
                           f"{TICK_S * 1000:.0f} ms; the listener is a separate process; "
                           "events read include the host's own background processes")
        table.notes.append("CPU = the listener process (both threads); % of one core from "
                           "schedstat (ns) when readable, else utime+stime (10 ms ticks)")
        table.notes += [f"not measured: {why}" for why in skipped]
        share: dict[tuple[str, str], float] = {}
        for load, rate in (("none", 0), (f"~{RATE:,} exits/s", RATE)):
            before = {lst.name: lst.sample() for lst in listeners}
            began = time.monotonic()
            if rate:
                spawned = spawn_load(window_s, rate)
            else:
                time.sleep(window_s)  # the idle window
                spawned = 0
            elapsed = time.monotonic() - began
            for lst in listeners:
                cpu0, run0, counts0 = before[lst.name]
                cpu1, run1, counts1 = lst.sample()
                delta = {k: counts1[k] - counts0[k] for k in counts1}
                cpu_s = cpu1 - cpu0
                precise = (run1 - run0) / 1e9 if run0 is not None and run1 is not None else None
                used = precise if precise is not None else cpu_s
                read = delta["exit"] + delta["other"]
                share[(lst.name, load)] = used / elapsed * 100
                table.add(lst.name, load, spawned / elapsed, delta["exit"], delta["other"],
                          delta["dropped"], cpu_s * 1000,
                          precise * 1000 if precise is not None else float("nan"),
                          f"{used / elapsed * 100:.3f}%",
                          used / read * 1e6 if read else float("nan"))
                print(f"  {lst.name}, load {load}: {delta}, CPU {used * 1000:.1f} ms "
                      f"in {elapsed:.1f} s", flush=True)
        result.tables.append(table)
        loaded = f"~{RATE:,} exits/s"
        filtered = next((lst for lst in listeners if lst.filtered), None)
        baseline = next((lst for lst in listeners if "baseline" in lst.name), None)
        for lst in listeners:
            busy, idle = share[(lst.name, loaded)], share[(lst.name, "none")]
            measured = f"{busy:.3f}% of one core (idle {idle:.3f}%)"
            if lst is baseline:
                assert filtered is not None
                ratio = share[(filtered.name, loaded)] / busy if busy > 0 else float("nan")
                result.target(f"listener CPU at {loaded}, {filtered.name} / {lst.name}",
                              f"{ratio:.2f}x", "informational: within noise of 1.0x",
                              ratio <= 1.25, informational=True)
            elif lst is filtered:
                result.target(f"listener CPU at {loaded}, {lst.name}", measured,
                              "<= 1% of one core", busy <= 1.0, absolute=True)
            else:
                if filtered is not None and share[(filtered.name, loaded)] > 0:
                    measured += f", {busy / share[(filtered.name, loaded)]:.1f}x filtered"
                result.target(f"listener CPU at {loaded}, {lst.name}", measured,
                              "informational: the kernel sends every event kind here",
                              busy <= 1.0, informational=True)
    finally:
        for lst in listeners:
            lst.stop()


def chain_watch_cost(result: Result, tmp: Path) -> None:
    """The remediator's chain watch over 8 fake GPUs and 64 holders (16 trees of 4, 6 of
    them orphaned): CPU per refresh, and its share of one core at its period."""
    from benchmarks.harness import FakeNvml, spawn_gpu_trees
    from gpuguard.base.counters import Counters
    from gpuguard.engine.scan.chain_watch import WATCH_PERIOD_SECONDS, ChainWatch
    from gpuguard.gpu.nvml import Nvml
    from gpuguard.host.events.listener import ProcessEvents
    from gpuguard.orphans.rules_config import Rules
    from tests.support.proctree import Trees

    fake = FakeNvml(tmp)
    for index in range(CHAIN_GPUS):
        fake.world.add_gpu(index)
    fake.load_here()
    trees = Trees(tmp / "trees")
    try:
        spawn_gpu_trees(trees, fake.world, count=CHAIN_TREES, per_tree=CHAIN_PER_TREE,
                        orphaned=6, gpus=CHAIN_GPUS)
        counters = Counters()
        events = ProcessEvents()  # not started: the set is all the watch touches
        nvml = Nvml(counters=counters, process_utilization=False)
        nvml.read()  # NVML's initialisation is not part of the cost
        watch = ChainWatch(nvml, events, rules=Rules, counters=counters)
        table = Table(f"Remediator chain watch: {CHAIN_GPUS} fake GPUs, "
                      f"{CHAIN_TREES * CHAIN_PER_TREE} holders",
                      ["refresh", "pids watched", "chains walked", "/proc reads",
                       "CPU ms per refresh", "wall ms per refresh",
                       f"% of one core at one per {WATCH_PERIOD_SECONDS:.0f} s"])
        share = 0.0
        for name, times in (("first (every holder new)", 1),
                            (f"steady (mean of {CHAIN_REFRESHES})", CHAIN_REFRESHES)):
            reads0, walks0 = counters.proc_reads(), watch.walks
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            for _ in range(times):
                watch.refresh()
            cpu = (time.thread_time() - cpu0) / times
            wall = (time.perf_counter() - wall0) / times
            share = cpu / WATCH_PERIOD_SECONDS * 100
            table.add(name, len(events.watched()), (watch.walks - walks0) / times,
                      (counters.proc_reads() - reads0) / times, cpu * 1000, wall * 1000,
                      f"{share:.3f}%")
        assert watch.reads == CHAIN_REFRESHES + 1, "a refresh did not publish"
        table.notes.append("most of a steady refresh is the NVML reading; the fake library "
                           "re-reads its state file on every call, a real driver has its "
                           "own cost per GPU")
        result.tables.append(table)
        result.target("chain watch CPU, 64 holders, steady", f"{share:.3f}% of one core",
                      "<= 0.25% of one core", share <= 0.25, absolute=True)
        nvml.close()
    finally:
        trees.cleanup()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--listener":
        args = sys.argv[2:]
        watched = int(args[args.index("--watch") + 1]) if "--watch" in args else 0
        sys.exit(listen("--allow-pid-namespace" in args, watched))
    if "--baseline" in sys.argv:
        at = sys.argv.index("--baseline")
        BASELINE = sys.argv[at + 1]
        del sys.argv[at:at + 2]
    sys.exit(run_benchmark("procevents_cost", body))
