"""classify(): docs/design.md, Orphan rules, one scenario per test, on a synthetic table.

Every scenario asserts the tree's verdict, reason, root pid and the rule that
decided (`tree.evidence.rule`). The pids used throughout:

    1    init (systemd, session 1)
    90   sshd listener (session leader, /system.slice/ssh.service)
    94   sshd: alice [priv]   (session leader of the ssh session)
    95   sshd: alice@pts/0
    100  bash                 (session leader of the user's shell session)
    200  python launch.py     (sid 100)
    300  python train.py      (sid 100): the GPU holder
"""

from __future__ import annotations

from collections import Counter

import pytest

from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.orphans.classify import classify, managed_cgroup
from gpuguard.orphans.process import Truncated
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.verdicts import Tree
from gpuguard.orphans.vocabulary import Verdict
from tests.support.proctable import (
    GIB,
    Exit,
    FakeProc,
    SyntheticView,
    chain,
    holder,
    init,
    leader,
    proc,
)

RULES = Rules()


# -- scenarios ------------------------------------------------------------------------


def ssh_host(*, listener_cgroup: str = "/system.slice/ssh.service") -> list[FakeProc]:
    """init and an ssh login, up to the login's pty process."""
    return [
        init(),
        leader(90, ppid=1, comm="sshd", uid=0, cmdline="sshd: /usr/sbin/sshd -D",
               cgroup=listener_cgroup),
        leader(94, ppid=90, comm="sshd", uid=0, cmdline="sshd: alice [priv]"),
        proc(95, ppid=94, sid=94, comm="sshd", cmdline="sshd: alice@pts/0"),
    ]


def interactive(**host_kw) -> list[FakeProc]:
    """bash (leader 100) -> python launch.py (200) -> python train.py (300, the holder)."""
    return ssh_host(**host_kw) + [
        leader(100, ppid=95, comm="bash", cmdline="-bash"),
        proc(200, ppid=100, sid=100, cmdline="python launch.py"),
        proc(300, ppid=200, sid=100, cmdline="python train.py --rank 0"),
    ]


def leader_killed(*extra: FakeProc, **view_kw) -> SyntheticView:
    """The shell (session leader 100) was killed: 200 is adopted by PID 1, sid 100 is gone."""
    view = SyntheticView(interactive() + list(extra), **view_kw)
    view.exit(100)
    return view


def one_tree(view: SyntheticView, *holders, rules: Rules = RULES) -> Tree:
    trees = classify(list(holders) or [holder(300)], view, rules)
    assert len(trees) == 1, trees
    return trees[0]


def check(tree: Tree, verdict: str, reason: str, root: int, rule: str) -> None:
    got = (tree.verdict, tree.reason, tree.root_pid, tree.evidence.rule)
    assert got == (verdict, reason, root, rule), tree.evidence


# -- rule 6: adoption ---------------------------------------------------------------


def test_session_leader_killed_is_orphan_session_ended_rooted_at_topmost_survivor():
    view = leader_killed()
    tree = one_tree(view)
    check(tree, Verdict.ORPHAN, "session-ended", 200, "6")
    assert tree.root == view.info(200)
    assert tree.root_start_time == view[200].start_time
    assert tree.evidence.pids == (200, 1, 100)
    assert "E1" in tree.evidence.detail
    # environ is read only inside the would-be orphan tree: its members are judged (rule 4)
    assert set(view.calls_to("keep_marker")) == {200, 300}
    assert tree.members == (view.info(200), view.info(300))


def test_intermediate_parent_killed_with_leader_alive_is_orphan_parent_exited():
    view = SyntheticView(interactive() + [proc(310, ppid=300, sid=100)])
    view.exit(200)  # 300 is reparented to PID 1; bash (100) still leads session 100
    tree = one_tree(view, holder(310))
    check(tree, Verdict.ORPHAN, "parent-exited", 300, "6")
    assert tree.evidence.pids == (300, 1, 100)


def test_adoption_by_unnamed_subreaper_is_caught_by_e1():
    agent = leader(50, ppid=1, comm="agentd", cmdline="/usr/local/bin/agentd --subreaper")
    view = SyntheticView(interactive() + [agent])
    view.exit(100, reaper=50)  # 200 now a child of an ordinary process in another session
    tree = one_tree(view)
    check(tree, Verdict.ORPHAN, "session-ended", 200, "6")
    assert tree.evidence.detail.startswith("E1")
    assert tree.evidence.pids == (200, 50, 100)


def _e2_pid1():
    table = [init(comm="sh", sid=1, cmdline="/bin/sh /entrypoint.sh"),
             proc(20, ppid=1, sid=1), proc(30, ppid=20, sid=1)]
    return SyntheticView(table), 20, 30, 1, 1


def _e2_reaper():
    # `tini -s -- ./launch.sh` from the shell; launch.sh (160) died, 170 adopted by tini.
    table = interactive() + [
        proc(150, ppid=100, sid=100, comm="tini", cmdline="tini -s -- ./launch.sh"),
        proc(170, ppid=150, sid=100), proc(180, ppid=170, sid=100),
    ]
    return SyntheticView(table), 170, 180, 150, 100


def _e2_namespace_init():
    # Exporter in a PID namespace of depth 2 with the host's /proc; a sibling container's
    # init (nspid ... 1) adopted 5020.
    table = [
        init(),
        leader(4990, ppid=1, comm="containerd-shim", uid=0),
        leader(5000, ppid=4990, comm="entrypoint.sh", nspid=(5000, 1)),
        proc(5020, ppid=5000, sid=5000, nspid=(5020, 20)),
        proc(5030, ppid=5020, sid=5000, nspid=(5030, 30)),
    ]
    return SyntheticView(table, own_nspid_depth=2), 5020, 5030, 5000, 5000


