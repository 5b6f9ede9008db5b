"""classify_windows(): the Windows rules (gpuguard/host/windows/tree.py) on synthetic tables.

What Wine cannot show (tests/windows/ runs the rest for real): AccessDenied rows,
SYSTEM and the services, session 0, ppid 0 and 4 at the top, explorer.exe under a dead
userinit.exe, pid reuse with a later process at the parent's pid. The base table is a
Windows 10 host after logon, with alice's terminal:

    0     System Idle Process  (ppid 0)
    4     System               (ppid 0)
    300   smss.exe             (ppid 4; AccessDenied, name known)
    400   csrss.exe            (ppid 380: that session's smss.exe, exited; session 0)
    500   wininit.exe          (ppid 380; session 0)
    600   services.exe         (ppid 500; session 0)
    700   svchost.exe          (ppid 600; session 0, SYSTEM)
    800   winlogon.exe         (ppid 390: session 1's smss.exe, exited; session 1)
    1200  explorer.exe         (ppid 1100: userinit.exe, exited; alice, session 1)
    1300  cmd.exe              (ppid 1200)
    1400  python.exe train.py  (ppid 1300): the GPU holder
    1500  python.exe worker    (ppid 1400)

Creation times are encode_create_time's milliseconds; a child is always created after
its parent unless a scenario says otherwise.
"""

from __future__ import annotations

import dataclasses

import pytest

from gpuguard.config.classify import default_rules
from gpuguard.host.platform.linux import BACKEND as LINUX_BACKEND
from gpuguard.host.windows.platform import BACKEND as WINDOWS_BACKEND
from gpuguard.host.windows.tree import (
    UNKNOWN_CREATE_TIME,
    WinProc,
    WinProcInfo,
    classify_windows,
    display_name,
    encode_create_time,
    judge_windows_member,
    windows_members,
)
from gpuguard.orphans.process import Holder
from gpuguard.orphans.rules_config import WINDOWS_ADOPTERS, WINDOWS_PROTECT, Rules
from gpuguard.orphans.verdicts import Tree
from gpuguard.orphans.vocabulary import Reason, Rule, Verdict

RULES = default_rules(WINDOWS_BACKEND.defaults)
#: Windows' adopters without explorer.exe among the protect patterns: what the adopter
#: rule alone says of a chain that tops out at explorer.exe.
NO_EXPLORER = Rules(protect=tuple(p for p in WINDOWS_PROTECT if "explorer" not in p),
                    adopters=WINDOWS_ADOPTERS)
BOOT = 1_733_000_000_000  # ms since the epoch
ALICE = "HOST\\alice"
SYSTEM = "NT AUTHORITY\\SYSTEM"
GIB = 1 << 30


def row(pid: int, ppid: int, at: int, name: str | None = "python.exe",
        cmdline: tuple[str, ...] | None = None, *, user: str | None = ALICE,
        session: int | None = 1, readable: bool = True) -> WinProc:
    """A row created `at` ms after boot; cmdline defaults to the name (none when unreadable)."""
    if cmdline is None:
        cmdline = () if not readable else (f"C:\\Windows\\{name}",) if name else ()
    return WinProc(pid=pid, ppid=ppid, create_time=BOOT + at, cmdline=cmdline, name=name,
                   username=user if readable else None, session_id=session, readable=readable)


def denied(pid: int, ppid: int, at: int, name: str | None, *, session: int = 0) -> WinProc:
    """An AccessDenied row (SYSTEM's, a service's): pid, ppid, and what psutil still gave."""
    return row(pid, ppid, at, name, session=session, readable=False)


BASE = (
    row(0, 0, 0, "System Idle Process", (), user=SYSTEM, session=0),
    row(4, 0, 0, "System", (), user=SYSTEM, session=0),
    denied(300, 4, 10, "smss.exe"),
    denied(400, 380, 30, "csrss.exe"),
    denied(500, 380, 31, "wininit.exe"),
    denied(600, 500, 40, "services.exe"),
    denied(700, 600, 50, "svchost.exe"),
    denied(800, 390, 60, "winlogon.exe", session=1),
    row(1200, 1100, 1_000, "explorer.exe"),
    row(1300, 1200, 2_000, "cmd.exe"),
    row(1400, 1300, 3_000, "python.exe", ("C:\\Python311\\python.exe", "train.py")),
    row(1500, 1400, 3_100, "python.exe", ("C:\\Python311\\python.exe", "-c", "worker")),
)


