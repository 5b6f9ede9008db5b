"""What `explain` and `reap` gather before they print: one record each, drawn by render.py
for people and written as their --json documents."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuguard.base.compat import StrEnum
from gpuguard.console.contract import REAP_SCHEMA, REFUSED
from gpuguard.console.json_records import live_json
from gpuguard.engine.decision.policy import Decision
from gpuguard.engine.decision.tree import LiveTree, TreeKey
from gpuguard.engine.reap.outcome import ReapResult
from gpuguard.gpu.reading import GpuReading
from gpuguard.orphans.process import Holder, ProcInfo
from gpuguard.orphans.verdicts import HolderVerdict, Tree


class LeaderState(StrEnum):
    """A session leader's state, rule 6's session-ended evidence."""

    ALIVE = "alive"
    ZOMBIE = "zombie"
    GONE = "gone"


@dataclass(frozen=True)
class Explanation:
    """One pid's verdict with everything `explain` shows, gathered once."""

    info: ProcInfo
    reading: GpuReading
    holdings: tuple[Holder, ...]
    verdict: HolderVerdict
    note: str | None
    tree: Tree | None = None  # the tree it belongs to, members judged too
    alert: dict[str, Any] | None = None  # Alertmanager's state of its alert, if configured
    sessions: list[dict[str, Any]] = field(default_factory=list)  # see session_states()
    #: `gpuguard run` launchers in its chain and the tier each holds its tree with.
    run_launchers: list[dict[str, Any]] = field(default_factory=list)

    def idle_seconds(self, holding: Holder) -> float | None:
        """How long this command has seen the holding without SM use: one read, so 0.0
        when NVML can say (the exporter's gpuguard_gpu_process_idle_seconds has watched
        longer), None when it cannot."""
        gpu = next((g for g in self.reading.gpus if g.uuid == holding.gpu_uuid), None)
        return None if gpu is None or gpu.busy_pids is None else 0.0


@dataclass(frozen=True)
class ReapReport:
    """Everything `reap` prints, for people or as gpuguard.reap/v1."""

    key: TreeKey
    live: LiveTree
    decision: Decision
    result: ReapResult | None
    apply: bool
    forced: bool
    audited: str | None  # the audit file, or None with `audit_error`
    audit_error: str | None
    alert: dict[str, Any] | None = None  # Alertmanager's state of the tree's alert

    def to_json(self, code: int) -> dict[str, Any]:
        res = self.result
        return {
            "schema": REAP_SCHEMA,
            "exit_code": code,
            "key": {"hostname": self.key.hostname, "root_pid": self.key.root_pid,
                    "root_start_time": self.key.root_start_time},
            "apply": self.apply,
            "forced": self.forced,
            "decision": self.decision.to_json(),
            "live": live_json(self.live),
            "outcome": res.outcome if res is not None else REFUSED,
            "reason": res.reason if res is not None else self.decision.reason,
            "detail": res.detail if res is not None else self.decision.detail,
            "kill_path": res.kill_path if res is not None else None,
            "members": [{"pid": m.pid, "start_time": m.start_time, "user": m.user,
                         "comm": m.comm} for m in (res.members if res else self.live.members)],
            "signals": [s.to_json() for s in res.signals] if res is not None else [],
            "survivors": list(res.survivors) if res is not None else [],
            "reclaimed_bytes": res.reclaimed_bytes if res is not None else None,
            "audit_log": self.audited,
            "audit_error": self.audit_error,
            "alert": self.alert,
        }
