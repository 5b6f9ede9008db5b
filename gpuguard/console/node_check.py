"""`gpuguard node-check`: is this node's GPU memory held only by live, normal trees?

For a gate that runs between jobs (a Slurm epilog, a Kubernetes node-problem-detector
plugin, docs/node-check.md): exit 0 when every byte of GPU memory is held by processes
the classifier calls `normal`, 1 when anything else remains: an orphan, a protected or
unknown tree, a pid NVML lists that /proc does not show, a holder NVML does not list,
memory no listed process accounts for above `accounting.unlisted_threshold_bytes`, or
memory whose owner cannot be reckoned. It fails closed: a node it cannot show clean (NVML
down or incomplete, a figure the driver cannot give) is not clean, exit 1, so that a
gate drains or taints it rather than hand its GPUs to the next job. A bad config is exit 2.

One scan of the exporter's scanner, its search for unlisted holders given a whole pass
(`--search-seconds` at most) rather than one scan's budget: a gate runs once and must
see every process. Never signals anything.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from gpuguard.console.config_file import load
from gpuguard.console.contract import EXIT_NOT_CLEAN, EXIT_OK, NODE_CHECK_SCHEMA, PROG
from gpuguard.console.json_records import holder_json, nvml_json
from gpuguard.console.render import print_json
from gpuguard.console.status import new_scanner
from gpuguard.engine.scan.scanner import Snapshot, owner
from gpuguard.orphans.vocabulary import Verdict

#: The search's process budget for one node-check: every process, in one pass.
WHOLE_PASS = 10**9


def remaining(snap: Snapshot, threshold: int, *, allow_protected: bool = False) -> dict[str, Any]:
    """What keeps the node from clean, by kind (empty lists when clean), and why in words.
    `allow_protected`: trees the classifier protects (another job's, under slurmstepd or
    tmux) count as live too, for nodes that several jobs share."""
    allowed = {Verdict.NORMAL, Verdict.PROTECTED} if allow_protected else {Verdict.NORMAL}
    why: list[str] = []
    reading = snap.reading
    if not reading.up:
        why.append("nvml-unavailable: NVML did not answer, nothing shows the GPUs free")
    elif reading.errors:
        why.append("nvml-incomplete: " + "; ".join(m for _, m in reading.errors))
    # A scan that failed past NVML's read (its accounting, the search) shows nothing
    # clean: what it did not finish looking at is not evidence the GPUs are free.
    failed = [m for stage, m in snap.errors if stage == "scan"]
    if failed:
        why.append("scan-failed: " + "; ".join(failed))
    trees = [{"root_pid": t.root_pid, "root_start_time": t.root_start_time,
              "root_comm": t.root.comm if t.root is not None else None,
              "root_user": owner(t.root, snap.users) if t.root is not None else None,
              "verdict": t.verdict, "reason": t.reason, "gpu_bytes": t.gpu_bytes,
              "holders": [holder_json(h) for h in t.holders]}
             for t in snap.trees if t.verdict not in allowed]
    unattributed = [{"index": g.index, "uuid": g.uuid, "unattributed_bytes":
                     g.unattributed_bytes, "why_unknown": g.why_unknown}
                    for g in snap.accounting.gpus
                    if g.unattributed_bytes is None or g.unattributed_bytes > threshold]
    unlisted = [dataclasses.asdict(h) for h in snap.unlisted]
    unseen = [dataclasses.asdict(u) for u in snap.unseen if u.processes]
    for what, items in (("trees that are not " + " or ".join(sorted(allowed)), trees),
                        ("GPUs with memory no listed process accounts for", unattributed),
                        ("holders NVML does not list", unlisted),
                        ("GPUs with pids NVML lists that /proc lacks", unseen)):
        if items:
            why.append(f"{len(items)} {what}")
    search = snap.search
    return {"trees": trees, "unattributed": unattributed, "unlisted": unlisted,
            "unseen": unseen, "why": why,
            "search": None if search is None else dataclasses.asdict(search)}


def node_check_json(snap: Snapshot, hostname: str, threshold: int, *,
                    allow_protected: bool = False) -> dict[str, Any]:
    left = remaining(snap, threshold, allow_protected=allow_protected)
    why = left.pop("why")
    return {"schema": NODE_CHECK_SCHEMA, "hostname": hostname, "taken_at": snap.taken_at,
            "clean": not why, "why": why, "nvml": nvml_json(snap.reading),
            "threshold_bytes": threshold, "remaining": left}


def cmd_node_check(args: argparse.Namespace) -> int:
    """One scan judged for a gate: 0 clean, 1 not (or not shown clean), 2 bad config."""
    config = load(args.config)
    settings = dataclasses.replace(
        config.accounting.unlisted, unlisted_search_budget_processes=WHOLE_PASS,
        unlisted_search_budget_milliseconds=args.search_seconds * 1000)
    scanner = new_scanner(dataclasses.replace(
        config, accounting=dataclasses.replace(config.accounting, unlisted=settings)))
    try:
        snap = scanner.scan_once()
    finally:
        scanner.nvml.close()
    doc = node_check_json(snap, args.hostname, settings.unlisted_threshold_bytes,
                          allow_protected=args.allow_protected)
    if args.json:
        print_json(doc)
    elif doc["clean"]:
        print(f"{PROG}: node clean: GPU memory held only by live, normal trees")
    else:
        print(f"{PROG}: node not clean: " + "; ".join(doc["why"]))
    return EXIT_OK if doc["clean"] else EXIT_NOT_CLEAN
