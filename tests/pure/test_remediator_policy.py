"""Pure parts of the remediator on synthetic inputs: payload parsing, decide(), the ledger."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

import gpuguard.engine.decision.policy
from gpuguard.config.remediate import RateLimit, Remediate, UserFilter
from gpuguard.engine.alerting.alerts import MAX_ALERTS, Alert, PayloadError, parse_notification
from gpuguard.engine.decision.pending import PendingItem
from gpuguard.engine.decision.policy import (
    Action,
    PolicyState,
    decide,
    rate_budget,
    rate_refusal,
    recorded_age_refusal,
    screen,
    user_refusal,
)
from gpuguard.engine.decision.tree import LiveTree, Member, ReapMark, TreeKey
from gpuguard.engine.reap.audit import AuditLog
from gpuguard.engine.state.ledger import Ledger, LedgerError
from gpuguard.orphans.process import Holder
from gpuguard.orphans.vocabulary import Reason
from tests.support.remediator_harness import alert, payload

NOW = 1_710_000_000.0  # after the helpers' default startsAt (2024-01-01)
KEY = TreeKey("node-a", 4242, 99_000)
ENFORCE = Remediate(mode="enforce", min_age_seconds=300)
#: A host without the kernel's connector whose operator opted in to session-ended.
NO_LISTENER = Remediate(mode="enforce", min_age_seconds=300,
                        reasons=(Reason.LAUNCHER_KILLED, Reason.SESSION_ENDED))


def make_alert(**kw: Any) -> Alert:
    kw.setdefault("reason", "launcher-killed")
    raw = alert(KEY.root_pid, KEY.root_start_time, hostname=KEY.hostname, **kw)
    (parsed,) = parse_notification(payload(raw)).alerts
    return parsed


def member(pid: int, *, uid: int = 1000, user: str = "alice", start: int = 99_000,
           ppid: int = 1, **kw: Any) -> Member:
    kw.setdefault("user_known", True)
    return Member(pid=pid, ppid=ppid, start_time=start, uid=uid, user=user, comm="python", **kw)


def orphan(*members: Member, reason: str = "launcher-killed") -> LiveTree:
    members = members or (member(KEY.root_pid), member(4243, ppid=KEY.root_pid))
    return LiveTree(root=members[0], tree_found=True, verdict="orphan", reason=reason,
                    members=members, holders=(Holder(4243, "GPU-0", 0, 2**30, "C"),),
                    gpu_bytes=2**30)


def state(policy: Remediate = ENFORCE, **kw: Any) -> PolicyState:
    """Boot clock and wall clock read NOW alike, unless `wall_now` says otherwise."""
    kw.setdefault("first_seen", {KEY: NOW - 3600})
    kw.setdefault("wall_now", NOW)
    return PolicyState(policy=policy, hostname="node-a", now=NOW, **kw)


# -- payload parsing ------------------------------------------------------------------


def test_parses_each_alert_with_its_own_status_and_labels() -> None:
    body = payload(alert(1, 2, hostname="node-a"), alert(3, 4, status="resolved"))
    body["commonLabels"] = {"hostname": "elsewhere"}
    note = parse_notification(body)
    assert [a.status for a in note.alerts] == ["firing", "resolved"]
    assert note.alerts[0].labels["hostname"] == "node-a"
    assert note.alerts[0].starts_at == 1704067200.0 and note.alerts[0].ends_at is None
    assert note.group_key.startswith("{}:")


def test_go_nanosecond_times_parse() -> None:
    body = payload(alert(1, 2, starts_at="2024-05-01T10:00:00.123456789+02:00"))
    (parsed,) = parse_notification(body).alerts
    assert parsed.starts_at == pytest.approx(1714550400.123456)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda b: b.update(version="3"), 'version: must be "4"'),
    (lambda b: b.pop("version"), "version: must be"),
    (lambda b: b.update(alerts={"a": 1}), "alerts: must be a list"),
    (lambda b: b["alerts"][0].update(status="pending"), "alerts[0].status: must be one of"),
    (lambda b: b["alerts"][0]["labels"].update(root_pid=42), "alerts[0].labels.root_pid: must "
                                                              "be a string"),
    (lambda b: b["alerts"][0].update(labels=["x"]), "alerts[0].labels: must be an object"),
    (lambda b: b["alerts"][0].update(startsAt="yesterday"), "alerts[0].startsAt: not an RFC"),
    (lambda b: b["alerts"].append("nope"), "alerts[1]: must be an object"),
    (lambda b: b.update(alerts=[b["alerts"][0]] * (MAX_ALERTS + 1)), "at most 1000"),
])
def test_malformed_payloads_name_the_problem(mutate: Any, message: str) -> None:
    body = payload(alert(1, 2))
    mutate(body)
    with pytest.raises(PayloadError, match=None) as err:
        parse_notification(body)
    assert message in str(err.value)


def test_not_an_object_is_malformed() -> None:
    with pytest.raises(PayloadError, match="body: must be an object"):
        parse_notification([1, 2])


# -- screen ---------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "reason"), [
    ({"status": "resolved"}, "not-firing"),
    ({"alertname": "GPUGuardExporterDown"}, "alertname-not-listed"),
    ({"hostname": "node-b"}, "other-host"),
    ({"root_pid": ""}, "missing-label"),
    ({"root_start_time": "12abc"}, "bad-label"),
])
def test_screen_ignores_with_a_reason(kw: dict[str, str], reason: str) -> None:
    labels = {k: kw.pop(k) for k in list(kw) if k in ("root_pid", "root_start_time")}
    raw = alert(labels.get("root_pid", KEY.root_pid),
                labels.get("root_start_time", KEY.root_start_time),
                hostname=kw.pop("hostname", "node-a"), **kw)
    (parsed,) = parse_notification(payload(raw)).alerts
    decision = screen(parsed, state())
    assert (decision.action, decision.reason) == (Action.IGNORE, reason)


def test_screen_uses_the_alerts_hostname_not_common_labels() -> None:
    decision = screen(make_alert(), state())
    assert decision.action == Action.ACCEPT and decision.key == KEY


def test_screen_protects_pid1_self_and_ancestors() -> None:
    for pid in (1, 2, 777):
        raw = alert(pid, 5, hostname="node-a")
        (parsed,) = parse_notification(payload(raw)).alerts
        decision = screen(parsed, state(protected_pids=frozenset({1, 777})))
        assert decision.reason == "protected-pid"


def test_duplicates_by_done_key_and_pending_key() -> None:
    assert screen(make_alert(), state(done={KEY: "enforce"})).reason == "duplicate"
    assert screen(make_alert(), state(pending=frozenset({KEY}))).reason == "duplicate"
    # A dry run does not settle the key for enforce mode, but an enforce reap settles it for all.
    assert screen(make_alert(), state(done={KEY: "dry-run"})).action == Action.ACCEPT
    dry = dataclasses.replace(ENFORCE, mode="dry-run")
    assert screen(make_alert(), state(dry, done={KEY: "enforce"})).reason == "duplicate"


def test_resolved_alert_cancels_a_pending_key() -> None:
    decision = screen(make_alert(status="resolved"), state(pending=frozenset({KEY})))
    assert (decision.action, decision.reason) == (Action.CANCEL, "resolved")


# -- decide ---------------------------------------------------------------------------


def test_reaps_a_verified_old_enough_orphan() -> None:
    decision = decide(make_alert(), orphan(), state())
    assert (decision.action, decision.reason) == (Action.REAP, "launcher-killed")
    dry = decide(make_alert(), orphan(), state(Remediate(min_age_seconds=0)))
    assert dry.action == Action.DRY_RUN


@pytest.mark.parametrize(("live", "reason"), [
    (LiveTree(root=None), "root-gone"),
    (LiveTree(root=member(KEY.root_pid, state="Z")), "root-gone"),
    (LiveTree(root=member(KEY.root_pid, start=12)), "root-replaced"),
    (LiveTree(root=member(KEY.root_pid), nvml_error="driver not loaded"), "nvml-unavailable"),
    (LiveTree(root=member(KEY.root_pid)), "tree-not-found"),
    (dataclasses.replace(orphan(), verdict="protected", reason="protect-pattern"),
     "not-orphan:protected"),
    (dataclasses.replace(orphan(), verdict="normal"), "not-orphan:normal"),
    (dataclasses.replace(orphan(), verdict="unknown"), "not-orphan:unknown"),
    (orphan(reason="parent-exited"), "reason-not-allowed"),
    (orphan(member(KEY.root_pid), member(555, ppid=KEY.root_pid)), "protected-pid"),
    (orphan(member(KEY.root_pid), member(600, kernel_thread=True)), "protected-pid"),
    (orphan(member(KEY.root_pid), member(601, uid=0, user="root")), "root-owned"),
    (orphan(member(KEY.root_pid), member(602, user="bob")), "user-denied"),
    (None, "inspect-failed"),
])
def test_decide_refuses_with_a_reason(live: LiveTree | None, reason: str) -> None:
    policy = dataclasses.replace(ENFORCE, users=UserFilter(allow=("a*",), deny=("root",)))
    decision = decide(make_alert(), live, state(policy, protected_pids=frozenset({1, 555})))
    assert (decision.action, decision.reason) == (Action.IGNORE, reason)
    assert decision.detail


def test_root_owned_allowed_only_by_policy_and_users_still_apply() -> None:
    tree = orphan(member(KEY.root_pid, uid=0, user="root"))
    allow_root = dataclasses.replace(ENFORCE, allow_root_owned=True)
    assert decide(make_alert(), tree, state(allow_root)).reason == "user-denied"
    anyone = dataclasses.replace(allow_root, users=UserFilter(allow=("*",), deny=()))
    assert decide(make_alert(), tree, state(anyone)).action == Action.REAP


def test_user_globs() -> None:
    users = UserFilter(allow=("ml-*", "alice"), deny=("ml-admin*",))
    assert user_refusal(None, "ml-bob", users) is None
    assert user_refusal(None, "alice", users) is None
    assert user_refusal(None, "ml-admin1", users) is not None
    assert user_refusal(None, "carol", users) is not None


def test_too_young_defers_until_min_age_counted_locally() -> None:
    young = state(first_seen={})  # first seen now: local age 0 whatever startsAt claims
    decision = decide(make_alert(), orphan(), young)
    assert (decision.action, decision.reason) == (Action.DEFER, "too-young")
    assert decision.first_seen == NOW and decision.recheck_at == NOW + 300
    # A startsAt later than our own first sighting wins (the alert restarted).
    recent = make_alert(starts_at=datetime.fromtimestamp(NOW - 100, tz=timezone.utc).isoformat())
    decision = decide(recent, orphan(), state())
    assert decision.action == Action.DEFER and decision.recheck_at == pytest.approx(NOW + 200)


def test_a_wall_clock_step_forward_neither_ages_a_tree_nor_empties_the_window() -> None:
    """Ages and windows are on the boot clock (state.now); the wall clock (wall_now) only
    places startsAt, so a day's step of it can make an alert look older, never the tree."""
    day = 86400.0
    starts = make_alert(starts_at=datetime.fromtimestamp(NOW - 10, tz=timezone.utc).isoformat())
    stepped = state(first_seen={KEY: NOW - 10}, wall_now=NOW + day)
    decision = decide(starts, orphan(), stepped)
    assert (decision.action, decision.reason) == (Action.DEFER, "too-young")
    assert decision.recheck_at == NOW + 290
    assert decide(starts, orphan(), state(first_seen={}, wall_now=NOW + day)).action == Action.DEFER
    policy = dataclasses.replace(ENFORCE, rate_limit=RateLimit(max_reaps=1, per_seconds=3600))
    full = state(policy, reaps=(ReapMark(NOW - 60),), wall_now=NOW + day)
    assert decide(make_alert(), orphan(), full).reason == "rate-limited"


