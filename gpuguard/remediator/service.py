"""The remediator service: its parts wired together, started and stopped as one.

`build_remediator` opens (or creates) the ledger in `state_dir`, checks that the
audit log can be written safely, and wires NVML, the reaper, the Alertmanager client
and pull mode's poller into one `Remediator`. It starts nothing: the caller starts it
(crash recovery, audit records, threads) once it is ready to serve, and
`gpuguard.remediator.app.create_app` only binds HTTP to it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.config import Config
from gpuguard.config.remediate import Mode
from gpuguard.engine.alerting.alertmanager import AlertmanagerClient
from gpuguard.engine.alerting.prometheus import PrometheusClient
from gpuguard.engine.platforms import (
    TreeReaper,
    platform_guardian,
    platform_reaper,
    protected_pids,
)
from gpuguard.engine.reap.audit import AuditLog, UnsafePathError
from gpuguard.engine.reap.thaw_guardian import ThawGuardian
from gpuguard.engine.scan.chain_watch import ChainWatch
from gpuguard.engine.scan.idle_watch import IdleWatch
from gpuguard.engine.scan.inspection import HolderSource
from gpuguard.engine.state.audit_trail import AuditTrail
from gpuguard.engine.state.clocks import Clocks
from gpuguard.engine.state.decision_log import DecisionLog
from gpuguard.engine.state.interrupted_reaps import InterruptedReaps
from gpuguard.engine.state.ledger import Ledger, StateUnavailable
from gpuguard.engine.state.metrics import Counts, RemediatorMetrics
from gpuguard.engine.state.reap_lock import host_reap_lock
from gpuguard.engine.state.refusals import RefusalMemory
from gpuguard.engine.state.workstate import WorkState
from gpuguard.gpu.vendors import gpu_source, vendor_source
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.host.launcher_memory import LAUNCHER_MEMORY_FILE, LauncherMemory
from gpuguard.host.marks import ensure_marks_dir
from gpuguard.host.platform import PLATFORM, Platform
from gpuguard.host.procfs import boot_id, boottime, identity_alive
from gpuguard.remediator.pull import Puller, PullSource
from gpuguard.remediator.screening import Intake
from gpuguard.remediator.status import HealthCode, Liveness, Status
from gpuguard.remediator.worker import Worker

log = logging.getLogger(__name__)
daemon_log = logging.getLogger("gpuguard.remediator")


class Companion(Liveness, Protocol):
    """A background loop that lives and dies with the worker (pull mode's poller)."""

    def start(self) -> None: ...
    def stop(self) -> None: ...


class Remediator:
    """Intake (thread-safe, fast) plus the worker thread that inspects, decides and reaps,
    over one shared WorkState; `status` answers /healthz and /state."""

    def __init__(
        self,
        config: Config,
        *,
        hostname: str,
        nvml: HolderSource,
        ledger: Ledger,
        audit: AuditLog,
        counters: Counters = COUNTERS,
        reaper: TreeReaper | None = None,
        alertmanager: AlertmanagerClient | None = None,
        events: ProcessEvents | None = None,
        launchers: LauncherMemory | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        guardian: ThawGuardian | None = None,
        audit_unusable: OSError | None = None,
        idle_nvml: HolderSource | None = None,
    ) -> None:
        """`idle_nvml`: the idle watch's own NVML reader (default: a new Nvml; it must not
        be `nvml`, whose reads by the reaper would consume the utilization samples)."""
        self.config = config
        self.audit_unusable = audit_unusable  # why the audit log cannot be used at start
        self.policy = config.remediate
        self.hostname = hostname
        self.nvml = nvml
        self.counters = counters
        self.ledger = ledger
        self.audit = audit
        self.reaper = (reaper if reaper is not None
                       else platform_reaper(nvml=nvml, counters=counters))
        self.alertmanager = alertmanager
        #: What pull mode polls (attach_puller): Alertmanager, Prometheus, or nothing.
        self.pull_source: PullSource | None = None
        self.events = events  # the kernel's process events: how launchers died
        self.launchers = launchers  # the first reason established per orphan root
        self.guardian = guardian  # the reaper's: started with the service, closed with it
        self.metrics = RemediatorMetrics()
        # The wall clock dates the audit and /state only; ages, rate-limit windows and
        # due times are on the ledger's boot clock, which no wall-clock step moves.
        clocks = Clocks(wall=clock, boot=ledger.boot_clock, monotonic=monotonic)
        work = WorkState(config, hostname, ledger, clocks, self.metrics,
                         DecisionLog(self.metrics, clocks), protected=protected_pids())
        self._work = work
        self._trail = AuditTrail(work, audit)
        #: One reap at a time on this host: the worker's, recovery's, and those of
        #: `gpuguard reap --apply` and MCP in other processes (state/reap_lock.py).
        self.reap_lock = host_reap_lock(work)
        self.interrupted = InterruptedReaps(work, self._trail, self.reaper, self.reap_lock)
        self.intake = Intake(work)
        if idle_nvml is None:
            # On the remediator's clocks: their offset moving is a wall-clock step, which
            # voids NVML's sample mark (gpuguard/orphans/idleness.py, SampleMark).
            idle_nvml = vendor_source(counters, wall=clocks.wall, boot=clocks.boot)
        self.idle = IdleWatch(idle_nvml, required=lambda: work.policy.idle_watch_seconds,
                              boot=clocks.boot, counters=counters)
        #: Keeps the exits of its holders' chains apart from the listener's general ring,
        #: so that a fork storm before the first delivery cannot erase a launcher's death.
        self.chain_watch = (ChainWatch(nvml, events, rules=lambda: work.config.classify,
                                       counters=counters) if events is not None else None)
        self.worker = Worker(work, trail=self._trail, refusals=RefusalMemory(work, self._trail),
                             reaper=self.reaper, nvml=nvml,
                             counters=counters, alertmanager=alertmanager, events=events,
                             launchers=launchers, idle=self.idle, reap_lock=self.reap_lock,
                             interrupted=self.interrupted)
        self._companions: list[Companion] = []
        self.status = Status(work, worker=self.worker, companions=self._companions,
                             trail=self._trail, recovery=self.interrupted)

    # -- lifecycle -------------------------------------------------------------------

    def attach(self, companion: Companion) -> None:
        """A background loop that lives and dies with the worker (pull mode's poller)."""
        self._companions.append(companion)

    def attach_puller(self, source: PullSource, interval: float) -> None:
        """Pull mode: poll `source` for this host's alerts every `interval` seconds."""
        self.pull_source = source
        self.attach(Puller(self.intake, source, interval=interval))

    def start(self) -> None:
        """Recover what a crash left (continue stopped trees), then start working.

        With a state directory that could not be written at load (read-only, full), the
        recovery still runs on what was read (what an interrupted reap left stopped is
        continued, audited where the log can be written), and then StateUnavailable (or,
        for an audit log that cannot be used, its OSError) is raised instead of starting:
        no new reap may begin without its state, and a restart (exit status 3) tries
        again once the disk is fixed.
        """
        if self.guardian is not None:
            self.guardian.start()  # not waited for: it comes up while recovery runs
        self.interrupted.settle()
        self._trail.pay()  # what an earlier run (or the recovery just now) owes the log
        if self.audit_unusable is not None:
            raise self.audit_unusable  # after recovery: what it stopped is continued anyway
        if (problem := self.ledger.unwritable) is not None:
            left = self._trail.owed_count()
            raise StateUnavailable(
                f"{problem}; crash recovery ran on the state as read"
                + (f" ({left} audit record(s) not yet written)"
                   if left else "") + "; nothing else starts until it can be written")
        if self.events is not None:
            self.events.start()  # never raises; without the connector it says so once
        if self.chain_watch is not None:
            self.chain_watch.start()  # its first read before any delivery is worked on
        self.worker.start()
        self.idle.start()
        for companion in self._companions:
            companion.start()
        if self.policy.mode == Mode.ENFORCE:
            daemon_log.warning("enforce mode: %s", self.guarantee())
        am = self.policy.alertmanager
        plain = [u for u in am.url if u.lower().startswith("http://")] if am else []
        if am is not None and am.credentials_file is None and plain:
            daemon_log.warning(
                "remediate.alertmanager: %s is plain http:// without credentials_file: "
                "nothing authenticates Alertmanager, and anyone who can POST alerts "
                "to it %s; put it behind authentication (its --web.config.file) "
                "and set credentials_file", ", ".join(plain),
                "chooses what this host reaps (pull mode)" if am.pull else "can confirm a reap")
        if am is not None and am.credentials_file is not None and plain:
            daemon_log.warning(
                "remediate.alertmanager.insecure_credentials_over_http: the token in %s goes "
                "in clear to %s: whoever holds that port (any local user who binds it while "
                "Alertmanager is not listening) gets it and can answer the confirmations; "
                "use https:// (with ca_file for a private CA)", am.credentials_file,
                ", ".join(plain))

        prom = self.policy.prometheus
        plain = [u for u in prom.url if u.lower().startswith("http://")] if prom else []
        if prom is not None and plain:
            daemon_log.warning(
                "remediate.prometheus: %s is plain http://%s: whoever answers there chooses "
                "which alerts this host hears of (Alertmanager still confirms every reap); "
                "use https:// (with ca_file for a private CA)", ", ".join(plain),
                "" if prom.credentials_file is None and prom.basic_auth is None
                else " and its credentials go in clear")

    def guarantee(self) -> str:
        """What stops a reap once an alert has been delivered, for the start-up log."""
        if self.alertmanager is not None:
            return ("every reap asks Alertmanager (" + ", ".join(self.alertmanager.urls)
                    + ") right before its first signal; a silence, an inhibition or a "
                    "resolved alert cancels it, and no answer refuses it")
        return ("remediate.alertmanager is not set: a reap runs only on a delivery (a tree "
                "too young waits for the next one, which a silence or inhibition prevents); "
                "once a delivery finds the tree old enough, it is reaped within milliseconds")

    def stop(self, timeout: float = 30.0) -> None:
        self.worker.request_stop()
        self.idle.stop()
        if self.chain_watch is not None:
            self.chain_watch.stop()
        for companion in self._companions:
            companion.stop()
        if self.events is not None:
            self.events.stop()
        self.worker.join(timeout)
        if self.guardian is not None and not self.worker.alive():
            # (A worker still reaping keeps it: this process's exit then tells it.)
            self.guardian.close()

    def wake(self) -> None:
        """Re-check the queue now (new work, or an injected clock moved)."""
        self._work.notify()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once nothing is due or in flight (tests; graceful shutdown)."""
        return self.worker.wait_idle(timeout)

    # -- what it reports -------------------------------------------------------------

    def healthy(self) -> tuple[bool, HealthCode, str]:
        """(ok, reason code, detail): see Status.health."""
        return self.status.health()

    def liveness_problem(self) -> HealthCode | None:
        """What a restart mends, if anything is degraded so: see Status.liveness_problem."""
        return self.status.liveness_problem()

    def snapshot(self) -> dict[str, Any]:
        """The JSON behind GET /state."""
        return self.status.snapshot()

    def counts(self) -> Counts:
        """A consistent copy of the counters for one scrape (HTTP threads mutate them)."""
        with self._work.lock:
            return self.metrics.counts(audit_ok=self._trail.problem() is None,
                                       audit_damaged_lines=self.audit.damaged_lines)

    def queue_depth(self) -> int:
        return len(self.ledger.pending())


def build_remediator(
    config: Config,
    *,
    hostname: str | None = None,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    boot_clock: Callable[[], float] = boottime,
    nvml: HolderSource | None = None,
    reaper: TreeReaper | None = None,
    alertmanager: AlertmanagerClient | None = None,
    events: ProcessEvents | None = None,
    counters: Counters | None = None,
    launchers: LauncherMemory | None = None,
    platform: Platform = PLATFORM,
) -> Remediator:
    """The Remediator (worker, ledger, audit) for `config`, not started.

    Raises LedgerError (StateUnavailable: for now), UnsafePathError or OSError when the
    state directory or the audit log cannot be used; call `stop()` on the result when
    done with it. A state directory that can be read but not written is not one of them:
    `start()` then recovers and raises.
    `clock` (wall) dates the audit; `boot_clock` counts ages, windows and due times.
    """
    counters = counters if counters is not None else Counters()
    if nvml is None:  # Windows': WDDM sizes what NVML lists under WDDM but cannot size.
        # Its reads (inspection, reaper) never ask for utilization: only the idle watch's
        # own reader does, so no read of this one consumes its samples.
        nvml = gpu_source(platform, counters, process_utilization=False)
    policy = config.remediate
    ledger = Ledger(policy.state_dir, clock=clock, boot_clock=boot_clock)
    audit = AuditLog(policy.audit_log)
    try:
        audit.check_writable()
        audit_unusable: OSError | None = None
    except UnsafePathError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink planted at the log: a person must look
            raise
        audit_unusable = exc  # read-only, full: crash recovery still runs (start())
    if launchers is None:
        launchers = LauncherMemory(os.path.join(policy.state_dir, LAUNCHER_MEMORY_FILE),
                                   boot=boot_id(), alive=identity_alive)
    if (problem := ensure_marks_dir(config.classify.marks_dir)) is not None:
        log.info("%s", problem)
    guardian = None
    if reaper is None:
        guardian = platform_guardian(platform)
        reaper = platform_reaper(platform, nvml=nvml, counters=counters, monotonic=monotonic,
                                 guardian=guardian)
    if alertmanager is None and policy.alertmanager is not None:
        alertmanager = AlertmanagerClient(policy.alertmanager)
    service = Remediator(config, hostname=hostname or socket.gethostname(), nvml=nvml,
                         ledger=ledger, audit=audit, counters=counters, reaper=reaper,
                         alertmanager=alertmanager, events=events, launchers=launchers,
                         clock=clock, monotonic=monotonic, guardian=guardian,
                         audit_unusable=audit_unusable)
    if alertmanager is not None and policy.alertmanager is not None and policy.alertmanager.pull:
        service.attach_puller(alertmanager, policy.alertmanager.pull_interval_seconds)
    elif policy.prometheus is not None:  # the config requires alertmanager with it
        service.attach_puller(PrometheusClient(policy.prometheus),
                              policy.prometheus.pull_interval_seconds)
    return service

