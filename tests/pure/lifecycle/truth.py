"""The truth about a GPU holder, computed from the model's history, never from /proc.

For each holder: its launch chain (who forked it, who forked that, ... up to the
process whose setsid() created its session); whether every process in it is
still alive; if not, the orphan root (the topmost live member of the chain that
is still in the holder's ancestry and whose forker is dead: the process that
lost its parent), whether the session's creator died and how; and which of
the deliberate-detachment rules (docs/design.md, Orphan rules) apply on the way
from the holder to that root (protect name, SIGHUP ignored, managed cgroup, PID
namespace, fork-setsid-fork daemon, keep marker).

"/proc shows adoption" means rule 6's evidence (E1, E2; docs/design.md, Orphan rules)
is there for the pair; the truth compares it with what happened (forked or adopted).
Evidence is *certain* where no fork can produce it (E1 under PID 1, under a named
reaper, or under a parent that leads no session: a process never leaves a session it
leads) and *ambiguous* otherwise (E2; E1 under an unnamed session leader, which may
have called setsid() after forking). Ambiguity matters only while the member's session
creator lives: once it is gone the member's session ended under it, forked or adopted.
Where /proc cannot tell, the truth tags the holder and the properties ask for the safe
side (never `orphan`) there:

- `adoption-invisible`: the root was adopted by a parent in its own session that
  is neither PID 1, a namespace init nor a process named like a reaper (an
  unnamed child subreaper, or one started inside the session). A child that
  parent forked itself reads the same in /proc.
- `setsid-after-fork`: a process forked a member of the chain and only then
  called setsid(), and the member's session creator lives. /proc shows a
  non-leader in another session than its parent under an unnamed session leader.
- `child-of-reaper`: PID 1, a namespace init or a process named like a reaper
  (tini, systemd, containerd-shim) forked a member of the chain in its own
  session, whose creator lives. /proc shows what E2 shows for an adoption.
- `adoption-ambiguous`: the member really was adopted, but the evidence is the
  ambiguous kind and its session creator lives: the table is the one a fork makes.
- nothing above the orphan root (or above the session's creator while every launcher
  lives) is tagged: rule 6 looks only at members of the holder's own session, which
  is what the launch chain is. (`adopted-above-chain` was a tag here while rule 6
  scanned the whole chain and rooted trees at adopted processes above the session.)
- launcher death before the root was born: the listener's record of the
  creator's exit is older than the root, and gpuguard.host.events.listener answers only
  exits at or after the root's start (a reused pid's older exit looks the same),
  so the expected reason is `session-ended` even when every exit was seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuguard.orphans.vocabulary import Reason, Verdict
from tests.pure.lifecycle.model import IGNORE, Proc

ADOPTION_INVISIBLE = "adoption-invisible"
SETSID_AFTER_FORK = "setsid-after-fork"
CHILD_OF_REAPER = "child-of-reaper"
ADOPTION_AMBIGUOUS = "adoption-ambiguous"
CERTAIN, AMBIGUOUS = "certain", "ambiguous"


@dataclass(frozen=True)
class Rule:
    """An orphan rule (docs/design.md, Orphan rules) that applies: the verdict it gives
    and the member it is about."""

    verdict: str
    reason: str
    member: Proc


@dataclass(frozen=True)
class Tag:
    """Where /proc cannot tell (or the orphan rules and the truth disagree), and about whom."""

    kind: str
    member: Proc  # x of the (x, parent) pair the tag is about
    where: str  # "inside" (below the root / creator), "root", "above"
    evident: bool = True  # /proc shows adoption evidence at `member` (E1 or E2)

    def __str__(self) -> str:
        return f"{self.kind} at {self.member.label()} ({self.where})"


@dataclass
class HolderTruth:
    holder: Proc
    chain: list[Proc]  # holder first, the session's creator last
    ancestry: list[Proc]  # holder first, PID 1 last (current parents)
    launchers_alive: bool
    root: Proc | None = None  # the orphan root (None while every launcher lives)
    #: The topmost process above the root (or the session's creator) whose own session's
    #: creator died (torchrun over its workers' sessions), else None. It decides only
    #: while every launcher lives (`session-orphaned`), or where /proc cannot show the
    #: launch chain's own break.
    outer_root: Proc | None = None
    lost_parent: Proc | None = None  # the root's forker, dead
    rules: list[Rule] = field(default_factory=list)  # in the orphan rules' order of precedence
    tags: list[Tag] = field(default_factory=list)

    @property
    def creator(self) -> Proc:
        return self.chain[-1]

    @property
    def candidate(self) -> Proc:
        """Rule 3's root candidate: the orphan root, else the top of the ancestry."""
        if self.root is not None:
            return self.root
        if self.outer_root is not None:
            return self.outer_root
        return self.ancestry[-2] if len(self.ancestry) > 1 else self.ancestry[0]

    @property
    def way(self) -> list[Proc]:
        """The holder up to the root candidate."""
        return self.ancestry[: self.ancestry.index(self.candidate) + 1]

    def kinds(self) -> set[str]:
        return {t.kind for t in self.tags}

    @property
    def decidable(self) -> bool:
        return not self.tags

    def expected_reason(self, listener: str) -> str:
        """The orphan reason: how the session's creator went away, as far as a listener
        that saw every exit ("every") or none ("none") can tell."""
        assert self.root is not None
        creator = self.creator
        if creator.alive:
            return Reason.PARENT_EXITED
        death = creator.death
        assert death is not None
        if listener == "none":
            return Reason.SESSION_ENDED
        if death.at < self.root.start_time:
            return Reason.LAUNCHER_UNRECORDED  # the listener answers only for after X started
        return Reason.LAUNCHER_KILLED if death.signal else Reason.LAUNCHER_EXITED

    def expected(self, listener: str) -> tuple[str, str] | None:
        """(verdict, reason) for a decidable orphan (or session-orphaned holder); None when
        every launcher lives and nothing above the session lost its own."""
        if self.root is None and self.outer_root is None:
            return None
        if self.rules:
            return self.rules[0].verdict, self.rules[0].reason
        if self.root is None:
            return Verdict.ORPHAN, Reason.SESSION_ORPHANED
        return Verdict.ORPHAN, self.expected_reason(listener)

    def describe(self) -> str:
        lines = [f"holder {self.holder.label()}: launch chain "
                 + " <- ".join(p.label() + ("" if p.alive else f"[{p.state}]")
                               for p in self.chain),
                 "  ancestry " + " <- ".join(p.label() for p in self.ancestry)]
        if self.root is None:
            lines.append("  every launcher is alive")
        else:
            assert self.lost_parent is not None
            death = self.creator.death
            lines.append(f"  orphan root {self.root.label()} (lost its parent "
                         f"{self.lost_parent.label()}); session creator "
                         f"{self.creator.label()} "
                         + ("alive" if death is None else f"{death} at t={death.at}"))
        for r in self.rules:
            lines.append(f"  rule applies: {r.verdict}/{r.reason} ({r.member.label()})")
        for t in self.tags:
            lines.append(f"  {t}")
        return "\n".join(lines)