def test_a_backward_wall_clock_step_never_places_a_sighting_in_the_future() -> None:
    """Our wall clock an hour behind Alertmanager's (stepped back, or not yet corrected):
    its startsAt reads as an hour from now. A sighting is never later than now on the
    boot clock, so once the clock is right the tree's age counts from this check, not
    from an hour ahead (issue 43: still too-young 120 s after the correction)."""
    hour = 3600.0
    starts = make_alert(starts_at=datetime.fromtimestamp(NOW - 10, tz=timezone.utc).isoformat())
    behind = state(first_seen={}, wall_now=NOW - hour)
    decision = decide(starts, orphan(), behind)
    assert (decision.action, decision.reason) == (Action.DEFER, "too-young")
    assert decision.first_seen == NOW and decision.recheck_at == NOW + 300
    assert "orphan for 0.0s" in decision.detail
    # startsAt from "the future" still makes a tree younger, as any later startsAt does
    # (the alert restarted), but no younger than now.
    seen = state(first_seen={KEY: NOW - 100}, wall_now=NOW - hour)
    assert decide(starts, orphan(), seen).first_seen == NOW
    # The clock put right: startsAt counts again.
    assert decide(starts, orphan(), state(first_seen={KEY: NOW - 400})).first_seen == NOW - 10
    # One stored in the future by an older version reads as now, never later.
    future = state(first_seen={KEY: NOW + hour})
    assert decide(starts, orphan(), future).first_seen == NOW


