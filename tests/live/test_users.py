"""Users a policy cannot name: gpuguard/host/users.py's resolver and remediate.users' rules.

A uid with no passwd entry (a container without the host's users) or whose NSS does
not answer (SSSD or LDAP down) has no name. Shown: such a failure is never cached
(a resolver with an injected lookup); the rules (pure); and on a real tree owned by a
uid without a passwd entry (setpriv, as root), that the live inspection says so and
decide(), the reaper and the in-process remediator refuse it under a filter that names
users, while a `uid:N` rule admits or denies it by number.
"""

from __future__ import annotations

import os
import pwd
import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest

from gpuguard.base.counters import Counters
from gpuguard.config.remediate import Remediate, UserFilter
from gpuguard.engine.alerting.alerts import Alert, parse_notification
from gpuguard.engine.decision.policy import Action, Decision, PolicyState, decide, user_refusal
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import LiveTree, TreeKey
from gpuguard.engine.platforms import inspect_tree
from gpuguard.engine.reap.reaper import Reaper
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.procfs import boottime
from gpuguard.host.users import UserNames
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.vocabulary import Reason
from tests.support.ci import require
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, environment_in_place, stat_fields, wait_for
from tests.support.remediator_harness import (
    GIB,
    HOST,
    Harness,
    Orphan,
    account,
    payload,
    start_time_of,
)

STRANGER_UID = 54321  # no passwd entry (checked): NSS has no name for it
UNRESOLVED = f"user of uid {STRANGER_UID} could not be resolved"


# -- the resolver ---------------------------------------------------------------------


class Answers:
    """An injected NSS: each call takes the next answer (an exception is raised)."""

    def __init__(self, *answers: str | Exception) -> None:
        self.answers = list(answers)
        self.asked: list[int] = []

    def __call__(self, uid: int) -> str:
        self.asked.append(uid)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_lookup_is_not_cached_and_the_name_comes_when_nss_does() -> None:
    nss = Answers(KeyError("getpwuid(): uid not found: 54321"), "alice")
    users = UserNames(lookup=nss, clock=Clock())
    assert users.name(STRANGER_UID) is None and users.label(STRANGER_UID) == "alice"
    assert users.name(STRANGER_UID) == "alice" and nss.asked == [STRANGER_UID] * 2
    assert users.label(STRANGER_UID) == "alice" and len(nss.asked) == 2  # a name is cached


def test_a_name_is_kept_for_its_ttl_then_asked_again() -> None:
    clock = Clock()
    nss = Answers("alice", "alice2")  # renamed
    users = UserNames(lookup=nss, clock=clock, ttl=300)
    assert users.name(1000) == "alice"
    clock.now += 299
    assert users.name(1000) == "alice" and len(nss.asked) == 1
    clock.now += 1
    assert users.name(1000) == "alice2" and len(nss.asked) == 2


def test_a_failure_after_a_name_expired_forgets_the_name() -> None:
    clock = Clock()
    nss = Answers("alice", OSError("NSS is down"), "alice")
    users = UserNames(lookup=nss, clock=clock, ttl=10)
    assert users.name(1000) == "alice"
    clock.now += 10
    assert users.name(1000) is None and users.label(1000) == "alice"


def test_the_cache_keeps_at_most_max_entries_uids() -> None:
    nss = Answers("someone")
    users = UserNames(lookup=nss, clock=Clock(), max_entries=2)
    for uid in (1, 2, 3, 1):
        users.name(uid)
    assert nss.asked == [1, 2, 3, 1]  # 1 was the oldest when 3 came


def test_label_is_the_bare_uid_when_there_is_no_name() -> None:
    users = UserNames(lookup=Answers(KeyError("no")), clock=Clock())
    assert users.label(STRANGER_UID) == str(STRANGER_UID) and users.label(None) == ""


# -- the rules (pure) -----------------------------------------------------------------


