"""Live, read-only inspection of one tree: the facts policy.decide() and a reap judge.

Reads /proc (through a fresh ProcessView) and NVML, re-runs classify(), and never
signals anything; the reaper (remediator/reaper.py) is the module that acts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Protocol

from gpuguard.exporter.classify import Rules, classify
from gpuguard.exporter.counters import COUNTERS, Counters
from gpuguard.exporter.nvml import NvmlReading
from gpuguard.exporter.procfs import ExitSource, ProcessView, ProcInfo
from gpuguard.exporter.scanner import user_name
from gpuguard.remediator.policy import LiveTree, Member, TreeKey


class HolderSource(Protocol):
    """What the remediator needs from exporter.nvml.Nvml (a stub in tests)."""

    def read(self) -> NvmlReading: ...


def member_of(info: ProcInfo, view: ProcessView) -> Member:
    status = view.status(info)
    kthread = (status.kernel_thread if status is not None else False) or info.ppid == 2
    return Member(pid=info.pid, ppid=info.ppid, start_time=info.start_time, uid=info.uid,
                  user=user_name(info.uid), comm=info.comm, state=info.state,
                  kernel_thread=kthread)


def nvml_problem(reading: NvmlReading, expected_gpus: Iterable[str] = ()) -> tuple[str, str] | None:
    """(reason, detail) when a reading cannot confirm a tree; None when it can.

    A holder list is only as complete as the reading: a lost GPU, a failed process
    query or any per-device error may hide a holder that would change the verdict
    (a nohup'd job on the lost GPU), and so may a GPU that an earlier check saw and
    this one does not.
    """
    if not reading.up:
        return "nvml-unavailable", "; ".join(msg for _, msg in reading.errors) or "NVML is down"
    if reading.errors:
        return "nvml-incomplete", "; ".join(msg for _, msg in reading.errors)
    missing = sorted(set(expected_gpus) - {gpu.uuid for gpu in reading.gpus})
    if missing:
        return "nvml-incomplete", (f"GPU(s) {', '.join(missing)} reported at the first check "
                                   "are missing now")
    return None


def inspect_tree(key: TreeKey, *, nvml: HolderSource, rules: Rules,
                 counters: Counters = COUNTERS, expected_gpus: Iterable[str] = (),
                 events: ExitSource | None = None) -> LiveTree:
    """Re-read the root, re-query NVML, re-run classify(): the facts policy.decide() judges.

    Every call reads /proc afresh through a new ProcessView: a fact cached at an
    earlier check (a SIGHUP disposition, a cgroup) may have changed since. `events`
    (the remediator's own process-event listener) says how a launcher died.
    """
    view = ProcessView(counters=counters, events=events)
    info = view.fresh_stat(key.root_pid)
    if info is None:
        return LiveTree(root=None)
    root = member_of(info, view)
    if info.is_zombie or info.start_time != key.root_start_time:
        return LiveTree(root=root)
    reading = nvml.read()
    gpus = tuple(gpu.uuid for gpu in reading.gpus)
    problem = nvml_problem(reading, expected_gpus)
    if problem is not None:
        return LiveTree(root=root, nvml_reason=problem[0], nvml_error=problem[1], gpus=gpus)
    wanted = (key.root_pid, key.root_start_time)
    tree = next((t for t in classify(reading.holders, view, rules)
                 if t.root is not None and t.root.identity == wanted), None)
    if tree is None:
        return LiveTree(root=root, gpus=gpus)
    members = tuple(member_of(m, view) for m in tree.members) or (root,)
    return LiveTree(root=root, tree_found=True, verdict=tree.verdict, reason=tree.reason,
                    detail=tree.evidence.detail, members=members, holders=tree.holders,
                    gpu_bytes=tree.gpu_bytes, gpus=gpus)


def protected_pids(view: ProcessView | None = None) -> frozenset[int]:
    """PID 1, this process and every ancestor: never to be signalled, whatever the alert says."""
    view = view if view is not None else ProcessView(counters=Counters())
    pids = {1, os.getpid()}
    pid = os.getpid()
    for _ in range(256):
        info = view.fresh_stat(pid)
        if info is None or info.ppid <= 0:
            break
        pids.add(info.ppid)
        pid = info.ppid
    return frozenset(pids)