def test_rate_limit_is_a_sliding_window_per_mode() -> None:
    policy = dataclasses.replace(ENFORCE, rate_limit=RateLimit(max_reaps=2, per_seconds=60))
    full = state(policy, reaps=(ReapMark(NOW - 50), ReapMark(NOW - 10)))
    decision = decide(make_alert(), orphan(), full)
    assert (decision.action, decision.reason) == (Action.IGNORE, "rate-limited")
    budget = rate_budget(full)
    assert budget.remaining == 0 and budget.next_slot_at == NOW + 10
    slid = state(policy, reaps=(ReapMark(NOW - 61), ReapMark(NOW - 10)))
    assert decide(make_alert(), orphan(), slid).action == Action.REAP
    assert rate_budget(slid).remaining == 1
    off = dataclasses.replace(ENFORCE, rate_limit=RateLimit(max_reaps=0, per_seconds=60))
    assert decide(make_alert(), orphan(), state(off)).reason == "rate-limited"


def test_one_users_orphans_never_spend_every_other_users_window() -> None:
    """Issue 47: rate_limit was node-wide only, so one user's throw-away orphans read every
    other user's orphan `rate-limited`, window after window. Each owner now has a share
    (rate_limit.per_user, half of max_reaps by default) beside the node-wide brake."""
    policy = dataclasses.replace(ENFORCE, rate_limit=RateLimit(max_reaps=5, per_seconds=3600))
    assert policy.rate_limit.user_share == 3
    mallory = tuple(ReapMark(NOW - 60 * i, 1001, "mallory") for i in range(1, 4))
    # Mallory's fourth tree waits; the detail names whose reaps fill her share.
    hers = orphan(member(KEY.root_pid, uid=1001, user="mallory"),
                  member(4243, uid=1001, user="mallory", ppid=KEY.root_pid))
    refused = decide(make_alert(), hers, state(policy, reaps=mallory))
    assert (refused.action, refused.reason) == (Action.IGNORE, "rate-limited")
    assert "3 reaps of mallory's trees" in refused.detail and "per_user 3" in refused.detail
    # Alice's tree is reaped in the same window.
    assert decide(make_alert(), orphan(), state(policy, reaps=mallory)).action == Action.REAP
    # The node-wide brake still holds, and names who filled it, most first.
    full = mallory + (ReapMark(NOW - 30, 1000, "alice"), ReapMark(NOW - 20, 1003, "bob"))
    refused = decide(make_alert(), orphan(member(KEY.root_pid, uid=1002, user="carol"),
                                          member(4243, uid=1002, user="carol",
                                                 ppid=KEY.root_pid)), state(policy, reaps=full))
    assert refused.reason == "rate-limited"
    assert refused.detail.endswith("(max 5): mallory 3, alice 1, bob 1")
    # An explicit share; a uid NSS cannot name is one owner too.
    strict = dataclasses.replace(policy, rate_limit=RateLimit(5, 3600, per_user=1),
                                 users=UserFilter(allow=("*",), deny=("uid:0",)))
    nameless = orphan(member(KEY.root_pid, uid=4242, user="4242", user_known=False),
                      member(4243, uid=4242, user="4242", user_known=False, ppid=KEY.root_pid))
    once = state(strict, reaps=(ReapMark(NOW - 5, 4242),))
    assert decide(make_alert(), nameless, once).reason == "rate-limited"
    assert decide(make_alert(), orphan(), once).action == Action.REAP
    # The share is the uid's, whatever name NSS gave it then or gives it now.
    named_then = state(strict, reaps=(ReapMark(NOW - 5, 4242, "dave"),))
    refused = decide(make_alert(), nameless, named_then)
    assert refused.reason == "rate-limited" and "dave 1" in refused.detail


