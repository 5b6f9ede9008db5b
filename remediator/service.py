"""Build the remediator's services from the config: where start-up's side effects live.

`build_remediator` opens (or creates) the ledger in `state_dir`, checks that the
audit log can be written safely, and wires NVML, the reaper, the Alertmanager
client and pull mode's poller into one `Remediator`. It starts nothing: the
caller starts the worker (crash recovery, audit records, threads) once it is
ready to serve, and `remediator.app.create_app` only binds HTTP to it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

from gpuguard.config import Config
from gpuguard.host.counters import Counters
from gpuguard.host.launcher_memory import LAUNCHER_MEMORY_FILE, LauncherMemory
from gpuguard.host.marks import ensure_marks_dir
from gpuguard.host.procevents import ProcessEvents
from gpuguard.host.procfs import boot_id, boottime, identity_alive
from gpuguard.remediator.alertmanager import AlertmanagerClient
from gpuguard.remediator.audit import AuditLog
from gpuguard.remediator.inspection import HolderSource
from gpuguard.remediator.ledger import Ledger
from gpuguard.remediator.pull import Puller
from gpuguard.remediator.reaper import Reaper
from gpuguard.remediator.worker import Remediator

log = logging.getLogger(__name__)


def build_remediator(
    config: Config,
    *,
    hostname: str | None = None,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    boot_clock: Callable[[], float] = boottime,
    nvml: HolderSource | None = None,
    reaper: Reaper | None = None,
    alertmanager: AlertmanagerClient | None = None,
    events: ProcessEvents | None = None,
    counters: Counters | None = None,
    launchers: LauncherMemory | None = None,
) -> Remediator:
    """The Remediator (worker, ledger, audit) for `config`, not started.

    Raises LedgerError, UnsafePathError or OSError when the state directory or
    the audit log cannot be used; call `stop()` on the result when done with it.
    `clock` (wall) dates the audit; `boot_clock` counts ages, windows and due times.
    """
    counters = counters if counters is not None else Counters()
    if nvml is None:
        from gpuguard.host.nvml import Nvml

        nvml = Nvml(counters=counters)
    policy = config.remediate
    ledger = Ledger(policy.state_dir, clock=clock, boot_clock=boot_clock)
    audit = AuditLog(policy.audit_log)
    audit.check_writable()
    if launchers is None:
        launchers = LauncherMemory(os.path.join(policy.state_dir, LAUNCHER_MEMORY_FILE),
                                   boot=boot_id(), alive=identity_alive)
    if (problem := ensure_marks_dir(config.classify.marks_dir)) is not None:
        log.info("%s", problem)
    if reaper is None:
        reaper = Reaper(nvml=nvml, counters=counters, monotonic=monotonic)
    if alertmanager is None and policy.alertmanager is not None:
        alertmanager = AlertmanagerClient(policy.alertmanager)
    service = Remediator(config, hostname=hostname or socket.gethostname(), nvml=nvml,
                         ledger=ledger, audit=audit, counters=counters, reaper=reaper,
                         alertmanager=alertmanager, events=events, launchers=launchers,
                         clock=clock,
                         monotonic=monotonic)
    if alertmanager is not None and policy.alertmanager is not None and policy.alertmanager.pull:
        service.attach(Puller(service, alertmanager,
                              interval=policy.alertmanager.pull_interval_seconds))
    return service