@pytest.mark.parametrize("scenario", [_e2_pid1, _e2_reaper, _e2_namespace_init],
                         ids=["pid1", "reaper-tini", "namespace-init"])
def test_e2_in_a_live_session_is_uncertain(scenario):
    # An init or a reaper forks its own command into its session (`tini -- cmd`,
    # `sh /entrypoint.sh` as PID 1): /proc shows exactly what an adoption shows.
    view, root, holder_pid, parent, session_leader = scenario()
    tree = one_tree(view, holder(holder_pid))
    check(tree, Verdict.UNKNOWN, "adoption-uncertain", root, "6")
    assert tree.evidence.detail.startswith("E2")
    assert "cannot tell" in tree.evidence.detail
    assert tree.evidence.pids == (root, parent, session_leader)


def test_e1_under_an_unnamed_session_leader_needs_the_session_gone():
    # agentd forked 200 and then called setsid(), or 200 was adopted by agentd (a child
    # subreaper): /proc shows the same. Session leader 100 alive: uncertain; gone: orphan.
    agent = leader(50, ppid=1, comm="agentd", cmdline="/usr/local/bin/agentd")
    view = SyntheticView(interactive() + [agent])
    view.update(200, ppid=50)
    tree = one_tree(view)
    check(tree, Verdict.UNKNOWN, "adoption-uncertain", 200, "6")
    assert tree.evidence.detail.startswith("E1")
    view.exit(100, reaper=50)
    check(one_tree(view), Verdict.ORPHAN, "session-ended", 200, "6")


def test_e1_under_a_process_that_leads_no_session_is_proof():
    # A non-leader never called setsid(): a child in another session was adopted.
    table = [init(), leader(40, ppid=1, comm="sshd"), proc(45, ppid=40, sid=40, comm="py"),
             leader(100, ppid=40, comm="bash"), proc(200, ppid=45, sid=100)]
    tree = one_tree(SyntheticView(table), holder(200))
    check(tree, Verdict.ORPHAN, "parent-exited", 200, "6")


def test_live_session_below_an_adopted_process_is_session_orphaned():
    # bash -> agent -> setsid shell -> job; bash (55) killed, the agent adopted by PID 1.
    # The job's own session lives; the agent above it lost its launcher.
    table = [init(), proc(60, ppid=1, sid=55, comm="agent"),
             leader(70, ppid=60, comm="bash"), proc(80, ppid=70, sid=70, comm="python")]
    tree = one_tree(SyntheticView(table), holder(80))
    check(tree, Verdict.ORPHAN, "session-orphaned", 60, "6")
    assert "the holder's own session 70" in tree.evidence.detail
    # While the agent's own launcher lives, nothing above the job's session counts.
    view = SyntheticView(table + [leader(55, ppid=1, comm="bash")])
    check(one_tree(view, holder(80)), Verdict.NORMAL, "attached", 60, "7")


@pytest.mark.parametrize(
    "table, holder_pid, root",
    [
        ([init(), proc(50, ppid=1, sid=0, comm="agetty"), proc(60, ppid=50, sid=0)], 60, 50),
        ([init(), proc(60, ppid=1, sid=0)], 60, 60),
        ([init(comm="sh", sid=0), proc(20, ppid=1, sid=0), proc(30, ppid=20, sid=0)], 30, 20),
    ],
    ids=["under-session0-parent", "child-of-init", "init-in-session0"],
)
def test_session_zero_is_never_evidence_of_adoption(table, holder_pid, root):
    tree = one_tree(SyntheticView(table), holder(holder_pid))
    check(tree, Verdict.NORMAL, "attached", root, "7")


@pytest.mark.parametrize("holder_pid", [700, 710], ids=["holder-is-leader", "child-of-leader"])
def test_setsid_daemon_at_top_of_chain_is_normal_detached(holder_pid):
    view = SyntheticView([init(), leader(700, ppid=1, comm="trainerd"),
                          proc(710, ppid=700, sid=700)])
    tree = one_tree(view, holder(holder_pid))
    check(tree, Verdict.NORMAL, "detached", 700, "7")


@pytest.mark.parametrize(
    "pgid, daemon_io, expected",
    [
        (650, True, (Verdict.NORMAL, "daemon")),
        (650, False, (Verdict.ORPHAN, "session-ended")),  # cwd or stdin not detached
        (700, True, (Verdict.ORPHAN, "session-ended")),  # pgid != sid: not the recipe
    ],
    ids=["fork-setsid-fork", "no-daemon-io", "pgid-not-sid"],
)
def test_fork_setsid_fork_daemon_is_normal_daemon(pgid, daemon_io, expected):
    # 650 was the setsid() middle child and exited; 700 is the daemon, adopted by PID 1.
    view = SyntheticView([
        init(),
        proc(700, ppid=1, sid=650, pgid=pgid, comm="gpud", daemon_io=daemon_io),
        proc(710, ppid=700, sid=650, pgid=pgid),
    ])
    tree = one_tree(view, holder(710))
    check(tree, *expected, 700, "6")
    assert view.calls_to("daemon_io") == ([700] if pgid == 650 else [])
    assert set(view.calls_to("keep_marker")) == (set() if expected[0] == Verdict.NORMAL
                                                 else {700, 710})


