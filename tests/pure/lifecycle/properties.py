"""The properties of issue #18, checked against one moment of a model's history.

`check_moment(world, listener)` renders the moment, runs classify() on every live
GPU holder, computes each holder's truth from the history, and raises
`PropertyFailed` (with the truth, the answer and the whole history) when:

(a) a holder whose launchers all live is called `orphan`;
(b) a holder whose launcher chain broke, where nothing detached and /proc can
    tell, is not `orphan` with the root and reason the truth names;
(c) `protected` / `normal` is answered where no rule applies, or not answered
    (with the first applicable rule's reason) where one does;
(d) a verdict names a root outside the holder's ancestry, or an orphan root
    outside its launch chain;
(k) an orphan tree's members are not exactly its root and the root's live
    descendants (by identity), or a member a reap must not signal is in a tree
    still called orphan, or a member of an orphan tree fails judge_member.

Where the truth says /proc cannot tell (truth.py's tags), the answer must be the
safe side: never `orphan`, and `unknown` only as `adoption-uncertain`. What the safe
answers were is counted in `DEVIATIONS` (the nightly run prints them).
"""

from __future__ import annotations

from collections import Counter

from gpuguard.orphans.classify import classify
from gpuguard.orphans.members import judge_member
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.verdicts import HolderVerdict
from gpuguard.orphans.vocabulary import Reason, Verdict
from tests.pure.lifecycle.model import SIGKILL, ZOMBIE, World, apply
from tests.pure.lifecycle.truth import (
    HolderTruth,
    holder_truth,
    member_protection,
)
from tests.support.proctable import holder

RULES = Rules()
LISTENERS = ("every", "none")

#: Known deviations seen, by (tags, verdict, reason): what the report counts.
DEVIATIONS: Counter[tuple[str, str, str]] = Counter()
#: Moments checked and holders judged (for the report).
STATS: Counter[str] = Counter()


class PropertyFailed(AssertionError):
    pass


def _answer(hv: HolderVerdict) -> str:
    root = hv.root.pid if hv.root is not None else None
    return (f"classify() answered {hv.verdict}/{hv.reason} root={root} "
            f"(rule {hv.evidence.rule}: {hv.evidence.detail})")


def _fail(prop: str, what: str, world: World, listener: str, truth: HolderTruth | None = None,
          hv: HolderVerdict | None = None) -> None:
    parts = [f"property ({prop}) failed, listener={listener}: {what}"]
    if truth is not None:
        parts.append(truth.describe())
    if hv is not None:
        parts.append(_answer(hv))
    parts.append("history:\n" + world.dump())
    raise PropertyFailed("\n".join(parts))


def check_holder(world: World, listener: str, truth: HolderTruth, hv: HolderVerdict) -> None:
    ancestry_ids = {p.identity for p in truth.ancestry if p.parent is not None}

    def fail(prop: str, what: str) -> None:
        _fail(prop, what, world, listener, truth, hv)

    if hv.verdict == Verdict.UNKNOWN and (truth.decidable
                                          or hv.reason != Reason.ADOPTION_UNCERTAIN):
        fail("c", "unknown, though every /proc read of a faithful table succeeds and "
             "the truth can be read from it")
    # (d): the root is in the holder's ancestry (the top of it, or an adopted member).
    if hv.root is None or hv.root.identity not in ancestry_ids:
        fail("d", "the verdict's root is not in the holder's ancestry")

    if not truth.decidable:
        kinds = truth.kinds()
        if hv.verdict == Verdict.ORPHAN:
            # The safe side is due; session-orphaned (never reaped by default) is allowed
            # where a process above the holder's session really lost its launcher.
            outer = truth.outer_root
            if (hv.reason != Reason.SESSION_ORPHANED or outer is None
                    or hv.root.identity != outer.identity):
                fail("a" if truth.root is None else "b",
                     "orphan where /proc cannot tell: the safe side was due")
        DEVIATIONS[(",".join(sorted(kinds)) + ("" if truth.root is None else "/orphan"),
                    hv.verdict, hv.reason if hv.verdict == Verdict.ORPHAN else "-")] += 1
        return

    if truth.root is None and truth.outer_root is None:
        # (a) never orphan while every launcher lives; (c) protected exactly by rules 3-4.
        if hv.verdict == Verdict.ORPHAN:
            fail("a", "orphan while every launcher is alive")
        if truth.rules:
            want = (truth.rules[0].verdict, truth.rules[0].reason)
            if (hv.verdict, hv.reason) != want:
                fail("c", f"expected {want[0]}/{want[1]}")
        elif hv.verdict != Verdict.NORMAL:
            fail("c", "expected normal: no rule protects it")
        STATS[f"checked live {hv.verdict}"] += 1
        return

    # (b) / (c): the launcher chain broke and /proc shows where.
    expected = truth.expected(listener)
    assert expected is not None
    if (hv.verdict, hv.reason) != expected:
        fail("b" if expected[0] == Verdict.ORPHAN else "c", f"expected {expected[0]}/{expected[1]}")
    want_root = truth.root if truth.root is not None else truth.outer_root
    assert want_root is not None
    if hv.root.identity != want_root.identity:
        fail("b", f"expected the root {want_root.label()}")
    STATS[f"checked {listener} {expected[0]}/{expected[1]}"] += 1


