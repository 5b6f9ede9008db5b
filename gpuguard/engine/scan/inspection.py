"""Live, read-only inspection of one tree: the facts policy.decide() and a reap judge.

Reads /proc (through a fresh ProcessView) and NVML, re-runs classify(), and never
signals anything; the reaper (gpuguard/engine/reap/reaper.py) is the module that acts. On
Windows the same questions are answered from a fresh process table and the Windows rules
(gpuguard/engine/windows/inspection.py); gpuguard/engine/platforms.py's inspect_tree and
protected_pids give the platform's (the programs call those).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Protocol

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.engine.decision.tree import LiveTree, Member, TreeKey
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.launchers import ExitSource
from gpuguard.host.procfs import ProcessView
from gpuguard.host.users import USERS
from gpuguard.orphans.classify import classify
from gpuguard.orphans.process import ProcInfo
from gpuguard.orphans.protections import ProcSource
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.vocabulary import DecisionReason


class HolderSource(Protocol):
    """What the remediator needs from a GPU source (gpuguard/gpu/source.py; a stub in tests)."""

    def read(self) -> GpuReading: ...


def member_of(info: ProcInfo, view: ProcSource) -> Member:
    """One process as policy.member_refusal() judges it; its owner named by gpuguard/host/users.py
    (every path that judges a member: the worker's inspection, the reaper's re-reads,
    `gpuguard reap`), which never remembers that a uid had no name."""
    status = view.status(info)
    kthread = (status.kernel_thread if status is not None else False) or info.ppid == 2
    name = USERS.name(info.uid)
    return Member(pid=info.pid, ppid=info.ppid, start_time=info.start_time, uid=info.uid,
                  user=name if name is not None else str(info.uid), comm=info.comm,
                  state=info.state, kernel_thread=kthread, user_known=name is not None)


def nvml_problem(reading: GpuReading, expected_gpus: Iterable[str] = (),
                 ) -> tuple[DecisionReason, str] | None:
    """(reason, detail) when a reading cannot confirm a tree; None when it can.

    A holder list is only as complete as the reading: a lost GPU, a failed process
    query or any per-device error may hide a holder that would change the verdict
    (a nohup'd job on the lost GPU), and so may a GPU that an earlier check saw and
    this one does not.
    """
    if not reading.up:
        return (DecisionReason.NVML_UNAVAILABLE,
                "; ".join(msg for _, msg in reading.errors) or "NVML is down")
    if reading.errors:
        return DecisionReason.NVML_INCOMPLETE, "; ".join(msg for _, msg in reading.errors)
    missing = sorted(set(expected_gpus) - {gpu.uuid for gpu in reading.gpus})
    if missing:
        return DecisionReason.NVML_INCOMPLETE, (f"GPU(s) {', '.join(missing)} reported at the "
                                                "first check are missing now")
    return None


class NvmlTimeout(Exception):
    """NVML did not answer within the time a caller could wait (a hung driver)."""


def read_within(nvml: HolderSource, seconds: float) -> GpuReading:
    """`nvml.read()`, waited for at most `seconds`; NvmlTimeout when it takes longer.

    The read runs on a daemon thread: a driver call cannot be interrupted, so one that
    hangs is left to finish (or not) on its own, and the caller goes on without it (a
    reap with its tree frozen continues the tree: principle 2). The wait itself can be
    interrupted (a signal handler's exception reaches the caller at once). What the read
    raises is raised here.
    """
    if getattr(nvml, "never_blocks", False):
        # A reading that cannot hang (the launcher's, which loads no NVML) needs no
        # thread; the pidns tier's launcher can start none (its children's PID namespace
        # is not its own: clone(CLONE_THREAD) fails with EINVAL).
        return nvml.read()
    box: list[GpuReading | BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            box.append(nvml.read())
        except BaseException as exc:  # handed to the waiting caller, never lost
            box.append(exc)
        finally:
            done.set()

    threading.Thread(target=read, name="gpuguard-nvml-read", daemon=True).start()
    if not done.wait(max(seconds, 0.0)):
        raise NvmlTimeout(f"NVML did not answer within {max(seconds, 0.0):.1f}s")
    answer = box[0]
    if isinstance(answer, BaseException):
        raise answer
    return answer


def inspect_proc_tree(key: TreeKey, *, nvml: HolderSource, rules: Rules,
                      counters: Counters = COUNTERS, expected_gpus: Iterable[str] = (),
                      events: ExitSource | None = None,
                      memory: LauncherMemory | None = None,
                      reading: GpuReading | None = None) -> LiveTree:
    """The live tree over /proc (engine/platforms.py's inspect_tree on Linux).

    Every call reads /proc afresh through a new ProcessView: a fact cached at an
    earlier check (a SIGHUP disposition, a cgroup) may have changed since. `events`
    (the remediator's own process-event listener) says how a launcher died; `memory`
    keeps the first reason established for each root (gpuguard/host/launcher_memory.py).
    `reading`, when given, is used instead of asking `nvml` (the reaper's re-check with
    the tree frozen reads NVML itself, bounded by its deadline). (`events` and `memory`
    have no Windows counterpart.)
    """
    view = ProcessView(counters=counters, events=events, memory=memory)
    info = view.fresh_stat(key.root_pid)
    if info is None:
        return LiveTree(root=None)
    root = member_of(info, view)
    if info.is_zombie or info.start_time != key.root_start_time:
        return LiveTree(root=root)
    if reading is None:
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


def proc_protected_pids(view: ProcSource | None = None) -> frozenset[int]:
    """PID 1, this process and every ancestor, over /proc (`view`, default a fresh one):
    never to be signalled (engine/platforms.py's protected_pids on Linux)."""
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
