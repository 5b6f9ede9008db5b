"""Named histories through the model, the truth and classify(): one per branch of the
truth that generated histories reach rarely, each checked by the same properties
(properties.check_moment, both listeners) and by what the truth must say."""

from __future__ import annotations

from gpuguard.orphans.classify import classify
from gpuguard.orphans.vocabulary import Verdict
from tests.pure.lifecycle.model import (
    IGNORE,
    PROGRAMS,
    SIGHUP,
    SIGKILL,
    SIGTERM,
    Proc,
    World,
    login,
)
from tests.pure.lifecycle.properties import LISTENERS, RULES, check_moment
from tests.pure.lifecycle.truth import ADOPTION_INVISIBLE, holder_truth
from tests.support.proctable import holder

PYTHON, SH = PROGRAMS[0], PROGRAMS[1]


def spawn(world: World, parent: Proc, program=PYTHON) -> Proc:
    child = world.fork(parent)
    assert child is not None
    world.exec(child, program)
    return child


def answer(world: World, p: Proc, listener: str = "every"):
    """(verdict, reason, root pid) of the tree holding p, after checking every property."""
    for each in LISTENERS:
        check_moment(world, each)
    trees = classify([holder(q.pid) for q in world.holders()], world.view(listener), RULES)
    (tree,) = [t for t in trees if any(h.pid == p.pid for h in t.holders)]
    return tree.verdict, tree.reason, tree.root_pid


def test_middle_parent_killed_while_the_shell_lives_is_parent_exited():
    world = World()
    bash = login(world)["bash"]
    launch = spawn(world, bash, SH)
    train = spawn(world, launch)
    world.gpu(train)
    assert answer(world, train) == (Verdict.NORMAL, "attached", login_sshd_pid(world))
    world.kill(launch, SIGTERM)
    truth = holder_truth(train)
    assert (truth.root, truth.lost_parent, truth.creator) == (train, launch, bash)
    assert answer(world, train) == (Verdict.ORPHAN, "parent-exited", train.pid)


def login_sshd_pid(world: World) -> int:
    return next(p.pid for p in world.procs if p.comm == "sshd" and p.parent is world.init)


def test_shell_killed_is_launcher_killed_or_session_ended_without_a_listener():
    world = World()
    bash = login(world)["bash"]
    launch = spawn(world, bash, SH)
    train = spawn(world, launch)
    world.gpu(train)
    world.kill(bash, SIGKILL)  # SIGKILL: bash cannot pass SIGHUP on
    assert answer(world, train, "every") == (Verdict.ORPHAN, "launcher-killed", launch.pid)
    assert answer(world, train, "none") == (Verdict.ORPHAN, "session-ended", launch.pid)
    world.reap(bash)  # gone from /proc altogether: the same
    assert answer(world, train, "every") == (Verdict.ORPHAN, "launcher-killed", launch.pid)


def test_zombie_shell_that_exited_is_launcher_exited():
    world = World()
    bash = login(world)["bash"]
    train = spawn(world, bash)
    world.gpu(train)
    world.exit(bash, 0)
    assert bash.state == "zombie"
    assert answer(world, train) == (Verdict.ORPHAN, "launcher-exited", train.pid)


def test_hangup_spares_only_the_nohup_job_which_is_protected():
    world = World()
    bash = login(world)["bash"]
    plain = spawn(world, bash)
    nohup = world.fork(bash)
    assert nohup is not None
    world.sighup_disposition(nohup, IGNORE)
    world.exec(nohup, PYTHON)  # nohup python train.py: the ignore survives exec
    world.gpu(plain)
    world.gpu(nohup)
    world.hangup(bash)
    assert not plain.alive and nohup.alive
    assert answer(world, nohup) == (Verdict.PROTECTED, "ignores-sighup", nohup.pid)


