"""The model's first and last steps against the real pure code: hypothesis drives
policy.decide() (the model's `decide`) and settlement.final_decision() (how the model's
endings are settled) through the model's environment steps: a member exits, execs a
protected name or changes uid, the root's pid is reused, the alert resolves, time passes,
the wall clock steps either way. decide() must never say reap where the model's judgement
would refuse, and never sooner than `min_age_seconds` on the boot clock after this
remediator's own first sighting, whatever the wall clock did."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

from gpuguard.config.remediate import Remediate
from gpuguard.engine.alerting.alerts import parse_notification
from gpuguard.engine.decision.policy import Action, Decision, PolicyState, decide
from gpuguard.engine.decision.tree import LiveTree, Member, TreeKey
from gpuguard.engine.reap.outcome import Outcome, ReapResult
from gpuguard.engine.reap.settlement import final_decision
from gpuguard.orphans.process import Holder
from gpuguard.orphans.vocabulary import Reason
from tests.pure.reap_model import states as model
from tests.support.remediator_harness import alert, payload

HOST = "node-a"
ROOT_PID, CHILD_PID, ROOT_START = 4242, 4243, 99_000
KEY = TreeKey(HOST, ROOT_PID, ROOT_START)
MIN_AGE = 300.0
POLICY = Remediate(mode="enforce", min_age_seconds=MIN_AGE,
                   reasons=(Reason.LAUNCHER_KILLED,))
WALL_START = 1_710_000_000.0  # Unix seconds when the machine starts
BOOT_START = 5_000.0  # the boot clock then


def iso(when: float) -> str:
    return datetime.fromtimestamp(when, tz=timezone.utc).isoformat().replace("+00:00", "Z")


class DecisionMachine(RuleBasedStateMachine):
    """The world as the worker's live check sees it, changed by the model's steps."""

    reaps = 0  # decisions to reap, over every run (a search that never reaps proves little)

    @initialize(started_ago=st.floats(0, 2 * MIN_AGE))
    def start(self, started_ago: float) -> None:
        self.boot, self.wall = BOOT_START, WALL_START
        self.starts_at = WALL_START - started_ago  # Alertmanager's startsAt, its wall clock
        self.root_alive, self.root_reused = True, False
        self.child_alive, self.child_protected, self.child_uid = True, False, 1000
        self.firing = True
        self.first_seen: float | None = None  # the ledger's first sighting (boot clock)

    # -- the environment's steps (the model's, where decide() can see them) ------------

    @rule()
    def child_exits(self) -> None:
        self.child_alive = False

    @rule()
    def child_execs_a_protected_name(self) -> None:
        if self.child_alive:
            self.child_protected = True

    @rule()
    def child_changes_uid_to_root(self) -> None:
        if self.child_alive:
            self.child_uid = 0

    @rule()
    def root_exits(self) -> None:
        self.root_alive = False

    @rule()
    def roots_pid_is_reused(self) -> None:
        if not self.root_alive:
            self.root_alive, self.root_reused = True, True

    @rule()
    def the_alert_resolves(self) -> None:
        self.firing = False

    @rule(seconds=st.floats(0, 2 * MIN_AGE))
    def time_passes(self, seconds: float) -> None:
        self.boot += seconds
        self.wall += seconds

    @rule(step=st.floats(-10 * MIN_AGE, 10 * MIN_AGE))
    def the_wall_clock_steps(self, step: float) -> None:
        self.wall += step

    # -- the model's decide step: the worker's live check -----------------------------

    def live(self) -> LiveTree:
        if not self.root_alive:
            return LiveTree(root=None)
        start = ROOT_START + 7 if self.root_reused else ROOT_START
        root = Member(pid=ROOT_PID, ppid=1, start_time=start, uid=1000, user="alice",
                      comm="python", user_known=True)
        members = [root]
        if self.child_alive:
            members.append(Member(pid=CHILD_PID, ppid=ROOT_PID, start_time=ROOT_START + 1,
                                  uid=self.child_uid,
                                  user="root" if self.child_uid == 0 else "alice",
                                  comm="python", user_known=True))
        verdict, reason = (("protected", Reason.MEMBER_PROTECTED)
                           if self.child_alive and self.child_protected
                           else ("orphan", Reason.LAUNCHER_KILLED))
        return LiveTree(root=root, tree_found=True, verdict=verdict, reason=reason,
                        members=tuple(members), gpu_bytes=2**30,
                        holders=(Holder(ROOT_PID, "GPU-0", 0, 2**30, "C"),))

    @rule()
    def a_deferred_item_comes_due(self) -> None:
        """The worker's re-check of a too-young tree, at its recheck time."""
        if self.first_seen is not None:
            wait = max(0.0, self.first_seen + MIN_AGE - self.boot)
            self.time_passes(wait)
        self.a_delivery_is_decided()

    @rule()
    def a_delivery_is_decided(self) -> None:
        raw = alert(ROOT_PID, ROOT_START, hostname=HOST, starts_at=iso(self.starts_at),
                    status="firing" if self.firing else "resolved", reason="launcher-killed")
        (parsed,) = parse_notification(payload(raw)).alerts
        state = PolicyState(policy=POLICY, hostname=HOST, now=self.boot, wall_now=self.wall,
                            first_seen={KEY: self.first_seen} if self.first_seen else {})
        decision = decide(parsed, self.live(), state)
        protected = self.child_alive and (self.child_protected or self.child_uid == 0)
        judged_ours = self.firing and self.root_alive and not self.root_reused and not protected
        if decision.action == Action.REAP:
            assert judged_ours, decision
            assert self.first_seen is not None, "reaped at its first sighting"
            assert self.boot - self.first_seen >= MIN_AGE, (
                f"reaped {self.boot - self.first_seen:.0f}s after the first sighting")
            DecisionMachine.reaps += 1
        elif not judged_ours:
            assert decision.action in (Action.IGNORE, Action.CANCEL), decision
        if decision.first_seen is not None and self.first_seen is None:
            self.first_seen = decision.first_seen  # the ledger keeps the first one