def table(*rows: WinProc, without: tuple[int, ...] = ()) -> dict[int, WinProc]:
    """BASE with `rows` added (or replacing the row at their pid), `without` removed."""
    out = {r.pid: r for r in BASE if r.pid not in without}
    out.update({r.pid: r for r in rows})
    return out


def one(tab: dict[int, WinProc], pid: int, rules: Rules = RULES) -> Tree:
    (tree,) = classify_windows(tab, [pid], rules)
    return tree


def check(tree: Tree, verdict: Verdict, reason: str, root: int, rule: Rule) -> None:
    assert (tree.verdict, tree.reason, tree.root_pid, tree.evidence.rule) == (
        verdict, reason, root, rule), tree.evidence.detail


# -- the top of a chain, and the adopters -----------------------------------------------------

def test_a_live_terminal_chain_is_protected_by_explorer() -> None:
    """Windows' defaults protect explorer.exe: the holder's shell lives, its chain is alive."""
    tree = one(table(), 1500)
    check(tree, Verdict.PROTECTED, "protect-pattern", 1200, Rule.PROTECT)
    assert tree.evidence.pids == (1200,)
    assert "'explorer.exe'" in tree.evidence.detail


def test_explorer_under_its_dead_userinit_is_the_top_not_an_orphan() -> None:
    """userinit.exe (1100) starts explorer.exe and exits: an adopter's parent is normally
    gone. Without explorer among the protect patterns, the adopter rule alone decides."""
    tree = one(table(), 1500, NO_EXPLORER)
    check(tree, Verdict.NORMAL, "attached", 1200, Rule.ADOPTION)
    assert [m.pid for m in tree.holder_verdicts[0].chain] == [1500, 1400, 1300, 1200]
    assert "adopter" in tree.evidence.detail and tree.members == ()
    # Not an adopter by these rules: the same chain is an orphan rooted at explorer.
    plain = Rules(protect=NO_EXPLORER.protect, adopters=("wininit.exe",))
    check(one(table(), 1500, plain), Verdict.ORPHAN, "parent-gone", 1200, Rule.ADOPTION)


def test_adopters_match_names_case_insensitively() -> None:
    tab = table(dataclasses.replace(BASE[8], name="Explorer.EXE"))
    check(one(tab, 1500, NO_EXPLORER), Verdict.NORMAL, "attached", 1200, Rule.ADOPTION)


@pytest.mark.parametrize("ppid", [0, 4])
def test_ppid_0_and_4_are_the_top_never_a_dead_parent(ppid: int) -> None:
    """System Idle (0) and System (4) are the top of every chain: a job started by the
    kernel's own processes is attached, even where 0 and 4 are not in the table."""
    tab = table(row(2000, ppid, 5_000, "gpujob.exe", user=SYSTEM, session=0),
                without=(0, 4))
    tree = one(tab, 2000)
    check(tree, Verdict.NORMAL, "attached", 2000, Rule.SESSION)
    assert ("System Idle" if ppid == 0 else "(System)") in tree.evidence.detail


def test_system_itself_holding_a_gpu_is_normal() -> None:
    check(one(table(), 4), Verdict.NORMAL, "attached", 4, Rule.SESSION)


def test_a_process_that_is_its_own_parent_is_the_top() -> None:
    tree = one(table(row(2000, 2000, 5_000, "gpujob.exe")), 2000)
    check(tree, Verdict.NORMAL, "attached", 2000, Rule.SESSION)
    assert "itself" in tree.evidence.detail


# -- orphans --------------------------------------------------------------------------------

def test_a_dead_parent_makes_an_orphan_rooted_at_the_topmost_live_process() -> None:
    """cmd.exe (1300) is gone; the holder is the deepest worker, the root is train.py,
    and the tree is every live descendant of the root in the table."""
    tab = table(row(1501, 1400, 3_200, "python.exe", ("python.exe", "-c", "helper")),
                row(1600, 1500, 3_300, "conhost.exe"),
                row(1700, 1200, 3_400, "notepad.exe"),  # explorer's: not in the tree
                without=(1300,))
    tree = one(tab, 1500)
    check(tree, Verdict.ORPHAN, "parent-gone", 1400, Rule.ADOPTION)
    assert tree.root_start_time == BOOT + 3_000
    assert isinstance(tree.root, WinProcInfo) and tree.root.comm == "python.exe"
    assert [m.pid for m in tree.members] == [1400, 1500, 1501, 1600]
    assert [m.pid for m in tree.members_seen] == [1500, 1400]
    assert tree.evidence.pids == (1400, 1300)


