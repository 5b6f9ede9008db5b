"""Pure orphan classification: (holders, view, rules) -> [Tree].

No I/O happens here: everything about processes comes through a `ProcSource`
(the live `procfs.ProcessView`, or a synthetic table in tests). The rules and
their order are DESIGN.md's "Orphan rules on Linux"; each verdict carries the
rule that decided it and the pids that were its evidence, so `explain` can
show why.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import re
import signal as signal_module
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import re2

from gpuguard.host.counters import COUNTERS
from gpuguard.orphans.process import (
    Holder,
    ProcInfo,
    ProcStatus,
    ProcUnreadable,
    Truncated,
    still_same,
    walk_members,
)


class Verdict(enum.StrEnum):
    """What a holder's chain (or a tree) is. Only ORPHAN is ever reaped."""

    NORMAL = "normal"
    ORPHAN = "orphan"
    PROTECTED = "protected"
    UNKNOWN = "unknown"


class Rule(enum.StrEnum):
    """DESIGN.md's orphan rules, by number: the rule that decided a verdict."""

    HOLDER = "1"  # the holder itself: visible, not a zombie
    CHAIN = "2"  # the parent chain (and a member's facts) readable and sane
    PROTECT = "3"  # protect patterns
    DETACH = "4"  # SIGHUP ignored, the keep marker
    MANAGED = "5"  # service manager cgroups, deeper PID namespaces
    ADOPTION = "6"  # adoption evidence, the launcher's fate
    SESSION = "7"  # no adoption: attached to or leading a live session


class Reason(enum.StrEnum):
    """Why a verdict was given; the rule that gives each is at its use."""

    NOT_VISIBLE = "not-visible"
    EXITING = "exiting"
    TOO_DEEP = "too-deep"
    CYCLE = "cycle"
    VANISHED = "vanished"
    INCONSISTENT = "inconsistent"
    UNREADABLE = "unreadable"
    PROTECT_PATTERN = "protect-pattern"
    IGNORES_SIGHUP = "ignores-sighup"
    KEEP_MARKER = "keep-marker"
    MANAGED = "managed"
    CONTAINER = "container"
    DAEMON = "daemon"
    #: Adopted by the live `gpuguard run` launcher that started it, which reaps the tree
    #: when it ends: attached to a live launcher, not orphaned.
    RUN_LAUNCHER = "run-launcher"
    #: Orphan reasons of rule 6: how the session leader (the launcher) went away.
    LAUNCHER_KILLED = "launcher-killed"  # died by a signal (an agent stopping its shell)
    LAUNCHER_EXITED = "launcher-exited"  # exited by itself (`exit`, a script finishing)
    #: Gone, and the listener that runs holds no record of how: it died before the
    #: listener started, or the record was evicted or dropped. Not reaped by default.
    LAUNCHER_UNRECORDED = "launcher-unrecorded"
    SESSION_ENDED = "session-ended"  # gone, and no process-event listener runs here
    PARENT_EXITED = "parent-exited"  # the leader lives; only a parent in between died
    #: The holder's session lives, but a process above it (that created it, or adopted
    #: it) lost its own launcher: alerted, reaped only where the policy names it.
    SESSION_ORPHANED = "session-orphaned"
    #: Rule 6's unknown: the evidence fits an adoption and a fork alike.
    ADOPTION_UNCERTAIN = "adoption-uncertain"
    ATTACHED = "attached"
    DETACHED = "detached"
    #: Tree reasons when the root's chain says orphan but a member must not be signalled.
    MEMBER_PROTECTED = "member-protected"
    MEMBER_UNKNOWN = "member-unknown"
    MEMBER_NORMAL = "member-normal"  # a GPU holder below the root that is not an orphan


NORMAL = Verdict.NORMAL
ORPHAN = Verdict.ORPHAN
PROTECTED = Verdict.PROTECTED
UNKNOWN = Verdict.UNKNOWN
VERDICTS = tuple(Verdict)

#: Tree verdict when its holders disagree: the safest one wins.
_SAFETY_ORDER = {PROTECTED: 0, NORMAL: 1, UNKNOWN: 2, ORPHAN: 3}
#: Orphan holders of one tree that disagree on the reason: the least reapable wins (a
#: setsid'd job's session-orphaned must not ride on its sibling's launcher-killed).
_REAP_ORDER = {Reason.SESSION_ORPHANED: 0, Reason.PARENT_EXITED: 1,
               Reason.LAUNCHER_EXITED: 2, Reason.LAUNCHER_UNRECORDED: 3,
               Reason.SESSION_ENDED: 4, Reason.LAUNCHER_KILLED: 5}