def test_max_reaps_zero_turns_reaping_off_for_every_path() -> None:
    off = dataclasses.replace(ENFORCE, rate_limit=RateLimit(max_reaps=0, per_seconds=60))
    refused = rate_refusal(KEY, member(KEY.root_pid), state(off))
    assert refused is not None and refused.reason == "rate-limited"
    assert "reaping is off" in refused.detail


def test_a_path_without_an_alert_needs_the_remediators_record_of_the_trees_age() -> None:
    """gpuguard reap --apply and MCP gpu_reap have no startsAt: the age is the remediator's
    first sighting; none is no evidence of age (refused unless min_age_seconds is 0)."""
    none = recorded_age_refusal(KEY, None, NOW, 300)
    assert none is not None and none.reason == "too-young" and "no record" in none.detail
    young = recorded_age_refusal(KEY, NOW - 0.8, NOW, 300)
    assert young is not None and young.reason == "too-young"
    assert recorded_age_refusal(KEY, NOW - 300, NOW, 300) is None
    assert recorded_age_refusal(KEY, None, NOW, 0) is None
    assert recorded_age_refusal(KEY, NOW + 50, NOW, 10) is not None  # never older than now


def test_one_user_cannot_fill_the_pending_queue() -> None:
    policy = dataclasses.replace(ENFORCE, max_pending=4)
    assert policy.pending_share == 2
    keys = [TreeKey("node-a", 100 + i, 1) for i in range(2)]
    queued = state(policy, pending=frozenset(keys),
                   pending_owners={k: "mallory" for k in keys})
    refused = screen(make_alert(user="mallory"), queued)
    assert (refused.action, refused.reason) == (Action.IGNORE, "queue-full")
    assert "mallory" in refused.detail and "max_pending_per_user 2" in refused.detail
    assert screen(make_alert(user="alice"), queued).action == Action.ACCEPT
    # Alerts with no `user` label share no bucket: only max_pending holds them.
    unlabelled = state(policy, pending=frozenset(keys), pending_owners={k: "" for k in keys})
    assert screen(make_alert(user=""), unlabelled).action == Action.ACCEPT


