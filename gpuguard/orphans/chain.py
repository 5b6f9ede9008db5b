"""A GPU holder's parent chain (rule 2's walk up to PID 1) and the adoption evidence on it
(rule 6's E1 and E2), which decides where the holder's tree is rooted."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuguard.orphans.process import Holder, ProcInfo
from gpuguard.orphans.protections import ProcSource
from gpuguard.orphans.rules_config import RUN_MARK, Rules
from gpuguard.orphans.verdicts import Evidence, HolderVerdict, unknown
from gpuguard.orphans.vocabulary import Reason, Rule, Verdict


def walk(holder: Holder, info: ProcInfo, view: ProcSource,
         rules: Rules) -> tuple[list[ProcInfo], None] | tuple[None, HolderVerdict]:
    """Holder up to the child of PID 1, plus PID 1 itself; or an unknown verdict."""
    chain = [info]
    seen = {info.pid}
    current = info
    while current.ppid not in (0,) and current.pid != 1:
        if len(chain) > rules.max_depth:
            return None, unknown(holder, Rule.CHAIN, Reason.TOO_DEEP,
                                 f"chain longer than max_depth={rules.max_depth}",
                                 chain, [p.pid for p in chain[-3:]])
        if current.ppid in seen:
            return None, unknown(holder, Rule.CHAIN, Reason.CYCLE,
                                 f"pid {current.ppid} appears twice",
                                 chain, [current.pid, current.ppid])
        parent = view.stat(current.ppid)
        if parent is None:
            return None, unknown(holder, Rule.CHAIN, Reason.VANISHED,
                                 f"parent {current.ppid} of {current.pid} vanished mid-walk",
                                 chain, [current.pid, current.ppid])
        if parent.start_time > current.start_time:
            return None, unknown(holder, Rule.CHAIN, Reason.INCONSISTENT,
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


def leader_gone(x: ProcInfo, view: ProcSource) -> str | None:
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


def adoption_of(x: ProcInfo, y: ProcInfo, view: ProcSource, rules: Rules) -> Adoption | None:
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
    if namespace_init(y, view):
        return Adoption(f"E2: {x.pid} shares session {x.sid} with namespace init {y.pid}",
                        False)
    return None


def namespace_init(y: ProcInfo, view: ProcSource) -> bool:
    """Y is PID 1 of a PID namespace below ours (a container's init)."""
    status = view.status(y)
    return status is not None and len(status.nspid) > 1 and status.nspid[-1] == 1


@dataclass(frozen=True)
class Adopted:
    """The chain member rule 6 roots the tree at, and why."""

    member: ProcInfo
    adoption: Adoption
    #: Outside the holder's session only: how the member's own session leader is gone.
    above: str | None = None


def find_adopted(chain: tuple[ProcInfo, ...], init: ProcInfo | None, sid: int,
                 view: ProcSource, rules: Rules) -> Adopted | None:
    """The topmost adopted member of the holder's session `sid`; else the topmost one above
    it whose own launcher is gone (torchrun's workers lead sessions of their own, so do an
    agent's shells), which roots a tree of reason session-orphaned.

    Only members of the holder's own session count first: a session is created on purpose
    (setsid), so what happened to the processes above it is not its launcher going away.
    """
    found = _scan(chain, init, sid, view, rules, own_session=True)
    if found is None:
        found = _scan(chain, init, sid, view, rules, own_session=False)
    return found


def _scan(chain: tuple[ProcInfo, ...], init: ProcInfo | None, sid: int, view: ProcSource,
          rules: Rules, *, own_session: bool) -> Adopted | None:
    """From the top down, the first member in (or outside) session `sid` that was adopted
    (outside it: and whose own session leader is gone)."""
    for i in range(len(chain) - 1, -1, -1):
        x = chain[i]
        y = chain[i + 1] if i + 1 < len(chain) else init
        if y is None or (x.sid == sid) != own_session:
            continue
        adoption = adoption_of(x, y, view, rules)
        if adoption is None:
            continue
        if own_session:
            return Adopted(x, adoption)
        above = leader_gone(x, view)
        if above is not None:
            return Adopted(x, adoption, above)
    return None


def run_launcher_of(x: ProcInfo, parent: ProcInfo, view: ProcSource, rules: Rules) -> bool:
    """`parent` is the live `gpuguard run` launcher X was adopted by: X's GPUGUARD_RUN
    names it (pid and start time), or it registered itself (a subreaper adopts only
    its own descendants). Never an adopter (init, a named adopter such as `systemd
    --user`, a namespace's init): naming one would turn every process it adopted into
    "attached" (GPUGUARD_KEEP=1 is the honest way to keep a tree)."""
    if (parent.pid == 1 or not parent.is_live(view.thread_states)
            or rules.is_adopter(parent.comm)
            or namespace_init(parent, view)):
        return False
    return (view.run_launcher(x) == (parent.pid, parent.start_time)
            or view.registered(RUN_MARK, parent, rules.marks_dir) is True)


@dataclass(frozen=True)
class Chain:
    """A live holder's chain as rules 3-7 judge it, rule 6's adoption search done."""

    holder: Holder
    info: ProcInfo  # the holder's process
    members: tuple[ProcInfo, ...]  # holder first, up to (not including) PID 1
    init: ProcInfo | None  # PID 1, when the walk reached it
    adopted: Adopted | None

    @property
    def candidate(self) -> ProcInfo:
        """The root candidate: the adopted member, else the top of the chain."""
        return self.adopted.member if self.adopted is not None else self.members[-1]

    @property
    def upto(self) -> tuple[ProcInfo, ...]:
        """The holder up to the root candidate."""
        return self.members[: self.members.index(self.candidate) + 1]

    @property
    def adopter(self) -> ProcInfo | None:
        """The adopted member's parent, as the walk read it (None: not read)."""
        assert self.adopted is not None
        x = self.adopted.member
        return self.members[self.members.index(x) + 1] if x is not self.members[-1] else self.init

    @property
    def adopter_pid(self) -> int:
        parent = self.adopter
        assert self.adopted is not None
        return parent.pid if parent is not None else self.adopted.member.ppid

    def verdict(self, verdict: Verdict, reason: Reason, rule: Rule, detail: str,
                pids: Iterable[int]) -> HolderVerdict:
        """A verdict for the holder, rooted at the root candidate."""
        return HolderVerdict(self.holder, verdict, reason, Evidence(rule, detail, tuple(pids)),
                             self.members, self.candidate)


def holder_chain(holder: Holder, view: ProcSource,
                 rules: Rules) -> tuple[tuple[ProcInfo, ...], bool]:
    """Rule 2's walk for `holder` alone (stat reads only, no judgement), as far as it could
    be read, and whether that is the whole chain: the remediator's chain watch, which
    classifies nothing between deliveries."""
    info = view.stat(holder.pid)
    if info is None:
        return (), False
    full, failed = walk(holder, info, view, rules)
    if full is not None:
        return tuple(full), True
    assert failed is not None
    return failed.chain, False


def chain_set(chains: Iterable[Sequence[ProcInfo]]) -> dict[int, int]:
    """The pids whose exit matters to these holders: each chain member (the holder and its
    ancestors) and its session leader, whose exit names a launcher-* reason (rule 6) and
    whose pid stays the session id once it is gone. What the exporter's listener keeps
    apart from its general ring (gpuguard/host/events/watched.py) and what an early rescan
    tests an exit against (a holder's or an ancestor's exit changes its tree); never PID
    0 or 1. Bounded by holders x (max_depth + 1) x 2. Each pid maps to the uid its record
    is charged to (_charged)."""
    return _charged(chains, sessions_only=False)


def session_set(chains: Iterable[Sequence[ProcInfo]]) -> dict[int, int]:
    """The session ids of these live chains' members, each with the uid charged for it:
    the only exits ever read as launcher evidence (rule 6 reads the exit of the adopted
    member's session leader, `launcher_exit(x.sid)`, and X is a chain member). What the
    remediator's chain watch keeps, from chains walked afresh: a dead ancestor's pid
    leaves the set once no live member's session bears it."""
    return _charged(chains, sessions_only=True)


def _charged(chains: Iterable[Sequence[ProcInfo]], *, sessions_only: bool) -> dict[int, int]:
    """Pid -> the uid of the holder (chain[0]) whose chain named it; the lowest uid where
    holders of several share it (their common ancestors). A pid lands on a user's account
    only through that user's own holders' chains, so no user can charge theirs to another
    (the watched store makes room from the uid that holds the most)."""
    owners: dict[int, int] = {}
    for chain in chains:
        if not chain:
            continue
        uid = chain[0].uid
        for member in chain:
            for pid in (member.sid,) if sessions_only else (member.pid, member.sid):
                if pid > 1 and owners.get(pid, uid) >= uid:
                    owners[pid] = uid
    return owners