DEFAULT_PROTECT = (
    "jupyter",
    "ipykernel",
    "tmux",
    "screen",
    "code-server",  # also matches VS Code's ~/.vscode-server
    "cursor-server",
    "vscodium-server",
    "windsurf-server",
    "slurmstepd",
    "raylet",
    "containerd-shim",
)
#: Processes that adopt orphans (PID 1 aside): rule 6 trusts E1 under them as proof.
DEFAULT_ADOPTERS = ("systemd", "containerd-shim", "tini", "dumb-init", "docker-init")
DEFAULT_MAX_DEPTH = 64
#: Keep and run registrations (gpuguard/host/marks.py): what a process cannot erase.
DEFAULT_MARKS_DIR = "/run/gpuguard/marks"
KEEP_MARK = "keep"
RUN_MARK = "run"
COMM_LEN = 15  # the kernel truncates comm to 15 bytes


class ProcSource(Protocol):
    """What classify() may ask about processes. Implementations do the I/O."""

    def stat(self, pid: int) -> ProcInfo | None: ...
    def fresh_stat(self, pid: int) -> ProcInfo | None: ...
    def children(self, pid: int) -> tuple[int, ...] | None: ...
    def thread_states(self, pid: int) -> tuple[str, ...] | None: ...
    def cmdline(self, info: ProcInfo) -> str | None: ...
    def cgroup(self, info: ProcInfo) -> tuple[str, ...] | None: ...
    def status(self, info: ProcInfo) -> ProcStatus | None: ...
    def keep_marker(self, info: ProcInfo) -> bool | None: ...
    def run_launcher(self, info: ProcInfo) -> tuple[int, int] | None: ...
    def registered(self, kind: str, info: ProcInfo, directory: str) -> bool | None: ...
    def memo(self, info: ProcInfo, key: object, compute: Callable[[], Any]) -> Any: ...
    def daemon_io(self, info: ProcInfo) -> bool | None: ...
    def own_nspid_depth(self) -> int: ...
    def launcher_exit(self, pid: int, after_start_time: int) -> ExitEvent | None: ...
    def listening(self) -> bool: ...
    def recall_launcher(self, root: ProcInfo, reason: str, detail: str, *,
                        recorded: bool) -> tuple[str, str]: ...


class ProtectPatternError(ValueError):
    """A protect pattern the linear-time matcher (RE2) does not accept."""


def compile_protect(pattern: str) -> Any:
    """One protect pattern, case-insensitive, for RE2: matching time is linear in the text.

    Any user names their processes and chooses their arguments, so a backtracking
    engine (Python's `re`) would let one `aaaa...!` command line stall every scan on a
    pattern like `(a+)+$` (and `re` holds the GIL while it does). RE2 has no
    back-references or look-arounds: patterns that need them are config errors.
    Patterns are compiled one by one, so groups in one cannot change another.
    """
    options = re2.Options()
    options.case_sensitive = False
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        message = exc.args[0] if exc.args else str(exc)
        if isinstance(message, bytes):
            message = message.decode("utf-8", "replace")
        raise ProtectPatternError(str(message)) from None


@dataclass(frozen=True)
class Rules:
    """The `classify:` section of the config file."""

    protect: tuple[str, ...] = DEFAULT_PROTECT
    adopters: tuple[str, ...] = DEFAULT_ADOPTERS
    max_depth: int = DEFAULT_MAX_DEPTH
    marks_dir: str = DEFAULT_MARKS_DIR
    _protect: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_protect", tuple(compile_protect(p) for p in self.protect))

    def protects(self, text: str) -> bool:
        if len(text) > _CACHED_TEXT:  # a command line: cached per process (cmdline_protect)
            return any(_protect_search(pattern, text) for pattern in self._protect)
        return any(_protect_hit(pattern, text) for pattern in self._protect)

    def is_adopter(self, comm: str) -> bool:
        """A process named like a child subreaper or init (tini, systemd, ...): it adopts
        orphans (the remediator's killer is the `Reaper`; this is not it)."""
        return any(comm == name[:COMM_LEN] for name in self.adopters)