def _adoption_evidence(x: Proc, y: Proc) -> str | None:
    """What /proc shows about x (child of y), per rule 6 (docs/design.md, Orphan rules):
    CERTAIN or AMBIGUOUS evidence of adoption, or None. E1: a non-leader in another
    session than its parent (session 0 never counts); E2: a non-leader sharing its
    session with PID 1, a namespace init or a process named like a reaper."""
    if x.is_session_leader or x.sid == 0:
        return None
    if x.sid != y.sid:
        return CERTAIN if (y.parent is None or not y.is_session_leader
                           or y.program.reaper) else AMBIGUOUS
    if y.parent is None or y.is_ns_init or y.program.reaper:
        return AMBIGUOUS
    return None


def holder_truth(holder: Proc) -> HolderTruth:
    chain = holder.launch_chain()
    ancestry = holder.ancestry()
    truth = HolderTruth(holder=holder, chain=chain, ancestry=ancestry,
                        launchers_alive=all(p.alive for p in chain))
    in_ancestry = {p.serial for p in ancestry}
    if not truth.launchers_alive:
        for i in range(len(chain) - 2, -1, -1):
            member, forker = chain[i], chain[i + 1]
            if (member.alive and member.session is holder.session
                    and member.serial in in_ancestry
                    and (not forker.alive or forker.session is not holder.session)):
                truth.root, truth.lost_parent = member, forker
                break
        assert truth.root is not None, "the holder is alive, so some member lost its parent"
    top = ancestry.index(truth.root) if truth.root is not None else ancestry.index(chain[-1])
    for x in reversed(ancestry[top + 1:-1]):  # top-down, PID 1 excluded
        if (x.sid != 0 and x.session is not holder.session and x.session is not None
                and not x.session.alive):
            truth.outer_root = x
            break

    # What /proc shows of each (x, parent) pair, against what really happened.
    for i, x in enumerate(ancestry[:-1]):
        y = ancestry[i + 1]
        evidence = _adoption_evidence(x, y)
        born = x.born_of is y
        assert not (born and evidence == CERTAIN), (
            f"certain evidence of adoption for {x.label()}, which {y.label()} forked")
        if i < top:
            where = "inside"
        elif i == top and truth.root is not None:
            where = "root"
        else:
            where = "above"
        session_lives = x.session is not None and x.session.alive
        if where == "above":
            continue  # rule 6 looks only at the holder's session, which ends at the root
        if evidence == AMBIGUOUS and session_lives:  # a fork reads the same
            kind = (ADOPTION_AMBIGUOUS if not born
                    else SETSID_AFTER_FORK if x.sid != y.sid else CHILD_OF_REAPER)
            truth.tags.append(Tag(kind, x, where))
        elif not born and evidence is None and where == "root":  # adopted, /proc cannot tell
            truth.tags.append(Tag(ADOPTION_INVISIBLE, x, where, evident=False))
    if truth.root is not None and not any(t.where == "root" for t in truth.tags):
        # The root's adoption shows, and rule 6 scans top-down: what looks adopted below
        # it cannot change the answer.
        truth.tags = [t for t in truth.tags if t.where != "inside"]

    truth.rules = _rules(truth)
    return truth