@pytest.mark.parametrize(("allow", "deny", "reason"), [
    (["*"], ["root"], "user-unresolved"),  # the default: not reaped by default
    (["*"], ["root", "svc-*"], "user-unresolved"),
    (["alice", "ml-*"], [], "user-unresolved"),
    (["*", "alice"], ["root"], "user-unresolved"),
    (["*"], [], None),  # names no user: anyone, named or not
    (["*"], ["uid:0"], None),  # deny by uid only: still names no user
    # Named by its uid, but a deny pattern may name its user: deny wins, unresolved.
    (["uid:54321"], ["root", "svc-*"], "user-unresolved"),
    (["uid:54321"], ["uid:0"], None),  # named by its uid, deny by uid only
    ([f"uid:{STRANGER_UID + 1}"], [], "user-denied"),  # only uids allowed, not this one
    (["*"], ["uid:54321"], "user-denied"),
    (["uid:54321"], ["uid:54321"], "user-denied"),  # deny wins
])
def test_a_uid_without_a_name_is_refused_whenever_the_filter_names_users(
        allow: list[str], deny: list[str], reason: str | None) -> None:
    got = user_refusal(STRANGER_UID, None, UserFilter(tuple(allow), tuple(deny)))
    assert (got[0] if got else None) == reason, got
    if reason == "user-unresolved":
        assert got is not None and got[1].startswith(UNRESOLVED)
        assert f"uid:{STRANGER_UID}" in got[1]  # says how to admit it


def test_uid_rules_apply_to_named_users_too() -> None:
    assert user_refusal(1000, "alice", UserFilter(("*",), ("uid:1000",))) is not None
    assert user_refusal(1000, "alice", UserFilter(("uid:1000",), ("root",))) is None
    refused = user_refusal(1000, "svc-x", UserFilter(("uid:1000",), ("svc-*",)))
    assert refused is not None and refused[0] == "user-denied" and "'svc-*'" in refused[1]
    assert user_refusal(0, "root", UserFilter()) is not None


# -- a real tree owned by a uid without a passwd entry ---------------------------------


#: bash (the launcher, killed) -> sh (the root, uid 54321) -> sleep (the holder, uid 54321).
#: The holder's pid goes out through a file the launcher opened (fd 3): the stranger may
#: not reach the tests' temporary directory.
STRANGER_TREE = (f"setpriv --reuid={STRANGER_UID} --regid={STRANGER_UID} --clear-groups "
                 "sh -c 'sleep 3600 & echo $! >&3; wait' 3>{dir}/holder & "
                 "echo $! > {dir}/root; wait")


@pytest.fixture
def stranger(trees: Trees, fake_gpu: FakeGpuWorld) -> Orphan:
    """An orphaned GPU tree whose every member runs as STRANGER_UID."""
    require(os.geteuid() == 0, "needs root to run processes as another uid")
    require(shutil.which("setpriv"), "setpriv not found (util-linux)")
    try:
        name = pwd.getpwuid(STRANGER_UID).pw_name
        pytest.skip(f"uid {STRANGER_UID} has a passwd entry here ({name})")
    except KeyError:
        pass
    tree = trees.spawn(STRANGER_TREE)
    holder, root = tree.pid("holder"), tree.pid("root")
    # `echo $!` runs once sleep is forked, maybe before it has exec'd and placed its
    # environment (which the judge reads): wait for what is meant.
    wait_for(lambda: (stat_fields(holder) or {}).get("comm") == "sleep"
             and environment_in_place(holder), what="the holder to exec sleep")
    fields = stat_fields(holder)
    assert fields is not None and fields["ppid"] == root
    assert os.stat(f"/proc/{holder}").st_uid == os.stat(f"/proc/{root}").st_uid == STRANGER_UID
    fake_gpu.add_process(0, holder, 2 * GIB)
    tree.kill_launcher()
    return Orphan(tree, root, start_time_of(root), holder)


def parsed(orphan: Orphan) -> Alert:
    (only,) = parse_notification(payload(orphan.alert(user=str(STRANGER_UID)))).alerts
    return only


def judged(orphan: Orphan, live: LiveTree, allow: list[str], deny: list[str]) -> Decision:
    # The tree's launcher dies where no listener may run (the suite's PID namespace): the
    # policy of such a host, which opts in to session-ended.
    policy = Remediate(mode="enforce", min_age_seconds=0,
                       reasons=(Reason.LAUNCHER_KILLED, Reason.SESSION_ENDED),
                       users=UserFilter(tuple(allow), tuple(deny)))
    state = PolicyState(policy=policy, hostname=HOST, now=boottime(), wall_now=time.time())
    return decide(parsed(orphan), live, state)


