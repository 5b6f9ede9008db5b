"""The exporter's user names: resolved on the scan thread, bounded, one map per scrape.

An NSS that hangs (SSSD or LDAP down) is an injected resolver at the seam, the lookup
the scanner's `users` calls, blocking on an Event: the real collector over the fake
NVML, served by the real HTTP server, answers `/metrics` in the usual time while it
hangs, and every series of one scrape names a uid alike. Decisions never see what
these labels remember (gpuguard/host/users.py: `USERS` caches no failure).
"""

from __future__ import annotations

import ast
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest

from gpuguard.base.counters import Counters
from gpuguard.engine.scan.scanner import GroupCache, Scanner
from gpuguard.exporter.cli import make_app
from gpuguard.exporter.metrics import GpuguardCollector
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.procfs import ProcessView
from gpuguard.host.users import (
    FAILURE_TTL_SECONDS,
    LOOKUP_TIMEOUT_SECONDS,
    USERS,
    BoundedLookup,
    UserNames,
    group_names,
    label_names,
)
from gpuguard.host.windows.platform import BACKEND as WINDOWS_BACKEND
from gpuguard.orphans.rules_config import Rules
from gpuguard.web.serving import create_server
from tests.live.test_users import Answers, Clock
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, wait_for
from tests.support.servers import find, parse_samples

GIB = 2**30
REPO = Path(__file__).resolve().parents[2]
#: What a scrape may take while NSS hangs (a scrape over the fake NVML takes ~10 ms).
SCRAPE_BOUND_SECONDS = 0.5


class HangingNss:
    """NSS that does not answer until `release` is set, then names everyone `name`."""

    def __init__(self, name: str = "alice") -> None:
        self.release = threading.Event()
        self.name = name
        self.asked: list[int] = []

    def __call__(self, uid: int) -> str:
        self.asked.append(uid)
        self.release.wait(60)  # bounded: a failed test leaves no thread behind for long
        return self.name


def scanner_with(users: UserNames, interval: float = 0.1) -> Scanner:
    counters = Counters()
    return Scanner(rules=Rules(), nvml=Nvml(counters=counters),
                   view=ProcessView(counters=counters), counters=counters,
                   interval=interval, users=users)


def orphan(trees: Trees, fake_gpu: FakeGpuWorld) -> tuple[int, int]:
    """(root, holder) of an orphaned GPU tree of ours: every user series names our uid."""
    tree = trees.spawn("sh -c '{holder} --pidfile {dir}/w & echo $$ > {dir}/sh; wait' & wait")
    holder, root = tree.pid("w"), tree.pid("sh")
    fake_gpu.add_process(0, holder, 2 * GIB)
    tree.kill_launcher()
    return root, holder


def user_labels(text: str, root: int, holder: int) -> dict[str, str]:
    """The `user` each series shows for our tree, by metric."""
    samples = parse_samples(text)
    out = {}
    for name, labels in (("gpuguard_gpu_process_info", {"pid": str(holder)}),
                         ("gpuguard_orphan_tree_age_seconds", {"root_pid": str(root)}),
                         ("gpuguard_orphan_tree_memory_bytes", {"root_pid": str(root)}),
                         ("gpuguard_user_gpu_memory_bytes", {})):
        found = find(samples, name, **labels)
        if found:
            (series, _), = found
            out[name] = series["user"]
    return out


@pytest.fixture
def served() -> Iterator[Callable[[Scanner], int]]:
    """The exporter's WSGI app over a scanner, on the real HTTP server: its port."""
    servers = []

    def serve(scanner: Scanner) -> int:
        registry = CollectorRegistry()
        registry.register(GpuguardCollector(scanner, hostname="node-1"))
        server = create_server(make_app(scanner, registry), host="127.0.0.1", port=0,
                               ident="test", threads=4)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        return int(server.effective_port)

    yield serve
    for server, thread in servers:
        server.trigger.pull_trigger(lambda s=server: [d.close() for d in list(s._map.values())])
        thread.join(timeout=5)
        server.task_dispatcher.shutdown()


