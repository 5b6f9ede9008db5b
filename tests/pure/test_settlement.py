"""One reap event is audited one way, whoever ran the reap (issue 26): the daemon's
worker and `gpuguard reap --apply` settle a reaper's result with the same function."""

from __future__ import annotations

import pytest

from gpuguard.console import reap as console_reap
from gpuguard.engine.decision.policy import Action, Decision
from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.reap import session
from gpuguard.engine.reap.outcome import Outcome, ReapResult
from gpuguard.engine.reap.settlement import final_decision
from gpuguard.remediator import worker

KEY = TreeKey("h", 10, 12345)
PLANNED = Decision(Action.REAP, "session-ended", "policy allows it", KEY)


def aborted(reason: str) -> ReapResult:
    return ReapResult(outcome=Outcome.ABORTED, reason=reason, detail="why")


def test_both_paths_settle_with_the_same_step() -> None:
    """Through the one reap session (engine/reap/session.py), which settles with
    final_decision (tests/pure/test_reap_session.py: no one else calls it)."""
    assert worker.ReapSession is console_reap.ReapSession is session.ReapSession
    assert session.final_decision is final_decision


@pytest.mark.parametrize(("reason", "action", "code"), [
    ("silenced", Action.CANCEL, "silenced"),
    ("inhibited", Action.CANCEL, "inhibited"),
    ("not-firing", Action.CANCEL, "not-firing"),
    ("cancelled", Action.CANCEL, "resolved"),
    ("root-replaced", Action.IGNORE, "root-replaced"),
    ("alertmanager-unreachable", Action.IGNORE, "alertmanager-unreachable"),
])
def test_an_abort_is_settled_by_its_reason(reason: str, action: Action, code: str) -> None:
    final = final_decision(PLANNED, aborted(reason), KEY)
    assert (final.action, final.reason, final.key) == (action, code, KEY)


def test_a_reap_that_ran_keeps_its_decision_and_one_that_raised_is_an_error() -> None:
    done = ReapResult(outcome=Outcome.REAPED, reason="", detail="")
    assert final_decision(PLANNED, done, KEY) is PLANNED
    assert final_decision(PLANNED, None, KEY).reason == "internal-error"


def test_an_aborted_reap_says_what_it_signalled() -> None:
    """Why a reap aborted is written before anyone knows whether the tree was stopped
    yet (issue 43: "nothing signalled" after SIGSTOP and SIGCONT to every member)."""
    from gpuguard.engine.reap.outcome import SignalRecord
    from gpuguard.engine.reap.settlement import told

    frozen = tuple(SignalRecord(pid, sig, "sent", 1.0) for sig in ("SIGSTOP", "SIGCONT")
                   for pid in (10, 11))
    refused = ReapResult(outcome=Outcome.ABORTED, reason="alertmanager-unreachable",
                         detail="Alertmanager not confirmed: HTTP 503", signals=frozen)
    assert told(refused).detail == ("Alertmanager not confirmed: HTTP 503; stopped (SIGSTOP) "
                                    "and continued (SIGCONT) 2 member(s); nothing was "
                                    "terminated")
    assert told(aborted("alertmanager-unreachable")).detail == "why; nothing was signalled"
    stuck = (*frozen[:3], SignalRecord(11, "SIGCONT", "error: Operation not permitted", 2.0))
    assert told(ReapResult(outcome=Outcome.ABORTED, detail="x", signals=stuck)).detail == (
        "x; stopped (SIGSTOP) 2 member(s) and continued (SIGCONT) 1; still stopped: 11; "
        "nothing was terminated")
    said = told(ReapResult(outcome=Outcome.ABORTED, detail="nothing was terminated",
                           signals=frozen)).detail
    assert said.count("nothing was terminated") == 1
    done = ReapResult(outcome=Outcome.REAPED, signals=frozen)
    assert told(done) is done
