"""One reap from plan to final decision (ReapSession), put together once for every program
that reaps on a decision: the remediator's worker and `gpuguard reap` (and through it
MCP's gpu_reap).

The session owns the order: the plan from the tree as inspected and the decision, the
write-ahead journal (the crash ledger's marks first, where the caller keeps a ledger,
then the caller's audit record), the caller's confirmation, the platform's reaper, the
detail true to the signals sent (settlement.told) and what the reap amounts to
(settlement.final_decision). What stays with each caller is its own business: the
record's words (the worker's alert item, the console's `manual`), where records go
(the worker's AuditTrail, the console's AuditLog), who is asked at kill time
(Alertmanager, within the deadline; the console's alert state and --force), the
ledger, the metrics, the brakes and stop signals. It lives in engine/reap/ because it
needs nothing above it: the ledger is reached through CrashMarks, which
engine/state/ledger.py's Ledger satisfies, and the reaper is handed in (a TreeReaper,
from engine/platforms.py). `gpuguard run`'s teardown reaps its own tree on no decision
(gpuguard/launch/teardown/)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from gpuguard.config.remediate import Remediate
from gpuguard.engine.decision.policy import Action, Decision
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import LiveTree, Member, TreeKey
from gpuguard.engine.reap.audit import Phase
from gpuguard.engine.reap.outcome import ReapResult
from gpuguard.engine.reap.reap_run import Confirm, Holding, Journal
from gpuguard.engine.reap.settlement import final_decision, told
from gpuguard.engine.reap.skeleton import TreeReaper
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.launchers import ExitSource
from gpuguard.orphans.process import STOPPED_STATES
from gpuguard.orphans.rules_config import Rules

#: The caller's write-ahead audit record of `members` at `phase`, in its own words.
RecordMaker = Callable[[Phase, tuple[Member, ...]], dict[str, Any]]
#: Appends one record durably; raises when it cannot (the reap then signals nothing).
RecordWriter = Callable[[dict[str, Any]], None]


class CrashMarks(Protocol):
    """The crash ledger's part in a reap (engine/state/ledger.py's Ledger): which members
    are about to be signalled, and which the reap may hold stopped (crash recovery
    continues only those)."""

    def add_members(self, key: TreeKey, members: Iterable[tuple[int, int, bool]]) -> None: ...

    def mark_held(self, key: TreeKey, members: Iterable[tuple[int, int]],
                  held: bool) -> None: ...


@dataclass(frozen=True)
class WriteAhead:
    """The write-ahead journal of a reap that may signal: before any member's first signal,
    the crash ledger's marks (when the caller keeps a ledger), then the caller's record."""

    record: RecordMaker
    write: RecordWriter
    marks: CrashMarks | None = None

    def journal(self, key: TreeKey) -> Journal:
        def journal(phase: Phase, members: tuple[Member, ...]) -> None:
            if self.marks is not None:  # the ledger first: recovery must find them
                self.marks.add_members(key, [(m.pid, m.start_time, m.state in STOPPED_STATES)
                                             for m in members])
            self.write(self.record(phase, members))
        return journal

    def holding(self, key: TreeKey) -> Holding | None:
        marks = self.marks
        if marks is None:
            return None

        def holding(members: tuple[tuple[int, int], ...], held: bool) -> None:
            marks.mark_held(key, members, held)
        return holding


@dataclass(frozen=True)
class Settled:
    """What a session's reap came to: the result (its detail told), or None when the
    reaper raised; and the decision it amounts to."""

    result: ReapResult | None
    decision: Decision


def _never() -> bool:
    return False


@dataclass(frozen=True)
class ReapSession:
    """One reap (or dry run: `decision.action` DRY_RUN) of the tree `live` under `key`, on
    `decision`. `reasons`: the orphan reasons the verdict derived again under freeze may
    carry (None: any). `write_ahead` is required unless it is a dry run (the reaper
    refuses to signal without one); `confirm` is asked at kill time (None: no one)."""

    reaper: TreeReaper
    key: TreeKey
    decision: Decision
    live: LiveTree
    policy: Remediate
    rules: Rules
    reasons: tuple[str, ...] | None
    write_ahead: WriteAhead | None
    confirm: Confirm | None = None
    cancelled: Callable[[], bool] = _never
    force: bool = False
    events: ExitSource | None = None
    memory: LauncherMemory | None = None

    @property
    def plan(self) -> ReapPlan:
        live = self.live
        return ReapPlan(key=self.key, members=live.members, holders=live.holders,
                        gpu_bytes=live.gpu_bytes, dry_run=self.decision.action == Action.DRY_RUN,
                        gpus=live.gpus, reasons=self.reasons)

    def run(self, *, deadline: float, protected_pids: frozenset[int],
            on_raise: Callable[[], None] | None = None) -> Settled:
        """Reap, and settle what came of it. A reaper that raises (a bug: it never raises
        for process-level trouble) raises through here, unless `on_raise` is given: it is
        called in the handler (the worker logs it there) and the reap settles as raised."""
        ahead = self.write_ahead
        try:
            result = self.reaper.reap(
                self.plan, policy=self.policy, rules=self.rules, protected_pids=protected_pids,
                deadline=deadline, journal=ahead.journal(self.key) if ahead else None,
                cancelled=self.cancelled, confirm=self.confirm, force=self.force,
                holding=ahead.holding(self.key) if ahead else None, events=self.events,
                memory=self.memory)
        except Exception:
            if on_raise is None:
                raise
            on_raise()
            return Settled(None, final_decision(self.decision, None, self.key))
        result = told(result)
        return Settled(result, final_decision(self.decision, result, self.key))
