"""A refused tree is logged once per change in pull mode, as its audit record is (issue 50).

Pull mode asks Alertmanager every pull_interval_seconds, and Alertmanager keeps answering
with the same firing alert of a tree the policy refuses: each poll was a delivery, and
each delivery an info line (`ignore KEY: reason-not-allowed (...)`): 240 lines an hour
per tree at the default 15 s, while the audit log wrote one record and counted the
rest. The real in-process remediator with its real poller, a real orphaned tree over
the fake NVML, a local fake Alertmanager on 127.0.0.1 that answers every poll alike.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

import pytest

from gpuguard.engine.decision.tree import TreeKey
from gpuguard.remediator.pull import Puller
from tests.e2e.test_alertmanager_client import FakeAlertmanager, answer, api_alert
from tests.live.test_pull_bounds import fake  # noqa: F401 - the fixture
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, children_of, wait_for
from tests.support.remediator_harness import HOST, FakeClock, Harness, spawn_orphan

#: bash (killed) -> sh (root, session-ended) -> holder with one sleeping child.
WITH_CHILD = ('sh -c "{holder} --children 1 --pidfile {dir}/holder" & echo $! > {dir}/root; '
              'wait')
POLLS = 10


def lines_about(caplog: pytest.LogCaptureFixture, key: TreeKey) -> list[str]:
    """The remediator's info (and louder) lines that name the tree."""
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("gpuguard.remediator") and r.levelno >= logging.INFO
            and str(key) in r.getMessage()]


def test_a_refused_tree_is_logged_once_per_change_over_repeated_polls(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        fake: Callable[..., FakeAlertmanager],  # noqa: F811 - the fixture
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gpuguard.remediator")
    orphan = spawn_orphan(trees, fake_gpu, WITH_CHILD)
    wait_for(lambda: len(children_of(orphan.holder)) == 1, what="the holder's child")
    labels = orphan.alert()["labels"]
    server = fake(answer(200, [api_alert(labels)]))
    clock = FakeClock()
    h = harness(clock=clock, reasons=["launcher-killed"],  # session-ended: refused
                alertmanager={"url": server.url, "pull": True, "pull_interval_seconds": 1,
                              "timeout_seconds": 2})
    (puller,) = [c for c in h.service._companions if isinstance(c, Puller)]
    key = TreeKey(HOST, orphan.root, orphan.root_start)

    def refused() -> int:
        return h.service.counts()["refusals_repeated"]

    # POLLS polls: most inside the refusal's re-check window (counted without a new
    # inspection), some after it (inspected again, the same refusal: counted).
    for n in range(POLLS):
        before = refused()
        if n % 3 == 2:
            clock.now += 61  # past REFUSAL_RECHECK_SECONDS: a new inspection
        if n == 0:
            wait_for(lambda: any(r["key"]["root_pid"] == orphan.root for r in h.audit()),
                     timeout=15, what="the first refusal audited")
        else:
            wait_for(lambda b=before: refused() > b, timeout=15, what=f"poll {n} counted")
    h.settle()
    assert puller.polls >= POLLS
    finals = [r for r in h.audit() if r["key"]["root_pid"] == orphan.root]
    assert len(finals) == 1 and finals[0]["decision"]["reason"] == "reason-not-allowed"
    said = lines_about(caplog, key)
    assert len(said) == 1, said  # was one per poll
    assert "reason-not-allowed" in said[0]
    assert orphan.all_alive()

    # A change (a member exits): the audit writes a full record again, and the log one
    # line, which says how many identical refusals it follows.
    child = children_of(orphan.holder)[0]
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: not alive(child), what="the child to exit")
    clock.now += 61
    wait_for(lambda: len([r for r in h.audit() if r["key"]["root_pid"] == orphan.root]) == 2,
             timeout=15, what="the changed refusal audited")
    h.settle()
    said = lines_about(caplog, key)
    assert len(said) == 2, said
    second = [r for r in h.audit() if r["key"]["root_pid"] == orphan.root][1]
    assert f"{second['repeats_before']} identical" in said[1], said[1]
