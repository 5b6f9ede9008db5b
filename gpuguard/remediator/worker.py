"""The remediator's one worker thread: take the next due item, inspect, decide, reap.

Everything slow or dangerous (NVML, /proc, signals) happens here, one tree at a time,
under a per-item time limit. Decisions come from policy.decide(); this module gathers
the facts, carries the decision out and writes it down (ledger, audit, metrics).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from gpuguard.base.counters import Counters
from gpuguard.config import Config
from gpuguard.config.remediate import Mode
from gpuguard.engine.alerting.alertmanager import AlertmanagerClient
from gpuguard.engine.alerting.confirmation import Confirmation, ConfirmationState
from gpuguard.engine.decision.pending import PendingItem
from gpuguard.engine.decision.policy import Action, Decision, decide
from gpuguard.engine.decision.tree import LiveTree, Member, ReapMark, TreeKey
from gpuguard.engine.platforms import inspect_tree, protected_pids
from gpuguard.engine.reap.audit import Phase, audit_record
from gpuguard.engine.reap.outcome import Outcome
from gpuguard.engine.reap.session import ReapSession, Settled, WriteAhead
from gpuguard.engine.reap.skeleton import TreeReaper
from gpuguard.engine.scan.idle_watch import IdleWatch, watched_inspection
from gpuguard.engine.scan.inspection import HolderSource
from gpuguard.engine.state.audit_trail import AuditTrail
from gpuguard.engine.state.decision_log import DecisionSource
from gpuguard.engine.state.interrupted_reaps import InterruptedReaps
from gpuguard.engine.state.ledger import LedgerError
from gpuguard.engine.state.reap_lock import ReapLock, ReapLockRefused, host_reap_lock
from gpuguard.engine.state.reap_window import read_manual_reaps
from gpuguard.engine.state.refusals import RefusalMemory
from gpuguard.engine.state.workstate import WorkState
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.orphans.vocabulary import AnyReason, DecisionReason

log = logging.getLogger("gpuguard.remediator")

#: After a failed state write (or a bug) on an item, the worker waits this long.
STATE_RETRY_SECONDS = 1.0
#: Longest the worker sleeps without re-reading the clock (an injected clock may jump).
MAX_IDLE_WAIT_SECONDS = 1.0

#: How soon a tree whose reap found the host's reap lock held is looked at again.
LOCK_RETRY_SECONDS = 5.0
#: Who the remediator's worker says it is in the reap lock's note.
LOCK_HOLDER = "gpuguard-remediator"


class Worker:
    """The worker thread and what it does to each due item."""

    def __init__(self, work: WorkState, *, trail: AuditTrail, refusals: RefusalMemory,
                 reaper: TreeReaper, nvml: HolderSource,
                 counters: Counters, alertmanager: AlertmanagerClient | None,
                 events: ProcessEvents | None, launchers: LauncherMemory | None,
                 idle: IdleWatch | None = None, reap_lock: ReapLock | None = None,
                 interrupted: InterruptedReaps | None = None) -> None:
        self._work = work
        #: One reap at a time on the host, whichever program runs it (reap_lock.py).
        self._reap_lock = reap_lock if reap_lock is not None else host_reap_lock(work)
        self._lock_deferred: set[TreeKey] = set()  # audited once while the lock stays held
        #: crash recovery that waits for the reap lock (another reaper held it at start)
        self._interrupted = interrupted
        self._idle = idle  # the idle requirements' own watch (Remediate.idle_watch_seconds)
        self._trail = trail
        self._refusals = refusals
        self._reaper = reaper
        self._nvml = nvml
        self._counters = counters
        self._alertmanager = alertmanager
        self._events = events
        self._launchers = launchers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.state_error: str | None = None  # the last state write failed: unhealthy

    @property
    def _config(self) -> Config:
        return self._work.config

    # -- the thread ------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuguard-remediator-worker",
                                        daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to end after its current item (join() waits for it)."""
        self._stop.set()
        self._work.notify()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once nothing is due or in flight (tests; graceful shutdown)."""
        work = self._work
        deadline = time.monotonic() + timeout
        with work.wake:
            while True:
                item = work.ledger.next_due()
                due = item is not None and item.due <= work.clocks.boot()
                if not due and work.current is None:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                work.wake.wait(min(left, 0.05))

    def _run(self) -> None:
        work = self._work
        while not self._stop.is_set():
            if self._interrupted is not None and self._interrupted.unsettled:
                self._interrupted.settle()  # waited for the host's reap lock
            self._trail.pay()  # records owed to the audit log, at every wake (cheap if none)
            item = self._next_due()
            if item is None:
                continue
            try:
                self._process(item)
                self.state_error = None
            except LedgerError as exc:  # the state disk: wait, say so, never spin on it
                if self.state_error is None:
                    log.error("state cannot be written, work on %s waits: %s", item.key, exc)
                self.state_error = str(exc)
                self._stop.wait(STATE_RETRY_SECONDS)
            except Exception:  # a bug must not kill the only worker; it is logged and audited
                log.exception("worker failed on %s", item.key)
                self._stop.wait(STATE_RETRY_SECONDS)  # and must not spin on the same item
            finally:
                with work.lock:
                    work.current = None
                    work.cancelled.discard(item.key)
                    work.busy_since = None
                work.notify()

    def _next_due(self) -> PendingItem | None:
        work = self._work
        with work.wake:
            item = work.ledger.next_due()
            now = work.clocks.boot()
            if item is not None and item.due <= now:
                with work.lock:
                    work.current = item.key
                    work.busy_since = work.clocks.monotonic()
                return item
            wait = MAX_IDLE_WAIT_SECONDS if item is None else min(item.due - now,
                                                                   MAX_IDLE_WAIT_SECONDS)
            work.wake.wait(max(wait, 0.0))
            return None

    # -- one item --------------------------------------------------------------------

    def _inspect(self, key: TreeKey) -> LiveTree | None:
        """The live tree; with an idle requirement in force (remediate.require_idle_seconds
        or an idle_reasons entry), NVML is read through the idle watch (this read is the
        kill-time observation) and its facts join the tree."""
        watch = self._idle if self._work.policy.idle_watch_seconds > 0 else None
        try:
            return watched_inspection(watch, lambda reading: inspect_tree(
                key, nvml=self._nvml, rules=self._config.classify, counters=self._counters,
                expected_gpus=self._work.ledger.gpus(key), events=self._events,
                memory=self._launchers, reading=reading))
        except Exception as exc:  # unreadable /proc and the like: refuse, never guess
            log.warning("inspecting %s failed: %s: %s", key, type(exc).__name__, exc)
            return None

    def _process(self, item: PendingItem) -> None:
        work = self._work
        key = item.key
        if self._refusals.repeated(item):
            return
        deadline = work.clocks.monotonic() + work.policy.worker_timeout_seconds
        work.protected = protected_pids()
        live = self._inspect(key)
        # Held from before the decision (which counts the other paths' reaps) to after
        # the last signal: no other reaper judges or signals meanwhile.
        try:
            locked = self._take_reap_lock(key)
            self._decide_and_reap(item, live, deadline, locked)
        finally:
            self._reap_lock.release()  # a no-op when it was not had

    def _take_reap_lock(self, key: TreeKey) -> tuple[ReapMark, ...] | ReapLockRefused:
        """In enforce mode, the host's reap lock and the other paths' reaps in its window
        (read under it); why not, when it cannot be had. A dry run signals nothing and
        takes no lock (it never holds another reaper off)."""
        if self._work.policy.mode != Mode.ENFORCE:
            return ()
        try:
            self._reap_lock.acquire({"by": LOCK_HOLDER, "key": str(key)})
        except ReapLockRefused as refused:
            return refused
        try:
            return read_manual_reaps(self._work.ledger.dir, boot=self._work.ledger.boot_id)
        except Exception as exc:  # WindowUnreadable, or a surprise: never keep the lock
            self._reap_lock.release()
            return ReapLockRefused(DecisionReason.STATE_FAILED,
                                   f"{exc}: the other reapers' share of the rate-limit "
                                   "window cannot be counted")

    def _decide_and_reap(self, item: PendingItem, live: LiveTree | None, deadline: float,
                         locked: tuple[ReapMark, ...] | ReapLockRefused) -> None:
        key = item.key
        with self._work.lock:  # decide and claim atomically with respect to the HTTP intake
            decision, reap_id = self._decide_and_claim(item, live, locked)
        if not isinstance(locked, ReapLockRefused):
            self._lock_deferred.clear()  # the lock was had: each later wait is audited anew
        elif decision.reason == locked.reason:
            if key not in self._lock_deferred and live is not None:
                self._trail.decision(item, decision, live, None)
            self._lock_deferred.add(key)  # at most the pending trees, until the lock is had
            return
        if decision.action == Action.DEFER:
            self._refusals.forget(key)
            return
        if decision.action == Action.IGNORE and live is not None:
            self._refusals.audit(item, decision, live)
            return
        self._refusals.forget(key)
        if decision.action not in (Action.REAP, Action.DRY_RUN):
            self._trail.decision(item, decision, live, None)
            return
        assert live is not None and reap_id is not None
        self._reap(item, decision, live, deadline, reap_id)

    def _decide_and_claim(self, item: PendingItem, live: LiveTree | None,
                          locked: tuple[ReapMark, ...] | ReapLockRefused = (),
                          ) -> tuple[Decision, str | None]:
        """The decision on `item` and its ledger entry (caller holds the lock); the
        reap id when it is a reap (the ledger then holds the key as reaping). `locked`:
        the other paths' reaps, or why the host's reap lock was not had (a reap then
        waits: DEFER, LOCK_RETRY_SECONDS)."""
        work = self._work
        key = item.key
        reap_id: str | None = None
        if key in work.cancelled or key not in work.ledger.pending():
            decision = Decision(Action.CANCEL, DecisionReason.RESOLVED,
                                "withdrawn before the live check",
                                key)
        else:
            now = work.clocks.boot()
            others = locked if not isinstance(locked, ReapLockRefused) else ()
            decision = decide(item.alert, live, work.policy_state(now, exclude=key,
                                                                  other_reaps=others))
            if decision.action == Action.REAP and isinstance(locked, ReapLockRefused):
                decision = Decision(Action.DEFER, locked.reason, locked.detail, key,
                                    decision.first_seen, now + LOCK_RETRY_SECONDS)
            decision = self._trail.bounded(decision)  # too much owed to the log: no reap
        gpus = live.gpus if live is not None else ()
        if decision.action == Action.DEFER and self._alertmanager is None:
            # No one to ask at kill time: only a delivery may lead to a reap, and a
            # silence or inhibition stops the next one. Keep the first sighting.
            assert decision.first_seen is not None
            work.ledger.note_first_seen(key, decision.first_seen, gpus)
            work.ledger.remove_pending(key)
            decision = dataclasses.replace(
                decision, detail=f"{decision.detail}; waits for the next delivery")
        elif decision.action == Action.DEFER:
            assert decision.recheck_at is not None
            work.ledger.defer(key, decision.recheck_at, decision.first_seen, gpus)
        elif decision.action in (Action.REAP, Action.DRY_RUN):
            assert live is not None and live.root is not None
            reap_id = work.ledger.begin_reap(key, work.policy.mode, item.alert.fingerprint,
                                             live.root.uid, live.root.user_name)
        else:
            if decision.first_seen is not None:
                work.ledger.note_first_seen(key, decision.first_seen, gpus)
            work.ledger.remove_pending(key)
        repeat, before = (self._refusals.standing(key, decision, live)
                          if decision.action == Action.IGNORE and live is not None
                          else (False, 0))
        work.decisions.note(decision, item.alert, item.group_key, source=DecisionSource.WORKER,
                            repeat=repeat, repeats_before=before)
        return decision, reap_id

    # -- one reap --------------------------------------------------------------------

    def _reap(self, item: PendingItem, decision: Decision, live: LiveTree,
              deadline: float, reap_id: str) -> None:
        """Carry out a REAP or DRY_RUN decision; the ledger already holds the key as reaping."""
        work = self._work
        key = item.key
        policy = work.policy

        def record(phase: Phase, members: tuple[Member, ...]) -> dict[str, Any]:
            """The intent (or joined) record, after the ledger named them (the session)."""
            return audit_record(work.hostname, work.clocks.wall(), decision, live, None,
                                key=key, mode=policy.mode, item=item, phase=phase,
                                members=members, reap_id=reap_id)

        confirmations: list[Confirmation] = []

        def confirm() -> tuple[AnyReason, str] | None:
            """Alertmanager, asked right before the first signal: still firing, unsilenced?
            Within what is left of the reap's deadline: the second time the tree is frozen,
            and a peer that answers slowly must not keep it so (no answer in time: the
            reap is refused and what it stopped continued)."""
            assert self._alertmanager is not None
            answer = self._alertmanager.confirm(
                alertname=item.alert.label("alertname") or "", hostname=key.hostname,
                root_pid=key.root_pid, root_start_time=key.root_start_time,
                within=deadline - work.clocks.monotonic())
            confirmations.append(answer)
            return None if answer.firing else refusal_of(answer)

        def raised() -> None:
            log.exception("reaping %s raised; the key stays settled, the tree is not retried",
                          key)

        session = ReapSession(
            self._reaper, key, decision, live, policy=policy, rules=self._config.classify,
            reasons=policy.rederivable(decision.idle_checked, decision.reason),
            write_ahead=WriteAhead(record, self._trail.append, marks=work.ledger),
            confirm=confirm if self._alertmanager is not None else None,
            cancelled=lambda: key in work.cancelled, events=self._events,
            memory=self._launchers)
        settled = session.run(deadline=deadline, protected_pids=work.protected,
                              on_raise=raised)
        self._settle(item, decision, live, settled, reap_id,
                     confirmations[-1] if confirmations else None)

    def _settle(self, item: PendingItem, decision: Decision, live: LiveTree,
                settled: Settled, reap_id: str, confirmation: Confirmation | None) -> None:
        """Count, audit and settle a reap that ran (or raised: no result)."""
        work = self._work
        result, final = settled.result, settled.decision
        with work.lock:
            if result is not None:
                work.metrics.reaped_processes += result.killed
                work.metrics.reclaimed_bytes += result.reclaimed_bytes or 0
            if result is None or result.outcome == Outcome.FAILED:
                work.metrics.reap_failures += 1
            if final is not decision:
                work.decisions.note(final, item.alert, item.group_key, source=DecisionSource.WORKER)
        # Audit first, settle second: a crash in between leaves the key "reaping", and the
        # restart finds this record instead of writing an "interrupted" one. A record the
        # log cannot take now is owed, in the same state write that settles the reap.
        owed = self._trail.decision(item, final, live, result, reap_id=reap_id,
                                    confirmation=confirmation)
        try:
            work.ledger.finish_reap(item.key, result.outcome if result else "error",
                                    signalled=result.signalled if result else True, owed=owed)
        except LedgerError:
            self._trail.keep([owed] if owed is not None else [])
            raise


def refusal_of(answer: Confirmation) -> tuple[AnyReason, str]:
    """The reason code and audit detail for any Alertmanager answer but "firing"."""
    assert answer.state != ConfirmationState.FIRING
    if answer.state == ConfirmationState.SILENCED:
        creators = ", ".join(answer.silence_creators) or "unknown"
        silences = ", ".join(answer.silenced_by)
        return DecisionReason.SILENCED, (f"silenced in Alertmanager by silence {silences}"
                                            f" (created by {creators})")
    if answer.state == ConfirmationState.INHIBITED:
        return DecisionReason.INHIBITED, f"Alertmanager: {answer.detail}"
    if answer.state == ConfirmationState.NOT_FIRING:
        return DecisionReason.NOT_FIRING, f"Alertmanager: {answer.detail}"
    # Not "nothing signalled": asked again with the tree frozen, it was (settlement.told).
    return DecisionReason.ALERTMANAGER_UNREACHABLE, f"Alertmanager not confirmed: {answer.detail}"
