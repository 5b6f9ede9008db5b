"""gpuguard-exporter beside nvitop-exporter, over the same fake NVML, in one run.

nvitop-exporter comes from the package registry into a venv of its own
(`.venv-nvitop/`, kept between runs; NVITOP_EXPORTER pins the requirement). Where the
registry cannot be reached the benchmark says so and skips: it never fails for that.
Both exporters read the same 4 fake GPUs and 16 holders (4 trees of 4, one orphaned)
and refresh every second (`--scan-interval 1`, `--interval 1`). Measured side by side,
after a warm-up: scrape time (median of alternating scrapes), body size, /proc opens
over one window (strace on both at once; what the kernel saw, not what either counts),
RSS and threads (/proc/PID/status). Ratios are gpuguard / nvitop.

    .venv/bin/python benchmarks/nvitop_footprint.py
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    REPO,
    FakeNvml,
    Result,
    Table,
    median,
    ms,
    rss_mib,
    run_benchmark,
    spawn_gpu_trees,
    status_kib,
)

GPUS = 4
TREES, PER_TREE, ORPHANED = 4, 4, 1
WARMUP_S = 5.0
SCRAPES = 200
STRACE_WINDOW_S = 10.0
VENV = REPO / ".venv-nvitop"
REQUIREMENT = os.environ.get("NVITOP_EXPORTER", "nvitop-exporter==1.7.2")
INSTALL_TIMEOUT_S = 300

_OPEN = re.compile(r'open(?:at)?\((?:[A-Z_]+, )?"(/proc/[^"]*)"')


def nvitop_exporter(install: bool = True) -> tuple[Path | None, str]:
    """The nvitop-exporter script in its own venv, installed on first use (`install`); or
    None and why."""
    script = VENV / "bin" / "nvitop-exporter"
    if script.exists():
        return script, "cached"
    if not install:
        return None, f"a --short run installs nothing ({VENV.name}/ not there)"
    try:
        if not (VENV / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True,
                           capture_output=True, timeout=120)
        proc = subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet",
                               "--disable-pip-version-check", REQUIREMENT],
                              capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot install {REQUIREMENT}: {exc}"
    if proc.returncode != 0 or not script.exists():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        shutil.rmtree(VENV, ignore_errors=True)  # a half install must not look cached
        return None, f"cannot install {REQUIREMENT} (registry unreachable?): {last}"
    return script, "installed"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_opens(pids: dict[str, int], window: float) -> dict[str, int] | None:
    """/proc paths each process opened during `window` seconds (strace -f, all threads);
    None where strace is missing or may not attach."""
    if shutil.which("strace") is None:
        return None
    tracers = {}
    for name, pid in pids.items():
        tracers[name] = subprocess.Popen(
            ["strace", "-f", "-qq", "-e", "trace=open,openat", "-p", str(pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(window)
    counts: dict[str, int] = {}
    for name, tracer in tracers.items():
        tracer.terminate()
        _, err = tracer.communicate(timeout=30)
        if "Operation not permitted" in err:
            return None
        counts[name] = len(_OPEN.findall(err))
    return counts


def scrape(session: requests.Session, url: str) -> tuple[float, int]:
    start = time.perf_counter()
    resp = session.get(url, timeout=10)
    took = time.perf_counter() - start
    resp.raise_for_status()
    return took, len(resp.content)


def body(result: Result, tmp: Path) -> None:
    from tests.support.proctree import Trees, wait_for
    from tests.support.servers import Exporter

    script, how = nvitop_exporter(install=not result.short)
    if script is None:
        result.target("nvitop-exporter side by side", f"skipped: {how}", "runs where the "
                      "registry is reachable", False, informational=True)  # INFO, not FAIL
        print(f"  skipped: {how}", flush=True)
        return
    fake = FakeNvml(tmp)
    for index in range(GPUS):
        fake.world.add_gpu(index)
    trees = Trees(tmp / "trees")
    ours: Exporter | None = None
    theirs: subprocess.Popen[str] | None = None
    try:
        spawn_gpu_trees(trees, fake.world, count=TREES, per_tree=PER_TREE, orphaned=ORPHANED,
                        gpus=GPUS)
        ours = Exporter(env=fake.env(), scan_interval=1.0)
        port = free_port()
        env = fake.env()
        env.pop("PYTHONPATH", None)  # nvitop runs from its own venv, nothing of ours
        theirs = subprocess.Popen([str(script), "--bind-address", "127.0.0.1", "--port",
                                   str(port), "--interval", "1"], env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, text=True)
        urls = {"gpuguard": f"{ours.url}/metrics", "nvitop": f"http://127.0.0.1:{port}/metrics"}
        session = requests.Session()
        wait_for(lambda: "gpuguard_orphan_trees 1.0" in session.get(urls["gpuguard"]).text,
                 timeout=30, what="gpuguard's first scan")

        def nvitop_ready() -> bool:
            try:
                return "gpu_utilization_Percentage{" in session.get(urls["nvitop"], timeout=2).text
            except requests.ConnectionError:
                return False

        wait_for(nvitop_ready, timeout=60, what="nvitop-exporter's first update")
        time.sleep(result.pick(WARMUP_S, 2.0))
        pids = {"gpuguard": ours.proc.pid, "nvitop": theirs.pid}
        times: dict[str, list[float]] = {name: [] for name in urls}
        sizes: dict[str, int] = {}
        for _ in range(result.pick(SCRAPES, 50)):  # alternating: both see the same machine
            for name, url in urls.items():
                took, sizes[name] = scrape(session, url)
                times[name].append(took)
        opens = proc_opens(pids, result.pick(STRACE_WINDOW_S, 3.0))
        rss = {name: rss_mib(pid) for name, pid in pids.items()}
        threads = {name: status_kib(pid, "Threads") for name, pid in pids.items()}
        report(result, how, times, sizes, opens, rss, threads)
    finally:
        if theirs is not None:
            theirs.terminate()
            theirs.wait(timeout=10)
        if ours is not None:
            ours.stop()
        trees.cleanup()


def report(result: Result, how: str, times: dict[str, list[float]], sizes: dict[str, int],
           opens: dict[str, int] | None, rss: dict[str, float],
           threads: dict[str, int]) -> None:
    table = Table(f"gpuguard-exporter beside {REQUIREMENT} ({how}): {GPUS} fake GPUs, "
                  f"{TREES * PER_TREE} holders, both refreshing every 1 s",
                  ["exporter", "scrape median ms", "body bytes",
                   f"/proc opens in {STRACE_WINDOW_S:g} s", "RSS MiB", "threads"])
    for name in times:
        table.add(name, ms(median(times[name])), sizes[name],
                  "n/a" if opens is None else opens[name], rss[name], threads[name])

    def ratio(mine: float, other: float) -> str:
        return f"{mine / other:.2f}x" if other else "n/a"

    table.add("ratio gpuguard/nvitop", ratio(median(times["gpuguard"]), median(times["nvitop"])),
              ratio(sizes["gpuguard"], sizes["nvitop"]),
              "n/a" if opens is None else ratio(opens["gpuguard"], opens["nvitop"]),
              ratio(rss["gpuguard"], rss["nvitop"]), ratio(threads["gpuguard"], threads["nvitop"]))
    table.notes.append(f"{SCRAPES} scrapes of each, alternating, after {WARMUP_S:g} s of "
                       "warm-up; /proc opens: strace -f on both at once over the same window "
                       "(n/a where strace cannot attach)")
    table.notes.append("gpuguard's body includes its own process_* and build families; "
                       "nvitop's its python_gc_* and process_* ones")
    result.tables.append(table)
    result.target("RSS beside nvitop-exporter", f"{ratio(rss['gpuguard'], rss['nvitop'])} "
                  f"({rss['gpuguard']:.1f} vs {rss['nvitop']:.1f} MiB)", "<= 1.0x",
                  rss["gpuguard"] <= rss["nvitop"])
    result.target("scrape time beside nvitop-exporter",
                  ratio(median(times["gpuguard"]), median(times["nvitop"])), "<= 1.0x",
                  median(times["gpuguard"]) <= median(times["nvitop"]), informational=True)


if __name__ == "__main__":
    sys.exit(run_benchmark("nvitop_footprint", body))