# -- rule 4: SIGHUP ignored, keep marker --------------------------------------------


@pytest.mark.parametrize("nohup_pid", [300, 200], ids=["holder", "root-candidate"])
def test_nohup_is_protected_ignores_sighup(nohup_pid):
    view = leader_killed()
    view.update(nohup_pid, sighup_ignored=True)
    tree = one_tree(view)
    check(tree, Verdict.PROTECTED, "ignores-sighup", 200, "4")
    assert tree.evidence.pids == (nohup_pid,)


def test_keep_marker_on_would_be_orphan_root_is_protected():
    view = leader_killed()
    view.update(200, keep=True)
    tree = one_tree(view)
    check(tree, Verdict.PROTECTED, "keep-marker", 200, "4")
    assert tree.evidence.pids == (200,)
    assert view.calls_to("keep_marker") == [200]


def _healthy():
    return SyntheticView(interactive())


def _detached():
    return SyntheticView([init(), leader(300, ppid=1, comm="trainerd", keep=True)])


def _managed():
    return leader_killed(), {"cgroup": "/system.slice/train.service"}


def _protected():
    return leader_killed(), {"comm": "jupyter-lab"}


def _nohup():
    return leader_killed(), {"sighup_ignored": True}


def _container():
    return leader_killed(), {"nspid": (300, 7)}


@pytest.mark.parametrize("scenario", [_healthy, _detached, _managed, _protected, _nohup,
                                      _container])
def test_environ_is_not_read_unless_the_tree_would_be_an_orphan(scenario):
    made = scenario()
    view, changes = made if isinstance(made, tuple) else (made, {})
    if changes:
        view.update(300, keep=True, **changes)
    tree = one_tree(view)
    assert tree.verdict in (Verdict.NORMAL, Verdict.PROTECTED)
    assert tree.reason != "keep-marker"
    assert view.calls_to("keep_marker") == [] and view.calls_to("registered") == []


def under_run_launcher(marker_of=None, **daemon_kw) -> SyntheticView:
    """bash (100) -> agent (200) -> `gpuguard run` (250, a subreaper) -> CMD (260); CMD
    double-forked a `setsid` daemon (300, the holder) whose middle process (280) exited,
    so 300 is in the dead session 280 and was adopted by the launcher. `marker_of`: the
    (pid, start_time) its GPUGUARD_RUN names; default the launcher's own."""
    view = SyntheticView(ssh_host() + [
        leader(100, ppid=95, comm="bash", cmdline="-bash"),
        proc(200, ppid=100, sid=100, cmdline="python agent.py"),
        proc(250, ppid=200, sid=100, comm="gpuguard", cmdline="python gpuguard run -- x"),
        proc(260, ppid=250, sid=100, cmdline="python x"),
        proc(300, ppid=250, sid=280, pgid=280, start_time=9_000, **daemon_kw),
    ])
    view.update(300, run=marker_of or (250, view[250].start_time))
    return view


def test_a_process_adopted_by_its_live_run_launcher_is_attached():
    view = under_run_launcher()
    tree = one_tree(view)
    check(tree, Verdict.NORMAL, "run-launcher", 300, "6")
    assert tree.evidence.pids == (300, 250)
    assert view.calls_to("keep_marker") == []  # decided before the keep marker


@pytest.mark.parametrize("marker", ["reused-pid", "not-the-parent", "absent"])
def test_a_run_marker_that_does_not_name_the_live_parent_changes_nothing(marker):
    view = under_run_launcher()
    wrong = {"reused-pid": (250, view[250].start_time + 1),  # another process at 250
             "not-the-parent": (200, view[200].start_time),  # a live ancestor, not the parent
             "absent": None}[marker]
    view.update(300, run=wrong)
    check(one_tree(view), Verdict.ORPHAN, "session-ended", 300, "6")


def test_a_run_marker_naming_init_changes_nothing():
    view = leader_killed()  # 200 was adopted by PID 1 when its session leader died
    view.update(200, run=(1, view[1].start_time))
    check(one_tree(view), Verdict.ORPHAN, "session-ended", 200, "6")


@pytest.mark.parametrize("adopter", ["named", "namespace-init"])
def test_a_run_marker_naming_another_adopter_changes_nothing(adopter):
    """`systemd --user` (a named adopter) or a container's init adopted 300: a marker
    naming it must not make its adoptee "attached"."""
    view = under_run_launcher()
    if adopter == "named":
        view.update(250, comm="systemd")
    else:
        view.update(250, nspid=(250, 1))
    check(one_tree(view), Verdict.ORPHAN, "session-ended", 300, "6")


def test_after_the_launcher_is_killed_its_adoptee_is_an_ordinary_orphan():
    view = under_run_launcher()
    view.exit(260)
    view.exit(250)  # the daemon goes to PID 1; its marker names a launcher that is gone
    check(one_tree(view), Verdict.ORPHAN, "session-ended", 300, "6")


# -- missing evidence never kills (issue 24) ----------------------------------------


def test_an_erased_environment_is_unreadable_not_unmarked():
    """setproctitle zero-fills /proc/PID/environ: a GPUGUARD_KEEP=1 the root held cannot
    be told from none, so the tree is unknown, not an orphan."""
    view = leader_killed()
    view.update(200, keep=True, environ_erased=True)
    tree = one_tree(view)
    check(tree, Verdict.UNKNOWN, "member-unknown", 200, "2")
    assert "environ" in tree.evidence.detail and "setproctitle" in tree.evidence.detail
    assert "gpuguard keep" in tree.evidence.detail