def test_a_parent_created_after_its_child_is_a_reused_pid() -> None:
    """cmd.exe (1300) died and its pid went to a later process: the root is the child
    (the topmost genuine member); the later process at 1300 is neither chain nor tree."""
    tab = table(row(1300, 1200, 9_000, "svc-updater.exe"),  # created after 1400
                row(1310, 1300, 9_100, "child-of-the-new-1300.exe"))
    tree = one(tab, 1500)
    check(tree, Verdict.ORPHAN, "parent-reused", 1400, Rule.ADOPTION)
    assert [m.pid for m in tree.members] == [1400, 1500]
    assert "svc-updater.exe" in tree.evidence.detail
    assert 1300 not in {m.pid for m in tree.holder_verdicts[0].chain}


def test_an_older_row_naming_the_root_as_parent_is_not_in_its_tree() -> None:
    """A child keeps its dead parent's pid: a row with ppid 1400 created before 1400 is
    the child of an earlier process at that pid, not of the root."""
    tab = table(row(1450, 1400, 2_500, "stale-child.exe"), without=(1300,))
    tree = one(tab, 1500)
    check(tree, Verdict.ORPHAN, "parent-gone", 1400, Rule.ADOPTION)
    assert [m.pid for m in tree.members] == [1400, 1500]


def test_the_same_creation_millisecond_is_not_reuse() -> None:
    tab = table(row(1500, 1400, 3_000, "python.exe"), without=(1300,))
    check(one(tab, 1500), Verdict.ORPHAN, "parent-gone", 1400, Rule.ADOPTION)


def test_holders_under_one_root_make_one_tree_with_their_memory() -> None:
    tab = table(row(1501, 1400, 3_200, "python.exe"), without=(1300,))
    holders = [Holder(1500, "GPU-0", 0, 2 * GIB, "C"), Holder(1501, "GPU-1", 1, GIB, "C"),
               Holder(1500, "GPU-1", 1, None, "C")]  # WDDM: memory N/A
    (tree,) = classify_windows(tab, holders, RULES)
    check(tree, Verdict.ORPHAN, "parent-gone", 1400, Rule.ADOPTION)
    assert tree.gpu_bytes == 3 * GIB and len(tree.holders) == 3


# -- unknown: never killed ------------------------------------------------------------------

def test_the_holder_missing_from_the_table_is_unknown() -> None:
    tree = one(table(), 9999)
    check(tree, Verdict.UNKNOWN, "not-visible", 9999, Rule.HOLDER)
    assert tree.root is None and tree.members == ()


def test_a_cycle_is_unknown() -> None:
    """Two processes each other's parent, created in the same millisecond: no creation
    time tells a later process at a reused pid, so it is a loop, and unknown."""
    tab = table(row(3000, 3001, 4_000), row(3001, 3000, 4_000))
    tree = one(tab, 3000)
    check(tree, Verdict.UNKNOWN, "cycle", 3000, Rule.CHAIN)


def test_a_parent_pid_reused_by_the_holders_own_child_is_reuse_not_a_cycle() -> None:
    """300's parent (an earlier 200) exited; pid 200 then went to 300's own child D, the
    GPU holder. Walking up from D reaches 300, whose ppid names D: seen before, but
    created after 300, so a later process at a reused pid. The reuse test comes first:
    orphan parent-reused, rooted at 300 (the topmost genuine member), D in its tree."""
    tab = table(row(200, 300, 60), row(300, 200, 50))
    tree = one(tab, 200)
    check(tree, Verdict.ORPHAN, "parent-reused", 300, Rule.ADOPTION)
    assert [m.pid for m in tree.members] == [300, 200]
    assert "parent pid 200 of 300 names a process created after it" in tree.evidence.detail