@dataclass(frozen=True)
class Evidence:
    """Which rule decided, what it saw, and the pids it looked at."""

    rule: Rule
    detail: str
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class HolderVerdict:
    holder: Holder
    verdict: Verdict
    reason: Reason
    evidence: Evidence
    chain: tuple[ProcInfo, ...]  # holder first, up to (not including) PID 1
    root: ProcInfo | None  # the orphan root, else the top of the chain


@dataclass(frozen=True)
class Tree:
    """GPU holders grouped under one root; the unit that alerts name and reaps kill."""

    root_pid: int
    root: ProcInfo | None
    holders: tuple[Holder, ...]
    members_seen: tuple[ProcInfo, ...]
    verdict: Verdict
    reason: Reason
    gpu_bytes: int
    evidence: Evidence
    holder_verdicts: tuple[HolderVerdict, ...] = ()
    #: Every process a reap of this tree would signal (root first, collected by identity);
    #: filled only for trees that were orphans before their members were judged.
    members: tuple[ProcInfo, ...] = ()

    @property
    def root_start_time(self) -> int | None:
        return self.root.start_time if self.root is not None else None


LAUNCHER_KILLED = Reason.LAUNCHER_KILLED
LAUNCHER_EXITED = Reason.LAUNCHER_EXITED
LAUNCHER_UNRECORDED = Reason.LAUNCHER_UNRECORDED
SESSION_ENDED = Reason.SESSION_ENDED
#: Rule 6's reasons for a gone launcher: the ones the launcher memory keeps.
_LAUNCHER_REASONS = frozenset({LAUNCHER_KILLED, LAUNCHER_EXITED, LAUNCHER_UNRECORDED,
                               SESSION_ENDED})
PARENT_EXITED = Reason.PARENT_EXITED
ADOPTION_UNCERTAIN = Reason.ADOPTION_UNCERTAIN
SESSION_ORPHANED = Reason.SESSION_ORPHANED


class ExitEvent(Protocol):
    """What the kernel reported about one process's exit (exporter/procevents.Exit)."""

    @property
    def signal(self) -> int | None: ...
    @property
    def status(self) -> int | None: ...
    @property
    def at(self) -> float: ...


def _signal_name(number: int) -> str:
    try:
        return signal_module.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _clock(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when))


MEMBER_PROTECTED = Reason.MEMBER_PROTECTED
MEMBER_UNKNOWN = Reason.MEMBER_UNKNOWN


def _unknown(holder: Holder, rule: Rule, reason: Reason, detail: str,
             chain: Sequence[ProcInfo] = (), pids: Iterable[int] = ()) -> HolderVerdict:
    return HolderVerdict(
        holder=holder,
        verdict=UNKNOWN,
        reason=reason,
        evidence=Evidence(rule=rule, detail=detail, pids=tuple(pids)),
        chain=tuple(chain),
        root=chain[0] if chain else None,
    )


def _walk(holder: Holder, info: ProcInfo, view: ProcSource,
          rules: Rules) -> tuple[list[ProcInfo], None] | tuple[None, HolderVerdict]:
    """Holder up to the child of PID 1, plus PID 1 itself; or an unknown verdict."""
    chain = [info]
    seen = {info.pid}
    current = info
    while current.ppid not in (0,) and current.pid != 1:
        if len(chain) > rules.max_depth:
            return None, _unknown(holder, Rule.CHAIN, Reason.TOO_DEEP,
                                  f"chain longer than max_depth={rules.max_depth}",
                                  chain, [p.pid for p in chain[-3:]])
        if current.ppid in seen:
            return None, _unknown(holder, Rule.CHAIN, Reason.CYCLE,
                                  f"pid {current.ppid} appears twice",
                                  chain, [current.pid, current.ppid])
        parent = view.stat(current.ppid)
        if parent is None:
            return None, _unknown(holder, Rule.CHAIN, Reason.VANISHED,
                                  f"parent {current.ppid} of {current.pid} vanished mid-walk",
                                  chain, [current.pid, current.ppid])
        if parent.start_time > current.start_time:
            return None, _unknown(holder, Rule.CHAIN, Reason.INCONSISTENT,
                                  f"parent {parent.pid} is newer than child {current.pid}",
                                  chain, [current.pid, parent.pid])
        seen.add(parent.pid)
        chain.append(parent)
        current = parent
    return chain, None


