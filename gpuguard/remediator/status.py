"""The remediator's health (/healthz, /state's "health") and GET /state's document."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from gpuguard.base.compat import StrEnum
from gpuguard.engine.decision.policy import rate_budget
from gpuguard.engine.reap.killing import KILL_CONFIRM_SECONDS
from gpuguard.engine.state.audit_trail import AuditTrail
from gpuguard.engine.state.reap_window import WindowUnreadable, read_manual_reaps
from gpuguard.engine.state.workstate import WorkState


class HealthCode(StrEnum):
    """The reason code /healthz answers (it is open to anyone: no paths, keys or errors)."""

    OK = "ok"
    WORKER_STOPPED = "worker-stopped"
    POLLER_STOPPED = "poller-stopped"
    STATE_UNWRITABLE = "state-unwritable"
    AUDIT_LOG_UNWRITABLE = "audit-log-unwritable"
    WORKER_STUCK = "worker-stuck"
    POLLER_STALLED = "poller-stalled"  # no poll completed for STALLED_INTERVALS intervals
    POLLER_FAILING = "poller-failing"  # FAILED_POLLS_UNHEALTHY failed polls in a row
    #: a reap a crash cut short left processes stopped, and their SIGCONT waits for the
    #: host's reap lock, which another reaper holds
    RECOVERY_WAITING = "recovery-waiting"

    @property
    def restart_mends(self) -> bool:
        """A stopped or hung thread, which a restart mends: what fails /-/healthy (the
        liveness probe). An unwritable disk or an Alertmanager outage a restart does not
        mend: a liveness probe that failed on them would restart the daemon in a loop,
        and hide the cause behind GPUGuardRemediatorDown; /healthz still says them."""
        return self in _RESTART_MENDS


_RESTART_MENDS = frozenset({HealthCode.WORKER_STOPPED, HealthCode.POLLER_STOPPED,
                            HealthCode.WORKER_STUCK, HealthCode.POLLER_STALLED})


class Liveness(Protocol):
    def alive(self) -> bool: ...


class RecoveryWait(Protocol):
    """Crash recovery as /healthz sees it (engine/state/interrupted_reaps.py)."""

    @property
    def unsettled(self) -> Sequence[object]: ...
    @property
    def waiting(self) -> str | None: ...


@runtime_checkable
class Degradable(Protocol):
    """A companion that can be alive and still not doing its job (pull mode's poller)."""

    def problem(self) -> tuple[HealthCode, str] | None: ...


class WorkerHealth(Liveness, Protocol):
    """What health needs of the worker: its thread, and its last state-write error."""

    state_error: str | None


class Status:
    def __init__(self, work: WorkState, *, worker: WorkerHealth, companions: Sequence[Liveness],
                 trail: AuditTrail, recovery: RecoveryWait | None = None) -> None:
        self._work = work
        self._worker = worker
        self._companions = companions
        self._trail = trail
        self._recovery = recovery

    def health(self) -> tuple[bool, HealthCode, str]:
        """(ok, reason code, detail): /healthz answers the code alone (it is open to
        anyone); the detail (paths, keys) is for the log and for /state."""
        for code, detail in self.problems():
            return False, code, detail
        return True, HealthCode.OK, "ok"

    def liveness_problem(self) -> HealthCode | None:
        """The first degraded state now that a restart mends (/-/healthy, the liveness
        probe), None when there is none. Not /healthz's one code: that is the first of
        all, and an unwritable audit log's would hide a worker stuck behind it."""
        return next((code for code, _ in self.problems() if code.restart_mends), None)

    def problems(self) -> Iterator[tuple[HealthCode, str]]:
        """Every degraded state now, with its detail, in the order /healthz chooses."""
        if not self._worker.alive():
            yield HealthCode.WORKER_STOPPED, "worker thread is not running"
        if not all(companion.alive() for companion in self._companions):
            yield HealthCode.POLLER_STOPPED, "the pull-mode poller is not running"
        if (state_error := self._worker.state_error) is not None:
            yield HealthCode.STATE_UNWRITABLE, (f"state cannot be written "
                                                f"({state_error}): no work proceeds")
        if (audit_problem := self._trail.problem()) is not None:
            yield HealthCode.AUDIT_LOG_UNWRITABLE, (
                f"audit log: {audit_problem}: no signal goes out without its record, and "
                "a record of one already sent is written once the log can take it")
        busy, limit = self.worker_busy()
        if busy > limit:
            yield HealthCode.WORKER_STUCK, f"worker stuck on one item for over {limit:g}s"
        if (problem := self.poller_problem()) is not None:
            yield problem
        if (waiting := self.recovery_waiting()) is not None:
            yield HealthCode.RECOVERY_WAITING, waiting

    def recovery_waiting(self) -> str | None:
        """What crash recovery waits for, while it waits: the processes an interrupted
        reap left stopped stay stopped until the host's reap lock is free."""
        recovery = self._recovery
        if recovery is None or not recovery.unsettled or recovery.waiting is None:
            return None
        return (f"{len(recovery.unsettled)} interrupted reap(s) left processes stopped; "
                f"continuing them waits for the host's reap lock ({recovery.waiting})")

    def worker_busy(self) -> tuple[float, float]:
        """(seconds the worker has been on its current item, 0 when idle; the most one item
        may take: the reap's deadline, then SIGTERM's wait and SIGKILL's, and 30 s of
        slack for inspection and records)."""
        busy = self._work.busy_since
        policy = self._work.policy
        limit = (policy.worker_timeout_seconds + policy.term_timeout_seconds
                 + KILL_CONFIRM_SECONDS + 30)
        return (0.0 if busy is None else max(0.0, self._work.clocks.monotonic() - busy)), limit

    def poller_problem(self) -> tuple[HealthCode, str] | None:
        """The first companion's reason to be degraded (pull mode: polls failing or none
        completing), None when there is none."""
        for companion in self._companions:
            if isinstance(companion, Degradable) and (problem := companion.problem()):
                return problem
        return None

    def snapshot(self) -> dict[str, Any]:
        """The JSON behind GET /state."""
        work = self._work
        on_wall = work.clocks.on_wall
        try:  # the other paths' reaps count in the same window (reap_window.py)
            others = read_manual_reaps(work.ledger.dir, boot=work.ledger.boot_id)
        except WindowUnreadable:
            others = ()
        with work.lock:
            now = work.clocks.boot()
            budget = rate_budget(work.policy_state(now, other_reaps=others))
            recent = work.decisions.recent()
            current = work.current
        pending = sorted(work.ledger.pending().values(), key=lambda i: i.due)
        return {  # times as Unix seconds: the boot clock means nothing to a person
            "hostname": work.hostname,
            "mode": work.policy.mode,
            "in_flight": str(current) if current else None,
            "pending": [{"key": str(i.key), "due": on_wall(i.due),
                         "accepted_at": on_wall(i.accepted_at),
                         "fingerprint": i.alert.fingerprint, "group_key": i.group_key}
                        for i in pending if i.key != current],
            "rate_limit": {"max_reaps": budget.max_reaps, "per_seconds": budget.per_seconds,
                           "used": budget.used, "remaining": budget.remaining,
                           "per_user": budget.per_user, "by_owner": dict(budget.owners),
                           "next_slot_at": None if budget.next_slot_at is None
                           else on_wall(budget.next_slot_at)},
            "recent_decisions": recent[::-1],
            "recovery_waiting": self.recovery_waiting(),
        }