@pytest.fixture
def live_stranger(stranger: Orphan) -> tuple[Orphan, LiveTree, Nvml]:
    nvml = Nvml(counters=Counters())
    key = TreeKey(HOST, stranger.root, stranger.root_start)
    live = inspect_tree(key, nvml=nvml, rules=Rules(), counters=Counters())
    assert live.tree_found and live.verdict == "orphan", live
    return stranger, live, nvml


def test_the_live_inspection_says_the_owner_has_no_name(
        live_stranger: tuple[Orphan, LiveTree, Nvml]) -> None:
    orphan, live, nvml = live_stranger
    try:
        assert sorted(m.pid for m in live.members) == sorted(orphan.members)
        assert {(m.uid, m.user, m.user_known, m.user_name) for m in live.members} == {
            (STRANGER_UID, str(STRANGER_UID), False, None)}
    finally:
        nvml.close()


def test_decide_on_the_real_tree_refuses_it_when_the_filter_names_users(
        live_stranger: tuple[Orphan, LiveTree, Nvml]) -> None:
    orphan, live, nvml = live_stranger
    try:
        refused = judged(orphan, live, ["*"], ["root", "svc-*"])
        assert (refused.action, refused.reason) == (Action.IGNORE, "user-unresolved"), refused
        assert UNRESOLVED in refused.detail
        assert judged(orphan, live, ["*"], ["root"]).reason == "user-unresolved"  # default
        # A uid rule matches it: admitted by number, or denied by number.
        assert judged(orphan, live, [f"uid:{STRANGER_UID}"], ["uid:0"]).action == Action.REAP
        denied = judged(orphan, live, ["*"], [f"uid:{STRANGER_UID}"])
        assert (denied.action, denied.reason) == (Action.IGNORE, "user-denied"), denied
        assert judged(orphan, live, ["*"], []).action == Action.REAP
        assert orphan.all_alive()
    finally:
        nvml.close()


def test_the_reaper_refuses_it_by_the_same_rule(
        live_stranger: tuple[Orphan, LiveTree, Nvml]) -> None:
    orphan, live, nvml = live_stranger
    try:
        policy = Remediate(mode="enforce", term_timeout_seconds=2,
                           users=UserFilter(("*",), ("root", "svc-*")))
        plan = ReapPlan(TreeKey(HOST, orphan.root, orphan.root_start), live.members,
                        live.holders, live.gpu_bytes, False, gpus=live.gpus)
        result = Reaper(nvml=nvml, counters=Counters()).reap(
            plan, policy=policy, rules=Rules(), protected_pids=frozenset({1, os.getpid()}),
            deadline=time.monotonic() + 30, journal=lambda phase, members: None)
        assert (result.outcome, result.reason) == ("aborted", "user-unresolved"), result
        assert UNRESOLVED in result.detail and not result.signalled
        assert orphan.all_alive()
    finally:
        nvml.close()


def test_the_remediator_audits_why(harness: Callable[..., Harness], stranger: Orphan) -> None:
    h = harness(users={"allow": ["*"], "deny": ["root", "svc-*"]}, mode="dry-run")
    answer: dict[str, Any] = account(h.post(payload(stranger.alert())))
    assert answer["status"] == "accepted"
    h.settle()
    (record,) = [r for r in h.audit() if r["key"]["root_pid"] == stranger.root]
    assert record["decision"]["reason"] == "user-unresolved" and record["signals"] == []
    assert UNRESOLVED in record["decision"]["detail"]
    assert {(m["uid"], m["user"]) for m in record["tree"]["members"]} == {
        (STRANGER_UID, str(STRANGER_UID))}
    assert stranger.all_alive()


def test_a_uid_rule_lets_the_remediator_reap_it(harness: Callable[..., Harness],
                                                stranger: Orphan) -> None:
    h = harness(users={"allow": [f"uid:{STRANGER_UID}"], "deny": ["uid:0"]})
    assert account(h.post(payload(stranger.alert())))["status"] == "accepted"
    wait_for(stranger.none_alive, what="the reap of the uid-ruled tree")
    h.settle()
    (record,) = [r for r in h.audit() if r["key"]["root_pid"] == stranger.root
                 and r["phase"] == "final"]
    assert (record["decision"]["action"], record["outcome"]) == (Action.REAP, "reaped"), record
