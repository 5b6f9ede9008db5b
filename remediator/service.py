"""Build the remediator's services from the config: where start-up's side effects live.

`build_remediator` opens (or creates) the ledger in `state_dir`, checks that the
audit log can be written safely, and wires NVML, the reaper, the Alertmanager
client and pull mode's poller into one `Remediator`. It starts nothing: the
caller starts the worker (crash recovery, audit records, threads) once it is
ready to serve, and `remediator.app.create_app` only binds HTTP to it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from gpuguard.exporter.config import Config
from gpuguard.exporter.counters import Counters
from gpuguard.exporter.procevents import ProcessEvents
from gpuguard.remediator.alertmanager import AlertmanagerClient
from gpuguard.remediator.audit import AuditLog
from gpuguard.remediator.inspection import HolderSource
from gpuguard.remediator.ledger import Ledger
from gpuguard.remediator.pull import Puller
from gpuguard.remediator.reaper import Reaper
from gpuguard.remediator.worker import Remediator


def build_remediator(
    config: Config,
    *,
    hostname: str | None = None,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    nvml: HolderSource | None = None,
    reaper: Reaper | None = None,
    alertmanager: AlertmanagerClient | None = None,
    events: ProcessEvents | None = None,
    counters: Counters | None = None,
) -> Remediator:
    """The Remediator (worker, ledger, audit) for `config`, not started.

    Raises LedgerError, UnsafePathError or OSError when the state directory or
    the audit log cannot be used; call `stop()` on the result when done with it.
    """
    counters = counters if counters is not None else Counters()
    if nvml is None:
        from gpuguard.exporter.nvml import Nvml

        nvml = Nvml(counters=counters)
    policy = config.remediate
    ledger = Ledger(policy.state_dir, clock=clock)
    audit = AuditLog(policy.audit_log)
    audit.check_writable()
    if reaper is None:
        reaper = Reaper(nvml=nvml, counters=counters, monotonic=monotonic)
    if alertmanager is None and policy.alertmanager is not None:
        alertmanager = AlertmanagerClient(policy.alertmanager)
    service = Remediator(config, hostname=hostname or socket.gethostname(), nvml=nvml,
                         ledger=ledger, audit=audit, counters=counters, reaper=reaper,
                         alertmanager=alertmanager, events=events, clock=clock,
                         monotonic=monotonic)
    if alertmanager is not None and policy.alertmanager is not None and policy.alertmanager.pull:
        service.attach(Puller(service, alertmanager,
                              interval=policy.alertmanager.pull_interval_seconds))
    return service