def test_an_erased_environment_below_the_root_is_unknown_too():
    view = leader_killed(proc(310, ppid=300, sid=100, environ_erased=True))
    check(one_tree(view), Verdict.UNKNOWN, "member-unknown", 200, "2")


def test_a_keep_registration_protects_whatever_the_environment_says():
    view = leader_killed()
    view.update(200, environ_erased=True, keep_registered=True)
    tree = one_tree(view)
    check(tree, Verdict.PROTECTED, "keep-marker", 200, "4")
    assert "gpuguard keep" in tree.evidence.detail


def test_a_keep_registration_on_a_member_protects_the_tree():
    view = leader_killed(proc(310, ppid=300, sid=100, keep_registered=True))
    check(one_tree(view), Verdict.PROTECTED, "member-protected", 200, "4")


def test_a_positive_protection_decides_before_an_unreadable_fact():
    """A nohup'd member whose environment was erased: protected (what was read says so),
    not merely unknown."""
    view = leader_killed(proc(310, ppid=300, sid=100, environ_erased=True,
                              sighup_ignored=True))
    check(one_tree(view), Verdict.PROTECTED, "member-protected", 200, "4")


def test_a_registered_run_launcher_attaches_its_adoptee_with_its_marker_erased():
    view = under_run_launcher()
    view.update(300, environ_erased=True)
    check(one_tree(view), Verdict.UNKNOWN, "member-unknown", 300, "2")  # the marker alone: lost
    view.update(250, run_registered=True)
    check(one_tree(view), Verdict.NORMAL, "run-launcher", 300, "6")


@pytest.mark.parametrize("adopter", ["init", "named", "namespace-init"])
def test_a_run_registration_of_an_adopter_changes_nothing(adopter):
    view = under_run_launcher()
    view.update(300, run=None)
    if adopter == "init":
        view = leader_killed()
        view.update(1, run_registered=True)
        check(one_tree(view), Verdict.ORPHAN, "session-ended", 200, "6")
        return
    view.update(250, run_registered=True,
                **({"comm": "systemd"} if adopter == "named" else {"nspid": (250, 1)}))
    check(one_tree(view), Verdict.ORPHAN, "session-ended", 300, "6")


def test_a_listener_without_a_record_says_so_and_no_listener_is_session_ended():
    """A listener runs but has no record of the launcher's exit (it started later, or the
    record was evicted): launcher-unrecorded, which the default policy does not reap."""
    heard = leader_killed(listener=True)
    tree = one_tree(heard)
    check(tree, Verdict.ORPHAN, "launcher-unrecorded", 200, "6")
    assert "evicted" in tree.evidence.detail
    check(one_tree(leader_killed()), Verdict.ORPHAN, "session-ended", 200, "6")


def test_a_record_read_late_replaces_a_first_answer_that_had_none():
    """The scan can run between the leader's death and the listener reading its exit:
    launcher-unrecorded first, then the record; the record is evidence and replaces it
    (an exit of the session id after the root started is its leader's)."""
    view = leader_killed(memory=LauncherMemory(), listener=True)
    check(one_tree(view), Verdict.ORPHAN, "launcher-unrecorded", 200, "6")
    view.exits[100] = Exit(signal=9, status=None, at=0.0)
    check(one_tree(view), Verdict.ORPHAN, "launcher-killed", 200, "6")
    view.exits.clear()
    check(one_tree(view), Verdict.ORPHAN, "launcher-killed", 200, "6")


def test_the_first_launcher_reason_stands_when_its_record_is_gone():
    view = leader_killed(memory=LauncherMemory(), listener=True)
    view.exits[100] = Exit(signal=None, status=0, at=0.0)  # the listener saw `exit 0`
    first = one_tree(view)
    check(first, Verdict.ORPHAN, "launcher-exited", 200, "6")
    view.exits.clear()  # the record is evicted
    again = one_tree(view)
    check(again, Verdict.ORPHAN, "launcher-exited", 200, "6")
    assert again.evidence.detail == first.evidence.detail
    view.listener = False  # and the listener is gone (a restart without the connector)
    check(one_tree(view), Verdict.ORPHAN, "launcher-exited", 200, "6")
    fresh = leader_killed()  # the same moment without the memory: more reapable
    check(one_tree(fresh), Verdict.ORPHAN, "session-ended", 200, "6")


def test_a_command_line_cut_at_the_cap_without_a_match_is_unknown():
    """Only CMDLINE_CAP bytes of a command line are read: a protect pattern past them
    cannot be ruled out, so the member is unknown (and a match within them protects)."""
    long = Truncated("python train.py " + "a" * 100)
    view = leader_killed(proc(310, ppid=300, sid=100, cmdline=long))
    tree = one_tree(view)
    check(tree, Verdict.UNKNOWN, "member-unknown", 200, "2")
    assert "read cap" in tree.evidence.detail
    view.update(310, cmdline=Truncated("jupyter-lab " + "a" * 100))
    check(one_tree(view), Verdict.PROTECTED, "member-protected", 200, "3")


# -- rule 3: protect patterns -------------------------------------------------------


def test_protect_pattern_on_holder_comm():
    view = leader_killed()
    view.update(300, comm="jupyter-notebook")  # comm is cut to "jupyter-noteboo"
    tree = one_tree(view)
    check(tree, Verdict.PROTECTED, "protect-pattern", 200, "3")
    assert tree.evidence.pids == (300,)