#: Audit events that mean a file, process, socket or sleep (sys.addaudithook names).
_IO_EVENTS = ("open", "os.", "socket.", "subprocess.", "shutil.", "urllib.", "http.", "ctypes.",
              "glob.", "time.sleep")
_CLOCKS = ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns",
           "process_time", "thread_time")
_watched: set[int] = set()  # threads inside decide() under test
_touched: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if threading.get_ident() in _watched and event.startswith(_IO_EVENTS):
        _touched.append(f"{event}{args!r}"[:200])
        raise AssertionError(f"decide() did I/O: {event}")


sys.addaudithook(_audit)  # for good (hooks cannot be removed), idle outside `sealed()`


class _NoEnviron(dict[str, str]):
    def _refuse(self, *_: Any) -> Any:
        _touched.append("os.environ")
        raise AssertionError("decide() read the environment")

    __getitem__ = get = __contains__ = __iter__ = __len__ = keys = items = values = _refuse


@contextlib.contextmanager
def sealed() -> Iterator[None]:
    """No clock, environment, stat, file, process or socket: each one raises and is recorded."""
    def forbid(what: str) -> Callable[..., Any]:
        def refuse(*_: Any, **__: Any) -> Any:
            _touched.append(what)
            raise AssertionError(f"decide() called {what}")
        return refuse

    places = [(time, n) for n in _CLOCKS] + [
        (os, "stat"), (os, "lstat"), (os, "getpid"), (os, "getenv"), (os.path, "exists")]
    banned = {getattr(module, n): f"{module.__name__}.{n}" for module, n in places}
    with pytest.MonkeyPatch.context() as mp:
        for module, name in places:
            mp.setattr(module, name, forbid(f"{module.__name__}.{name}"))
        # `from time import time` too
        for name, value in vars(gpuguard.engine.decision.policy).items():
            if callable(value) and value in banned:
                mp.setattr(gpuguard.engine.decision.policy, name, forbid(banned[value]))
        mp.setattr(os, "environ", _NoEnviron())
        _watched.add(threading.get_ident())
        try:
            yield
        finally:
            _watched.discard(threading.get_ident())


def fixed() -> Alert:
    return make_alert(fingerprint="00000000000000f1")  # the helpers number the others


