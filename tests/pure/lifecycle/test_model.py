"""The model itself: kernel behaviour it claims (model.py's docstring), and its hand-made
labels agreeing with the classifier's configuration."""

from __future__ import annotations

import pytest

from gpuguard.orphans.classify import managed_cgroup
from gpuguard.orphans.rules_config import Rules
from tests.pure.lifecycle.model import (
    CGROUPS,
    DEFAULT,
    HANDLE,
    IGNORE,
    PROGRAMS,
    SIGHUP,
    SIGKILL,
    World,
    login,
)
from tests.pure.lifecycle.truth import holder_truth

RULES = Rules()


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.cmdline)
def test_program_labels_agree_with_the_default_rules(program):
    assert program.protected == (RULES.protects(program.kernel_comm)
                                 or RULES.protects(program.cmdline))
    assert program.reaper == RULES.is_adopter(program.kernel_comm)


@pytest.mark.parametrize("cgroup", CGROUPS, ids=lambda c: c.path)
def test_cgroup_labels_agree_with_rule_5(cgroup):
    assert cgroup.managed == (managed_cgroup([cgroup.path]) is not None)


def test_fork_inherits_session_group_cgroup_environment_and_dispositions():
    world = World()
    bash = login(world)["bash"]
    world.sighup_disposition(bash, HANDLE)
    world.detach_io(bash)
    world.exec(bash, PROGRAMS[1], keep=True)  # exec resets the handler
    assert bash.sighup == DEFAULT and bash.keep
    world.sighup_disposition(bash, HANDLE)
    child = world.fork(bash)
    assert child is not None
    assert (child.sid, child.pgid, child.cgroup, child.keep, child.daemon_io, child.sighup) == (
        bash.sid, bash.pgid, bash.cgroup, True, True, HANDLE)
    assert child.session is bash and child.born_of is bash and not child.subreaper
    assert child.start_time > bash.start_time


def test_exec_keeps_ignored_sighup_and_subreaper_drops_gpu():
    world = World()
    bash = login(world)["bash"]
    child = world.fork(bash)
    assert child is not None
    world.sighup_disposition(child, IGNORE)
    world.set_subreaper(child)
    world.gpu(child)
    world.exec(child, PROGRAMS[0])
    assert child.sighup == IGNORE and child.subreaper and not child.gpu


def test_setsid_is_refused_to_a_group_leader_and_setpgid_to_a_session_leader():
    world = World()
    bash = login(world)["bash"]
    assert not world.setsid(bash)  # already leads its session (and its group)
    assert not world.setpgid(bash, 0)
    child = world.fork(bash)
    assert child is not None and child.pgid == bash.pid
    world.setpgid(child, sorted({bash.pid, child.pid}).index(child.pid))  # its own group
    assert child.pgid == child.pid
    assert not world.setsid(child)
    grandchild = world.fork(child)
    assert grandchild is not None and grandchild.pgid == child.pid
    assert world.setsid(grandchild)
    assert grandchild.sid == grandchild.pgid == grandchild.pid


def test_exit_reparents_to_the_nearest_live_subreaper_else_init():
    world = World()
    bash = login(world)["bash"]
    sub = world.fork(bash)
    assert sub is not None
    world.set_subreaper(sub)
    mid = world.fork(sub)
    assert mid is not None
    leaf = world.fork(mid)
    assert leaf is not None
    world.exit(mid, 0)
    assert leaf.parent is sub and mid.state == "zombie"
    world.kill(sub, SIGKILL)
    assert leaf.parent is world.init
    assert [d.signal for _, d in world.exits] == [None, SIGKILL]


def test_namespace_init_death_kills_the_namespace_and_subreapers_outside_do_not_adopt():
    world = World()
    bash = login(world)["bash"]
    world.set_subreaper(bash)
    nsinit = world.fork(bash, new_ns=True)
    assert nsinit is not None and nsinit.nspid[-1] == 1 and len(nsinit.nspid) == 2
    mid = world.fork(nsinit)
    assert mid is not None
    leaf = world.fork(mid)
    assert leaf is not None
    world.exit(mid, 0)
    assert leaf.parent is nsinit  # not bash: a subreaper outside the namespace
    world.exit(nsinit, 0)
    assert leaf.state == "gone" and leaf.death is not None and leaf.death.signal == SIGKILL


def test_pids_wrap_and_are_not_reused_while_a_session_uses_them():
    world = World(pid_max=16)
    bash = login(world)["bash"]
    leader = world.fork(bash)
    assert leader is not None and world.setsid(leader)
    member = world.fork(leader)
    assert member is not None
    world.exit(leader, 0)
    world.reap(leader)
    seen = set()
    for _ in range(40):
        p = world.fork(bash)
        if p is None:
            break
        seen.add(p.pid)
        assert p.pid != leader.pid  # still the session id of `member`
        world.exit(p, 0)
        world.reap(p)
    assert len(seen) > 1 and max(seen) < 16


def test_hangup_kills_plain_members_and_spares_ignoring_and_handling_ones():
    world = World()
    bash = login(world)["bash"]
    plain, nohup, handler = (world.fork(bash) for _ in range(3))
    assert plain and nohup and handler
    world.sighup_disposition(nohup, IGNORE)
    world.sighup_disposition(handler, HANDLE)
    world.hangup(bash)
    assert not bash.alive and not plain.alive and nohup.alive and handler.alive
    assert bash.death is not None and bash.death.signal == SIGHUP
    truth = holder_truth(nohup)
    assert truth.root is nohup and truth.lost_parent is bash