def test_protect_pattern_on_ancestor_cmdline_only():
    view = leader_killed(proc(310, ppid=300, sid=100))
    view.update(300, cmdline="/opt/conda/bin/python -m ipykernel_launcher -f kernel-1.json")
    assert view.info(300).comm == "python"
    tree = one_tree(view, holder(310))
    check(tree, Verdict.PROTECTED, "protect-pattern", 200, "3")
    assert tree.evidence.pids == (300,)
    assert "command line" in tree.evidence.detail


def test_protect_pattern_above_root_candidate_does_not_protect():
    adopter = leader(50, ppid=1, comm="tmux: server", cmdline="tmux new-session -d -s jobs")
    view = SyntheticView(interactive() + [adopter])
    view.exit(100, reaper=50)
    tree = one_tree(view)
    check(tree, Verdict.ORPHAN, "session-ended", 200, "6")
    assert 50 not in view.calls_to("cmdline")


# -- rule 5: managed, container -----------------------------------------------------


@pytest.mark.parametrize(
    "cgroup",
    [
        "/system.slice/foo.service",
        "/user.slice/user-1000.slice/user@1000.service/app.slice/foo.service",
        "/system.slice/docker-0123456789ab.scope",
        "/docker/0123456789ab",
        "/machine.slice/libpod-0123456789ab.scope/container",
        "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-abc.scope",
        "/system.slice/slurmstepd.scope/job_42/step_0",
        "/slurm/uid_1000/job_42/step_0",
    ],
)
def test_managed_cgroup_is_normal_managed(cgroup):
    view = leader_killed()
    view.update(200, cgroup=cgroup)
    view.update(300, cgroup=cgroup)
    tree = one_tree(view)
    check(tree, Verdict.NORMAL, "managed", 200, "5")
    assert tree.evidence.pids == (300,)
    assert managed_cgroup([cgroup]) == cgroup


@pytest.mark.parametrize(
    "cgroup",
    [
        "/user.slice/user-1000.slice/user@1000.service",
        "/user.slice/user-1000.slice/user@1000.service/init.scope",
        "/user.slice/user-1000.slice/user@1000.service/app.slice/vte-spawn-1.scope",
        "/user.slice/user-1000.slice/session-1.scope",
    ],
)
def test_user_manager_and_session_cgroups_are_not_managed(cgroup):
    view = leader_killed()
    view.update(200, cgroup=cgroup)
    view.update(300, cgroup=cgroup)
    tree = one_tree(view)
    check(tree, Verdict.ORPHAN, "session-ended", 200, "6")
    assert managed_cgroup([cgroup]) is None


def test_holder_in_deeper_pid_namespace_is_normal_container():
    view = leader_killed()
    view.update(200, nspid=(200, 6))
    view.update(300, nspid=(300, 7))
    tree = one_tree(view)
    check(tree, Verdict.NORMAL, "container", 200, "5")
    assert tree.evidence.pids == (300,)


# -- session leader gone ------------------------------------------------------------


def test_zombie_session_leader_is_session_ended():
    view = SyntheticView(interactive())
    view.exit(100, zombie=True)
    assert view.info(100).is_zombie
    tree = one_tree(view)
    check(tree, Verdict.ORPHAN, "session-ended", 200, "6")
    assert "zombie" in tree.evidence.detail


# -- rules 1 and 2: unknown ---------------------------------------------------------


def test_holder_not_visible_is_unknown():
    tree = one_tree(SyntheticView(interactive()), holder(999))
    check(tree, Verdict.UNKNOWN, "not-visible", 999, "1")
    assert tree.root is None


def test_zombie_holder_is_unknown_exiting():
    view = SyntheticView(interactive())
    view.update(300, state="Z")
    check(one_tree(view), Verdict.UNKNOWN, "exiting", 300, "1")


def test_cycle_is_unknown():
    view = SyntheticView([
        init(),
        proc(200, ppid=250, sid=100, start_time=500),
        proc(250, ppid=200, sid=100, start_time=500),
        proc(300, ppid=200, sid=100, start_time=600),
    ])
    tree = one_tree(view)
    check(tree, Verdict.UNKNOWN, "cycle", 300, "2")
    assert set(tree.evidence.pids) == {200, 250}


@pytest.mark.parametrize(
    "depth, expected",
    [
        (60, (Verdict.NORMAL, "detached", 1000, "7")),
        (64, (Verdict.NORMAL, "detached", 1000, "7")),
        (65, (Verdict.UNKNOWN, "too-deep", None, "2")),
        (70, (Verdict.UNKNOWN, "too-deep", None, "2")),
    ],
)
def test_chain_deeper_than_max_depth_is_unknown(depth, expected):
    # depth = processes from the holder up to the child of PID 1
    table = [init(), leader(1000, ppid=1)] + chain(range(1001, 1000 + depth), ppid=1000,
                                                    sid=1000)
    holder_pid = 1000 + depth - 1
    verdict, reason, root, rule = expected
    tree = one_tree(SyntheticView(table), holder(holder_pid))
    check(tree, verdict, reason, root if root is not None else holder_pid, rule)
    if verdict == Verdict.UNKNOWN:  # gave up: read at most max_depth + 1 stats, never reached init
        assert len(tree.holder_verdicts[0].chain) <= RULES.max_depth + 1


@pytest.mark.parametrize(
    "make_view",
    [
        lambda: SyntheticView([p for p in interactive() if p.pid != 200]),
        lambda: SyntheticView(interactive(), vanish_after_reads={200: 0}),
    ],
    ids=["parent-absent", "parent-exits-during-walk"],
)
def test_parent_vanished_mid_walk_is_unknown(make_view):
    tree = one_tree(make_view())
    check(tree, Verdict.UNKNOWN, "vanished", 300, "2")
    assert tree.evidence.pids == (300, 200)


