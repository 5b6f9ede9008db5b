"""remediate.idle_reasons (issue 50): an orphan reason allowed only for a tree idle a stated
time, per reason; its config reading, and decide() on synthetic trees: idle long enough
reaps, busy or unknown keeps."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpuguard.base.validation import ConfigError
from gpuguard.config import parse_config
from gpuguard.config.remediate import Remediate
from gpuguard.engine.alerting.alerts import Alert, parse_notification
from gpuguard.engine.decision.policy import (
    Action,
    PolicyState,
    decide,
    reason_refusal,
    unwatched_refusal,
)
from gpuguard.engine.decision.tree import HolderIdle, LiveTree, Member, TreeKey
from gpuguard.orphans.process import Holder
from gpuguard.orphans.vocabulary import Reason
from tests.support.remediator_harness import alert, payload

NOW = 1_710_000_000.0
KEY = TreeKey("node-a", 4242, 99_000)
HOUR = 3600.0
#: The lab preset's shape: launcher-killed as by default, the rest only when idle an hour.
LAB = Remediate(mode="enforce", min_age_seconds=300,
                idle_reasons=((Reason.LAUNCHER_EXITED, HOUR),
                              (Reason.SESSION_ORPHANED, HOUR)))


def make_alert(reason: str) -> Alert:
    raw = alert(KEY.root_pid, KEY.root_start_time, hostname=KEY.hostname, reason=reason)
    (parsed,) = parse_notification(payload(raw)).alerts
    return parsed


def tree(reason: str, idle: float | None, watched: float | None = None) -> LiveTree:
    """An orphan with one holder whose idleness the watch read as `idle` (None: unknown)."""
    root = Member(pid=KEY.root_pid, ppid=1, start_time=KEY.root_start_time, uid=1000,
                  user="alice", comm="python", user_known=True)
    child = dataclasses.replace(root, pid=4243, ppid=KEY.root_pid)
    return LiveTree(root=root, tree_found=True, verdict="orphan", reason=reason,
                    members=(root, child), holders=(Holder(4243, "GPU-0", 0, 2**30, "C"),),
                    gpu_bytes=2**30,
                    idle=(HolderIdle(4243, "GPU-0", idle,
                                     watched if watched is not None else idle),))


def state(policy: Remediate = LAB) -> PolicyState:
    return PolicyState(policy=policy, hostname="node-a", now=NOW, wall_now=NOW,
                       first_seen={KEY: NOW - 2 * HOUR})


def test_an_idle_reason_tree_idle_past_its_time_is_reaped() -> None:
    got = decide(make_alert("launcher-exited"), tree("launcher-exited", HOUR + 1), state())
    assert got.action == Action.REAP, got


def test_an_idle_reason_tree_still_computing_is_kept_with_its_key_named() -> None:
    got = decide(make_alert("launcher-exited"), tree("launcher-exited", 30.0, 2 * HOUR),
                 state())
    assert (got.action, got.reason) == (Action.IGNORE, "not-idle"), got
    assert "remediate.idle_reasons.launcher-exited is 3600s" in got.detail, got.detail
    assert got.recheck_at == NOW + HOUR - 30.0


def test_an_idle_reason_tree_whose_idleness_is_unknown_is_kept() -> None:
    got = decide(make_alert("session-orphaned"), tree("session-orphaned", None), state())
    assert (got.action, got.reason) == (Action.IGNORE, "idle-unknown"), got
    no_watch = dataclasses.replace(tree("session-orphaned", HOUR * 2), idle=())
    got = decide(make_alert("session-orphaned"), no_watch, state())
    assert (got.action, got.reason) == (Action.IGNORE, "idle-unknown"), got


def test_each_reason_keeps_its_own_time_and_the_default_reason_needs_none() -> None:
    policy = dataclasses.replace(LAB, idle_reasons=((Reason.LAUNCHER_EXITED, 600.0),
                                                    (Reason.SESSION_ORPHANED, 7200.0)))
    idle_hour = HOUR + 1
    assert decide(make_alert("launcher-exited"), tree("launcher-exited", idle_hour),
                  state(policy)).action == Action.REAP
    kept = decide(make_alert("session-orphaned"), tree("session-orphaned", idle_hour),
                  state(policy))
    assert kept.reason == "not-idle" and "session-orphaned is 7200s" in kept.detail
    # launcher-killed is in `reasons`, with no idle requirement: reaped busy.
    assert decide(make_alert("launcher-killed"), tree("launcher-killed", 0.0),
                  state(policy)).action == Action.REAP


def test_the_alert_label_s_less_reapable_reason_brings_its_idle_requirement() -> None:
    """The remediator took launcher-killed, the exporter heard launcher-exited: the tree
    is judged as launcher-exited, idle requirement included."""
    got = decide(make_alert("launcher-exited"), tree("launcher-killed", 10.0, 2 * HOUR),
                 state())
    assert got.reason == "not-idle", got


def test_the_longer_of_the_global_and_the_reason_s_requirement_applies() -> None:
    policy = dataclasses.replace(LAB, require_idle_seconds=2 * HOUR,
                                 reasons=(Reason.LAUNCHER_KILLED, Reason.LAUNCHER_EXITED))
    assert policy.idle_requirement("launcher-exited") == (2 * HOUR,
                                                          "remediate.require_idle_seconds")
    assert policy.idle_requirement("launcher-killed") == (2 * HOUR,
                                                          "remediate.require_idle_seconds")
    named_twice = dataclasses.replace(LAB, reasons=(Reason.LAUNCHER_KILLED,
                                                    Reason.LAUNCHER_EXITED))
    # Named in reasons too, the idle requirement stays (the stricter reading).
    assert named_twice.idle_requirement("launcher-exited") == (
        HOUR, "remediate.idle_reasons.launcher-exited")
    assert decide(make_alert("launcher-exited"), tree("launcher-exited", 5.0, 2 * HOUR),
                  state(named_twice)).reason == "not-idle"


def test_a_reason_in_neither_list_is_refused_and_the_detail_names_both() -> None:
    got = decide(make_alert("launcher-unrecorded"), tree("launcher-unrecorded", 2 * HOUR),
                 state())
    assert got.reason == "reason-not-allowed"
    assert "remediate.reasons or remediate.idle_reasons" in got.detail
    assert reason_refusal(KEY, "launcher-exited", LAB) is None


def test_a_one_read_path_cannot_meet_an_idle_reason() -> None:
    """`gpuguard reap --apply` and MCP read NVML once: the console passes the reason's
    requirement to unwatched_refusal, which refuses, naming the key."""
    got = unwatched_refusal(KEY, *LAB.idle_requirement("launcher-exited"))
    assert got is not None and got.reason == "idle-unknown"
    assert "remediate.idle_reasons.launcher-exited is 3600s" in got.detail
    assert unwatched_refusal(KEY, *LAB.idle_requirement("launcher-killed")) is None


def test_the_watch_runs_for_the_shortest_requirement() -> None:
    assert Remediate().idle_watch_seconds == 0
    assert LAB.idle_watch_seconds == HOUR
    both = dataclasses.replace(LAB, require_idle_seconds=600)
    assert both.idle_watch_seconds == 600
    assert LAB.allowed_reasons == (Reason.LAUNCHER_KILLED, Reason.LAUNCHER_EXITED,
                                   Reason.SESSION_ORPHANED)


# -- the config ---------------------------------------------------------------------


def remediate(text: str) -> Any:
    return parse_config("remediate:\n  idle_reasons: " + text + "\n",
                        source="/etc/gpuguard.yml").remediate


def test_durations_read_as_seconds_numbers_or_one_unit() -> None:
    got = remediate("{launcher-exited: 1h, session-orphaned: 90, parent-exited: 30m, "
                    "launcher-unrecorded: 1.5h, session-ended: 2d, parent-gone: 45s}")
    assert dict(got.idle_reasons) == {
        "launcher-exited": 3600.0, "session-orphaned": 90.0, "parent-exited": 1800.0,
        "launcher-unrecorded": 5400.0, "session-ended": 172800.0, "parent-gone": 45.0}


@pytest.mark.parametrize(("text", "key", "problem"), [
    ("{launcher-exited: 1h30m}", "remediate.idle_reasons.launcher-exited",
     "a number and one unit of s, m, h, d"),
    ("{launcher-exited: '60'}", "remediate.idle_reasons.launcher-exited",
     "must be seconds (a number)"),
    ("{launcher-exited: 0}", "remediate.idle_reasons.launcher-exited", "must be > 0"),
    ("{launcher-exited: 0h}", "remediate.idle_reasons.launcher-exited", "longer than 0s"),
    ("{launcher-exited: .inf}", "remediate.idle_reasons.launcher-exited", "finite"),
    ("{launcher-exited: -1h}", "remediate.idle_reasons.launcher-exited", "got '-1h'"),
    ("{ignores-sighup: 1h}", "remediate.idle_reasons.ignores-sighup", "not an orphan reason"),
    ("[launcher-exited]", "remediate.idle_reasons", "must be a mapping"),
])
def test_a_bad_entry_is_one_line_naming_file_key_and_problem(text: str, key: str,
                                                             problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        remediate(text)
    message = str(err.value)
    assert message.startswith(f"/etc/gpuguard.yml: {key}: "), message
    assert problem in message and "\n" not in message, message


def test_a_verdict_derived_again_may_not_carry_a_reason_stricter_about_idleness() -> None:
    """The reap re-derives the verdict with the tree frozen (reap/recheck.py) and goes on
    only with a reason in the plan's list, which the worker takes from `rederivable`
    over the idleness its decision checked: a tree decided on launcher-killed (no idle
    requirement) that reads launcher-exited under freeze (an hour idle, never checked)
    is not killed; one decided on launcher-exited, whose hour was checked, may read
    launcher-killed."""
    killed = decide(make_alert(Reason.LAUNCHER_KILLED), tree(Reason.LAUNCHER_KILLED, 5.0),
                    state())
    assert killed.action == Action.REAP and killed.idle_checked == 0
    assert LAB.rederivable(killed.idle_checked, killed.reason) == (Reason.LAUNCHER_KILLED,)
    exited = decide(make_alert(Reason.LAUNCHER_EXITED), tree(Reason.LAUNCHER_EXITED, 2 * HOUR),
                    state())
    assert exited.action == Action.REAP and exited.idle_checked == HOUR
    assert set(LAB.rederivable(exited.idle_checked, exited.reason)) == {
        Reason.LAUNCHER_KILLED, Reason.LAUNCHER_EXITED, Reason.SESSION_ORPHANED}
    # A global requirement binds every reason alike: nothing is stricter than another.
    alike = dataclasses.replace(LAB, require_idle_seconds=2 * HOUR)
    assert set(alike.rederivable(2 * HOUR)) == set(alike.allowed_reasons)
    # A one-read manual reap checks no idleness: only reasons that ask none.
    assert LAB.rederivable(0.0) == (Reason.LAUNCHER_KILLED,)
    # A reason the policy does not allow is never one to go on with.
    assert Reason.SESSION_ENDED not in LAB.rederivable(2 * HOUR)


def test_the_idleness_checked_is_the_label_s_when_the_label_lowered_the_reason() -> None:
    """decide() judges a tree by the alert's launcher reason where that is the less
    reapable (the exporter knew more): its idle requirement is the one checked, and the
    reap's re-derived verdict may carry nothing that asks more than that, besides the
    reason decided on."""
    odd = Remediate(mode="enforce", min_age_seconds=300,
                    reasons=(Reason.LAUNCHER_KILLED, Reason.LAUNCHER_UNRECORDED),
                    idle_reasons=((Reason.LAUNCHER_KILLED, HOUR), (Reason.SESSION_ENDED, HOUR)))
    decision = decide(make_alert(Reason.LAUNCHER_UNRECORDED), tree(Reason.LAUNCHER_KILLED, 5.0),
                      state(odd))
    assert decision.action == Action.REAP and decision.reason == Reason.LAUNCHER_KILLED
    assert decision.idle_checked == 0  # launcher-unrecorded's requirement, not killed's
    allowed = odd.rederivable(decision.idle_checked, decision.reason)
    assert Reason.SESSION_ENDED not in allowed  # its hour was never checked
    assert set(allowed) == {Reason.LAUNCHER_KILLED, Reason.LAUNCHER_UNRECORDED}
