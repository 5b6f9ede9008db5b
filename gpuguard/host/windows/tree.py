"""The Windows orphan rules, pure: one process table in, the shared Trees out.

Windows never reparents and never cascades a kill: a child keeps its dead parent's pid
as its ppid, and a parent created after its child is a later process at a reused pid.
So all the evidence is in one table of rows (pid, ppid, creation time, command line,
name), read by gpuguard/host/windows/processes.py through psutil. Each GPU holder's
chain is walked up through the ppids and judged, in this order (the first answer stands):

1. the holder is in no row: unknown `not-visible`;
2. a chain longer than `classify.max_depth`, or a ppid seen before on the chain that
   is not a reused pid (rule 8's test, applied first where both creation times are
   known: a parent created after its child is a later process, even the holder's own
   descendant): unknown `too-deep` / `cycle`;
3. a protect pattern (case-insensitive, as every protect pattern) on the name of any
   chain member, then on any whole command line: protected `protect-pattern`;
4. a link whose creation times are unknown (a row psutil could not time): unknown
   `unreadable`: its parent cannot be told from a later process at a reused pid;
5. the top: ppid 0 (System Idle), 4 (System), or the process's own pid: normal
   `attached`; 0 and 4 are the top of every chain, never a dead parent;
6. a parent gone or reused above an adopter (`classify.adopters`: explorer.exe under a
   userinit.exe that exited, wininit.exe, csrss.exe, winlogon.exe under an smss.exe
   that exited): its parent is normally gone, it is the top: normal `attached`;
7. an AccessDenied row (`readable=False`) from the holder up to the root: unknown
   `unreadable`, since a reap would signal a process whose command line was not read;
8. a ppid in no row: orphan `parent-gone`, rooted at the topmost live process of the
   chain; a ppid naming a process created after its child: orphan `parent-reused`,
   rooted at that child (the topmost genuine member).

Protections come before anything that calls a chain normal or orphan, as on Linux.
Missing evidence never kills: an AccessDenied row on a chain is walked through (its pid
and ppid are known), and it can make the chain normal (the chain reached System through
it: nothing is killed) or protected (its name, when psutil could read it, matched), but
never an orphan. An orphan tree is its root and every live descendant in the table;
each must be readable and unprotected and every GPU holder among them an orphan of the
same root, else the tree is protected or unknown (`member-*`), as on Linux. The whole
tree is reaped from the root, never the deepest worker alone.

Trees, verdicts and metrics are Linux's (gpuguard/orphans/verdicts.py): a `WinProcInfo`
(a ProcInfo whose start_time is `encode_create_time`'s integer milliseconds) stands for
each row, so `root_start_time` is that integer everywhere (labels, alerts, audit).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gpuguard.base.compat import StrEnum
from gpuguard.orphans.members import MemberJudgement, settle_members
from gpuguard.orphans.process import Holder, ProcInfo, breadth_first
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.trees import build_trees
from gpuguard.orphans.verdicts import Evidence, HolderVerdict, Tree, unknown
from gpuguard.orphans.vocabulary import Reason, Rule, Verdict

#: Parent pids that are the top of a chain, never a dead parent: System Idle, System.
TOP_PIDS = frozenset({0, 4})
#: `WinProc.create_time` of a row whose creation time could not be read.
UNKNOWN_CREATE_TIME = 0
#: The most processes one tree's walk collects (as gpuguard.orphans.process.walk_members).
MEMBER_LIMIT = 100_000

def encode_create_time(seconds: float) -> int:
    """psutil's `create_time()` (float seconds since the epoch) as the one integer that
    stands for a Windows process's creation everywhere (`root_start_time` in labels,
    alerts, the remediator's dedupe key, identity checks, audit records, `gpuguard reap
    --start-time`): milliseconds since the epoch, rounded. The same float always gives
    the same integer, so identities compare equal across reads."""
    return round(seconds * 1000)


@dataclass(frozen=True)
class WinProc:
    """One row of a Windows process table, as psutil showed it.

    `readable` is False for an AccessDenied row (SYSTEM's, a service's, another user's
    without the privilege): its pid and ppid are known, the rest only where psutil still
    gave it (often the name and the creation time); `create_time` is
    UNKNOWN_CREATE_TIME when it could not be read. `name` is optional (Wine 8 cannot give
    it): the basename of cmdline[0] stands in for it (`display_name`). `username` is
    for people and name patterns; `user_sid` says who owns it (it is not localised).
    """

    pid: int
    ppid: int
    create_time: int  # encode_create_time's milliseconds; UNKNOWN_CREATE_TIME: unread
    cmdline: tuple[str, ...] = ()
    name: str | None = None
    username: str | None = None  # DOMAIN\\user, as psutil gives it
    session_id: int | None = None  # Terminal Services session: 0 is the services' session
    readable: bool = True
    #: The token's user SID (S-1-5-18, S-1-5-21-...-1001): what the owner is, in every
    #: language; None when it could not be read (the remediator then fails closed).
    user_sid: str | None = None

    @property
    def identity(self) -> tuple[int, int]:
        return (self.pid, self.create_time)

    @property
    def timed(self) -> bool:
        """Whether the creation time was read (identity and reuse checks need it)."""
        return self.create_time > UNKNOWN_CREATE_TIME


def display_name(proc: WinProc) -> str:
    """The name psutil gave, else the basename of the command line's program ("" when
    neither is known)."""
    if proc.name:
        return proc.name
    if proc.cmdline and proc.cmdline[0]:
        return proc.cmdline[0].replace("/", "\\").rstrip("\\").rsplit("\\", 1)[-1]
    return ""


@dataclass(frozen=True)
class WinProcInfo(ProcInfo):
    """A WinProc as the shared Tree and HolderVerdict carry it (they hold ProcInfo):
    start_time is the row's create_time (integer ms), comm its display name, sid its
    session (-1: unknown); pgid, uid and state mean nothing on Windows (0, -1, "R").
    `proc` is the row itself (its user name, command line, readability)."""

    proc: WinProc


def as_proc_info(proc: WinProc) -> WinProcInfo:
    return WinProcInfo(
        pid=proc.pid, ppid=proc.ppid, pgid=0,
        sid=proc.session_id if proc.session_id is not None else -1,
        start_time=proc.create_time, state="R", uid=-1, comm=display_name(proc), proc=proc)


# -- the walk -----------------------------------------------------------------------------

class _End(StrEnum):
    """How a chain's walk ended (`_Walk.end`); CYCLE and TOO_DEEP become the Reasons of
    those names."""

    TOP = "top"
    GONE = "gone"
    REUSED = "reused"
    CYCLE = "cycle"
    TOO_DEEP = "too-deep"
    UNTIMED = "untimed"


@dataclass(frozen=True)
class _Walk:
    """A holder's chain, holder first, up to where the walk ended and why."""

    chain: tuple[WinProc, ...]
    end: _End
    #: The row above the top of `chain` that ended it: a reused pid's process, or one
    #: whose creation time is unknown (None otherwise).
    above: WinProc | None = None

    @property
    def top(self) -> WinProc:
        return self.chain[-1]


def _walk(table: Mapping[int, WinProc], holder: WinProc, rules: Rules) -> _Walk:
    chain = [holder]
    seen = {holder.pid}
    current = holder
    while True:
        if current.ppid in TOP_PIDS or current.ppid == current.pid:
            return _Walk(tuple(chain), _End.TOP)
        if len(chain) > rules.max_depth:
            return _Walk(tuple(chain), _End.TOO_DEEP)
        parent = table.get(current.ppid)  # a pid seen on the chain is always in the table
        if parent is None:
            return _Walk(tuple(chain), _End.GONE)
        # The reuse test first: a parent pid that now names the holder's own descendant
        # (created after `current`) is a reused pid, not a loop of parents.
        if parent.timed and current.timed and parent.create_time > current.create_time:
            return _Walk(tuple(chain), _End.REUSED, parent)
        if current.ppid in seen:
            return _Walk(tuple(chain), _End.CYCLE)
        if not (parent.timed and current.timed):
            return _Walk(tuple(chain), _End.UNTIMED, parent)
        seen.add(parent.pid)
        chain.append(parent)
        current = parent


# -- protections ----------------------------------------------------------------------------

def protected_name(proc: WinProc, rules: Rules) -> bool:
    """A protect pattern matches the process's name (or its stand-in, `display_name`)."""
    name = display_name(proc)
    return bool(name) and rules.protects(name)


def protected_cmdline(proc: WinProc, rules: Rules) -> bool:
    """A protect pattern matches the whole command line (its arguments joined by spaces);
    an unread one matches nothing, and proves nothing (the caller asks `readable`)."""
    return bool(proc.cmdline) and rules.protects(" ".join(proc.cmdline))


def _first_protected(chain: Sequence[WinProc], rules: Rules) -> tuple[WinProc, str] | None:
    """Rule 3: the first chain member a protect pattern matches, names before command
    lines (as Linux's comms before command lines), and how it matched."""
    for proc in chain:
        if protected_name(proc, rules):
            return proc, f"{proc.pid} name {display_name(proc)!r} matches protect"
    for proc in chain:
        if protected_cmdline(proc, rules):
            return proc, f"{proc.pid} command line matches protect"
    return None


def is_adopter(proc: WinProc, rules: Rules) -> bool:
    """The process is named as one whose parent is normally gone (case-insensitive)."""
    name = display_name(proc).casefold()
    return bool(name) and any(name == adopter.casefold() for adopter in rules.adopters)


# -- one holder -----------------------------------------------------------------------------

def _verdict(holder: Holder, chain: tuple[ProcInfo, ...], verdict: Verdict, reason: Reason,
             rule: Rule, detail: str, pids: Iterable[int]) -> HolderVerdict:
    """A verdict for the holder, rooted at the top of its chain."""
    return HolderVerdict(holder, verdict, reason, Evidence(rule, detail, tuple(pids)), chain,
                         chain[-1])


def judge_windows_holder(table: Mapping[int, WinProc], holder: Holder,
                         rules: Rules) -> HolderVerdict:
    """Rules 1-8 (module doc), in order, for one GPU holder."""
    row = table.get(holder.pid)
    if row is None:
        return unknown(holder, Rule.HOLDER, Reason.NOT_VISIBLE,
                       f"pid {holder.pid} is not in the process table", (), [holder.pid])
    walk = _walk(table, row, rules)
    chain = tuple(as_proc_info(p) for p in walk.chain)
    top = walk.top
    if walk.end == _End.TOO_DEEP:
        return unknown(holder, Rule.CHAIN, Reason.TOO_DEEP,
                       f"chain longer than max_depth={rules.max_depth}", chain,
                       [p.pid for p in walk.chain[-3:]])
    if walk.end == _End.CYCLE:
        return unknown(holder, Rule.CHAIN, Reason.CYCLE, f"pid {top.ppid} appears twice",
                       chain, [top.pid, top.ppid])
    hit = _first_protected(walk.chain, rules)
    if hit is not None:
        return _verdict(holder, chain, Verdict.PROTECTED, Reason.PROTECT_PATTERN,
                        Rule.PROTECT, hit[1], [hit[0].pid])
    if walk.end == _End.UNTIMED:
        assert walk.above is not None
        untimed = top if not top.timed else walk.above
        return unknown(holder, Rule.CHAIN, Reason.UNREADABLE,
                       f"creation time of {untimed.pid} unknown: cannot tell whether "
                       f"{walk.above.pid} is the parent of {top.pid} or a later process at "
                       "its pid", chain, [top.pid, walk.above.pid])
    if walk.end == _End.TOP:
        parent = ("itself" if top.ppid == top.pid
                  else f"{top.ppid} ({'System Idle' if top.ppid == 0 else 'System'})")
        return _verdict(holder, chain, Verdict.NORMAL, Reason.ATTACHED, Rule.SESSION,
                        f"a live chain from {row.pid} up to {top.pid}, whose parent is "
                        f"{parent}", [top.pid])
    return _orphan(holder, walk, chain, rules)


def _orphan(holder: Holder, walk: _Walk, chain: tuple[ProcInfo, ...],
            rules: Rules) -> HolderVerdict:
    """Rules 6-8 for a chain whose top's parent is gone or names a later process."""
    top = walk.top
    if walk.end == _End.GONE:
        why = f"parent {top.ppid} of {top.pid} is not in the process table"
        reason = Reason.PARENT_GONE
    else:
        assert walk.above is not None
        why = (f"parent pid {top.ppid} of {top.pid} names a process created after it "
               f"({display_name(walk.above) or '?'}): the pid was reused")
        reason = Reason.PARENT_REUSED
    if is_adopter(top, rules):
        return _verdict(holder, chain, Verdict.NORMAL, Reason.ATTACHED, Rule.ADOPTION,
                        f"{why}; {top.pid} ({display_name(top)}) is an adopter, whose "
                        "parent is normally gone: the top of its chain", [top.pid])
    denied = next((p for p in walk.chain if not (p.readable and p.timed)), None)
    if denied is not None:
        return unknown(holder, Rule.CHAIN, Reason.UNREADABLE,
                       f"{why}; but {denied.pid} ({display_name(denied) or '?'}) on the "
                       "chain could not be read (access denied): a reap would signal it "
                       "unseen", chain, [denied.pid, top.pid])
    return _verdict(holder, chain, Verdict.ORPHAN, reason, Rule.ADOPTION,
                    f"{why}; root {top.pid}", [top.pid, top.ppid])


# -- trees ----------------------------------------------------------------------------------

def as_holder(holder: int | Holder) -> Holder:
    """A holder given by pid alone: no GPU named, its memory unknown."""
    if isinstance(holder, Holder):
        return holder
    return Holder(pid=holder, gpu_uuid="", gpu_index=-1, used_bytes=None, kind="C")


def classify_windows(table: Mapping[int, WinProc], holders: Iterable[int | Holder],
                     rules: Rules) -> list[Tree]:
    """Judge every holder (a pid, or NVML's Holder with its GPU and memory) over `table`
    and group them into trees by root identity: Linux's classify() on Windows' rules.
    Orphan trees carry their members (the root and every live descendant), each judged."""
    return build_trees((judge_windows_holder(table, as_holder(h), rules) for h in holders),
                       lambda tree, by_pid: _judge_members(tree, table, rules, by_pid))


@runtime_checkable
class ParentIndexed(Protocol):
    """A table that knows every listed pid's ppid without reading its row (Windows gives
    all of them in one process snapshot): a walk down from a root then reads only the
    rows below it, not the whole table (docs/design.md, Cost rules)."""

    @property
    def ppids(self) -> Mapping[int, int]: ...


def pids_by_parent(table: Mapping[int, WinProc]) -> dict[int, list[int]]:
    """Every listed pid by the ppid it names (itself excluded), sorted: from the table's
    ppid index where it has one, else from its rows."""
    ppids = table.ppids if isinstance(table, ParentIndexed) else \
        {proc.pid: proc.ppid for proc in table.values()}
    out: dict[int, list[int]] = {}
    for pid, ppid in sorted(ppids.items()):
        if pid != ppid:
            out.setdefault(ppid, []).append(pid)
    return out


def windows_members(table: Mapping[int, WinProc], root: WinProc, *,
                    limit: int = MEMBER_LIMIT) -> tuple[WinProc, ...]:
    """The root and every live descendant in `table`, root first, breadth first.

    A row is a child of a member when its ppid names the member and it was not created
    before it (an older row with that ppid is the child of an earlier process at the
    pid). A row whose creation time is unknown counts as a child: it cannot be ruled
    out, and as an unreadable member it makes the tree unknown (fail closed).
    """
    by_parent = pids_by_parent(table)

    def children(parent: WinProc, seen: Set[int]) -> Iterator[WinProc]:
        for pid in by_parent.get(parent.pid, ()):
            child = table.get(pid)  # gone since the snapshot: no row
            if child is None or child.pid in seen or (
                    child.timed and parent.timed and child.create_time < parent.create_time):
                continue
            yield child

    return breadth_first(root, children, limit=limit)


def _member_judgement(proc: WinProc, rules: Rules) -> MemberJudgement | None:
    """Rule 3 for one process a reap would signal, and whether it could be read."""
    who = f"member {proc.pid} ({display_name(proc) or '?'})"
    for how, test in (("by name", protected_name), ("by command line", protected_cmdline)):
        if test(proc, rules):
            return MemberJudgement(Verdict.PROTECTED, Reason.MEMBER_PROTECTED,
                                   Evidence(Rule.PROTECT, f"{who} matches protect {how}: a "
                                            "reap would signal it", (proc.pid,)))
    if not proc.readable or not proc.timed:
        what = "could not be read (access denied)" if not proc.readable else \
            "has no creation time"
        return MemberJudgement(Verdict.UNKNOWN, Reason.MEMBER_UNKNOWN,
                               Evidence(Rule.CHAIN, f"{who} {what}: a reap would signal it "
                                        "unseen", (proc.pid,)))
    return None


def _judge_members(tree: Tree, table: Mapping[int, WinProc], rules: Rules,
                   by_pid: Mapping[int, list[HolderVerdict]]) -> Tree:
    """Windows' member judgement: the root's live descendants in the table."""
    assert isinstance(tree.root, WinProcInfo)
    members = tuple(as_proc_info(m) for m in windows_members(table, tree.root.proc))
    return settle_members(tree, members, by_pid,
                          lambda m: _member_judgement(_row(m), rules))


def _row(info: ProcInfo) -> WinProc:
    assert isinstance(info, WinProcInfo)
    return info.proc


def judge_windows_member(table: Mapping[int, WinProc], pid: int, rules: Rules, *,
                         create_time: int | None = None) -> MemberJudgement | None:
    """Re-judge one member of an orphan tree (the reaper, after suspending it) over a
    fresh `table`: None when it may be signalled, else why not.

    None only for a row at `pid` (created at `create_time`, when given: the process the
    plan named, not a later one at its pid) that is readable, has a creation time and
    matches no protect pattern by name or command line. Otherwise a MemberJudgement:
    PROTECTED / member-protected, UNKNOWN / member-unknown (AccessDenied, untimed), or
    UNKNOWN / vanished when the pid is gone or names another process (nothing of the
    plan's is left there to signal). Any answer but None means: do not signal it.
    """
    proc = table.get(pid)
    if proc is None or (create_time is not None and proc.create_time != create_time):
        what = "is gone" if proc is None else (
            f"names another process (created at {proc.create_time}, not {create_time})")
        return MemberJudgement(Verdict.UNKNOWN, Reason.VANISHED,
                               Evidence(Rule.CHAIN, f"member {pid} {what}: nothing of the "
                                        "tree's to signal there", (pid,)))
    return _member_judgement(proc, rules)