@dataclass(frozen=True)
class Adoption:
    """Rule 6's evidence that X (child of Y) was adopted, and whether it proves it.

    /proc cannot tell some adoptions from a parent that forked X itself: E2 always (an
    init or a reaper forks its own children into its session, `tini -- cmd`), and E1
    when Y leads its own session but is neither PID 1 nor a named adopter (Y may have
    called setsid() after forking X). A process that leads no session never called
    setsid(), so E1 under it is proof; PID 1 and the configured adopters are trusted
    not to call setsid() after forking. It matters only while X's session leader lives:
    once it is gone X's session ended under it, whoever forked it.
    """

    why: str
    certain: bool


def _leader_gone(x: ProcInfo, view: ProcSource) -> str | None:
    """How X's session leader is gone (gone, a zombie, or its pid names a process newer
    than X), or None while it lives."""
    leader = view.stat(x.sid)
    if leader is None:
        return "gone"
    if leader.is_zombie:
        # A main thread that called pthread_exit() shows Z while its process runs on.
        if leader.is_live(view.thread_states):
            return None
        return "a zombie"
    if leader.start_time > x.start_time:
        return f"replaced by a newer process ({leader.comm})"
    return None


def _adopted(x: ProcInfo, y: ProcInfo, view: ProcSource, rules: Rules) -> Adoption | None:
    """Why X (child of Y) must (or may) have been adopted, or None."""
    if x.sid not in (x.pid, y.sid, 0):
        why = f"E1: {x.pid} sid {x.sid} differs from parent {y.pid} sid {y.sid}"
        certain = y.pid == 1 or not y.is_session_leader or rules.is_adopter(y.comm)
        return Adoption(why, certain)
    if x.is_session_leader or x.sid == 0 or x.sid != y.sid:
        return None
    if y.pid == 1:
        return Adoption(f"E2: {x.pid} shares session {x.sid} with init and is not its leader",
                        False)
    if rules.is_adopter(y.comm):
        return Adoption(f"E2: {x.pid} shares session {x.sid} with reaper {y.pid} ({y.comm})",
                        False)
    if _namespace_init(y, view):
        return Adoption(f"E2: {x.pid} shares session {x.sid} with namespace init {y.pid}",
                        False)
    return None


def _namespace_init(y: ProcInfo, view: ProcSource) -> bool:
    """Y is PID 1 of a PID namespace below ours (a container's init)."""
    status = view.status(y)
    return status is not None and len(status.nspid) > 1 and status.nspid[-1] == 1


_MANAGED = re.compile(
    r"(?:^|/)(?!user@)[^/]+\.service(?:/|$)"  # a systemd service (not the user manager)
    r"|(?:^|/)(?:docker|libpod)-[^/]*"  # docker and podman scopes
    r"|(?:^|/)docker/"  # docker's cgroupfs driver
    r"|kubepods"
    r"|(?:^|/)slurm(?:/|_)|/job_\d+"
)


@functools.lru_cache(maxsize=16384)
def _matches(pattern: re.Pattern[str], text: str) -> bool:
    """Regex results cached by text: the same ancestors recur in every chain, every scan."""
    return pattern.search(text) is not None


#: Texts up to this long (comms, short command lines) are cached by text; at 4,096
#: entries the cache holds at most 1 MiB of them, whatever users run.
_CACHED_TEXT = 256


@functools.lru_cache(maxsize=4096)
def _protect_hit(pattern: Any, text: str) -> bool:
    """One protect pattern on one comm or short command line, cached by text."""
    return _protect_search(pattern, text)


def _protect_search(pattern: Any, text: str) -> bool:
    """One protect pattern on one text (linear time: RE2), its time counted."""
    with COUNTERS.track("protect_match"):
        return pattern.search(text) is not None


def cmdline_protect(info: ProcInfo, view: ProcSource, rules: Rules) -> bool | None:
    """Rule 3 on the command line: True when a protect pattern matches it; None when it
    cannot be read, or was cut at the read cap and nothing matched in what was read (the
    rest may hold the match). Cached per process identity, never by the text."""
    cmd = view.cmdline(info)
    if cmd is None:
        return None
    hit = bool(cmd) and view.memo(info, ("protect-cmdline", rules.protect),
                                  lambda: rules.protects(cmd))
    if hit:
        return True
    return None if isinstance(cmd, Truncated) else False


def managed_cgroup(paths: Iterable[str]) -> str | None:
    for path in paths:
        if _matches(_MANAGED, path):
            return path
    return None