@pytest.mark.parametrize("unreadable", [100, 300], ids=["ancestor", "holder"])
def test_unreadable_stat_is_unknown(unreadable):
    view = SyntheticView(interactive(), unreadable={unreadable})
    tree = one_tree(view)
    check(tree, Verdict.UNKNOWN, "unreadable", 300, "2")


def test_parent_newer_than_child_is_unknown_inconsistent():
    table = interactive()
    view = SyntheticView([p for p in table if p.pid != 200]
                         + [proc(200, ppid=100, sid=100, start_time=10_000)])
    tree = one_tree(view)
    check(tree, Verdict.UNKNOWN, "inconsistent", 300, "2")
    assert tree.evidence.pids == (300, 200)


# -- rule 7: healthy trees ----------------------------------------------------------


def test_healthy_interactive_tree_is_normal():
    view = SyntheticView(interactive())
    tree = one_tree(view)
    assert (tree.verdict, tree.root_pid) == (Verdict.NORMAL, 90)
    assert view.calls_to("keep_marker") == []
    assert 100 in {m.pid for m in tree.members_seen}


def test_healthy_ssh_tree_is_attached():
    check(one_tree(SyntheticView(interactive())), Verdict.NORMAL, "attached", 90, "7")


def test_healthy_shell_tree_under_a_leader_that_is_not_its_session_is_attached():
    view = SyntheticView(interactive(listener_cgroup="/user.slice"))
    check(one_tree(view), Verdict.NORMAL, "attached", 90, "7")


# -- grouping ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "holders",
    [
        [holder(300, gpu=0, used=GIB), holder(301, gpu=1, used=2 * GIB)],
        [holder(300, gpu=0, used=GIB), holder(300, gpu=1, used=2 * GIB)],
    ],
    ids=["two-processes", "one-process-two-gpus"],
)
def test_two_holders_under_one_orphan_root_make_one_tree(holders):
    view = leader_killed(proc(301, ppid=200, sid=100))
    tree = one_tree(view, *holders)
    check(tree, Verdict.ORPHAN, "session-ended", 200, "6")
    assert tree.holders == tuple(holders)
    assert tree.gpu_bytes == 3 * GIB
    assert len(tree.holder_verdicts) == 2


def test_two_holders_one_protected_by_cmdline_the_tree_is_protected():
    view = leader_killed(proc(301, ppid=200, sid=100,
                              cmdline="python -m ipykernel_launcher -f kernel-2.json"))
    tree = one_tree(view, holder(300, used=GIB), holder(301, gpu=1, used=GIB))
    check(tree, Verdict.PROTECTED, "protect-pattern", 200, "3")
    assert tree.evidence.pids == (301,)
    assert sorted(hv.verdict for hv in tree.holder_verdicts) == [Verdict.ORPHAN, Verdict.PROTECTED]
    assert tree.gpu_bytes == 2 * GIB


def test_orphan_tree_members_are_the_root_and_below_only():
    view = SyntheticView(interactive() + [leader(50, ppid=1, comm="agentd")])
    view.exit(100, reaper=50)
    tree = one_tree(view)
    assert tree.root_pid == 200
    assert {m.pid for m in tree.members_seen} == {200, 300}


# -- Rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rules, comm, expected",
    [
        (Rules(protect=(r"train\.py",)), "python", (Verdict.PROTECTED, "protect-pattern", "3")),
        (Rules(), "python", (Verdict.ORPHAN, "session-ended", "6")),
        (Rules(protect=()), "jupyter-lab", (Verdict.ORPHAN, "session-ended", "6")),
        (Rules(), "jupyter-lab", (Verdict.PROTECTED, "protect-pattern", "3")),
    ],
    ids=["custom-protects", "default-does-not", "empty-protects-nothing", "default-protects"],
)
def test_custom_protect_patterns(rules, comm, expected):
    view = leader_killed()
    view.update(300, comm=comm)
    verdict, reason, rule = expected
    check(one_tree(view, rules=rules), verdict, reason, 200, rule)


@pytest.mark.parametrize(
    "rules, comm, expected",
    [
        (Rules(adopters=("supervisor",)), "supervisor", (Verdict.UNKNOWN, "adoption-uncertain", 420,
                                                        "6")),
        (Rules(), "supervisor", (Verdict.NORMAL, "detached", 400, "7")),
        (Rules(adopters=("containerd-shim-runc-v2",)), "containerd-shim-runc-v2",
         (Verdict.UNKNOWN, "adoption-uncertain", 420, "6")),
        (Rules(adopters=()), "tini", (Verdict.NORMAL, "detached", 400, "7")),
    ],
    ids=["custom-reaper", "not-a-default-reaper", "reaper-name-cut-like-comm", "no-reapers"],
)
def test_custom_reapers(rules, comm, expected):
    view = SyntheticView([init(), leader(400, ppid=1, comm=comm),
                          proc(420, ppid=400, sid=400), proc(430, ppid=420, sid=400)])
    check(one_tree(view, holder(430), rules=rules), *expected)