#: One case per kind of answer; each builds its inputs afresh on every call.
PURE_CASES: dict[str, Callable[[], tuple[Alert, LiveTree | None, PolicyState]]] = {
    "reap": lambda: (fixed(), orphan(), state()),
    "dry-run": lambda: (fixed(), orphan(), state(Remediate(min_age_seconds=0))),
    "defer": lambda: (fixed(), orphan(), state(first_seen={})),
    "rate-limited": lambda: (fixed(), orphan(), state(
        dataclasses.replace(ENFORCE, rate_limit=RateLimit(max_reaps=1, per_seconds=60)),
        reaps=(ReapMark(NOW - 5),))),
    "root-replaced": lambda: (fixed(), LiveTree(root=member(KEY.root_pid, start=1)),
                              state()),
    "duplicate": lambda: (fixed(), orphan(), state(done={KEY: "enforce"})),
}


@pytest.mark.parametrize("case", PURE_CASES)
def test_decide_is_pure(case: str) -> None:
    """Same answer for equal inputs built apart, inputs untouched, and nothing read besides
    them: no clock (the answer's times come from state.now), environment, file or process."""
    inputs, twin = PURE_CASES[case](), PURE_CASES[case]()
    assert inputs == twin and inputs[2] is not twin[2]
    before = copy.deepcopy(inputs)
    _touched.clear()
    with sealed():
        got = decide(*inputs)
    assert _touched == [], f"decide() reached outside its arguments: {_touched}"
    assert inputs == before, "decide() mutated its inputs"
    assert got == decide(*twin)
    assert got.action == case or got.reason == case
    if got.action == Action.DEFER:
        assert got.first_seen == NOW and got.recheck_at == NOW + ENFORCE.min_age_seconds


# -- ledger and audit -----------------------------------------------------------------


def item(key: TreeKey = KEY, due: float = NOW) -> PendingItem:
    return PendingItem(key, make_alert(), "group", NOW, due)


def test_ledger_survives_a_restart(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path, clock=lambda: NOW, boot_clock=lambda: NOW)
    other = TreeKey("node-a", 5, 6)
    ledger.add_pending([item(), item(other, NOW + 30)])
    ledger.begin_reap(KEY, "enforce", "fp1")
    ledger.finish_reap(KEY, "reaped", signalled=True)
    again = Ledger(tmp_path, clock=lambda: NOW, boot_clock=lambda: NOW)
    assert again.done_modes() == {KEY: "enforce"}
    assert list(again.pending()) == [other] and again.next_due().due == NOW + 30
    assert again.reap_times("enforce") == (NOW,) and again.reap_times("dry-run") == ()
    assert not again.interrupted


def test_ledger_reports_a_reap_cut_short_and_keeps_it_done(tmp_path: Path) -> None:
    Ledger(tmp_path, clock=lambda: NOW, boot_clock=lambda: NOW).begin_reap(KEY, "enforce", "fp1")
    again = Ledger(tmp_path, clock=lambda: NOW, boot_clock=lambda: NOW)
    assert [k for k, _ in again.interrupted] == [KEY]
    assert again.done_modes() == {KEY: "enforce"}


def test_a_reap_aborted_before_any_signal_frees_key_and_slot(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path, clock=lambda: NOW, boot_clock=lambda: NOW)
    ledger.begin_reap(KEY, "enforce", "fp1")
    ledger.finish_reap(KEY, "aborted", signalled=False)
    assert ledger.done_modes() == {} and ledger.reap_times("enforce") == ()


def test_ledger_forgets_keys_of_another_boot(tmp_path: Path) -> None:
    """Only the rate-limit window outlives a reboot: a reap 50 s before the last write
    of the old boot is 50 s before the new boot began (the downtime is not credited)."""
    boot_now = [5_000.0]
    old = Ledger(tmp_path, clock=lambda: NOW, boot=lambda: "boot-1",
                 boot_clock=lambda: boot_now[0])
    old.begin_reap(KEY, "enforce", "f")
    boot_now[0] += 50
    old.add_pending([item(TreeKey("node-a", 5, 6))])  # the last write, 50 s later
    boot_now[0] = 10.0  # rebooted: the boot clock starts again
    again = Ledger(tmp_path, clock=lambda: NOW, boot=lambda: "boot-2",
                   boot_clock=lambda: boot_now[0])
    assert again.done_modes() == {} and again.pending() == {}
    assert again.reap_times("enforce") == (-50.0,)


