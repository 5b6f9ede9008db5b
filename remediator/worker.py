"""The remediator's one worker thread, and the intake the HTTP handler calls.

The handler only screens alerts (labels, host, dedupe) and records accepted
ones in the ledger, so it answers in milliseconds; everything slow or
dangerous (NVML, /proc, signals) happens here, one tree at a time, under a
per-item time limit. Decisions come from policy.decide(); this module gathers
the facts, carries the decision out and writes it down (ledger, audit, metrics).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gpuguard.config import Config
from gpuguard.host.counters import COUNTERS, Counters
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.procevents import ProcessEvents
from gpuguard.remediator.alertmanager import (
    FIRING,
    INHIBITED,
    NOT_FIRING,
    SILENCED,
    AlertmanagerClient,
    Confirmation,
)
from gpuguard.remediator.alerts import Alert, Notification
from gpuguard.remediator.audit import INTENT, AuditLog, audit_record, iso_time
from gpuguard.remediator.inspection import HolderSource, inspect_tree, protected_pids
from gpuguard.remediator.ledger import Ledger, LedgerError, PendingItem
from gpuguard.remediator.policy import (
    ACCEPT,
    CANCEL,
    DEFER,
    DRY_RUN,
    IGNORE,
    REAP,
    Decision,
    LiveTree,
    Member,
    PolicyState,
    TreeKey,
    decide,
    policy_state,
    rate_budget,
    screen,
)
from gpuguard.remediator.reaper import KILL_CONFIRM_SECONDS, Outcome, Reaper, ReapPlan, ReapResult

log = logging.getLogger("gpuguard.remediator")

#: After a failed state write (or a bug) on an item, the worker waits this long.
STATE_RETRY_SECONDS = 1.0
#: Longest the worker sleeps without re-reading the clock (an injected clock may jump).
MAX_IDLE_WAIT_SECONDS = 1.0
RECENT_DECISIONS = 200
#: A tree refused for the same reason, with the same members, is audited once in full and
#: then only counted: the next full record says how many repeats it stands for. Within
#: this many seconds (boot clock) of a refusal, a delivery for the same tree is counted
#: without a new inspection (a refusal stands; a reap waits at most this long).
REFUSAL_RECHECK_SECONDS = 60.0
#: Trees whose last refusal is remembered (oldest forgotten first): junk alerts naming
#: random roots cannot grow it.
REFUSALS_REMEMBERED = 4096


@dataclass
class _Refusal:
    """The last refusal of one tree: what it said, when it was inspected, and how many
    identical ones were counted instead of audited since its full record."""

    decision: Decision
    signature: tuple[object, ...]
    inspected_at: float  # boot clock
    repeats: int = 0
REJECT_CAUSES = ("unauthorized", "too_large", "not_json", "malformed", "state_unwritable")

#: Alertmanager's answers at kill time that withdraw a reap (a person or a rule chose so);
#: "unreachable" is not one of them: it is a refusal, retried on the next delivery.
CANCELLED_BY_ALERTMANAGER = (SILENCED, INHIBITED, NOT_FIRING)
UNREACHABLE_REASON = "alertmanager-unreachable"

#: Per-alert answer in the HTTP response, by decision action.
_ACCOUNT = {ACCEPT: "accepted", CANCEL: "cancelled", IGNORE: "ignored"}


@dataclass(frozen=True)
class Account:
    """What happened to one alert of a delivery, as answered to Alertmanager."""

    index: int
    fingerprint: str
    status: str  # accepted | ignored | duplicate | cancelled
    reason: str
    detail: str
    key: str | None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "fingerprint": self.fingerprint, "status": self.status,
                "reason": self.reason, "detail": self.detail, "key": self.key}


class Companion(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def alive(self) -> bool: ...


class Remediator:
    """Intake (thread-safe, fast) plus the worker thread that inspects, decides and reaps."""

    def __init__(
        self,
        config: Config,
        *,
        hostname: str,
        nvml: HolderSource,
        ledger: Ledger,
        audit: AuditLog,
        counters: Counters = COUNTERS,
        reaper: Reaper | None = None,
        alertmanager: AlertmanagerClient | None = None,
        events: ProcessEvents | None = None,
        launchers: LauncherMemory | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.policy = config.remediate
        self.hostname = hostname
        self.nvml = nvml
        self.counters = counters
        self.ledger = ledger
        self.audit = audit
        self.reaper = reaper if reaper is not None else Reaper(nvml=nvml, counters=counters)
        self.alertmanager = alertmanager
        self.events = events  # the kernel's process events: how launchers died
        self.launchers = launchers  # the first reason established per orphan root
        self._companions: list[Companion] = []
        self._clock = clock  # the wall clock: audit and /state times only
        # Ages, rate-limit windows and due times: the ledger's boot clock, which no
        # wall-clock step moves (PolicyState.now).
        self._boot_clock = ledger.boot_clock
        self._monotonic = monotonic
        self._lock = threading.Lock()  # intake + worker hand-over; never held across I/O to /proc
        self._wake = threading.Condition(threading.Lock())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._protected = protected_pids()
        self._current: TreeKey | None = None
        self._cancelled: set[TreeKey] = set()
        self._busy_since: float | None = None
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_DECISIONS)
        self._refusals: OrderedDict[TreeKey, _Refusal] = OrderedDict()
        # metrics
        self.refusals_repeated = 0  # identical refusals counted instead of audited
        self.decisions: dict[tuple[str, str], int] = {}
        self.rejected = dict.fromkeys(REJECT_CAUSES, 0)
        self.reaped_processes = 0
        self.reclaimed_bytes = 0
        self.reap_failures = 0
        self.audit_failures = 0
        self._audit_error: str | None = None  # the last audit write failed: unhealthy
        self._unsettled = list(ledger.interrupted)  # reaps a crash cut short, not yet settled
        self._state_error: str | None = None  # the last state write failed: unhealthy

    # -- lifecycle -------------------------------------------------------------------

    def attach(self, companion: Companion) -> None:
        """A background loop that lives and dies with the worker (pull mode's poller)."""
        self._companions.append(companion)

    def start(self) -> None:
        """Recover what a crash left (continue stopped trees), then start working."""
        self._settle_interrupted()
        if self.events is not None:
            self.events.start()  # never raises; without the connector it says so once
        self._thread = threading.Thread(target=self._run, name="gpuguard-remediator-worker",
                                        daemon=True)
        self._thread.start()
        for companion in self._companions:
            companion.start()
        if self.policy.mode == "enforce":
            log.warning("enforce mode: %s", self.guarantee())
        am = self.policy.alertmanager
        plain = [u for u in am.url if u.lower().startswith("http://")] if am else []
        if am is not None and am.credentials_file is None and plain:
            log.warning("remediate.alertmanager: %s is plain http:// without credentials_file: "
                        "nothing authenticates Alertmanager, and anyone who can POST alerts "
                        "to it %s; put it behind authentication (its --web.config.file) "
                        "and set credentials_file", ", ".join(plain),
                        "chooses what this host reaps (pull mode)" if am.pull
                        else "can confirm a reap")

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
        self._stop.set()
        self.wake()
        for companion in self._companions:
            companion.stop()
        if self.events is not None:
            self.events.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def wake(self) -> None:
        """Re-check the queue now (new work, or an injected clock moved)."""
        with self._wake:
            self._wake.notify_all()

    def healthy(self) -> tuple[bool, str, str]:
        """(ok, reason code, detail): /healthz answers the code alone (it is open to
        anyone); the detail (paths, keys) is for the log and for /state."""
        if self._thread is None or not self._thread.is_alive():
            return False, "worker-stopped", "worker thread is not running"
        if not all(companion.alive() for companion in self._companions):
            return False, "poller-stopped", "the Alertmanager poller is not running"
        if self._state_error is not None:
            return False, "state-unwritable", (f"state cannot be written ({self._state_error}):"
                                               " no work proceeds")
        if self._unsettled:
            keys = ", ".join(str(k) for k, _ in self._unsettled)
            return False, "reaps-unsettled", (f"interrupted reap(s) {keys} not settled (audit "
                                              "log not writable): their trees may be left "
                                              "stopped")
        if self._audit_error is not None:
            return False, "audit-log-unwritable", (f"audit log cannot be written "
                                                   f"({self._audit_error}): no reap can run")
        busy = self._busy_since
        limit = (self.policy.worker_timeout_seconds + self.policy.term_timeout_seconds
                 + KILL_CONFIRM_SECONDS + 30)
        if busy is not None and self._monotonic() - busy > limit:
            return False, "worker-stuck", f"worker stuck on one item for over {limit:g}s"
        return True, "ok", "ok"

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once nothing is due or in flight (tests; graceful shutdown)."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while True:
                item = self.ledger.next_due()
                due = item is not None and item.due <= self._boot_clock()
                if not due and self._current is None:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.05))

    # -- intake (HTTP threads) -------------------------------------------------------

    def reject(self, cause: str) -> None:
        with self._lock:
            self.rejected[cause] += 1

    def submit(self, notification: Notification, *, source: str = "http") -> list[Account]:
        """Screen each alert, queue the acceptable ones durably, answer per alert."""
        if notification.truncated_alerts:
            log.warning("delivery %s had %d truncated alert(s): set max_alerts: 0 on the "
                        "webhook receiver", notification.group_key, notification.truncated_alerts)
        accounts: list[Account] = []
        queued: list[PendingItem] = []
        with self._lock:
            now = self._boot_clock()
            state = self._state(now)
            pending = set(state.pending)
            for index, alert in enumerate(notification.alerts):
                decision = screen(alert, _with_pending(state, pending))
                key = decision.key
                if decision.action == ACCEPT and key is not None:
                    pending.add(key)
                    queued.append(PendingItem(key, alert, notification.group_key, now, now))
                elif decision.action == CANCEL and key is not None:
                    self._cancel(key)
                    pending.discard(key)
                    queued = [q for q in queued if q.key != key]
                elif alert.status == "resolved" and key is not None and key == self._current:
                    self._cancelled.add(key)  # past the pending stage: stop before any signal
                    decision = Decision(CANCEL, "resolved", "resolved while in flight: the reap "
                                        "stops unless it has already signalled", key)
                status = _ACCOUNT.get(decision.action, "ignored")
                if decision.reason == "duplicate":
                    status = "duplicate"
                accounts.append(Account(index, alert.fingerprint, status, decision.reason,
                                        decision.detail, str(key) if key else None))
                self._note(decision, alert, notification.group_key, source=source)
            self.ledger.add_pending(queued)
        if queued:
            self.wake()
        return accounts

    def _cancel(self, key: TreeKey) -> None:
        """Withdraw a pending key; if the worker holds it now, stop it before any signal."""
        if key == self._current:
            self._cancelled.add(key)
        self.ledger.remove_pending(key)

    # -- state -----------------------------------------------------------------------

    def _state(self, now: float, *, exclude: TreeKey | None = None) -> PolicyState:
        """The policy's view at boot-clock time `now`."""
        return policy_state(self.policy, self.hostname, self.ledger, now, self._protected,
                            wall_now=self._clock(), exclude=exclude)

    def _on_wall(self, boot_time: float) -> float:
        """A boot-clock time as Unix seconds, for people (the clocks' offset now)."""
        return boot_time + (self._clock() - self._boot_clock())

    def _note(self, decision: Decision, alert: Alert | None, group_key: str, *,
              source: str) -> None:
        """Count a decision and keep it for /state (caller holds self._lock)."""
        slot = (decision.action, decision.reason)
        self.decisions[slot] = self.decisions.get(slot, 0) + 1
        shown = decision.to_json()
        if decision.recheck_at is not None:
            shown["recheck_at"] = self._on_wall(decision.recheck_at)
        self._recent.append({
            "time": iso_time(self._clock()),
            "source": source,
            "key": str(decision.key) if decision.key else None,
            "fingerprint": alert.fingerprint if alert else "",
            "group_key": group_key,
            **shown,
        })
        level = logging.INFO if decision.action in (REAP, DRY_RUN, CANCEL) else logging.DEBUG
        if decision.action == IGNORE and source == "worker":
            level = logging.INFO
        log.log(level, "%s %s: %s (%s)", decision.action, decision.key or "-", decision.reason,
                decision.detail)

    def snapshot(self) -> dict[str, Any]:
        """The JSON behind GET /state."""
        with self._lock:
            now = self._boot_clock()
            budget = rate_budget(self._state(now))
            recent = list(self._recent)
            current = self._current
        pending = sorted(self.ledger.pending().values(), key=lambda i: i.due)
        return {  # times as Unix seconds: the boot clock means nothing to a person
            "hostname": self.hostname,
            "mode": self.policy.mode,
            "in_flight": str(current) if current else None,
            "pending": [{"key": str(i.key), "due": self._on_wall(i.due),
                         "accepted_at": self._on_wall(i.accepted_at),
                         "fingerprint": i.alert.fingerprint, "group_key": i.group_key}
                        for i in pending if i.key != current],
            "rate_limit": {"max_reaps": budget.max_reaps, "per_seconds": budget.per_seconds,
                           "used": budget.used, "remaining": budget.remaining,
                           "next_slot_at": None if budget.next_slot_at is None
                           else self._on_wall(budget.next_slot_at)},
            "recent_decisions": recent[::-1],
        }

    def counts(self) -> dict[str, Any]:
        """A consistent copy of the counters for one scrape (HTTP threads mutate them)."""
        with self._lock:
            return {"decisions": dict(self.decisions), "rejected": dict(self.rejected),
                    "reaped_processes": self.reaped_processes,
                    "reclaimed_bytes": self.reclaimed_bytes,
                    "reap_failures": self.reap_failures,
                    "refusals_repeated": self.refusals_repeated,
                    "audit_failures": self.audit_failures,
                    "audit_ok": self._audit_error is None}

    def queue_depth(self) -> int:
        return len(self.ledger.pending())

    # -- worker ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._unsettled:
                self._settle_interrupted()
            item = self._next_due()
            if item is None:
                continue
            try:
                self._process(item)
                self._state_error = None
            except LedgerError as exc:  # the state disk: wait, say so, never spin on it
                if self._state_error is None:
                    log.error("state cannot be written, work on %s waits: %s", item.key, exc)
                self._state_error = str(exc)
                self._stop.wait(STATE_RETRY_SECONDS)
            except Exception:  # a bug must not kill the only worker; it is logged and audited
                log.exception("worker failed on %s", item.key)
                self._stop.wait(STATE_RETRY_SECONDS)  # and must not spin on the same item
            finally:
                with self._lock:
                    self._current = None
                    self._cancelled.discard(item.key)
                    self._busy_since = None
                with self._wake:
                    self._wake.notify_all()

    def _next_due(self) -> PendingItem | None:
        with self._wake:
            item = self.ledger.next_due()
            now = self._boot_clock()
            if item is not None and item.due <= now:
                with self._lock:
                    self._current = item.key
                    self._busy_since = self._monotonic()
                return item
            wait = MAX_IDLE_WAIT_SECONDS if item is None else min(item.due - now,
                                                                   MAX_IDLE_WAIT_SECONDS)
            self._wake.wait(max(wait, 0.0))
            return None

    def _process(self, item: PendingItem) -> None:
        key = item.key
        if self._repeated(item):
            return
        deadline = self._monotonic() + self.policy.worker_timeout_seconds
        self._protected = protected_pids()
        live: LiveTree | None
        try:
            live = inspect_tree(key, nvml=self.nvml, rules=self.config.classify,
                                counters=self.counters, expected_gpus=self.ledger.gpus(key),
                                events=self.events, memory=self.launchers)
        except Exception as exc:  # unreadable /proc and the like: refuse, never guess
            log.warning("inspecting %s failed: %s: %s", key, type(exc).__name__, exc)
            live = None
        with self._lock:  # decide and claim atomically with respect to the HTTP intake
            if key in self._cancelled or key not in self.ledger.pending():
                decision = Decision(CANCEL, "resolved", "withdrawn before the live check", key)
            else:
                decision = decide(item.alert, live, self._state(self._boot_clock(),
                                                                exclude=key))
            gpus = live.gpus if live is not None else ()
            if decision.action == DEFER and self.alertmanager is None:
                # No one to ask at kill time: only a delivery may lead to a reap, and a
                # silence or inhibition stops the next one. Keep the first sighting.
                assert decision.first_seen is not None
                self.ledger.note_first_seen(key, decision.first_seen, gpus)
                self.ledger.remove_pending(key)
                decision = dataclasses.replace(
                    decision, detail=f"{decision.detail}; waits for the next delivery")
            elif decision.action == DEFER:
                assert decision.recheck_at is not None
                self.ledger.defer(key, decision.recheck_at, decision.first_seen, gpus)
            elif decision.action in (REAP, DRY_RUN):
                reap_id = self.ledger.begin_reap(key, self.policy.mode, item.alert.fingerprint)
            else:
                if decision.first_seen is not None:
                    self.ledger.note_first_seen(key, decision.first_seen, gpus)
                self.ledger.remove_pending(key)
            self._note(decision, item.alert, item.group_key, source="worker")
        if decision.action == DEFER:
            self._refusals.pop(key, None)
            return
        if decision.action == IGNORE and live is not None:
            self._audit_refusal(item, decision, live)
            return
        self._refusals.pop(key, None)
        if decision.action not in (REAP, DRY_RUN):
            self._audit(item, decision, live, None)
            return
        assert live is not None
        self._reap(item, decision, live, deadline, reap_id)

    def _repeated(self, item: PendingItem) -> bool:
        """A delivery for a tree refused less than REFUSAL_RECHECK_SECONDS ago: counted
        against that refusal, not inspected again (its ledger entry settled as one)."""
        known = self._refusals.get(item.key)
        if known is None or self._boot_clock() - known.inspected_at >= REFUSAL_RECHECK_SECONDS:
            return False
        with self._lock:
            if item.key in self._cancelled or item.key not in self.ledger.pending():
                return False  # withdrawn meanwhile: the ordinary path says so
            self.ledger.remove_pending(item.key)
            self._note(known.decision, item.alert, item.group_key, source="worker")
        known.repeats += 1
        self.refusals_repeated += 1
        return True

    def _audit_refusal(self, item: PendingItem, decision: Decision, live: LiveTree) -> None:
        """Audit a refusal in full unless it repeats the last one of this tree (same
        action, reason and members): then count it. A full record carries how many
        identical refusals it follows (`repeats_before`)."""
        members = tuple((m.pid, m.start_time) for m in live.members)
        signature = (decision.action, decision.reason, live.verdict, live.reason, members)
        now = self._boot_clock()
        known = self._refusals.pop(item.key, None)
        if known is not None and known.signature == signature:
            known.repeats += 1
            known.inspected_at = now
            self.refusals_repeated += 1
            self._refusals[item.key] = known
            return
        self._refusals[item.key] = _Refusal(decision, signature, now)
        while len(self._refusals) > REFUSALS_REMEMBERED:
            self._refusals.popitem(last=False)
        self._audit(item, decision, live, None,
                    repeats_before=known.repeats if known is not None else 0)

    def _reap(self, item: PendingItem, decision: Decision, live: LiveTree,
              deadline: float, reap_id: str) -> None:
        """Carry out a REAP or DRY_RUN decision; the ledger already holds the key as reaping."""
        key = item.key
        plan = ReapPlan(key=key, members=live.members, holders=live.holders,
                        gpu_bytes=live.gpu_bytes, dry_run=decision.action == DRY_RUN,
                        gpus=live.gpus, reasons=tuple(self.policy.reasons))
        result: ReapResult | None = None

        def journal(phase: str, members: tuple[Member, ...]) -> None:
            """Ledger (for crash recovery) and audit log name them before any signal."""
            self.ledger.add_members(key, [(m.pid, m.start_time, m.state in ("T", "t"))
                                          for m in members])
            self._append(audit_record(self.hostname, self._clock(), decision, live, None,
                                      key=key, mode=self.policy.mode, item=item, phase=phase,
                                      members=members, reap_id=reap_id))

        def holding(members: tuple[tuple[int, int], ...], held: bool) -> None:
            """The ledger: which members this reap may hold stopped (crash recovery
            continues only those)."""
            self.ledger.mark_held(key, members, held)

        confirmations: list[Confirmation] = []

        def confirm() -> tuple[str, str] | None:
            """Alertmanager, asked right before the first signal: still firing, unsilenced?"""
            assert self.alertmanager is not None
            answer = self.alertmanager.confirm(
                alertname=item.alert.label("alertname") or "", hostname=key.hostname,
                root_pid=key.root_pid, root_start_time=key.root_start_time)
            confirmations.append(answer)
            return None if answer.firing else refusal_of(answer)

        try:
            result = self.reaper.reap(plan, policy=self.policy, rules=self.config.classify,
                                      protected_pids=self._protected, deadline=deadline,
                                      journal=journal, cancelled=lambda: key in self._cancelled,
                                      confirm=confirm if self.alertmanager is not None else None,
                                      holding=holding, events=self.events,
                                      memory=self.launchers)
        except Exception:
            log.exception("reaping %s raised; the key stays settled, the tree is not retried",
                          key)
        if result is None:
            final = Decision(IGNORE, "internal-error", "the reap raised; see the log", key)
        elif result.outcome == Outcome.ABORTED and result.reason == "cancelled":
            final = Decision(CANCEL, "resolved", result.detail, key)
        elif result.outcome == Outcome.ABORTED and result.reason in CANCELLED_BY_ALERTMANAGER:
            final = Decision(CANCEL, result.reason, result.detail, key)
        elif result.outcome == Outcome.ABORTED:
            final = Decision(IGNORE, result.reason, result.detail, key)
        else:
            final = decision
        with self._lock:
            if result is not None:
                self.reaped_processes += result.killed
                self.reclaimed_bytes += result.reclaimed_bytes or 0
            if result is None or result.outcome == Outcome.FAILED:
                self.reap_failures += 1
            if final is not decision:
                self._note(final, item.alert, item.group_key, source="worker")
        # Audit first, settle second: a crash in between leaves the key "reaping", and the
        # restart finds this record instead of writing an "interrupted" one.
        self._audit(item, final, live, result, reap_id=reap_id,
                    confirmation=confirmations[-1] if confirmations else None)
        self.ledger.finish_reap(key, result.outcome if result else "error",
                                signalled=result.signalled if result else True)

    def _settle_interrupted(self) -> None:
        """Reaps a crash cut short: continue what they left stopped, audit, never re-kill.

        One that cannot be audited now stays unsettled (the tree may stay stopped):
        /healthz says so and the worker tries again every loop, since no signal, a
        SIGCONT included, goes out without its record.
        """
        left: list[tuple[TreeKey, dict[str, Any]]] = []
        for key, entry in self._unsettled:
            reap_id = entry.get("reap_id")
            finished = (self.audit.has_final(str(reap_id)) if reap_id else
                        self.audit.has_record(key.hostname, key.root_pid, key.root_start_time,
                                              since=float(entry.get("at", 0))))
            if finished:
                self.ledger.settle_interrupted(key)  # the final record made it; only settle
                continue
            recorded = [(int(m[0]), int(m[1]), bool(m[2]) if len(m) > 2 else False,
                         bool(m[3]) if len(m) > 3 else True)
                        for m in entry.get("members", [])]
            # Only what this reap may have stopped: marked held (right before its SIGSTOP,
            # cleared once the reap continued it: see Reaper.thaw_interrupted for what that
            # can and cannot tell), and not stopped already when the reap held it (Ctrl-Z,
            # a scheduler): that one is left as its owner left it. A state file from
            # before the marks (3 fields) counts every member as held.
            thaw = [(pid, start) for pid, start, was_stopped, held in recorded
                    if held and not was_stopped]
            decision = Decision(IGNORE, "interrupted-thawed" if recorded else "interrupted",
                                "the remediator stopped during this reap; members it may "
                                "have stopped are continued (SIGCONT) and left alive", key)
            record = functools.partial(
                audit_record, self.hostname, live=None, result=None, decision=decision,
                key=key, mode=str(entry.get("mode")), reap_id=reap_id,
                fingerprint=str(entry.get("fingerprint", "")),
                member_ids=[(pid, start) for pid, start, _, _ in recorded])
            try:
                if thaw:  # the SIGCONTs are signals too: written down first
                    self._append(record(now=self._clock(), phase=INTENT))
                signals = self.reaper.thaw_interrupted(thaw)
                self._append(record(now=self._clock(), signals=signals))
            except OSError:
                log.error("interrupted reap of %s not settled: the audit log cannot be "
                          "written; retried while the worker runs", key)
                left.append((key, entry))
                continue
            self.reap_failures += 1
            self.ledger.settle_interrupted(key, decision.reason)
        self._unsettled = left

    # -- audit -----------------------------------------------------------------------

    def _append(self, record: dict[str, Any]) -> None:
        """One durable audit record; a failure is counted, makes /healthz 503, and raises."""
        try:
            self.audit.append(record)
        except OSError as exc:
            with self._lock:
                self.audit_failures += 1
                self._audit_error = f"{self.audit.path}: {exc.strerror or exc}"
            log.error("audit record not written: %s", self._audit_error)
            raise
        if self._audit_error is not None:
            with self._lock:
                self._audit_error = None
            log.info("audit log %s is writable again", self.audit.path)

    def _audit(self, item: PendingItem, decision: Decision, live: LiveTree | None,
               result: ReapResult | None, *, reap_id: str | None = None,
               confirmation: Confirmation | None = None, repeats_before: int = 0) -> None:
        record = audit_record(self.hostname, self._clock(), decision, live, result,
                              key=item.key, mode=self.policy.mode, item=item, reap_id=reap_id)
        if repeats_before:
            record["repeats_before"] = repeats_before
        if confirmation is not None:
            record["alertmanager"] = confirmation.to_json()
        try:
            self._append(record)
        except OSError:
            pass  # counted and reported by _append; the decision stands either way


def refusal_of(answer: Confirmation) -> tuple[str, str]:
    """The reason code and audit detail for any Alertmanager answer but "firing"."""
    assert answer.state != FIRING
    if answer.state == SILENCED:
        creators = ", ".join(answer.silence_creators) or "unknown"
        return SILENCED, (f"silenced in Alertmanager by silence {', '.join(answer.silenced_by)}"
                          f" (created by {creators})")
    if answer.state in (INHIBITED, NOT_FIRING):
        return answer.state, f"Alertmanager: {answer.detail}"
    return UNREACHABLE_REASON, f"Alertmanager not confirmed, nothing signalled: {answer.detail}"


def _with_pending(state: PolicyState, pending: set[TreeKey]) -> PolicyState:
    """The same state with this delivery's own accepted keys counted as pending."""
    if pending == state.pending:
        return state
    return dataclasses.replace(state, pending=frozenset(pending))