@dataclass(frozen=True)
class MemberJudgement:
    """Why one process of an orphan tree must not be signalled."""

    verdict: Verdict  # PROTECTED or UNKNOWN (or a GPU holder's own verdict)
    reason: Reason  # MEMBER_PROTECTED, MEMBER_UNKNOWN, or member-<verdict>
    evidence: Evidence


def judge_member(member: ProcInfo, view: ProcSource, rules: Rules) -> MemberJudgement | None:
    """Rules 3 and 4 for one process a reap would signal; None when it may be signalled.

    The chain's rules look at the path from a holder up to the root; a reap signals
    the root's whole subtree, so every process in it (siblings, helpers, children
    born during the freeze) must pass the same protections. A fact that cannot be
    read for a live process makes it `unknown`: never signalled on a guess.
    """
    who = f"member {member.pid} ({member.comm})"

    def protected(rule: Rule, why: str) -> MemberJudgement:
        return MemberJudgement(PROTECTED, MEMBER_PROTECTED,
                               Evidence(rule, f"{who} {why}: a reap would signal it",
                                        (member.pid,)))

    if rules.protects(member.comm):
        return protected(Rule.PROTECT, "matches protect by comm")
    cmd = cmdline_protect(member, view, rules)
    status = view.status(member)
    keep = keep_mark(member, view, rules)
    # What is positively read protects, whatever else could not be read.
    if cmd:
        return protected(Rule.PROTECT, "matches protect by command line")
    if status is not None and status.sighup_ignored:
        return protected(Rule.DETACH, "ignores SIGHUP (nohup)")
    if keep:
        return protected(Rule.DETACH, "is marked to keep (GPUGUARD_KEEP=1 or `gpuguard keep`)")
    if cmd is None or status is None or keep is None:
        if not still_same(view.fresh_stat(member.pid), member):
            return None  # exited while being judged: nothing left to signal
        missing = [name for name, value in (("cmdline", cmd), ("status", status),
                                            ("environ", keep)) if value is None]
        return MemberJudgement(UNKNOWN, MEMBER_UNKNOWN,
                               Evidence(Rule.CHAIN, f"{who}: cannot read /proc/{member.pid}/"
                                        f"{{{','.join(missing)}}}"
                                        f"{_CUT if cmd is None else ''}"
                                        f"{_ERASED if keep is None else ''}", (member.pid,)))
    return None


_CUT = (" (cmdline: unreadable, or longer than the read cap with no protect pattern "
        "matching what was read)")
_ERASED = (" (environ: unreadable, or no KEY=VALUE entry left: a process that overwrote its "
           "environment, as setproctitle does, may have held GPUGUARD_KEEP=1; `gpuguard "
           "keep PID` marks it where it cannot be erased)")


def keep_mark(info: ProcInfo, view: ProcSource, rules: Rules) -> bool | None:
    """Rule 4's keep marker: GPUGUARD_KEEP=1 in the environment or a keep registration
    (`gpuguard keep PID`); None when neither says yes and one cannot be read."""
    env = view.keep_marker(info)
    registered = view.registered(KEEP_MARK, info, rules.marks_dir)
    if env or registered:
        return True
    if env is None or registered is None:
        return None
    return False


def run_launcher_of(x: ProcInfo, parent: ProcInfo, view: ProcSource, rules: Rules) -> bool:
    """`parent` is the live `gpuguard run` launcher X was adopted by: X's GPUGUARD_RUN
    names it (pid and start time), or it registered itself (a subreaper adopts only
    its own descendants). Never an adopter (init, a named adopter such as `systemd
    --user`, a namespace's init): naming one would turn every process it adopted into
    "attached" (GPUGUARD_KEEP=1 is the honest way to keep a tree)."""
    if (parent.pid == 1 or not parent.is_live(view.thread_states)
            or rules.is_adopter(parent.comm)
            or _namespace_init(parent, view)):
        return False
    return (view.run_launcher(x) == (parent.pid, parent.start_time)
            or view.registered(RUN_MARK, parent, rules.marks_dir) is True)