def check_trees(world: World, listener: str, view, trees, truths: dict[int, HolderTruth]) -> None:
    """(k): what a reap of an orphan tree would signal."""
    for tree in trees:
        if not tree.members:
            if tree.verdict == Verdict.ORPHAN:
                _fail("k", f"orphan tree {tree.root_pid} has no members", world, listener)
            continue
        assert tree.root is not None
        root = world.find(tree.root.identity)
        if root is None or not root.alive:
            _fail("k", f"tree root {tree.root_pid} is not a live process", world, listener)
        assert root is not None
        expected = {root.identity} | {p.identity for p in world.descendants(root)}
        got = {m.identity for m in tree.members}
        if got != expected or len(tree.members) != len(got):
            _fail("k", f"members of {root.label()}: got {sorted(got)}, expected "
                  f"{sorted(expected)}", world, listener)
        members = [world.find(m.identity) for m in tree.members]
        protected = [(p, member_protection(p)) for p in members
                     if p is not None and member_protection(p)]
        holders_inside = [p for p in members if p is not None and p.gpu]
        strays = [p for p in holders_inside
                  if not any(hv.holder.pid == p.pid and hv.verdict == Verdict.ORPHAN and hv.root
                             is not None and hv.root.identity == root.identity
                             for t in trees for hv in t.holder_verdicts)]
        if protected or strays:
            if tree.verdict == Verdict.ORPHAN:
                why = protected[0] if protected else (strays[0], "a holder not orphaned here")
                _fail("k", f"orphan tree {root.label()} holds {why[0].label()} ({why[1]})",
                      world, listener)
            if protected and not strays and tree.reason != Reason.MEMBER_PROTECTED:
                _fail("k", f"tree {root.label()} refused as {tree.reason}, expected "
                      f"{Reason.MEMBER_PROTECTED}", world, listener)
            continue
        if tree.verdict != Verdict.ORPHAN:
            _fail("k", f"tree {root.label()} refused ({tree.verdict}/{tree.reason}: "
                  f"{tree.evidence.detail}) though no member is protected", world, listener)
        for m in tree.members:
            judged = judge_member(m, view, RULES)
            if judged is not None:
                _fail("k", f"member {m.pid} of orphan tree fails judge_member: "
                      f"{judged.evidence.detail}", world, listener)
        # A holder whose truth is session-orphaned makes the whole tree so: a reason the
        # default policy reaps must not cover a session created on purpose.
        if tree.reason != Reason.SESSION_ORPHANED and any(
                truths[hv.holder.pid].expected(listener)
                == (Verdict.ORPHAN, Reason.SESSION_ORPHANED)
                for hv in tree.holder_verdicts):
            _fail("k", f"tree {root.label()} is {tree.reason} though a holder in it is "
                  "session-orphaned", world, listener)
        # Every holder of an orphan tree: its truth says orphan (or a known deviation).
        for hv in tree.holder_verdicts:
            truth = truths[hv.holder.pid]
            if truth.decidable and truth.root is None and truth.outer_root is None:
                _fail("a", "an orphan tree holds a holder whose launchers all live",
                      world, listener, truth, hv)
        STATS["orphan trees"] += 1


