"""Alertmanager's word on an orphan tree's alert (silenced, inhibited, firing...), asked
as the remediator asks it, and the line that says it."""

from __future__ import annotations

import time
from typing import Any

from gpuguard.config import Config
from gpuguard.engine.alerting.alertmanager import AlertmanagerClient
from gpuguard.engine.alerting.confirmation import ConfirmationState
from gpuguard.engine.scan.scanner import Snapshot
from gpuguard.orphans.vocabulary import Verdict


def alert_state(config: Config, hostname: str, root_pid: int,
                root_start_time: int, *, deadline: float | None = None) -> dict[str, Any] | None:
    """Alertmanager's view of this tree's alert (None when remediate.alertmanager is unset).

    Every alertname in remediate.alerts is asked; the answer that most constrains a
    reap is kept: silenced, then unreachable, then inhibited, firing, not-firing.
    `deadline` (time.monotonic()): a reap's, which every question ends within (the tree
    may be frozen meanwhile); a question with no time left reads unreachable.
    """
    if config.remediate.alertmanager is None:
        return None
    client = AlertmanagerClient(config.remediate.alertmanager)
    answers = [(name, client.confirm(
        alertname=name, hostname=hostname, root_pid=root_pid, root_start_time=root_start_time,
        within=None if deadline is None else deadline - time.monotonic()))
               for name in config.remediate.alerts]
    # A question that got no answer may be the one whose alert is silenced: it ranks
    # right after a silence, above every answer that would let a reap go on.
    rank = {ConfirmationState.SILENCED: 0, ConfirmationState.UNREACHABLE: 1,
            ConfirmationState.INHIBITED: 2, ConfirmationState.FIRING: 3,
            ConfirmationState.NOT_FIRING: 4}
    name, answer = min(answers, key=lambda a: rank.get(a[1].state, 5))
    return {"alertname": name, **answer.to_json()}


def alert_line(alert: dict[str, Any]) -> str:
    if alert["state"] == ConfirmationState.SILENCED:
        creators = ", ".join(alert["silence_creators"]) or "unknown"
        return (f"{alert['alertname']} silenced by {', '.join(alert['silenced_by'])} "
                f"(created by {creators}): the remediator will not reap it")
    return f"{alert['alertname']} {alert['state']}: {alert['detail']}"


def orphan_alerts(config: Config, hostname: str, snap: Snapshot) -> dict[int, dict[str, Any]]:
    """Alertmanager's state for each orphan tree's alert; {} when not configured."""
    out: dict[int, dict[str, Any]] = {}
    for tree in snap.trees:
        if tree.verdict == Verdict.ORPHAN and tree.root is not None:
            state = alert_state(config, hostname, tree.root.pid, tree.root.start_time)
            if state is not None:
                out[tree.root_pid] = state
    return out
