"""The brakes a reap by hand or by an agent meets before its first signal, as the
remediator's own reaps do: the host's reap lock (one reap at a time), the rate-limit
window every path counts in, and the tree's age by the remediator's records.

`gpuguard reap --apply --override-brakes` lifts the window and the age (a person decided;
the audit record says which were lifted); nothing lifts the lock. MCP never overrides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gpuguard.config.remediate import Remediate
from gpuguard.engine.decision.policy import (
    Action,
    Decision,
    PolicyState,
    rate_refusal,
    recorded_age_refusal,
)
from gpuguard.engine.decision.tree import LiveTree, ReapMark, TreeKey, mark_for
from gpuguard.engine.state.ledger import this_boot_id
from gpuguard.engine.state.reap_lock import ReapLock, ReapLockRefused
from gpuguard.engine.state.reap_window import (
    WindowUnreadable,
    read_history,
    record_manual_reap,
)
from gpuguard.host.procfs import boottime
from gpuguard.orphans.vocabulary import AnyReason, DecisionReason

#: What each brake is called in the audit record's `manual.brakes_overridden`.
RATE_BRAKE = "rate_limit"
AGE_BRAKE = "min_age_seconds"


@dataclass
class ManualBrakes:
    """One manual reap's hold on the host's reap lock and its slot in the window."""

    policy: Remediate
    hostname: str
    key: TreeKey
    by: str  # who holds the lock, for another reaper's refusal
    override: bool = False  # --override-brakes
    lock_hint: str = ""  # what a person can do when the lock cannot be opened
    runtime_dir: str | None = None  # the daemons' runtime directory (reap_lock.py)
    overridden: list[str] = field(default_factory=list)
    _lock: ReapLock | None = None
    _mark: ReapMark | None = None
    _boot: str = ""

    def engage(self, live: LiveTree) -> Decision | None:
        """Take the lock, check the brakes, and take a slot in the window: None when the
        reap may go on (call release() after its last signal), else the refusal (the
        lock is let go already)."""
        lock = ReapLock(self.policy.state_dir, runtime_dir=self.runtime_dir, create=True)
        try:
            lock.acquire({"by": self.by, "key": str(self.key)})
        except ReapLockRefused as refused:
            hint = (f"; {self.lock_hint}" if self.lock_hint
                    and refused.reason == DecisionReason.REAP_LOCK_UNAVAILABLE else "")
            return self._refuse(refused.reason, refused.detail + hint)
        self._lock = lock
        try:
            refused_decision = self._check_and_take_slot(live)
        except BaseException:
            self.release(signalled=False)
            raise
        if refused_decision is not None:
            self.release(signalled=False)
        return refused_decision

    def _check_and_take_slot(self, live: LiveTree) -> Decision | None:
        assert live.root is not None  # refusal() refuses a tree without one
        try:
            self._boot = this_boot_id()
        except OSError as exc:
            return self._refuse(DecisionReason.STATE_FAILED,
                                f"the boot id cannot be read ({exc.strerror}): the rate-limit "
                                "window cannot be placed")
        now = boottime()
        try:
            history = read_history(self.policy.state_dir, boot=self._boot, boot_now=now,
                                   wall=time.time())
        except WindowUnreadable as exc:
            if not self.override:
                return self._refuse(DecisionReason.STATE_FAILED,
                                    f"{exc}: the rate-limit window and the tree's age cannot "
                                    "be counted")
            self.overridden += [RATE_BRAKE, AGE_BRAKE]
        else:
            state = PolicyState(policy=self.policy, hostname=self.hostname, now=now,
                                wall_now=time.time(), reaps=history.reaps)
            for brake, refused in (
                    (RATE_BRAKE, rate_refusal(self.key, live.root, state)),
                    (AGE_BRAKE, recorded_age_refusal(self.key, history.first_seen.get(self.key),
                                                     now, self.policy.min_age_seconds))):
                if refused is None:
                    continue
                if not self.override:
                    return refused
                self.overridden.append(brake)
        mark = mark_for(now, live.root)
        try:
            record_manual_reap(self.policy.state_dir, mark, boot=self._boot, boot_now=now)
        except (OSError, WindowUnreadable) as exc:
            return self._refuse(DecisionReason.STATE_FAILED,
                                f"this reap cannot be counted in the rate-limit window "
                                f"({exc}): nothing is signalled")
        self._mark = mark
        return None

    def release(self, *, signalled: bool) -> None:
        """After the reap's last signal: a reap that signalled nothing gives its slot
        back (as the remediator's does); then the lock is let go."""
        mark, self._mark = self._mark, None
        try:
            if mark is not None and not signalled:
                try:
                    record_manual_reap(self.policy.state_dir, mark, boot=self._boot,
                                       boot_now=boottime(), remove=True)
                except (OSError, WindowUnreadable):
                    pass  # the slot stays used: the safe side of a window
        finally:
            lock, self._lock = self._lock, None
            if lock is not None:
                lock.release()

    def _refuse(self, reason: AnyReason, detail: str) -> Decision:
        return Decision(Action.IGNORE, reason, detail, self.key)