def check_moment(world: World, listener: str) -> None:
    holders = world.holders()
    STATS["moments"] += 1
    if not holders:
        return
    view = world.view(listener)
    trees = classify([holder(p.pid) for p in holders], view, RULES)
    verdicts = {hv.holder.pid: hv for t in trees for hv in t.holder_verdicts}
    truths: dict[int, HolderTruth] = {}
    for p in holders:
        truth = holder_truth(p)
        truths[p.pid] = truth
        STATS["holders"] += 1
        STATS["orphan truths" if truth.root is not None else "live truths"] += 1
        check_holder(world, listener, truth, verdicts[p.pid])
    check_trees(world, listener, view, trees, truths)


def check_history(world: World, steps) -> None:
    """Play `steps` on `world`, checking every moment with both listeners."""
    for step in steps:
        apply(world, *step)
        for listener in LISTENERS:
            check_moment(world, listener)



class ChangingView:
    """/proc as the walk reads it while the world moves: before every read, the next of
    `steps` is played (exits, kills, reaps, forks: pids freed and handed out again), and
    each read renders the world as it is at that moment."""

    def __init__(self, world: World, steps) -> None:
        self.world = world
        self.steps = list(steps)
        self.read: list[int] = []  # pids read so far, in order

    def _move(self) -> None:
        if not self.steps:
            return
        kind, a, b = self.steps.pop(0)
        if kind == "reuse" and self.read:
            self._reuse(self.read[-1 - a % len(self.read)], with_child=b % 2 == 0)
        elif kind != "reuse":
            apply(self.world, kind, a, b)

    def _reuse(self, pid: int, *, with_child: bool) -> None:
        """The process at `pid` dies and is reaped, and a process outside the tree (forked
        by PID 1, with a child of its own) gets its pid, as ns_last_pid makes happen."""
        world = self.world
        victim = world.by_pid(pid)
        if victim is None or victim is world.init:
            return
        if victim.alive:
            world.kill(victim, SIGKILL)
        if victim.state == ZOMBIE:
            world.reap(victim)
        world.last_pid = pid - 1 if pid > 2 else world.pid_max - 1
        newcomer = world.fork(world.init)
        if newcomer is not None and with_child:
            world.fork(newcomer)

    def stat(self, pid: int):
        self._move()
        self.read.append(pid)
        p = self.world.by_pid(pid)
        return self.world.info(p) if p is not None else None

    fresh_stat = stat

    def children(self, pid: int) -> tuple[int, ...] | None:
        self._move()
        self.read.append(pid)
        p = self.world.by_pid(pid)
        if p is None:
            return None
        return tuple(c.pid for c in self.world.children(p))

    def thread_states(self, pid: int) -> tuple[str, ...] | None:
        """The model's processes are single-threaded: the main thread's state is all."""
        p = self.world.by_pid(pid)
        return (self.world.info(p).state,) if p is not None else None


def ever_below(p, root) -> bool:
    """Whether `p` is `root` or was ever in its subtree. Reparenting moves a process only
    to an ancestor, so nothing enters a subtree from outside: the subtree's members, past
    and present, are exactly what root and its descendants forked."""
    cur = p
    while cur is not None:
        if cur is root:
            return True
        cur = cur.born_of
    return False


def check_walk(world: World, root_pick: int, steps) -> None:
    """(k) under pid reuse: walk_members from a live root while `steps` happen between
    its reads. Every process it returns must be, by identity, the root or a process
    that was in the root's subtree: never one that reused a member's pid elsewhere."""
    from gpuguard.orphans.process import walk_members

    candidates = [p for p in world.live() if p is not world.init]
    if not candidates:
        return
    root_proc = candidates[root_pick % len(candidates)]
    view = ChangingView(world, steps)
    members = walk_members(world.info(root_proc), view.children, view.stat, view.fresh_stat,
                           view.thread_states)
    STATS["walks"] += 1
    STATS["walk steps played"] += len(steps) - len(view.steps)
    for m in members:
        p = next((q for q in world.procs if q.identity == m.identity), None)
        if p is None or not ever_below(p, root_proc):
            who = p.label() if p is not None else str(m.identity)
            _fail("k", f"walk from {root_proc.label()} returned {who}, never in its subtree",
                  world, "every")
