"""What the intake, the worker and /state share, and the one lock that guards it.

`lock` makes the worker's decide-and-claim atomic with respect to the intake and
guards the in-flight fields, the metrics and the decision log; it is never held across
I/O to /proc. `wake` is the worker's wake-up (new work, or an injected clock moved).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from gpuguard.config import Config
from gpuguard.config.remediate import Remediate
from gpuguard.engine.decision.policy import PolicyState, policy_state
from gpuguard.engine.decision.tree import ReapMark, TreeKey
from gpuguard.engine.state.clocks import Clocks
from gpuguard.engine.state.decision_log import DecisionLog
from gpuguard.engine.state.ledger import Ledger
from gpuguard.engine.state.metrics import RemediatorMetrics


@dataclass(eq=False)
class WorkState:
    config: Config
    hostname: str
    ledger: Ledger
    clocks: Clocks
    metrics: RemediatorMetrics
    decisions: DecisionLog
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Condition = field(
        default_factory=lambda: threading.Condition(threading.Lock()))
    current: TreeKey | None = None  # the key the worker holds now
    cancelled: set[TreeKey] = field(default_factory=set)  # withdrawn while in flight
    busy_since: float | None = None  # monotonic clock
    #: pid 1, the remediator and its ancestors (the platform's, handed in by the program:
    #: gpuguard/engine/platforms.py's protected_pids); the worker refreshes it per item.
    protected: frozenset[int] = field(kw_only=True)

    @property
    def policy(self) -> Remediate:
        return self.config.remediate

    def policy_state(self, now: float, *, exclude: TreeKey | None = None,
                     other_reaps: tuple[ReapMark, ...] = ()) -> PolicyState:
        """The policy's view at boot-clock time `now` (`other_reaps`: those of `gpuguard
        reap --apply` and MCP, read under the host's reap lock)."""
        return policy_state(self.policy, self.hostname, self.ledger, now, self.protected,
                            wall_now=self.clocks.wall(), exclude=exclude,
                            other_reaps=other_reaps)

    def notify(self) -> None:
        """Wake whoever waits on `wake` (the worker; wait_idle)."""
        with self.wake:
            self.wake.notify_all()