@pytest.mark.parametrize("depth, verdict", [(5, Verdict.NORMAL), (6, Verdict.UNKNOWN)])
def test_custom_max_depth(depth, verdict):
    table = [init(), leader(1000, ppid=1)] + chain(range(1001, 1000 + depth), ppid=1000,
                                                    sid=1000)
    tree = one_tree(SyntheticView(table), holder(1000 + depth - 1), rules=Rules(max_depth=5))
    assert tree.verdict == verdict
    assert tree.reason == ("detached" if verdict == Verdict.NORMAL else "too-deep")


@pytest.mark.parametrize(
    "rules, changes",
    [
        (Rules(protect=("JUPYTER",)), {"comm": "jupyter-lab"}),
        (Rules(), {"cmdline": "/opt/Conda/bin/python /opt/Conda/bin/JupyterLab"}),
        (Rules(protect=("IpyKernel",)), {"cmdline": "python -m ipykernel_launcher"}),
    ],
    ids=["upper-pattern", "upper-cmdline", "mixed"],
)
def test_protect_patterns_are_case_insensitive(rules, changes):
    view = leader_killed()
    view.update(300, **changes)
    check(one_tree(view, rules=rules), Verdict.PROTECTED, "protect-pattern", 200, "3")


# -- cost ----------------------------------------------------------------------------


