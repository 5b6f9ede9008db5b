"""`gpuguard run`: how fast the tree goes when the launcher's parent is SIGKILLed, and
what the launcher costs while CMD runs.

    .venv/bin/python benchmarks/run_teardown.py

Teardown, ten runs: a `bash` parent (a session leader, as an agent's shell) starts
`gpuguard run -- sh -c ...`, whose tree holds a retry loop with its worker, a plain
background child and a double-forked `setsid` daemon (adopted by the launcher). Once
all five descendants run, a pidfd is held on each, the parent is SIGKILLed, and the
time from the parent's exit (its pidfd turning readable) to the last descendant's exit
is taken from pidfd readiness, not from /proc polling. Every member dies on SIGTERM: a
tree that ignores it takes --grace more per child of the launcher (docs/run.md#limits).

Idle: `gpuguard run -- sleep 10`; the launcher's utime+stime (/proc/PID/stat) and
VmRSS (/proc/PID/status) once CMD runs, and again 9 s later.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    CLK_TCK,
    Result,
    Table,
    cpu_seconds,
    descendants,
    median,
    ms,
    rss_mib,
    run_benchmark,
)
from tests.support.proctree import Trees, wait_for  # noqa: E402
from tests.support.servers import child_env  # noqa: E402

RUNS, SHORT_RUNS = 10, 3
LAUNCHER = f"{sys.executable} -m gpuguard.console run"
#: CMD's tree: a retry loop and its worker, a background child, a setsid daemon.
TREE = ("sh -c 'while :; do sleep 3600 & wait; done & sleep 3600 & "
        "(setsid sleep 3600 &); wait'")
DESCENDANTS = 5  # sh, the loop's subshell, its worker, the child, the daemon
IDLE_SECONDS, SHORT_IDLE_SECONDS = 9.0, 4.0


def one_teardown(trees: Trees) -> tuple[float, float]:
    """(ms from the parent's exit to the last descendant's, ms to the launcher's exit)."""
    # `; exit`: a single command would be exec'd by bash, leaving no parent in between.
    tree = trees.spawn(f"{LAUNCHER} -- {TREE}; exit $?", env=child_env())
    parent = tree.launcher.pid

    def ready() -> list[int] | None:
        kids = descendants(parent)
        return kids if len(kids) == 1 + DESCENDANTS else None

    launcher, *members = wait_for(ready, timeout=30, what="the tree")  # type: ignore[misc]
    fds = {os.pidfd_open(pid): pid for pid in members}
    launcher_fd = os.pidfd_open(launcher)
    parent_fd = os.pidfd_open(parent)
    try:
        poller = select.poll()
        for fd in (*fds, launcher_fd, parent_fd):
            poller.register(fd, select.POLLIN)
        tree.launcher.send_signal(signal.SIGKILL)
        exited: dict[int, float] = {}
        while len(exited) < len(fds) + 2:
            for fd, _ in poller.poll(10_000):
                exited.setdefault(fd, time.monotonic())
                poller.unregister(fd)
            if not exited:
                raise RuntimeError("nothing exited within 10 s of the parent's SIGKILL")
        t0 = exited[parent_fd]
        last = max(exited[fd] for fd in fds)
        return ms(last - t0), ms(exited[launcher_fd] - t0)
    finally:
        for fd in (*fds, launcher_fd, parent_fd):
            os.close(fd)
        tree.launcher.wait(timeout=30)


def idle(result: Result) -> None:
    window = result.pick(IDLE_SECONDS, SHORT_IDLE_SECONDS)
    proc = subprocess.Popen([*LAUNCHER.split(), "--", "sleep", f"{window + 1:g}"],
                            env=child_env())
    try:
        wait_for(lambda: descendants(proc.pid), timeout=30, what="CMD to start")
        cpu0, rss0 = cpu_seconds(proc.pid), rss_mib(proc.pid)
        time.sleep(window)  # the measurement window, not a synchronisation
        cpu1, rss1 = cpu_seconds(proc.pid), rss_mib(proc.pid)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    share = (cpu1 - cpu0) / window * 100
    table = Table(f"The launcher while CMD sleeps (`gpuguard run -- sleep {window + 1:g}`)",
                  ["figure", "value"])
    table.add("CPU of start-up (interpreter + imports), s", cpu0)
    table.add(f"CPU over the next {window:g} s, s (clock tick {1 / CLK_TCK:g} s)",
              cpu1 - cpu0)
    table.add("RSS once CMD runs, MiB", rss0)
    table.add(f"RSS {window:g} s later, MiB", rss1)
    result.tables.append(table)
    result.target("launcher CPU while CMD runs", f"{share:.2f}% of one core", "< 0.1%",
                  share < 0.1, absolute=True)
    result.target("launcher RSS", f"{rss1:.1f} MiB", "informational", False, informational=True)


def body(result: Result, tmp: Path) -> None:
    trees = Trees(tmp / "trees")
    try:
        runs = [one_teardown(trees) for _ in range(result.pick(RUNS, SHORT_RUNS))]
    finally:
        trees.cleanup()
    last = [r[0] for r in runs]
    table = Table(f"Parent SIGKILLed -> last descendant gone ({len(runs)} runs, {DESCENDANTS} "
                  "descendants: retry loop + worker, child, setsid daemon)",
                  ["", "min", "median", "max"])
    table.add("last descendant gone, ms", min(last), median(last), max(last))
    table.add("launcher exited, ms", min(r[1] for r in runs), median([r[1] for r in runs]),
              max(r[1] for r in runs))
    table.notes.append("each run: " + ", ".join(f"{v:.1f}" for v in last) + " ms")
    result.tables.append(table)
    # one_teardown returns only once every descendant is gone (it raises otherwise).
    result.target("runs whose every descendant went", f"{len(runs)} of {len(runs)}",
                  "all", True)
    result.target(f"parent's death -> last descendant gone (max of {len(runs)})",
                  f"{max(last):.1f} ms", "< 1,000 ms", max(last) < 1000, absolute=True)
    idle(result)


if __name__ == "__main__":
    sys.exit(run_benchmark("run_teardown", body))