def test_an_implausible_depth_is_unknown() -> None:
    rows = [row(5000 + 4 * i, 5000 + 4 * (i - 1) if i else 4, 100 + i) for i in range(80)]
    tab = table(*rows)
    deepest = rows[-1].pid
    check(one(tab, deepest), Verdict.UNKNOWN, "too-deep", deepest, Rule.CHAIN)
    deep_enough = dataclasses.replace(RULES, max_depth=100)
    check(one(tab, deepest, deep_enough), Verdict.NORMAL, "attached", 5000, Rule.SESSION)


def test_a_holder_whose_command_line_is_unreadable_is_never_an_orphan() -> None:
    """AccessDenied on the holder itself (another user's job): its parent is gone, but a
    reap would signal a process whose command line was never read."""
    tab = table(denied(1400, 1300, 3_000, "python.exe", session=1), without=(1300,))
    tree = one(tab, 1400)
    check(tree, Verdict.UNKNOWN, "unreadable", 1400, Rule.CHAIN)
    assert tree.members == () and "access denied" in tree.evidence.detail


def test_an_access_denied_row_up_the_chain_stops_an_orphan() -> None:
    tab = table(denied(1450, 1300, 2_900, None, session=1),
                row(1400, 1450, 3_000), without=(1300,))
    tree = one(tab, 1500)
    check(tree, Verdict.UNKNOWN, "unreadable", 1500, Rule.CHAIN)
    assert tree.evidence.pids == (1450, 1450)


def test_an_unknown_creation_time_cannot_tell_a_parent_from_a_reused_pid() -> None:
    untimed = dataclasses.replace(denied(1300, 1200, 0, None, session=1),
                                  create_time=UNKNOWN_CREATE_TIME)
    tree = one(table(untimed), 1500)
    check(tree, Verdict.UNKNOWN, "unreadable", 1500, Rule.CHAIN)
    assert "creation time of 1300 unknown" in tree.evidence.detail


# -- SYSTEM, services, session 0 --------------------------------------------------------------

def test_a_services_child_is_protected_by_its_hosts_name() -> None:
    """A GPU job a service started: svchost.exe and services.exe are AccessDenied rows,
    and the name psutil still gave them is protected by Windows' defaults."""
    tab = table(row(2000, 700, 5_000, "inference.exe", user=SYSTEM, session=0))
    tree = one(tab, 2000)
    check(tree, Verdict.PROTECTED, "protect-pattern", 500, Rule.PROTECT)  # rooted at the top
    assert tree.evidence.pids == (700,)
    assert [m.pid for m in tree.members_seen] == [2000, 700, 600, 500]


def test_a_chain_that_reaches_system_through_access_denied_rows_is_normal() -> None:
    """Nameless AccessDenied rows up to smss.exe and System: their pids and ppids are
    known, the chain is alive up to 4, so the holder is attached (nothing is killed)."""
    tab = table(denied(2100, 300, 4_000, None), denied(2200, 2100, 4_100, None),
                row(2000, 2200, 5_000, "inference.exe", user=SYSTEM, session=0))
    tree = one(tab, 2000)
    check(tree, Verdict.NORMAL, "attached", 300, Rule.SESSION)
    assert [m.pid for m in tree.holder_verdicts[0].chain] == [2000, 2200, 2100, 300]


def test_session_0_is_judged_like_any_session() -> None:
    """A service's GPU child whose nameless service host died: parent-gone, rooted at the
    child, in session 0 (the verdict's row carries its session; the policy decides)."""
    tab = table(row(2000, 2100, 5_000, "inference.exe", user=SYSTEM, session=0))
    tree = one(tab, 2000)
    check(tree, Verdict.ORPHAN, "parent-gone", 2000, Rule.ADOPTION)
    assert tree.root is not None and tree.root.sid == 0
    assert isinstance(tree.root, WinProcInfo) and tree.root.proc.username == SYSTEM


def test_an_unreadable_system_holder_under_a_dead_parent_is_unknown() -> None:
    tab = table(denied(2000, 2100, 5_000, None))
    check(one(tab, 2000), Verdict.UNKNOWN, "unreadable", 2000, Rule.CHAIN)