def test_owed_audit_records_outlive_a_restart_and_a_reboot_until_paid(tmp_path: Path) -> None:
    """A reap's final record the audit log could not take is owed in the write that
    settles the reap (issue 47); it outlives a restart and a reboot (it is what
    happened); a file from before (no "owed") owes nothing."""
    old = Ledger(tmp_path, clock=lambda: NOW, boot=lambda: "boot-1", boot_clock=lambda: NOW)
    assert old.owed() == [] and old.owed_load() == (0, 0)
    record = {"phase": "final", "reap_id": "r1", "ts": NOW, "signals": [{"pid": 5}]}
    old.begin_reap(KEY, "enforce", "fp1")
    old.finish_reap(KEY, "reaped", signalled=True, owed=record)
    old.settle_interrupted(TreeKey("node-a", 5, 6), owed=[{"phase": "intent", "ts": NOW}])
    again = Ledger(tmp_path, clock=lambda: NOW, boot=lambda: "boot-2", boot_clock=lambda: 1.0)
    assert again.done_modes() == {}  # keys of another boot: forgotten
    assert again.owed() == [record, {"phase": "intent", "ts": NOW}]
    assert again.owed_load()[0] == 2
    again.paid(record)
    assert Ledger(tmp_path, boot=lambda: "boot-2").owed() == [{"phase": "intent", "ts": NOW}]
    saved = json.loads((tmp_path / "remediator-state.json").read_text())
    del saved["owed"]  # as an older version wrote it
    (tmp_path / "remediator-state.json").write_text(json.dumps(saved))
    assert Ledger(tmp_path, boot=lambda: "boot-2").owed() == []


def test_a_wall_clock_step_makes_the_ledger_forget_nothing(tmp_path: Path) -> None:
    """Retention and the rate-limit window count on the boot clock: 40 days' step of the
    wall clock (past both retentions) between two runs of one boot drops nothing."""
    wall, boot = [NOW], [1_000.0]
    other = TreeKey("node-a", 5, 6)

    def open_ledger() -> Ledger:
        return Ledger(tmp_path, clock=lambda: wall[0], boot_clock=lambda: boot[0])

    ledger = open_ledger()
    ledger.begin_reap(KEY, "enforce", "fp1")
    ledger.finish_reap(KEY, "reaped", signalled=True)
    ledger.note_first_seen(other, 990.0)
    wall[0] += 40 * 86400
    boot[0] += 5
    again = open_ledger()
    assert again.done_modes() == {KEY: "enforce"}
    assert again.reap_times("enforce") == (1_000.0,) and again.first_seen() == {other: 990.0}


def test_the_ledger_never_keeps_a_sighting_in_the_future(tmp_path: Path) -> None:
    """A first sighting later than now on the boot clock (written by a version that took
    a wall-clock step for the tree's age) is read as now, and none is stored later."""
    boot = [1_000.0]
    other, third = TreeKey("node-a", 5, 6), TreeKey("node-a", 7, 8)
    (tmp_path / "remediator-state.json").write_text(json.dumps({
        "version": 3, "boot_id": "boot-1", "boot_clock": 990.0, "done": {}, "pending": {},
        "first_seen": {str(KEY): 4_600.0, str(other): 900.0}, "gpus": {}, "reaps": []}))
    ledger = Ledger(tmp_path, clock=lambda: NOW, boot=lambda: "boot-1",
                    boot_clock=lambda: boot[0])
    assert ledger.first_seen() == {KEY: 1_000.0, other: 900.0}
    ledger.note_first_seen(third, 5_000.0)
    assert ledger.first_seen()[third] == 1_000.0
    item = PendingItem(TreeKey("node-a", 9, 10), make_alert(), "g", 1_000.0, 1_000.0)
    ledger.add_pending([item])
    ledger.defer(item.key, 1_300.0, 7_000.0)
    assert ledger.first_seen()[item.key] == 1_000.0
    saved = json.loads((tmp_path / "remediator-state.json").read_text())["first_seen"]
    assert max(saved.values()) == 1_000.0


