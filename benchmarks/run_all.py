"""Run every benchmark (each in its own process) and write benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/run_all.py            # what `make bench` runs
    .venv/bin/python benchmarks/run_all.py scan_cost  # a subset, still writes RESULTS.md
    .venv/bin/python benchmarks/run_all.py --short    # smaller counts, RESULTS.md untouched

Exit status 1 when a benchmark crashed (or, with --strict, when a target failed). A
--short run is strict: a count target that fails fails the run, as does a timed ratio
missed by more than twice its goal; an absolute one (seconds, CPU share, MiB on this
machine), or a timed ratio missed by less, is reported as SLOW, as CI's
tests/deploy/test_benchmarks.py does for each benchmark.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import REPO, Result, machine, prepare_process, sweep_descendants  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"

#: name -> (wall-clock limit in seconds, what it measures and its targets)
BENCHMARKS: dict[str, tuple[float, str]] = {
    "scan_cost": (240.0,
                  "gpuguard's `Scanner.scan_once()` vs a naive full-table check "
                  "(`psutil.process_iter` + ppid map) with 0 / 1,000 / 5,000 unrelated "
                  "processes; /proc reads per warm scan vs the lower bound of docs/design.md, "
                  "Cost rules. Targets: "
                  "scan at 5,000 within 1.25x of scan at 0; naive/gpuguard >= 50x at 5,000; "
                  "stat reads <= 1.0x the lower bound."),
    "scrape_latency": (120.0,
                       "GET /metrics p50/p99 on the real exporter scanning back to back, "
                       "with normal NVML, with NVML slowed to ~1 s per scan, and behind "
                       "--web-config-file (TLS + bcrypt basic auth). Targets: p99 < 20 ms "
                       "each; p99 does not follow the scan duration."),
    "footprint": (180.0,
                  "The exporter's CPU and RSS with 8 GPUs, 64 holders and 5,000 unrelated "
                  "processes, scraped every 15 s, at --scan-interval 5 and 1 side by side. "
                  "Target: < 1% of one core at the default interval."),
    "webhook_load": (240.0,
                     "A bounded burst of 2,000 POSTs (50 concurrent) of valid, duplicate and "
                     "malformed Alertmanager payloads at the remediator (dry-run). Targets: "
                     "no 5xx; p99 < 100 ms; exactly one decision per tree; RSS back to "
                     "within 10% of baseline."),
    "shared_argv": (120.0,
                    "Two exporters side by side, one classifying an orphan tree of 101 "
                    "processes that share one ~1.6 MiB command line, one not. Target: peak "
                    "RSS with the tree < 16 MiB above the one without (it was 43 -> 215 MiB "
                    "before command-line reads were capped)."),
    "login_flood": (120.0,
                    "POST /alerts p50/p99 at the remediator (bearer token, one at a time) "
                    "quiet, under 16 clients sending wrong basic-auth passwords to /metrics "
                    "(bcrypt cost 10) from one address, and from a new address per request "
                    "(no throttle applies). Target: webhook p50 < 50 ms under each flood "
                    "(419 ms before issue 25)."),
    "refusal_audit": (120.0,
                      "One refused 40-process tree delivered 240 times 15 s apart (a "
                      "simulated hour): audit bytes against a full record per delivery. "
                      "Target: >= 20x fewer bytes."),
    "reap_latency": (240.0,
                     "Reap latency (plan to final result, enforce, the real Reaper over the fake "
                     "NVML) of a 10- and a 1,100-process orphan tree, each reap in a child that "
                     "starts at the default soft limit of 1,024 open files: this code against "
                     "7c2d221 (before issue 43) side by side. Targets: both reaped, 10 in < 1 s, "
                     "1,100 in < 10 s (before: 1,100 refused, member-unknown)."),
    "unlisted_cost": (120.0,
                      "The search for GPU holders NVML does not list: scan time and /proc "
                      "listings with every byte accounted for and with 2 GiB unattributed, at "
                      "0 and 5,000 unrelated processes, side by side. Targets: nothing "
                      "unattributed costs 0 search reads and scan time within 1.25x of 0 "
                      "unrelated; the search adds at most its 50 ms budget (+10 ms) a scan."),
    "drm_cost": (240.0,
                 "The DRM back-end's search of /proc for DRM clients (Intel, AMD without "
                 "ROCm) over a synthetic /proc of 1,000 and 10,000 processes with 16 "
                 "clients: reads and time of a fresh source's first read (a whole pass), of "
                 "a steady read between passes and of a read during a pass, against one read "
                 "with no budget, side by side; a host without render nodes; and a process "
                 "with 200,000 descriptors, examined in shares. Targets: 0 /proc reads "
                 "without render nodes; the first read a whole pass at 10,000, within its "
                 "2 s cap; at most 2,000 processes examined a read; a steady read re-reads "
                 "only the known clients (3 reads each); no read during a pass through the "
                 "200,000 descriptors over the 50 ms budget + 25 ms."),
    "thread_heavy": (180.0,
                     "A warm scan of one orphan whose holder has 2,000 and 5,000 threads: "
                     "every thread's children file read every scan against the exporter's "
                     "reads in turns (SCAN_THREAD_TURNS a scan), side by side. Target: >= 5x "
                     "faster at 5,000 threads (issue 48: 20,000 threads cost 530 ms a scan)."),
    "nvitop_footprint": (420.0,
                         "gpuguard-exporter beside nvitop-exporter (installed from the "
                         "registry into .venv-nvitop/, skipped where it cannot be) over the "
                         "same 4 fake GPUs, both refreshing every second: scrape time, body "
                         "size, /proc opens (strace), RSS and threads as ratios. Target: RSS "
                         "<= nvitop-exporter's."),
    "hostile_fronts": (420.0,
                       "The exporter behind TLS, this checkout and b573558 (before issue 48) "
                       "side by side: RSS over 2,000 connect-and-close (no byte) and 1,000 "
                       "one-byte connections, and scrapes answered while one address holds "
                       "512 silent TLS connections. Targets: RSS back within 5 MiB; peak "
                       "under half the DaemonSet's 256 MiB; every scrape answered."),
    "event_latency": (300.0,
                      "Launcher SIGKILL -> its orphan on /metrics over 50 launchers, this "
                      "checkout (event-driven rescans) and c6e6b9b (the interval alone) side "
                      "by side at --scan-interval 5 and 30; idle CPU; scans caused by ~1,000 "
                      "unrelated exits a second and by a storm of 100 holder-chain exits. "
                      "Targets: p50 <= 100 ms, p99 <= 1 s at both intervals; idle CPU "
                      "within noise of c6e6b9b; 0 early scans from unrelated exits; the "
                      "chain storm's early scans within the 4-a-second bound."),
    "procevents_cost": (180.0,
                        "The process-event listener's CPU over an idle window and over ~1,000 "
                        "exits a second, side by side, with 1,024 chain pids watched (one set "
                        "lookup an exit) and, where it can, in a child PID namespace (no "
                        "kernel filter); then the remediator's chain watch over 64 holders. "
                        "Needs the initial PID namespace. Targets: listener CPU per 1,000 "
                        "exits/s; the chain watch's steady CPU."),
    "fleet_pull": (600.0,
                   "A simulated fleet of lightweight pollers, each one host asking for its "
                   "own alerts with the remediator's exact request, against a real "
                   "Alertmanager 0.25 (GET /api/v2/alerts, filtered) and a real Prometheus "
                   "2.x (ALERTS{...,hostname=...} through /api/v1/query) holding 1,000 and "
                   "10,000 firing alerts, a real remediator on each server's pull among them: "
                   "the polls/s each server carries before its p99 passes 1 s or it sheds, CPU "
                   "and RSS per 100 polls/s, the remediator's lost polls. Goal: 333 polls/s "
                   "(10,000 nodes every 30 s) at 10,000 alerts without a lost poll."),
    "run_teardown": (120.0,
                     "`gpuguard run`: its parent SIGKILLed -> the last of five descendants "
                     "gone, over ten runs; the launcher's CPU and RSS while CMD runs. "
                     "Targets: every descendant gone within 1 s; launcher CPU < 0.1% of one "
                     "core while CMD runs."),
}


#: A --short run's wall-clock limit for each benchmark (they take 5-40 s on 2 busy cores).
SHORT_LIMIT = 150.0


def run_one(name: str, limit: float, out: Path, *, short: bool = False
            ) -> tuple[Result | None, str]:
    """Run benchmarks/NAME.py in a child process; its output streams through."""
    cmd = [sys.executable, str(HERE / f"{name}.py"), "--json", str(out),
           *(["--short"] if short else [])]
    print(f"== {name}{' --short' if short else ''} (limit {limit:.0f} s)", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO)
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the benchmark's finally blocks clean up
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None, f"timed out after {limit:.0f} s"
    finally:
        if proc.poll() is None:  # we are being stopped: let the benchmark clean up first
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        sweep_descendants()  # anything it orphaned came back to us
    if rc != 0 or not out.exists():
        return None, f"exited with status {rc}"
    return Result.from_json(json.loads(out.read_text())), ""


def render(results: dict[str, Result | str], total: float, command: str,
           load: tuple[str, str]) -> str:
    info = machine()
    lines = [
        "# gpuguard benchmarks",
        "",
        "Generated by `benchmarks/run_all.py`; every ratio below was measured side by side "
        "in one run on this machine. Run one benchmark alone with "
        "`.venv/bin/python benchmarks/NAME.py`; CI runs each with `--short` "
        "(tests/deploy/test_benchmarks.py) and fails on a count target, or a timed ratio "
        "missed by more than twice its goal, never on an absolute time.",
        "",
    ]
    lines += [f"- **{name}**: {BENCHMARKS[name][1]}" for name in results]
    lines += [
        "",
        "| machine | |",
        "|---|---|",
        f"| date | {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')} |",
        f"| command | `{command}` |",
        f"| nproc | {info['nproc']} |",
        f"| CPU | {info['cpu']} |",
        f"| memory | {info['memory']} |",
        f"| kernel | {info['kernel']} |",
        f"| python | {info['python']} |",
        f"| load average (1, 5, 15 min) at start / end | {load[0]} / {load[1]} |",
        f"| total wall time | {total:.0f} s |",
        "",
        "## Summary",
        "",
        "| benchmark | target | measured | goal | result |",
        "|---|---|---|---|---|",
    ]
    for name, res in results.items():
        if isinstance(res, str):
            lines.append(f"| {name} | (benchmark did not finish) | {res} | | ERROR |")
            continue
        for t in res.targets:
            lines.append(f"| {name} | {t.name} | {t.measured} | {t.goal} | {t.status} |")
    for name, res in results.items():
        lines += ["", f"## {name}", ""]
        if isinstance(res, str):
            lines.append(f"Did not finish: {res}.")
            continue
        lines.append(f"Ran in {res.seconds:.0f} s.")
        lines.append("")
        lines.append(res.markdown().rstrip())
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run_all.py")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target FAILs")
    parser.add_argument("--short", action="store_true",
                        help="each benchmark's smaller counts (CI's); implies --strict, and "
                             "writes no RESULTS.md unless --output says where")
    parser.add_argument("--output", type=Path, default=None,
                        help="where the results go (default: benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(BENCHMARKS)}")
    prepare_process()
    names = args.names or list(BENCHMARKS)
    command = " ".join([".venv/bin/python", "benchmarks/run_all.py", *(argv or sys.argv[1:])])
    output = args.output if args.output is not None or args.short else RESULTS
    results: dict[str, Result | str] = {}
    load_start = loadavg()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as tmp:
        for name in names:
            limit = SHORT_LIMIT if args.short else BENCHMARKS[name][0]
            res, why = run_one(name, limit, Path(tmp) / f"{name}.json", short=args.short)
            results[name] = res if res is not None else why
    total = time.monotonic() - start
    if output is not None:
        output.write_text(render(results, total, command, (load_start, loadavg())))
    crashed = [n for n, r in results.items() if isinstance(r, str)]
    failed = [f"{n}: {t.name}" for n, r in results.items() if isinstance(r, Result)
              for t in r.failed()]
    slow = [f"{n}: {t.name} ({t.measured}, goal {t.goal})" for n, r in results.items()
            if isinstance(r, Result) for t in r.targets if t.status == "SLOW"]
    print(f"\n{'wrote ' + str(output) if output else 'ran'} in {total:.0f} s")
    for line in crashed:
        print(f"ERROR: {line} did not finish")
    for line in failed:
        print(f"FAIL: {line}")
    for line in slow:
        print(f"SLOW (reported, judged by the full run): {line}")
    if crashed or ((args.strict or args.short) and failed):
        return 1
    return 0


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages: how busy the machine was (shared machines)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