def test_wininit_and_winlogon_under_their_dead_smss_are_the_top() -> None:
    """dwm.exe-like holders under winlogon.exe, whose session smss.exe exited: normal."""
    tab = table(denied(900, 800, 70, "dwm.exe", session=1))
    check(one(tab, 900), Verdict.NORMAL, "attached", 800, Rule.ADOPTION)
    tab = table(denied(910, 500, 70, "fontdrvhost.exe"))
    check(one(tab, 910), Verdict.NORMAL, "attached", 500, Rule.ADOPTION)


# -- protect patterns -----------------------------------------------------------------------

@pytest.mark.parametrize(("name", "cmdline", "how"), [
    ("CODE.EXE", None, "name"),
    ("Code.exe", None, "name"),
    ("python.exe", ("C:\\Python311\\python.exe", "C:\\Python311\\Scripts\\jupyter-lab-script.py"),
     "command line"),
    ("python.exe", ("C:\\Python311\\python.exe", "-m", "JUPYTER", "lab"), "command line"),
    ("bash.exe", ("C:\\msys64\\usr\\bin\\bash.exe", "-c", "NoHup python train.py"),
     "command line"),
])
def test_protect_patterns_match_names_and_command_lines_case_insensitively(
        name: str, cmdline: tuple[str, ...] | None, how: str) -> None:
    """Anywhere on the chain: here the orphan root itself (its parent cmd.exe is gone)."""
    tab = table(row(1400, 1300, 3_000, name, cmdline), without=(1300,))
    tree = one(tab, 1500)
    check(tree, Verdict.PROTECTED, "protect-pattern", 1400, Rule.PROTECT)
    assert how in tree.evidence.detail and tree.evidence.pids == (1400,)


def test_a_name_that_matches_nothing_leaves_the_orphan() -> None:
    tab = table(row(1400, 1300, 3_000, "decoder.exe"), without=(1300,))
    check(one(tab, 1500), Verdict.ORPHAN, "parent-gone", 1400, Rule.ADOPTION)


def test_without_a_name_the_command_lines_program_stands_in() -> None:
    """Wine 8 cannot give names: the basename of cmdline[0] is the name then."""
    proc = row(1400, 1300, 3_000, None, ("C:\\Program Files\\Microsoft VS Code\\Code.exe",))
    assert display_name(proc) == "Code.exe"
    assert display_name(row(1, 0, 0, None, ("C:/tools/run.exe", "x"))) == "run.exe"
    assert display_name(denied(2, 0, 0, None)) == ""
    tree = one(table(proc, without=(1300,)), 1500)
    check(tree, Verdict.PROTECTED, "protect-pattern", 1400, Rule.PROTECT)


# -- the tree's members ---------------------------------------------------------------------

def test_a_protected_process_in_the_tree_keeps_the_whole_tree() -> None:
    tab = table(row(1501, 1400, 3_200, "Code.exe"), without=(1300,))
    tree = one(tab, 1500)
    check(tree, Verdict.PROTECTED, "member-protected", 1400, Rule.PROTECT)
    assert tree.evidence.pids == (1501,) and len(tree.members) == 3


def test_an_access_denied_process_in_the_tree_makes_it_unknown() -> None:
    tab = table(denied(1501, 1400, 3_200, "elevated.exe", session=1), without=(1300,))
    tree = one(tab, 1500)
    check(tree, Verdict.UNKNOWN, "member-unknown", 1400, Rule.CHAIN)
    assert [m.pid for m in tree.members] == [1400, 1500, 1501]


def test_an_untimed_row_naming_a_member_as_parent_is_in_the_tree() -> None:
    """Its age cannot rule it out as the root's child: fail closed."""
    untimed = dataclasses.replace(denied(1502, 1400, 0, None, session=1),
                                  create_time=UNKNOWN_CREATE_TIME)
    tree = one(table(untimed, without=(1300,)), 1500)
    check(tree, Verdict.UNKNOWN, "member-unknown", 1400, Rule.CHAIN)


def test_a_holder_below_the_root_with_another_verdict_refuses_the_tree() -> None:
    """An AccessDenied GPU holder inside train.py's tree is unknown on its own; the tree
    that would signal it is unknown too (member-unknown), naming that holder."""
    tab = table(denied(1501, 1400, 3_200, "elevated.exe", session=1), without=(1300,))
    trees = classify_windows(tab, [1500, 1501], RULES)
    assert {(t.root_pid, t.verdict, t.reason) for t in trees} == {
        (1400, Verdict.UNKNOWN, "member-unknown"), (1501, Verdict.UNKNOWN, "unreadable")}
    tree = next(t for t in trees if t.root_pid == 1400)
    assert "GPU holder 1501" in tree.evidence.detail and tree.evidence.pids[0] == 1501