def test_a_hung_name_service_slows_no_scrape_and_one_scrape_names_a_uid_alike(
        trees: Trees, fake_gpu: FakeGpuWorld, served: Callable[[Scanner], int]) -> None:
    root, holder = orphan(trees, fake_gpu)
    nss = HangingNss()
    clock = Clock()
    users = UserNames(lookup=BoundedLookup(nss, timeout=0.5), failure_ttl=FAILURE_TTL_SECONDS,
                      clock=clock)
    scanner = scanner_with(users)
    port = served(scanner)
    url = f"http://127.0.0.1:{port}/metrics"
    uid = str(os.getuid())
    scanner.start()
    try:
        wait_for(lambda: len(user_labels(requests.get(url, timeout=5).text, root, holder)) == 4,
                 what="every series of the orphan tree")
        scans = scanner.counts()[0]
        took = []
        while scanner.counts()[0] < scans + 5:  # scans go on (each once a failure is known)
            started = time.monotonic()
            answer = requests.get(url, timeout=5)
            took.append(time.monotonic() - started)
            assert answer.status_code == 200
            # One scan's names: every series says the uid, none waits for a name.
            assert set(user_labels(answer.text, root, holder).values()) == {uid}
        assert max(took) < SCRAPE_BOUND_SECONDS, took
        # Asked once (root and holder share the uid), off the serving path, and the
        # failure is remembered: no scan since has waited on NSS again.
        assert nss.asked == [os.getuid()]
        assert scanner.latest is not None and scanner.latest.duration_seconds < 0.5

        # NSS answers again: the failure is believed for its minute, then the name shows,
        # in every series of a scrape at once.
        nss.release.set()
        clock.now += FAILURE_TTL_SECONDS
        wait_for(lambda: set(user_labels(requests.get(url, timeout=5).text, root,
                                         holder).values()) == {"alice"},
                 what="the name once NSS answers")
        assert nss.asked == [os.getuid()] * 2
    finally:
        nss.release.set()
        scanner.stop()


def test_a_scrape_never_asks_nss_and_shows_the_names_of_its_scan(
        trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """Issue 36: accounting named a uid at scan time and process labels at scrape time,
    so one scrape could say `0` in one metric and `root` in another."""
    root, holder = orphan(trees, fake_gpu)
    nss = Answers(KeyError("getpwuid(): uid not found"), "alice")
    scanner = scanner_with(UserNames(lookup=nss))
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="node-1"))
    scanner.scan_once()  # NSS has no name: the scan's labels are the number
    text = generate_latest(registry).decode()  # NSS would say alice now: not asked
    assert set(user_labels(text, root, holder).values()) == {str(os.getuid())}
    assert len(user_labels(text, root, holder)) == 4 and len(nss.asked) == 1
    scanner.scan_once()
    text = generate_latest(registry).decode()
    assert set(user_labels(text, root, holder).values()) == {"alice"} and len(nss.asked) == 2


# -- the bounded lookup ---------------------------------------------------------------


def test_a_lookup_that_overruns_is_abandoned_and_so_are_at_most_a_few() -> None:
    nss = HangingNss()
    lookup = BoundedLookup(nss, timeout=0.05, max_abandoned=2)
    try:
        for uid in (1001, 1002):
            started = time.monotonic()
            with pytest.raises(TimeoutError, match=f"uid {uid}"):
                lookup(uid)
            assert time.monotonic() - started < 1.0
        assert lookup.abandoned == 2
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="still hang"):
            lookup(1003)  # two still hang: NSS is not asked a third time
        assert time.monotonic() - started < 0.05 and nss.asked == [1001, 1002]
    finally:
        nss.release.set()
    wait_for(lambda: lookup.abandoned == 0, what="the abandoned lookups to return")
    assert lookup(1003) == "alice"  # NSS answers: asked again


def test_a_lookup_answers_and_fails_as_nss_does() -> None:
    assert BoundedLookup(Answers("bob"))(1000) == "bob"
    with pytest.raises(KeyError):
        BoundedLookup(Answers(KeyError("no such uid")))(1000)


def test_a_failed_label_is_remembered_for_a_minute_a_decisions_never() -> None:
    clock = Clock()
    nss = Answers(KeyError("no"), "alice")
    labels = UserNames(lookup=nss, clock=clock, failure_ttl=FAILURE_TTL_SECONDS)
    assert labels.labels([1001, 1001, None]) == {1001: "1001"} and len(nss.asked) == 1
    clock.now += FAILURE_TTL_SECONDS - 1
    assert labels.label(1001) == "1001" and len(nss.asked) == 1
    clock.now += 1
    assert labels.label(1001) == "alice" and len(nss.asked) == 2
    # The decisions' resolver has no failure memory: the next call asks NSS again.
    decisions = UserNames(lookup=Answers(KeyError("no"), "alice"), clock=clock)
    assert decisions.name(1001) is None and decisions.name(1001) == "alice"
    assert USERS._failure_ttl == 0