def test_launcher_that_died_before_the_root_was_born_is_unrecorded_even_when_seen():
    # bash -> sh; bash exits; sh forks python afterwards and exits: the listener's record
    # of bash's exit is older than the orphan root, so it cannot be tied to this session:
    # a listener runs and cannot say how the launcher went (launcher-unrecorded, not
    # reaped by default); without one the reason is session-ended, as everywhere.
    world = World()
    bash = login(world)["bash"]
    launch = spawn(world, bash, SH)
    world.exit(bash, 0)
    train = spawn(world, launch)
    world.gpu(train)
    world.exit(launch, 0)
    truth = holder_truth(train)
    assert truth.root is train and truth.creator.death is not None
    assert truth.creator.death.at < train.start_time
    assert truth.expected_reason("every") == "launcher-unrecorded"
    assert answer(world, train, "every") == (Verdict.ORPHAN, "launcher-unrecorded", train.pid)
    assert answer(world, train, "none") == (Verdict.ORPHAN, "session-ended", train.pid)


def test_adoption_by_an_unnamed_subreaper_in_the_same_session_is_answered_safely():
    # An ordinary process in the shell's session made itself a child subreaper; a job it
    # did not fork lands on it. /proc reads exactly as if it had forked the job itself.
    world = World()
    bash = login(world)["bash"]
    supervisor = spawn(world, bash)
    world.set_subreaper(supervisor)
    launch = spawn(world, supervisor, SH)
    train = spawn(world, launch)
    world.gpu(train)
    world.exit(launch, 0)
    truth = holder_truth(train)
    assert truth.root is train and truth.kinds() == {ADOPTION_INVISIBLE}
    assert answer(world, train)[0] != Verdict.ORPHAN


def test_fork_setsid_fork_daemon_is_normal_daemon():
    world = World()
    bash = login(world)["bash"]
    first = world.fork(bash)
    assert first is not None
    middle = world.fork(first)
    assert middle is not None and world.setsid(middle)
    daemon = spawn(world, middle)
    world.detach_io(daemon)
    world.gpu(daemon)
    world.exit(middle, 0)
    world.exit(first, 0)
    assert answer(world, daemon) == (Verdict.NORMAL, "daemon", daemon.pid)


def test_keep_marker_on_a_disowned_job_is_protected():
    world = World()
    bash = login(world)["bash"]
    job = world.fork(bash)
    assert job is not None
    world.exec(job, PYTHON, keep=True)  # GPUGUARD_KEEP=1 python train.py & disown
    world.gpu(job)
    world.kill(bash, SIGHUP)
    assert answer(world, job) == (Verdict.PROTECTED, "keep-marker", job.pid)


def test_reap_scope_is_the_root_and_its_live_descendants_and_a_protected_one_refuses_it():
    world = World()
    bash = login(world)["bash"]
    launch = spawn(world, bash, SH)
    train = spawn(world, launch)
    helper = spawn(world, launch)
    kernel = spawn(world, helper, PROGRAMS[2])  # python -m ipykernel_launcher
    done = spawn(world, launch)
    world.gpu(train)
    world.exit(done, 0)  # a zombie child of the root: nothing a reap could signal
    world.kill(bash, SIGKILL)
    view = world.view()
    (tree,) = classify([holder(train.pid)], view, RULES)
    assert {m.pid for m in tree.members} == {launch.pid, train.pid, helper.pid, kernel.pid}
    assert (tree.verdict, tree.reason) == (Verdict.PROTECTED, "member-protected")
    for listener in LISTENERS:
        check_moment(world, listener)
    world.kill(kernel, SIGTERM)
    assert answer(world, train) == (Verdict.ORPHAN, "launcher-killed", launch.pid)


def test_holder_in_a_pid_namespace_is_normal_container():
    world = World()
    bash = login(world)["bash"]
    nsinit = world.fork(bash, new_ns=True)
    assert nsinit is not None and world.setsid(nsinit)
    train = spawn(world, nsinit)
    world.gpu(train)
    world.kill(bash, SIGKILL)
    assert answer(world, train)[:2] == (Verdict.NORMAL, "container")
