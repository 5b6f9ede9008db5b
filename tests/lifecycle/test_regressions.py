"""Counterexamples the lifecycle properties found, each as the smallest history that shows it.

Each test asserts what the truth (truth.py) demands and is a strict xfail while
classify() answers otherwise, so a change that fixes one turns the suite red until
its mark is removed. In all three, every process that launched the holder is alive
and classify() still answers `orphan`; properties.py tolerates exactly these answers
(an orphan rooted where /proc shows the adoption evidence) and counts them.
"""

from __future__ import annotations

import pytest

from exporter.classify import ORPHAN, classify
from tests.lifecycle.model import PROGRAMS, SIGKILL, Proc, World, login
from tests.lifecycle.properties import RULES
from tests.lifecycle.truth import (
    ADOPTED_ABOVE_CHAIN,
    CHILD_OF_REAPER,
    SETSID_AFTER_FORK,
    holder_truth,
)
from tests.proctable import holder

PYTHON, SH, TINI = PROGRAMS[0], PROGRAMS[1], PROGRAMS[5]
assert TINI.comm == "tini"


def spawn(world: World, parent: Proc, program=PYTHON) -> Proc:
    child = world.fork(parent)
    assert child is not None
    world.exec(child, program)
    return child


def verdicts(world: World, p: Proc, listener: str):
    trees = classify([holder(q.pid) for q in world.holders()], world.view(listener), RULES)
    (tree,) = [t for t in trees if any(h.pid == p.pid for h in t.holders)]
    return tree


@pytest.mark.xfail(strict=True, reason=(
    "rule 6 scans the whole chain top-down: an adopted process above the holder's session "
    "leader roots an orphan tree over a session that was created on purpose and whose "
    "launchers all live; with the leader's session gone the reason is launcher-killed or "
    "session-ended, which the default policy reaps"))
@pytest.mark.parametrize("listener, reason", [("every", "launcher-killed"),
                                              ("none", "session-ended")])
def test_live_session_under_an_adopted_agent_is_not_orphan(listener, reason):
    # An agent started from a login shell opens its own shell sessions (fork + setsid) and
    # runs a GPU job in one. The login shell is killed; the agent survives (disowned) and
    # is adopted by PID 1. The job, its shell and the agent are all alive.
    world = World()
    bash = login(world)["bash"]
    agent = spawn(world, bash)
    shell = world.fork(agent)
    assert shell is not None and world.setsid(shell)
    world.exec(shell, PROGRAMS[8])  # bash
    job = spawn(world, shell)
    world.gpu(job)
    world.kill(bash, SIGKILL)
    truth = holder_truth(job)
    assert truth.launchers_alive and truth.chain == [job, shell]
    assert truth.kinds() == {ADOPTED_ABOVE_CHAIN}
    tree = verdicts(world, job, listener)
    assert tree.verdict != ORPHAN, (
        f"{tree.verdict}/{tree.reason} rooted at {tree.root_pid} (the agent is {agent.pid}), "
        f"{reason} expected from today's classifier")


@pytest.mark.xfail(strict=True, reason=(
    "E2 takes every non-leader child of a process named like a reaper (tini, systemd, "
    "containerd-shim) in its own session as adopted; the one it forked itself reads the "
    "same in /proc, so the safe answer is not orphan (classify says orphan/parent-exited)"))
def test_child_that_tini_forked_itself_is_not_orphan():
    # bash -> tini -s -- ./run.sh -> python: nothing has died.
    world = World()
    bash = login(world)["bash"]
    tini = spawn(world, bash, TINI)
    world.set_subreaper(tini)
    job = spawn(world, tini)
    world.gpu(job)
    truth = holder_truth(job)
    assert truth.launchers_alive and truth.kinds() == {CHILD_OF_REAPER}
    assert verdicts(world, job, "every").verdict != ORPHAN


@pytest.mark.xfail(strict=True, reason=(
    "E1 takes a non-leader in another session than its parent as adopted; a parent that "
    "calls setsid() after forking it reads the same in /proc, so the safe answer is not "
    "orphan (classify says orphan/parent-exited)"))
def test_child_whose_parent_called_setsid_after_forking_it_is_not_orphan():
    # bash -> python (in bash's process group, so setsid() is allowed) forks a worker,
    # then calls setsid(). Nothing has died.
    world = World()
    bash = login(world)["bash"]
    parent = spawn(world, bash)
    worker = spawn(world, parent)
    world.gpu(worker)
    assert world.setsid(parent)
    truth = holder_truth(worker)
    assert truth.launchers_alive and truth.kinds() == {SETSID_AFTER_FORK}
    assert verdicts(world, worker, "every").verdict != ORPHAN