def test_holders_under_one_root_disagreeing_make_the_safest_tree() -> None:
    """A notebook kernel under train.py (through jupyter-lab.exe) and a plain worker share
    the root 1400: the tree is protected, the worker keeps its own orphan verdict."""
    tab = table(row(1501, 1400, 3_200, "jupyter-lab.exe"),
                row(1502, 1501, 3_300, "python.exe", ("python.exe", "-m", "ipykernel_launcher")),
                without=(1300,))
    (tree,) = classify_windows(tab, [1500, 1502], RULES)
    check(tree, Verdict.PROTECTED, "protect-pattern", 1400, Rule.PROTECT)
    assert {hv.holder.pid: hv.verdict for hv in tree.holder_verdicts} == {
        1500: Verdict.ORPHAN, 1502: Verdict.PROTECTED}


def test_windows_members_walks_every_live_descendant_breadth_first() -> None:
    tab = table(row(1501, 1400, 3_200), row(1600, 1500, 3_300), row(1601, 1501, 3_400))
    assert [m.pid for m in windows_members(tab, tab[1400])] == [1400, 1500, 1501, 1600, 1601]


def test_judge_windows_member_for_the_reaper() -> None:
    tab = table(row(1501, 1400, 3_200, "Code.exe"), denied(1502, 1400, 3_300, None, session=1))
    assert judge_windows_member(tab, 1500, RULES) is None
    assert judge_windows_member(tab, 1500, RULES, create_time=BOOT + 3_100) is None
    protected = judge_windows_member(tab, 1501, RULES)
    assert protected is not None and protected.reason == Reason.MEMBER_PROTECTED
    unread = judge_windows_member(tab, 1502, RULES)
    assert unread is not None and (unread.verdict, unread.reason) == (
        Verdict.UNKNOWN, Reason.MEMBER_UNKNOWN)
    gone = judge_windows_member(tab, 4242, RULES)
    assert gone is not None and gone.reason == Reason.VANISHED
    reused = judge_windows_member(tab, 1500, RULES, create_time=BOOT + 1)
    assert reused is not None and reused.reason == Reason.VANISHED
    assert "another process" in reused.evidence.detail


# -- the creation time encoding -------------------------------------------------------------

def test_encode_create_time_is_integer_milliseconds_and_stable() -> None:
    seconds = 1_733_001_234.567_891
    assert encode_create_time(seconds) == 1_733_001_234_568
    assert encode_create_time(seconds) == encode_create_time(float(repr(seconds)))
    assert type(encode_create_time(seconds)) is int
    assert encode_create_time(1_733_001_234.0) == 1_733_001_234_000
    assert encode_create_time(1_733_001_234) == 1_733_001_234_000
    assert type(encode_create_time(1_733_001_234)) is int


def test_the_root_start_time_is_the_encoded_creation_time() -> None:
    created = encode_create_time(1_733_000_003.25)
    tab = table(dataclasses.replace(BASE[10], create_time=created), without=(1300,))
    tab[1500] = dataclasses.replace(tab[1500], create_time=created + 100)
    tree = one(tab, 1500)
    assert tree.root_start_time == 1_733_000_003_250
    assert tree.root is not None and tree.root.identity == (1400, 1_733_000_003_250)


# -- the defaults ---------------------------------------------------------------------------

def test_windows_defaults_protect_the_issues_patterns() -> None:
    rules = default_rules(WINDOWS_BACKEND.defaults)
    for text in ("jupyter-lab.exe", "nohup", "Code.exe", "EXPLORER.EXE", "services.exe",
                 "C:\\Windows\\System32\\svchost.exe -k netsvcs"):
        assert rules.protects(text), text
    assert not rules.protects("python.exe train.py")
    assert set(rules.adopters) >= {"explorer.exe", "wininit.exe", "csrss.exe", "winlogon.exe"}
    assert default_rules(LINUX_BACKEND.defaults) == Rules()
