from __future__ import annotations

import os
import re
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.host.procfs import in_host_pid_namespace
from tests.support.ci import INITIAL_PIDNS, RUN_INITIAL_PIDNS, require
from tests.support.proctree import Trees, become_subreaper, reap_zombie_children

#: Fixtures: the fake NVML and AMD SMI worlds, the in-process remediator `harness`, slow
#: HTTP `peer`s.
pytest_plugins = ["tests.support.fakenvml.plugin", "tests.support.fakeamdsmi.plugin",
                  "tests.support.remediator_harness", "tests.support.slowpeer"]


LIVE = Path(__file__).parent / "live"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--live-share", metavar="K/N", default=None,
        help="of tests/live, run only the K-th of N shares (whole files, dealt so that each "
             "share has about as many tests); the rest of the selection runs whole. "
             ".ci/run gives each of the two compat interpreters one share "
             "(docs/development.md)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    share = config.getoption("--live-share")
    if share is None:
        return
    shape = re.fullmatch(r"([0-9]+)/([0-9]+)", str(share))  # not isdigit(): "²" is one
    if shape is None or not 1 <= int(shape[1]) <= int(shape[2]):
        raise pytest.UsageError(f"--live-share {share}: give K/N with 1 <= K <= N, e.g. 1/2")
    k, n = int(shape[1]), int(shape[2])
    kept = live_shares([item.path for item in items if item.path.parent == LIVE], n)[k - 1]
    dropped = [item for item in items if item.path.parent == LIVE and item.path not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(dropped)
        items[:] = [item for item in items if item not in gone]


def live_shares(paths: list[Path], n: int) -> list[set[Path]]:
    """The files of `paths` (one entry per test) dealt into `n` shares of about as many
    tests each: the file with the most tests first, each to the share that has fewest so
    far (ties: the first share; files in name order among equals). The same collection
    deals the same shares, whichever share is asked for."""
    counts = Counter(paths)
    shares: list[set[Path]] = [set() for _ in range(n)]
    loads = [0] * n
    for path in sorted(counts, key=lambda p: (-counts[p], p.name)):
        lightest = loads.index(min(loads))
        shares[lightest].add(path)
        loads[lightest] += counts[path]
    return shares


def pytest_configure(config: pytest.Config) -> None:
    # Orphans of the trees the tests spawn come back to us, so cleanup can find them.
    become_subreaper()
    # A runner started under nohup (or by a supervisor that ignores SIGHUP) hands that
    # disposition to every tree the tests build, which the classifier rightly reads as a
    # deliberate detach (ignores-sighup): the trees start as a login's jobs do.
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.get_closest_marker(INITIAL_PIDNS) is None for item in session.items):
        check_own_ancestry()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker(INITIAL_PIDNS) is not None and not in_host_pid_namespace():
        require(False, "a child PID namespace: the kernel's process events carry host pids "
                f"that this namespace cannot name; {RUN_INITIAL_PIDNS}")


def check_own_ancestry() -> None:
    """Fail fast when the runner itself sits under an adopted process.

    The classifier roots an orphan tree at the topmost adopted member of a chain, so
    if one of our own ancestors was adopted (say, a shell backgrounded by a wrapper
    that has exited), every tree the tests build would be rooted there instead of
    where the tests expect, and the remediator would rightly refuse to touch it.
    """
    from gpuguard.base.counters import Counters
    from gpuguard.host.procfs import ProcessView
    from gpuguard.orphans.classify import classify_holder
    from gpuguard.orphans.process import Holder
    from gpuguard.orphans.rules_config import Rules
    from gpuguard.orphans.vocabulary import Verdict

    if os.getpid() <= 2:
        # The runner adopts every orphan the tests make (a child subreaper); an orphan whose
        # parent is pid 1 or 2 (kthreadd's pid) reads as protected, and every reap refuses.
        pytest.exit(
            f"the test runner is pid {os.getpid()} of its PID namespace: start it below a "
            "process of its own, e.g. unshare --pid --fork --mount-proc make test, or "
            "sh -c '/bin/true; python -m pytest ...'", returncode=3)
    me = Holder(pid=os.getpid(), gpu_uuid="self-check", gpu_index=0, used_bytes=0, kind="C")
    verdict = classify_holder(me, ProcessView(counters=Counters()), Rules())
    if verdict.verdict == Verdict.ORPHAN:
        pytest.exit(
            f"the test runner's ancestry contains an adopted process "
            f"({verdict.evidence.detail}); run the tests from a shell whose launchers are "
            "alive, or in a fresh PID namespace: unshare --pid --fork --mount-proc make test",
            returncode=3,
        )


@pytest.fixture
def trees(tmp_path: Path) -> Iterator[Trees]:
    """Spawn real process trees; everything they leave is killed at teardown, pass or fail."""
    registry = Trees(tmp_path / "trees")
    try:
        yield registry
    finally:
        registry.cleanup()
        reap_zombie_children()
