"""Counterexamples the lifecycle properties found, each as the smallest history that shows it.

Each was an `orphan` verdict (and, for the first, a reap under the default policy)
for a holder whose launchers all live; each now gets the answer the truth demands or,
where /proc cannot tell, the safe one (`unknown`, reason `adoption-uncertain`).
"""

from __future__ import annotations

import pytest

from gpuguard.orphans.classify import classify
from gpuguard.orphans.vocabulary import Reason, Verdict
from tests.pure.lifecycle.model import PROGRAMS, SIGKILL, Proc, World, login
from tests.pure.lifecycle.properties import RULES, check_moment
from tests.pure.lifecycle.truth import (
    ADOPTION_AMBIGUOUS,
    CHILD_OF_REAPER,
    SETSID_AFTER_FORK,
    holder_truth,
)
from tests.support.proctable import holder

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


@pytest.mark.parametrize("listener", ["every", "none"])
def test_live_session_under_an_adopted_agent_is_session_orphaned(listener):
    # An agent started from a login shell opens its own shell sessions (fork + setsid) and
    # runs a GPU job in one. The login shell is killed; the agent survives (disowned) and
    # is adopted by PID 1. The job, its shell and the agent are all alive. Rule 6 used to
    # root an orphan tree at the agent as launcher-killed (reaped by default); the job's
    # own session lives, so it is session-orphaned: alerted, not reaped by default.
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
    assert truth.launchers_alive and truth.chain == [job, shell] and truth.decidable
    assert truth.outer_root is agent
    tree = verdicts(world, job, listener)
    assert (tree.verdict, tree.reason, tree.root_pid) == (Verdict.ORPHAN, Reason.SESSION_ORPHANED,
                                                          agent.pid), tree.evidence
    check_moment(world, listener)


@pytest.mark.parametrize("listener", ["every", "none"])
def test_torchrun_workers_in_sessions_of_their_own_are_session_orphaned(listener):
    # torchrun starts its workers with start_new_session=True: each GPU holder leads its
    # own session. The shell that ran torchrun is killed: torchrun's tree (both workers)
    # is one session-orphaned tree rooted at torchrun. (Found by review: the holder's
    # session alone showed nothing, and the job was called normal.)
    world = World()
    bash = login(world)["bash"]
    torchrun = spawn(world, bash, PROGRAMS[4])
    workers = []
    for _ in range(2):
        worker = world.fork(torchrun)
        assert worker is not None and world.setsid(worker)
        world.exec(worker, PYTHON)
        world.gpu(worker)
        workers.append(worker)
    world.kill(bash, SIGKILL)
    trees = classify([holder(w.pid) for w in workers], world.view(listener), RULES)
    assert len(trees) == 1
    (tree,) = trees
    assert (tree.verdict, tree.reason, tree.root_pid) == (Verdict.ORPHAN, Reason.SESSION_ORPHANED,
                                                          torchrun.pid), tree.evidence
    assert {m.pid for m in tree.members} == {torchrun.pid, *(w.pid for w in workers)}
    check_moment(world, listener)


@pytest.mark.parametrize("history, kinds", [("forked", {CHILD_OF_REAPER}),
                                             ("adopted", {ADOPTION_AMBIGUOUS})])
def test_child_of_tini_is_uncertain_whether_tini_forked_or_adopted_it(history, kinds):
    # forked: bash -> tini -s -- ./run.sh -> python, nothing has died. adopted: run.sh
    # (forked by tini) dies and its python is adopted by tini. /proc shows the same table,
    # so classify() cannot answer differently: both are uncertain (they used to be
    # orphan/parent-exited).
    world = World()
    bash = login(world)["bash"]
    tini = spawn(world, bash, TINI)
    world.set_subreaper(tini)
    script = spawn(world, tini, SH) if history == "adopted" else tini
    job = spawn(world, script)
    world.gpu(job)
    if script is not tini:
        world.exit(script, 0)
    truth = holder_truth(job)
    assert truth.launchers_alive == (history == "forked") and truth.kinds() == kinds
    tree = verdicts(world, job, "every")
    assert (tree.verdict, tree.reason) == (Verdict.UNKNOWN, Reason.ADOPTION_UNCERTAIN), \
        tree.evidence
    check_moment(world, "every")


def setsid_after_fork() -> tuple[World, Proc, Proc]:
    """bash -> python (in bash's process group, so setsid() is allowed) forks a GPU
    worker, then calls setsid(). Returns the world, bash and the worker."""
    world = World()
    bash = login(world)["bash"]
    parent = spawn(world, bash)
    worker = spawn(world, parent)
    world.gpu(worker)
    assert world.setsid(parent)
    return world, bash, worker


def test_child_whose_parent_called_setsid_after_forking_it_is_uncertain():
    # Nothing has died; it used to be orphan/parent-exited.
    world, _, worker = setsid_after_fork()
    truth = holder_truth(worker)
    assert truth.launchers_alive and truth.kinds() == {SETSID_AFTER_FORK}
    tree = verdicts(world, worker, "every")
    assert (tree.verdict, tree.reason) == (Verdict.UNKNOWN, Reason.ADOPTION_UNCERTAIN), \
        tree.evidence
    check_moment(world, "every")


@pytest.mark.parametrize("listener, reason", [("every", Reason.LAUNCHER_KILLED),
                                              ("none", Reason.SESSION_ENDED)])
def test_worker_left_in_a_killed_session_is_the_orphan_root(listener, reason):
    # As above, then bash is killed. The worker's session ended under it; its parent
    # detached itself only. The truth used to name the parent (which lost bash) as the
    # root, although the parent left the session: the root is the worker, as classify()
    # says, and the parent survives the reap.
    world, bash, worker = setsid_after_fork()
    world.kill(bash, SIGKILL)
    truth = holder_truth(worker)
    assert truth.decidable and truth.root is worker
    tree = verdicts(world, worker, listener)
    assert (tree.verdict, tree.reason, tree.root_pid) == (Verdict.ORPHAN, reason, worker.pid)
    assert {m.pid for m in tree.members} == {worker.pid}
    check_moment(world, listener)


@pytest.mark.parametrize("listener", ["every", "none"])
def test_orphan_root_is_in_the_holders_session_not_above_it(listener):
    # bash -> R (a child subreaper) -> C (setsid: a session of its own) -> B -> job. B
    # exits: the job is adopted by R, across sessions. Then bash is killed and R adopted
    # by PID 1. Rule 6 used to root the tree at R (launcher-killed: reaped by default,
    # with C's whole session); the job's launcher that went away is B, in its session.
    world = World()
    bash = login(world)["bash"]
    r = spawn(world, bash)
    world.set_subreaper(r)
    c = world.fork(r)
    assert c is not None and world.setsid(c)
    b = spawn(world, c, SH)
    job = spawn(world, b)
    world.gpu(job)
    world.exit(b, 0)
    world.kill(bash, SIGKILL)
    assert job.parent is r and r.parent is world.init
    truth = holder_truth(job)
    assert truth.decidable and truth.root is job
    tree = verdicts(world, job, listener)
    assert (tree.verdict, tree.reason, tree.root_pid) == (Verdict.ORPHAN, Reason.PARENT_EXITED,
                                                          job.pid)
    assert {m.pid for m in tree.members} == {job.pid}
    check_moment(world, listener)
