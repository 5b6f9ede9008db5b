"""`gpuguard status`: one scan (or a refreshing view of scans), as the exporter would see it."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Group
from rich.spinner import Spinner
from rich.text import Text

from gpuguard.config import Config
from gpuguard.console.alert_state import alert_line, orphan_alerts
from gpuguard.console.config_file import load
from gpuguard.console.contract import EXIT_NVML_DOWN, EXIT_OK, PROG, STATUS_SCHEMA
from gpuguard.console.evidence import (
    FROM_EXPORTER,
    OWN_SCAN,
    ExporterClocks,
    exporter_clocks,
    launcher_evidence,
)
from gpuguard.console.json_records import (
    gpu_json,
    holder_json,
    member_json,
    nvml_json,
    use_json,
)
from gpuguard.console.lineage import process_age, tree_members
from gpuguard.console.render import (
    make_console,
    nvml_down_line,
    print_json,
    status_renderable,
)
from gpuguard.engine.scan.accounting import Accounting
from gpuguard.engine.scan.attribution import NONE as NO_CONTAINER
from gpuguard.engine.scan.scanner import Scanner, Snapshot, owner, platform_scanner
from gpuguard.host.platform import PLATFORM, Platform
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.process import Holder
from gpuguard.orphans.verdicts import HolderVerdict, Tree
from gpuguard.orphans.vocabulary import Verdict


def holder_accounting_json(holder: Holder, acc: Accounting,
                           use: dict[str, Any] | None = None) -> dict[str, Any]:
    """A holder with its container, pod and suspicion, and its SM use (`use`, use_json's
    keys) (keys added to holder_json's)."""
    where = acc.attribution.get(holder.pid, NO_CONTAINER)
    suspect = acc.suspect_of(holder.pid)
    return {
        **holder_json(holder),
        **(use or {}),
        "container_id": where.container_id or None,
        "pod_uid": where.pod_uid or None,
        "suspect": None if suspect is None else {"why": suspect.why, "detail": suspect.detail},
    }


def accounting_json(acc: Accounting) -> dict[str, Any]:
    return {
        "users": [{"user": u.user, "used_bytes": u.used_bytes, "quota_bytes": u.quota_bytes,
                   "idle_bytes": u.idle_bytes} for u in acc.users],
        "suspects": [{"pid": s.pid, "start_time": s.start_time, "user": s.user, "comm": s.comm,
                      "why": s.why, "detail": s.detail} for s in acc.suspects],
        "gpus": [{"index": g.index, "uuid": g.uuid, "used_bytes": g.used_bytes,
                  "processes_bytes": g.processes_bytes, "processes": g.processes,
                  "unattributed_bytes": g.unattributed_bytes, "why_unknown": g.why_unknown}
                 for g in acc.gpus],
    }


def holder_idle(snap: Snapshot, clocks: ExporterClocks | None, pid: int, start_time: int,
                gpu_uuid: str) -> tuple[float | None, str | None]:
    """A holding's idle seconds and where they came from: the exporter's (at its scan)
    where it has them, else this command's own clock (None: unknown)."""
    theirs = clocks.idle_seconds(pid, start_time, gpu_uuid) if clocks is not None else None
    if theirs is not None:
        return theirs, FROM_EXPORTER
    ours = snap.idle_seconds(pid, start_time, gpu_uuid)
    return ours, (OWN_SCAN if ours is not None else None)


def holder_json_of(hv: HolderVerdict, snap: Snapshot,
                   clocks: ExporterClocks | None) -> dict[str, Any]:
    """One holder of status's tree, its idle seconds the exporter's where it has them."""
    if not hv.chain:
        return holder_accounting_json(hv.holder, snap.accounting,
                                      {**use_json(hv.holder, snap.reading, None),
                                       "idle_source": None})
    seconds, source = holder_idle(snap, clocks, hv.holder.pid, hv.chain[0].start_time,
                                  hv.holder.gpu_uuid)
    return holder_accounting_json(hv.holder, snap.accounting, {
        **use_json(hv.holder, snap.reading, seconds), "idle_source": source})


def tree_json(tree: Tree, snap: Snapshot, alerts: dict[int, dict[str, Any]] | None = None,
              marks_dir: str | None = None,
              clocks: ExporterClocks | None = None) -> dict[str, Any]:
    root = tree.root
    orphan = snap.orphans.get(root.identity) if root is not None else None
    age = (clocks.orphan_age(root.identity) if clocks is not None and root is not None
           and tree.verdict == Verdict.ORPHAN else None)
    return {
        "root_pid": tree.root_pid,
        "root_start_time": tree.root_start_time,
        "root_comm": root.comm if root is not None else None,
        "root_user": owner(root) if root is not None else None,
        "root_age_seconds": process_age(tree.root_start_time),
        "orphan_since": (clocks.scanned_at - age
                         if age is not None and clocks is not None and clocks.scanned_at
                         else None),
        "orphan_age_seconds": age,
        "verdict": tree.verdict,
        "reason": tree.reason,
        "rule": tree.evidence.rule,
        "evidence": {
            "rule": tree.evidence.rule,
            "detail": tree.evidence.detail,
            "pids": list(tree.evidence.pids),
        },
        "gpu_bytes": tree.gpu_bytes,
        "processes": orphan.processes if orphan is not None else None,
        "holders": [holder_json_of(hv, snap, clocks) for hv in tree.holder_verdicts],
        "members": [member_json(m) for m in tree_members(tree)],
        "alert": alerts.get(tree.root_pid) if alerts else None,
        "run_launchers": launchers_of(tree, marks_dir),
    }


def launchers_of(tree: Tree, marks_dir: str | None,
                 platform: Platform = PLATFORM) -> list[dict[str, Any]]:
    """The `gpuguard run` launchers among the tree's members, with their tiers (the
    registrations in classify.marks_dir); [] without a directory to read (none given,
    or a platform that keeps no registrations)."""
    if (directory := platform.registrations.read_from(marks_dir)) is None:
        return []
    from gpuguard.launch.registration import run_launchers

    return run_launchers(directory, tree_members(tree))


def status_json(snap: Snapshot, hostname: str,
                alerts: dict[int, dict[str, Any]] | None = None,
                marks_dir: str | None = None,
                clocks: ExporterClocks | None = None) -> dict[str, Any]:
    """status --json's document; `clocks`: the running exporter's (None: not asked)."""
    clocks = clocks if clocks is not None else ExporterClocks("", why_not="no exporter asked")
    return {
        "schema": STATUS_SCHEMA,
        "hostname": hostname,
        "taken_at": snap.taken_at,
        "nvml": nvml_json(snap.reading),
        "errors": [{"stage": s, "message": m} for s, m in snap.errors],
        "gpus": [gpu_json(g) for g in snap.reading.gpus],
        "trees": [tree_json(t, snap, alerts, marks_dir, clocks) for t in snap.trees],
        "accounting": accounting_json(snap.accounting),
        "clocks": clocks.to_json(),
    }


def new_scanner(config: Config, platform: Platform = PLATFORM) -> Scanner:
    """The exporter's scanner for this platform (exporter.scanner.platform_scanner), its
    /proc view judging launchers on what the daemons recorded (console.evidence)."""

    def view() -> ProcessView:
        events, memory = launcher_evidence(config)
        return ProcessView(events=events, memory=memory)

    return platform_scanner(platform, rules=config.classify, quotas=config.quotas,
                            audit=config.audit, accounting=config.accounting, view=view)


def cmd_status(args: argparse.Namespace) -> int:
    """One scan, or a refreshing view of scans: what the exporter would publish, for people."""
    config = load(args.config)
    scanner = new_scanner(config)
    hostname = args.hostname
    url = args.exporter_url
    try:
        if args.watch is None:
            snap = scanner.scan_once()
            clocks = exporter_clocks(url)
            alerts = orphan_alerts(config, hostname, snap)
            if args.json:
                print_json(status_json(snap, hostname, alerts, config.classify.marks_dir,
                                       clocks))
            elif not snap.reading.up:
                print(f"{PROG}: {nvml_down_line(snap.reading)}")
            else:
                console = make_console()
                console.print(status_renderable(snap, hostname, lambda _t: None, clocks))
                for root_pid, alert in sorted(alerts.items()):
                    console.print(Text(f"alert for root {root_pid}: {alert_line(alert)}"))
                for tree in snap.trees:
                    for run in launchers_of(tree, config.classify.marks_dir):
                        console.print(Text(f"gpuguard run: launcher {run['pid']} holds the "
                                           f"tree of root {tree.root_pid} with the "
                                           f"{run['tier'] or 'unrecorded'} tier"))
            return EXIT_OK if snap.reading.up else EXIT_NVML_DOWN
        return watch(scanner, hostname, args.watch, as_json=args.json, exporter_url=url)
    finally:
        scanner.nvml.close()


def watch(scanner: Scanner, hostname: str, interval: float, *, as_json: bool,
          exporter_url: str = "") -> int:
    """Rescan every `interval` seconds until Ctrl-C, which is the normal way out (exit 0);
    each scan asks the exporter at `exporter_url` for its clocks again."""
    from rich.live import Live

    def watched_for(tree: Tree) -> float | None:
        snap = scanner.latest
        if snap is None or tree.root is None or scanner.scans_total < 2:
            return None
        info = snap.orphans.get(tree.root.identity)
        return info.age_seconds if info is not None else None

    try:
        if as_json:
            while True:
                snap = scanner.scan_once()
                print_json(status_json(snap, hostname, clocks=exporter_clocks(exporter_url)))
                time.sleep(interval)
        console = make_console()
        spinner = Spinner("dots", text="scanning", style="cyan")
        snap = scanner.scan_once()
        clocks = exporter_clocks(exporter_url)
        with Live(console=console, refresh_per_second=8, transient=False) as live:
            while True:
                body = status_renderable(snap, hostname, watched_for, clocks)
                deadline = time.monotonic() + interval
                while (left := deadline - time.monotonic()) > 0:
                    spinner.update(text=Text(
                        f"every {interval:g}s, next scan in {left:.0f}s, "
                        f"last took {snap.duration_seconds * 1000:.0f} ms (Ctrl-C to quit)",
                        style="dim"))
                    live.update(Group(spinner, body))
                    time.sleep(min(0.25, left))
                spinner.update(text=Text("scanning", style="dim"))
                live.update(Group(spinner, body), refresh=True)
                snap = scanner.scan_once()
                clocks = exporter_clocks(exporter_url)
    except KeyboardInterrupt:
        return EXIT_OK