def _judge_members(tree: Tree, view: ProcSource, rules: Rules,
                   by_pid: dict[int, list[HolderVerdict]]) -> Tree:
    """An orphan tree stays an orphan only if every process a reap would signal may be."""
    assert tree.root is not None
    # Children may come from this scan's stat reads; the parent is re-read after its
    # children file, which is what catches a reused pid.
    members = walk_members(tree.root, view.children, view.stat, view.fresh_stat, view.thread_states)
    found: MemberJudgement | None = None
    for member in members:
        for hv in by_pid.get(member.pid, ()):
            if hv.verdict != ORPHAN or hv.root is None or hv.root.identity != tree.root.identity:
                # An orphan of another root below this one cannot be: call it unknown.
                verdict = UNKNOWN if hv.verdict == ORPHAN else hv.verdict
                found = MemberJudgement(
                    verdict, Reason(f"member-{verdict}"),
                    Evidence(hv.evidence.rule, f"GPU holder {member.pid} ({member.comm}) below "
                             f"root {tree.root.pid} is {hv.verdict} ({hv.reason}: "
                             f"{hv.evidence.detail})", (member.pid, *hv.evidence.pids)))
                break
        if found is None:
            found = judge_member(member, view, rules)
        if found is not None:
            break
    if found is None:
        return dataclasses.replace(tree, members=members)
    return dataclasses.replace(tree, verdict=found.verdict, reason=found.reason,
                               evidence=found.evidence, members=members)


def classify_holder(holder: Holder, view: ProcSource, rules: Rules) -> HolderVerdict:
    """Apply DESIGN.md's rules 1-7, in order, to one GPU holder."""
    try:
        return _classify_holder(holder, view, rules)
    except ProcUnreadable as exc:
        return _unknown(holder, Rule.CHAIN, Reason.UNREADABLE, str(exc), (), [holder.pid])