def _unrelated(n: int = 100) -> list[FakeProc]:
    """Neighbours of every kind that a scan must never look at."""
    out: list[FakeProc] = []
    for i in range(n):
        pid = 2000 + i
        kind = i % 4
        if kind == 0:  # siblings/children of the chains, no GPU
            out.append(proc(pid, ppid=(200, 300, 700, 710)[i % 8 // 2], sid=100))
        elif kind == 1:  # daemons of their own
            out.append(leader(pid, ppid=1, comm=f"svc{i}", cgroup=f"/system.slice/svc{i}.service"))
        elif kind == 2:  # in session 100 under an unrelated parent
            out.append(proc(pid, ppid=pid - 1, sid=100))
        else:  # in another user's session
            out.append(proc(pid, ppid=95, sid=94, uid=1001))
    return out


def test_warm_classify_reads_only_chains_and_session_leaders():
    table = interactive() + [leader(700, ppid=1, comm="trainerd"),
                             proc(710, ppid=700, sid=700)] + _unrelated(100)
    view = SyntheticView(table)
    view.exit(100)  # 200 -> orphan (dead leader 100); 710 stays normal under 700
    holders = [holder(300), holder(710, gpu=1)]
    classify(holders, view, RULES)  # cold
    members = {200, *view.descendants(200)}  # what a reap of the orphan would signal
    view.reset_calls()
    trees = classify(holders, view, RULES)  # warm
    assert [(t.verdict, t.root_pid) for t in trees] == [(Verdict.ORPHAN, 200),
                                                        (Verdict.NORMAL, 700)]
    assert {m.pid for m in trees[0].members} == members and len(members) > 2
    chains = {300, 200, 1, 100, 710, 700}  # chains, init, the dead session leader
    assert set(view.calls_to("stat")) == chains | members  # the orphan's members, walked down
    parents = {m for m in members if view.descendants(m)}
    assert set(view.calls_to("fresh_stat")) == parents  # re-read after their children files
    assert view.touched() == chains | members
    assert len(view) > 100  # the table really is bigger than what was read


def test_one_holder_stats_each_pid_once():
    view = leader_killed(*_unrelated(100))
    tree = one_tree(view)
    below = set(view.descendants(200)) - {300}  # members that are on no chain
    assert {m.pid for m in tree.members} == {200, 300, *below}
    # Each pid once walking up, and the orphan's members once more walking down (a real
    # ProcessView answers the second read from its per-scan memo).
    expected = {300: 2, 200: 1, 1: 1, 100: 1, **dict.fromkeys(below, 1)}
    assert Counter(view.calls_to("stat")) == expected


# -- the synthetic table itself -----------------------------------------------------


def test_proctable_defaults_make_parents_older_and_record_calls():
    view = SyntheticView(interactive())
    for p in view.procs:
        if p.ppid in view:
            assert view[p.ppid].start_time < p.start_time
    assert view[300].pgid == 300 and view[300].cmdline == "python train.py --rank 0"
    assert view[300].nspid == (300,) and view[1].uid == 0
    assert view.stat(4242) is None
    assert view.calls == [("stat", 4242)]
    assert view.children(100) == (200,) and view.descendants(95) == (100, 200, 300)
    view.exit(200)
    assert view.stat(300).ppid == 1 and 200 not in view
    late = view.add(proc(400, ppid=1, sid=400))
    assert late.start_time > max(p.start_time for p in view.procs if p.pid != 400)
    assert holder(300, gpu=2).gpu_index == 2


def test_proctable_unreadable_and_vanishing():
    from gpuguard.orphans.process import ProcUnreadable

    view = SyntheticView(interactive(), unreadable={100}, vanish_after_reads={200: 1})
    with pytest.raises(ProcUnreadable):
        view.stat(100)
    info = view.stat(200)
    assert info is not None and view.cmdline(info) == "python launch.py"
    assert view.stat(200) is None and view.cmdline(info) is None
    assert view.info(300).comm == "python"
    assert SyntheticView([init(), proc(5, ppid=1, sid=5, comm="x" * 20)]).info(5).comm == "x" * 15


# -- every member of an orphan tree is judged (what a reap would signal) -------------


@pytest.mark.parametrize(("sibling", "why"), [
    ({"sighup_ignored": True}, "ignores SIGHUP"),
    ({"keep": True}, "GPUGUARD_KEEP=1"),
    ({"comm": "tmux: server"}, "matches protect by comm"),
    ({"cmdline": "python -m jupyter_server"}, "matches protect by command line"),
], ids=["nohup", "keep", "comm", "cmdline"])
def test_a_protected_member_off_every_chain_protects_the_tree(sibling, why):
    view = leader_killed(proc(400, ppid=200, sid=100, **sibling))  # sibling of the holder
    tree = one_tree(view)
    check(tree, Verdict.PROTECTED, "member-protected", 200, "3" if "protect" in why else "4")
    assert tree.evidence.pids == (400,) and why in tree.evidence.detail
    assert {m.pid for m in tree.members} == {200, 300, 400}


def test_a_member_whose_facts_cannot_be_read_makes_the_tree_unknown():
    view = leader_killed(proc(400, ppid=300, sid=100), opaque={400})
    tree = one_tree(view)
    check(tree, Verdict.UNKNOWN, "member-unknown", 200, "2")
    assert tree.evidence.pids == (400,) and "cannot read" in tree.evidence.detail


def test_an_unknown_holder_below_the_root_makes_the_tree_unknown():
    # 400's own chain is one too deep for max_depth; it sits below the orphan root 200.
    view = leader_killed(proc(400, ppid=300, sid=100))
    depth = len(["300", "200", "1"])  # 300's chain to PID 1: admitted
    trees = classify([holder(300), holder(400)], view, Rules(max_depth=depth - 1))
    by_root = {t.root_pid: t for t in trees}
    assert (by_root[400].verdict, by_root[400].reason) == (Verdict.UNKNOWN, "too-deep")
    check(by_root[200], Verdict.UNKNOWN, "member-unknown", 200, "2")
    assert 400 in by_root[200].evidence.pids


def test_plain_members_keep_the_orphan():
    view = leader_killed(proc(400, ppid=200, sid=100, comm="sleep"))
    tree = one_tree(view)
    check(tree, Verdict.ORPHAN, "session-ended", 200, "6")
    assert [m.pid for m in tree.members] == [200, 300, 400]


# -- rule 6: how the launcher died (process events) ---------------------------------------


@pytest.mark.parametrize(("how", "reason", "words"), [
    ({"signal": 9}, "launcher-killed", "killed by SIGKILL"),
    ({"signal": 15}, "launcher-killed", "killed by SIGTERM"),
    ({"status": 0}, "launcher-exited", "exited with status 0"),
    ({}, "session-ended", "no exit event seen"),
], ids=["sigkill", "sigterm", "exit-0", "no-event"])
def test_the_launchers_exit_names_the_orphan_reason(how, reason, words):
    view = SyntheticView(interactive())
    if how:
        view.record_exit(100, **how)
    else:
        view.exit(100)
    tree = one_tree(view)
    check(tree, Verdict.ORPHAN, reason, 200, "6")
    assert words in tree.evidence.detail and 100 in tree.evidence.pids


def test_a_leaders_pid_reused_by_a_newer_process_still_reads_as_ended():
    """The kernel keeps a session id's pid while the session has members; should one ever
    name a newer process anyway, it is not the launcher."""
    view = leader_killed()
    view.add(proc(100, ppid=1, sid=100, comm="cron"))  # newer than everything there
    tree = one_tree(view)
    check(tree, Verdict.ORPHAN, "session-ended", 200, "6")
    assert "replaced by a newer process" in tree.evidence.detail


def test_zombie_leader_whose_other_threads_run_is_alive():
    # The session leader's main thread called pthread_exit(): /proc/100/stat shows Z while
    # the process runs on. Its session has not ended: not session-ended (reaped by
    # default), but parent-exited (only 200's own parent died).
    view = leader_killed()
    view.add(leader(100, ppid=95, comm="bash", state="Z", threads_alive=True))
    check(one_tree(view), Verdict.ORPHAN, "parent-exited", 200, "6")
    view.update(100, threads_alive=False)  # the whole thread group is gone now
    check(one_tree(view), Verdict.ORPHAN, "session-ended", 200, "6")


@pytest.mark.parametrize("holders", [(300, 400), (400, 300)], ids=["300-first", "400-first"])
def test_holders_of_one_tree_disagreeing_on_the_reason_give_the_least_reapable(holders):
    # bash (100) ran `bash train.sh` (200), which runs train.py (300) and a setsid'd
    # serve.py (400, its own session). bash is killed: 300 is session-ended, 400
    # session-orphaned, both rooted at 200. Whichever NVML lists first, the tree is
    # session-orphaned: the deliberately detached job must not ride on its sibling's
    # default-reaped reason.
    view = leader_killed(leader(400, ppid=200, cmdline="python serve.py"))
    trees = classify([holder(p) for p in holders], view, RULES)
    assert [(t.verdict, t.reason, t.root_pid) for t in trees] == [
        (Verdict.ORPHAN, "session-orphaned", 200)]


@pytest.mark.parametrize("server", ["/home/a/.cursor-server/bin/x/node",
                                    "/home/a/.vscodium-server/bin/x/node",
                                    "/home/a/.vscode-server/bin/x/node"])
def test_remote_ide_servers_are_protected(server):
    # A remote IDE's server, left behind by the ssh login that started it, runs a
    # terminal (a session of its own) with a GPU job.
    table = [init(), proc(500, ppid=1, sid=480, comm="node", cmdline=f"{server} server.js"),
             leader(520, ppid=500, comm="bash"), proc(530, ppid=520, sid=520)]
    check(one_tree(SyntheticView(table), holder(530)), Verdict.PROTECTED, "protect-pattern", 500,
          "3")
