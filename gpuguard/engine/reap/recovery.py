"""Crash recovery of a reap's held marks: after a crash mid-reap the tree may be left
frozen; every member the reap had marked held is continued (SIGCONT) and left alive.
Killing it again needs a new decision."""

from __future__ import annotations

import signal
from collections.abc import Iterable

from gpuguard.base.counters import Counters
from gpuguard.config.remediate import Remediate
from gpuguard.engine.reap.outcome import KillPath, SignalRecord
from gpuguard.engine.reap.reap_run import NoPidfd, ReapRun
from gpuguard.engine.reap.signalling import Signaller
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.rules_config import Rules


def thaw_interrupted(signaller: Signaller, counters: Counters,
                     members: Iterable[tuple[int, int]]) -> tuple[SignalRecord, ...]:
    """SIGCONT every (pid, start_time) that is still that process and may be stopped.

    The caller audits first, and passes only members the interrupted reap may have
    stopped itself: marked held (written right before their SIGSTOP, cleared once the
    reap continued them, or, for those it never stopped, once it gave up) and not
    stopped already when the reap found them (a reap refuses such a member before
    recording it: only an earlier version's state file has one; every member a reap
    sent SIGSTOP is marked held first). /proc never says who stopped a process: a stop
    its owner sent after the crash cannot be told from ours, and is continued too (the
    freeze was ours). A member the reap never stopped, or had already continued, is
    never continued here.
    """
    run = ReapRun(started=signaller.monotonic(), path=signaller.path,
                  view=ProcessView(counters=counters), policy=Remediate(), rules=Rules(),
                  protected=frozenset(), journal=None)
    try:
        for pid, start_time in members:
            try:
                target, _ = signaller.open(run, pid, start_time)
            except NoPidfd:
                signaller.drop_pidfd()
                run.path = KillPath.PID
                target, _ = signaller.open(run, pid, start_time)
            if target is None:
                continue
            run.targets[pid] = target
            if signaller.maybe_stopped(run, target):
                signaller.send(run, target, signal.SIGCONT)
    finally:
        signaller.close(run)
    return tuple(run.signals)