def _classify_holder(holder: Holder, view: ProcSource, rules: Rules) -> HolderVerdict:
    # Rule 1: the holder itself.
    info = view.stat(holder.pid)
    if info is None:
        return _unknown(holder, Rule.HOLDER, Reason.NOT_VISIBLE,
                        f"pid {holder.pid} is not in /proc", (), [holder.pid])
    if not info.is_live(view.thread_states):
        return _unknown(holder, Rule.HOLDER, Reason.EXITING, f"pid {holder.pid} is a zombie",
                        (info,), [info.pid])

    # Rule 2: the chain.
    full, failed = _walk(holder, info, view, rules)
    if failed is not None:
        return failed
    assert full is not None
    init = full[-1] if full[-1].pid == 1 and len(full) > 1 else None
    chain = tuple(full[:-1]) if init is not None else tuple(full)

    # Rule 6 first, silently: rules 3-5 need the root candidate it finds. Only members of
    # the holder's own session count: a session is created on purpose (setsid), so what
    # happened to the processes above it is not the holder's launcher going away.
    leader_at = next((i for i, m in enumerate(chain) if m.pid == info.sid), None)
    adopted: ProcInfo | None = None
    adoption: Adoption | None = None
    for i in range(len(chain) - 1, -1, -1):
        x = chain[i]
        y = chain[i + 1] if i + 1 < len(chain) else init
        if y is None or x.sid != info.sid:
            continue
        adoption = _adopted(x, y, view, rules)
        if adoption is not None:
            adopted = x
            break
    # Nothing in the holder's session: a process above it whose own launcher is gone
    # (torchrun's workers lead sessions of their own; so do an agent's shells) roots a
    # tree of reason session-orphaned, which people see and the default policy leaves.
    above: str | None = None  # how the session leader of the member above is gone
    for i in range(len(chain) - 1, -1, -1) if adopted is None else ():
        x = chain[i]
        y = chain[i + 1] if i + 1 < len(chain) else init
        if y is None or x.sid == info.sid:
            continue
        adoption = _adopted(x, y, view, rules)
        above = _leader_gone(x, view) if adoption is not None else None
        if above is not None:
            adopted = x
            break
    candidate = adopted if adopted is not None else chain[-1]
    upto = chain[: chain.index(candidate) + 1]

    def verdict(v: Verdict, reason: Reason, rule: Rule, detail: str,
                pids: Iterable[int]) -> HolderVerdict:
        root = candidate
        return HolderVerdict(holder, v, reason, Evidence(rule, detail, tuple(pids)), chain, root)

    # Rule 3: protect patterns, holder up to the root candidate.
    for member in upto:
        if rules.protects(member.comm):
            return verdict(PROTECTED, Reason.PROTECT_PATTERN, Rule.PROTECT,
                           f"{member.pid} comm {member.comm!r} matches protect", [member.pid])
    for member in upto:
        if cmdline_protect(member, view, rules):
            return verdict(PROTECTED, Reason.PROTECT_PATTERN, Rule.PROTECT,
                           f"{member.pid} command line matches protect", [member.pid])

    # Rule 4: deliberate detachment by ignoring SIGHUP.
    for member in dict.fromkeys((info, candidate)):
        status = view.status(member)
        if status is not None and status.sighup_ignored:
            return verdict(PROTECTED, Reason.IGNORES_SIGHUP, Rule.DETACH,
                           f"{member.pid} ignores SIGHUP (nohup)", [member.pid])

    # Rule 5: managed by a service manager or in a container. Without adoption only the
    # holder's own session counts: sshd's listener sits in ssh.service, its logins do not.
    in_scope = upto
    if adopted is None:
        in_scope = tuple(m for m in itertools.takewhile(lambda m: m.sid == info.sid, chain))
    for member in in_scope:
        path = managed_cgroup(view.cgroup(member) or ())
        if path is not None:
            return verdict(NORMAL, Reason.MANAGED, Rule.MANAGED,
                           f"{member.pid} in cgroup {path}", [member.pid])
    holder_status = view.status(info)
    if holder_status is not None and len(holder_status.nspid) > view.own_nspid_depth():
        return verdict(NORMAL, Reason.CONTAINER, Rule.MANAGED,
                       f"{info.pid} is in a deeper PID namespace", [info.pid])

    # Rule 6: adoption.
    if adopted is not None:
        parent = chain[chain.index(adopted) + 1] if adopted is not chain[-1] else init
        ppid = parent.pid if parent is not None else adopted.ppid
        if adopted.pgid == adopted.sid and view.daemon_io(adopted):
            return verdict(NORMAL, Reason.DAEMON, Rule.ADOPTION,
                           f"{adopted.pid} detached on purpose (cwd /, stdin /dev/null)",
                           [adopted.pid])
        # Read environ only for what would otherwise be an orphan (one read, two markers).
        # Adopted by the `gpuguard run` that started it, alive: the launcher's identity
        # (pid and start time) equals X's parent's, so it names this very process, not a
        # later one at its pid.
        if parent is not None and run_launcher_of(adopted, parent, view, rules):
            return verdict(NORMAL, Reason.RUN_LAUNCHER, Rule.ADOPTION,
                           f"{adopted.pid} was adopted by its `gpuguard run` launcher "
                           f"{parent.pid}, which lives and reaps the tree when it ends",
                           [adopted.pid, parent.pid])
        state = _leader_gone(adopted, view)
        # Rule 4's keep marker. One that cannot be read (or was erased) is not an absent
        # one: the tree's member judgement (the root is a member) makes it unknown.
        if keep_mark(adopted, view, rules):
            return verdict(PROTECTED, Reason.KEEP_MARKER, Rule.DETACH,
                           f"{adopted.pid} is marked to keep (GPUGUARD_KEEP=1 in its "
                           "environment or `gpuguard keep`)", [adopted.pid])
        assert adoption is not None
        adopted_why = adoption.why
        if above is not None:
            return verdict(ORPHAN, Reason.SESSION_ORPHANED, Rule.ADOPTION,
                           f"{adopted_why}; its session leader {adopted.sid} is {above}; the "
                           f"holder's own session {info.sid} below it was created on purpose "
                           "and its leader lives", [adopted.pid, ppid, adopted.sid, info.sid])
        if state is not None:
            pids = [adopted.pid, ppid, adopted.sid]
            # How it died, when the kernel's process events saw it (after X started).
            died = view.launcher_exit(adopted.sid, adopted.start_time)
            if died is not None and died.signal:
                reason = Reason.LAUNCHER_KILLED
                detail = (f"{adopted_why}; session leader {adopted.sid} was killed by "
                          f"{_signal_name(died.signal)} at {_clock(died.at)}")
            elif died is not None:
                reason = Reason.LAUNCHER_EXITED
                detail = (f"{adopted_why}; session leader {adopted.sid} exited with "
                          f"status {died.status} at {_clock(died.at)}")
            elif view.listening():
                reason = Reason.LAUNCHER_UNRECORDED
                detail = (f"{adopted_why}; session leader {adopted.sid} is {state} (no exit "
                          "event seen: it died before the listener started, or its record "
                          "was evicted or dropped)")
            else:
                reason = Reason.SESSION_ENDED
                detail = (f"{adopted_why}; session leader {adopted.sid} is {state} (no exit "
                          "event seen: no process-event listener)")
            # The first reason established for this root stands: an exit record that
            # ages out, or a listener gone after a restart, never makes it more reapable.
            # Only a record read late replaces a first answer that had none.
            first, first_detail = view.recall_launcher(adopted, reason.value, detail,
                                                       recorded=died is not None)
            if first in _LAUNCHER_REASONS:
                reason, detail = Reason(first), first_detail
            return verdict(ORPHAN, reason, Rule.ADOPTION, detail, pids)
        if not adoption.certain:
            # With the session gone X is orphaned whoever forked it; with it alive, only
            # an adoption would make X an orphan, and /proc cannot show which it was.
            return verdict(UNKNOWN, Reason.ADOPTION_UNCERTAIN, Rule.ADOPTION,
                           f"{adopted_why}; session leader {adopted.sid} is alive and /proc "
                           f"cannot tell whether {ppid} forked {adopted.pid} or adopted it",
                           [adopted.pid, ppid, adopted.sid])
        return verdict(ORPHAN, Reason.PARENT_EXITED, Rule.ADOPTION,
                       f"{adopted_why}; session leader {adopted.sid} is alive",
                       [adopted.pid, ppid, adopted.sid])

    # Rule 7: "detached" only when the holder lives in the session its chain's top created.
    if leader_at is not None and leader_at < len(chain) - 1:
        leader = chain[leader_at]
        return verdict(NORMAL, Reason.ATTACHED, Rule.SESSION,
                       f"no adopted member from {info.pid} up to its session leader "
                       f"{leader.pid}, which is alive", [leader.pid])
    top = chain[-1]
    if top.is_session_leader and info.sid == top.sid:
        return verdict(NORMAL, Reason.DETACHED, Rule.SESSION,
                       f"top of chain {top.pid} leads its own session", [top.pid])
    return verdict(NORMAL, Reason.ATTACHED, Rule.SESSION,
                   f"no adopted member from {info.pid} up to {top.pid}", [top.pid])