def _rules(truth: HolderTruth) -> list[Rule]:
    """The orphan rules 3-6 that apply, in the order classify() must honour them. For a
    holder whose launchers all live only rules 3 and 4 (SIGHUP) decide between
    protected and normal, so only those are listed."""
    holder, candidate, way = truth.holder, truth.candidate, truth.way
    out: list[Rule] = []
    for m in way:
        if m.program.protected:
            out.append(Rule(Verdict.PROTECTED, "protect-pattern", m))
            break
    for m in dict.fromkeys((holder, candidate)):
        if m.sighup == IGNORE:
            out.append(Rule(Verdict.PROTECTED, "ignores-sighup", m))
            break
    if truth.root is None and truth.outer_root is None:
        return out
    for m in way:
        if m.cgroup.managed:
            out.append(Rule(Verdict.NORMAL, "managed", m))
            break
    if holder.ns.level > 0:
        out.append(Rule(Verdict.NORMAL, "container", holder))
    if candidate.pgid == candidate.sid and candidate.daemon_io:
        out.append(Rule(Verdict.NORMAL, "daemon", candidate))
    if candidate.keep:
        out.append(Rule(Verdict.PROTECTED, "keep-marker", candidate))
    return out


def member_protection(p: Proc) -> str | None:
    """Why a reap must not signal `p` (docs/reap-safety.md), from the model."""
    if p.program.protected:
        return "protect-pattern"
    if p.sighup == IGNORE:
        return "ignores-sighup"
    if p.keep:
        return "keep-marker"
    return None
