"""What a reap that ran amounts to, audited one way whoever ran it: the remediator's
worker and `gpuguard reap --apply` both settle a reaper's result here, through the one
reap session (session.py)."""

from __future__ import annotations

import dataclasses
from typing import cast

from gpuguard.engine.decision.policy import Action, Decision
from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.reap.outcome import Outcome, ReapResult, SignalResult
from gpuguard.orphans.vocabulary import AnyReason, DecisionReason

#: Alertmanager's answers at kill time that withdraw a reap (a person or a rule chose so);
#: "unreachable" is not one of them: it is a refusal, retried on the next delivery.
CANCELLED_BY_ALERTMANAGER = (DecisionReason.SILENCED, DecisionReason.INHIBITED,
                             DecisionReason.NOT_FIRING)


def final_decision(decision: Decision, result: ReapResult | None, key: TreeKey) -> Decision:
    """`decision` itself unless the reap aborted or raised (result None)."""
    if result is None:
        return Decision(Action.IGNORE, DecisionReason.INTERNAL_ERROR,
                        "the reap raised; see the log", key)
    # An aborted reap always says why (Abort and Interrupted carry a reason).
    reason = cast(AnyReason, result.reason)
    if result.outcome == Outcome.ABORTED and reason == DecisionReason.CANCELLED:
        return Decision(Action.CANCEL, DecisionReason.RESOLVED, result.detail, key)
    if result.outcome == Outcome.ABORTED and reason in CANCELLED_BY_ALERTMANAGER:
        return Decision(Action.CANCEL, reason, result.detail, key)
    if result.outcome == Outcome.ABORTED:
        return Decision(Action.IGNORE, reason, result.detail, key)
    return decision


#: The signal that stops a member and the one that continues it, per platform.
_PAUSES = {"SIGSTOP": "SIGCONT", "SUSPEND": "RESUME"}
NOTHING_TERMINATED = "nothing was terminated"


def told(result: ReapResult) -> ReapResult:
    """`result` with a detail true to the signals it sent, for an aborted reap.

    Why a reap aborted is written where it aborted, often before anyone knows whether
    the tree had been stopped yet (Alertmanager's answer is asked for before the freeze
    and again after it): the signals sent are only known here, so this is where the
    record says them, "nothing was signalled" or what was stopped and continued.
    """
    if result.outcome != Outcome.ABORTED:
        return result
    sent = [s for s in result.signals if s.result == SignalResult.SENT]
    if not sent:
        return dataclasses.replace(result, detail=f"{result.detail}; nothing was signalled")
    said = []
    for pause, resume in _PAUSES.items():
        paused = {s.pid for s in sent if s.signal == pause}
        resumed = {s.pid for s in sent if s.signal == resume}
        if paused and paused == resumed:
            said.append(f"stopped ({pause}) and continued ({resume}) {len(paused)} member(s)")
        elif paused or resumed:
            said.append(f"stopped ({pause}) {len(paused)} member(s) and continued ({resume}) "
                        f"{len(resumed)}")
            if left := sorted(paused - resumed):
                said.append(f"still stopped: {', '.join(map(str, left))}")
    if NOTHING_TERMINATED not in result.detail:
        said.append(NOTHING_TERMINATED)
    return dataclasses.replace(result, detail="; ".join([result.detail, *said]))