@pytest.mark.parametrize("same_boot", [True, False])
def test_a_version_2_file_is_placed_on_the_boot_clock(tmp_path: Path, same_boot: bool) -> None:
    """Version 2 kept wall-clock times: read once by the clocks' offset now; an earlier
    boot's reaps no later than this boot's start (its keys are dropped as before)."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (tmp_path / "remediator-state.json").write_text(json.dumps({
        "version": 2, "boot_id": boot_id if same_boot else "an-earlier-boot",
        "done": {str(KEY): {"status": "done", "mode": "enforce", "at": NOW - 100}},
        "pending": {}, "first_seen": {str(KEY): NOW - 200},
        "reaps": [[NOW - 100, "enforce"], [NOW + 50, "enforce"]]}))
    again = Ledger(tmp_path, clock=lambda: NOW, boot_clock=lambda: 30.0)
    if same_boot:  # wall NOW is boot 30
        assert again.reap_times("enforce") == (-70.0, 80.0)
        assert again.first_seen() == {KEY: -170.0} and again.done_modes() == {KEY: "enforce"}
    else:
        assert again.reap_times("enforce") == (-70.0, 0.0)
        assert again.first_seen() == {} and again.done_modes() == {}
    saved = json.loads((tmp_path / "remediator-state.json").read_text())
    assert saved["version"] == 3 and saved["boot_clock"] == 30.0


def test_corrupt_ledger_refuses(tmp_path: Path) -> None:
    (tmp_path / "remediator-state.json").write_text("{not json")
    with pytest.raises(LedgerError, match="unusable state file"):
        Ledger(tmp_path)


def test_audit_is_json_lines_appended(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "sub" / "audit.jsonl")
    log.append({"a": 1})
    log.append({"b": [1, 2]})
    lines = (tmp_path / "sub" / "audit.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"a": 1}, {"b": [1, 2]}]


def test_an_exporter_that_saw_the_launcher_exit_keeps_the_tree_from_session_ended() -> None:
    """The remediator started after the launcher's exit: it sees only session-ended, but the
    alert says launcher-exited, which the default policy does not reap."""
    live = orphan(reason="session-ended")
    decision = decide(make_alert(reason="launcher-exited"), live, state(NO_LISTENER))
    assert (decision.action, decision.reason) == ("ignore", "reason-not-allowed")
    assert "launcher-exited" in decision.detail
    assert decide(make_alert(reason="session-ended"), live,
                  state(NO_LISTENER)).action == Action.REAP
    default = decide(make_alert(reason="session-ended"), live, state())
    assert (default.action, default.reason) == ("ignore", "reason-not-allowed")
    killed = decide(make_alert(reason="launcher-killed"), orphan(reason="launcher-killed"),
                    state())
    assert (killed.action, killed.reason) == (Action.REAP, "launcher-killed")


@pytest.mark.parametrize(("said", "local", "reason"), [
    ("launcher-unrecorded", "session-ended", "launcher-unrecorded"),  # no listener here
    ("launcher-unrecorded", "launcher-killed", "launcher-unrecorded"),
    ("launcher-exited", "launcher-unrecorded", "launcher-exited"),
    ("launcher-killed", "launcher-unrecorded", "launcher-unrecorded"),  # never harsher
    ("parent-exited", "session-ended", "session-ended"),  # not a launcher reason
])
def test_the_less_reapable_of_the_alert_and_the_local_launcher_reason_decides(
        said: str, local: str, reason: str) -> None:
    """A remediator whose listener did not start reads session-ended where the exporter
    knew it had no record (launcher-unrecorded): the alert's label must not be outweighed
    by knowing less. A label never makes a tree more reapable than the local reading."""
    decision = decide(make_alert(reason=said), orphan(reason=local), state(NO_LISTENER))
    if reason in ("launcher-killed", "session-ended"):
        assert (decision.action, decision.reason) == (Action.REAP, reason)
    else:
        assert (decision.action, decision.reason) == ("ignore", "reason-not-allowed")
        assert reason in decision.detail


@pytest.mark.parametrize("value", [None, "false", "True"])
def test_only_an_alert_that_asks_for_remediation_is_accepted(value: str | None) -> None:
    """remediate="true" is set by the one reaping rule; the route and pull mode select on
    it, and the policy checks it too: an alert posted straight to Alertmanager without it
    (or with another value) never reaches a live check."""
    raw = alert(KEY.root_pid, KEY.root_start_time, hostname=KEY.hostname)
    if value is None:
        del raw["labels"]["remediate"]
    else:
        raw["labels"]["remediate"] = value
    (parsed,) = parse_notification(payload(raw)).alerts
    decision = screen(parsed, state())
    assert (decision.action, decision.reason) == ("ignore", "not-remediate")
    assert screen(make_alert(), state()).action == "accept"