def test_the_exporter_labels_with_its_own_resolver_never_the_decisions_one() -> None:
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=Counters()))
    assert scanner.users is not USERS and scanner.users._failure_ttl == FAILURE_TTL_SECONDS
    assert isinstance(label_names()._lookup, BoundedLookup)


def test_no_decision_path_imports_the_label_resolver() -> None:
    """What the labels remember (a failure, for a minute) must not reach
    `remediate.users`: the remediator and the console (reap, MCP) ask USERS only."""
    offenders = []
    for folder in ("remediator", "gpuguard/console", "gpuguard/launch"):
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "gpuguard.host.users":
                    offenders += [f"{path.relative_to(REPO)}: {a.name}" for a in node.names
                                  if a.name not in ("USERS", "UserNames", "passwd_name")]
                if isinstance(node, ast.Attribute) and node.attr in (
                        "label_names", "label_groups", "BoundedLookup"):
                    offenders.append(f"{path.relative_to(REPO)}: {node.attr}")
    assert offenders == []


# -- group names (accounting quotas), asked on the scan thread too -------------------------


class HangingGroups:
    """NSS's group lookup hanging until `release` is set, then answering `groups`."""

    def __init__(self, *groups: str) -> None:
        self.release = threading.Event()
        self.groups = frozenset(groups)
        self.asked: list[str] = []

    def __call__(self, user: str) -> frozenset[str]:
        self.asked.append(user)
        self.release.wait(60)
        return self.groups


def test_a_hung_group_lookup_costs_a_scan_its_bound_once_a_minute() -> None:
    """Before, GroupCache called getgrouplist() on the scan thread with no bound: a hung
    SSSD held every scan. Now the scan waits the bound, the user counts as in no group
    (their own quota or "*" applies) for FAILURE_TTL_SECONDS, then NSS is asked again."""
    nss = HangingGroups("staff")
    clock = Clock()
    groups = GroupCache(clock=clock, lookup=BoundedLookup(
        nss, timeout=0.05, what="the groups of", meanwhile="no group quota applies"))
    try:
        started = time.monotonic()
        assert groups("alice") == frozenset()
        assert time.monotonic() - started < 1.0
        clock.now += FAILURE_TTL_SECONDS - 1
        assert groups("alice") == frozenset() and nss.asked == ["alice"]  # not asked again
    finally:
        nss.release.set()
    clock.now += 1

    def answered() -> bool:  # a lookup that overran its 50 ms once more is believed 60 s
        clock.now += FAILURE_TTL_SECONDS
        return groups("alice") == {"staff"}

    wait_for(answered, what="the groups once NSS answers")
    asked = len(nss.asked)
    clock.now += 299
    assert groups("alice") == {"staff"} and len(nss.asked) == asked  # an answer: 5 minutes


def test_the_exporters_group_lookup_is_bounded_and_asks_nss() -> None:
    bounded = GroupCache()._lookup
    assert isinstance(bounded, BoundedLookup) and bounded._timeout == LOOKUP_TIMEOUT_SECONDS
    import grp
    import pwd

    me = pwd.getpwuid(os.getuid())
    assert grp.getgrgid(me.pw_gid).gr_name in group_names(me.pw_name)
    assert group_names("no-such-user-gpuguard-test") == frozenset()
    # Windows has no NSS groups: its platform's lookup answers none and starts no NSS ask.
    no_groups = WINDOWS_BACKEND.group_lookup()
    assert not isinstance(no_groups, BoundedLookup)
    assert GroupCache(lookup=no_groups)("alice") == frozenset()


def test_the_group_cache_keeps_at_most_max_entries_users() -> None:
    """Users are named by the uids of GPU holders (a user namespace's many subordinate
    uids among them): the cache forgets the oldest answer rather than grow with them."""
    asked: list[str] = []

    def nss(user: str) -> frozenset[str]:
        asked.append(user)
        return frozenset({"staff"})

    groups = GroupCache(clock=Clock(), lookup=nss, max_entries=2)
    for user in ("100001", "100002", "100003"):
        assert groups(user) == {"staff"}
    assert groups("100003") == {"staff"} and groups("100002") == {"staff"}
    assert asked == ["100001", "100002", "100003"]  # the last two still cached
    assert groups("100001") == {"staff"} and asked[-1] == "100001"  # the first was dropped