def test_decide_under_the_models_steps() -> None:
    DecisionMachine.reaps = 0
    run_state_machine_as_test(DecisionMachine, settings=settings(
        max_examples=200, stateful_step_count=20, derandomize=True, deadline=None,
        database=None, suppress_health_check=[HealthCheck.too_slow]))
    assert DecisionMachine.reaps > 0


def test_a_backward_wall_step_never_dates_a_sighting_in_the_future() -> None:
    """Issue 43, 6: found by this script, not by the stateful search; fixed in decide()."""
    machine = DecisionMachine()
    machine.start(started_ago=0.0)
    machine.the_wall_clock_steps(step=-1000.0)
    machine.a_delivery_is_decided()
    assert machine.first_seen is not None and machine.first_seen <= machine.boot


#: How each of the model's endings settles: Alertmanager's and a resolved alert's
#: withdraw the reap (CANCEL), every other refusal is an IGNORE with its reason.
CANCELLED = {"silenced": "silenced", "not-firing": "not-firing", "cancelled": "resolved"}


@pytest.mark.parametrize("reason", sorted(set(model.ABORT_REASONS) - {"interrupted-thawed"}))
def test_each_model_abort_settles_as_the_code_settles_it(reason: str) -> None:
    planned = Decision(Action.REAP, "launcher-killed", "policy allows it", KEY)
    final = final_decision(planned, ReapResult(outcome=Outcome.ABORTED, reason=reason), KEY)
    if reason in CANCELLED:
        assert (final.action, final.reason) == (Action.CANCEL, CANCELLED[reason])
    else:
        assert (final.action, final.reason) == (Action.IGNORE, reason)


@pytest.mark.parametrize("outcome", [Outcome.REAPED, Outcome.FAILED])
def test_a_reap_that_ran_keeps_its_decision(outcome: Outcome) -> None:
    planned = Decision(Action.REAP, "launcher-killed", "policy allows it", KEY)
    assert final_decision(planned, ReapResult(outcome=outcome), KEY) is planned