def classify(holders: Sequence[Holder], view: ProcSource, rules: Rules) -> list[Tree]:
    """Classify every holder and group them into trees by root identity."""
    groups: dict[tuple[object, ...], list[HolderVerdict]] = {}
    for holder in holders:
        hv = classify_holder(holder, view, rules)
        key = hv.root.identity if hv.root is not None else ("pid", hv.holder.pid)
        if hv.verdict == UNKNOWN:
            key = ("unknown", hv.holder.pid)
        groups.setdefault(key, []).append(hv)
    trees = []
    for hvs in groups.values():
        decisive = min(hvs, key=lambda h: (_SAFETY_ORDER[h.verdict],
                                           _REAP_ORDER.get(h.reason, 0)))
        members: dict[int, ProcInfo] = {}
        for hv in hvs:
            # The tree is its root and below: never the adopter or anything above the root.
            upto_root = hv.chain
            if hv.root is not None and hv.root in hv.chain:
                upto_root = hv.chain[: hv.chain.index(hv.root) + 1]
            for member in upto_root:
                members.setdefault(member.pid, member)
        seen_holders: dict[tuple[int, str], Holder] = {}
        for hv in hvs:
            seen_holders.setdefault((hv.holder.pid, hv.holder.gpu_uuid), hv.holder)
        root = decisive.root
        trees.append(
            Tree(
                root_pid=root.pid if root is not None else decisive.holder.pid,
                root=root,
                holders=tuple(seen_holders.values()),
                members_seen=tuple(members.values()),
                verdict=decisive.verdict,
                reason=decisive.reason,
                gpu_bytes=sum(h.used_bytes or 0 for h in seen_holders.values()),
                evidence=decisive.evidence,
                holder_verdicts=tuple(hvs),
            )
        )
    by_pid: dict[int, list[HolderVerdict]] = {}
    for hvs in groups.values():
        for hv in hvs:
            by_pid.setdefault(hv.holder.pid, []).append(hv)
    trees = [_judge_members(t, view, rules, by_pid) if t.verdict == ORPHAN else t
             for t in trees]
    trees.sort(key=lambda t: (t.verdict != ORPHAN, t.root_pid))
    return trees
