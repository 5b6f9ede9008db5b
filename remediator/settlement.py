"""What a reap that ran amounts to, audited one way whoever ran it: the remediator's
worker and `gpuguard reap --apply` both settle a reaper's result here."""

from __future__ import annotations

from gpuguard.remediator.alertmanager import ConfirmationState
from gpuguard.remediator.outcome import Outcome, ReapResult
from gpuguard.remediator.policy import Action, Decision
from gpuguard.remediator.tree import TreeKey

#: Alertmanager's answers at kill time that withdraw a reap (a person or a rule chose so);
#: "unreachable" is not one of them: it is a refusal, retried on the next delivery.
CANCELLED_BY_ALERTMANAGER = (ConfirmationState.SILENCED, ConfirmationState.INHIBITED,
                             ConfirmationState.NOT_FIRING)


def final_decision(decision: Decision, result: ReapResult | None, key: TreeKey) -> Decision:
    """`decision` itself unless the reap aborted or raised (result None)."""
    if result is None:
        return Decision(Action.IGNORE, "internal-error", "the reap raised; see the log", key)
    if result.outcome == Outcome.ABORTED and result.reason == "cancelled":
        return Decision(Action.CANCEL, "resolved", result.detail, key)
    if result.outcome == Outcome.ABORTED and result.reason in CANCELLED_BY_ALERTMANAGER:
        return Decision(Action.CANCEL, result.reason, result.detail, key)
    if result.outcome == Outcome.ABORTED:
        return Decision(Action.IGNORE, result.reason, result.detail, key)
    return decision
