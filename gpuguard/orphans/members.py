"""The member judgement: a reap signals an orphan root's whole subtree, so every process in
it must pass the protections its chain did, and each must be readable."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpuguard.orphans.process import ProcInfo, failure, still_same, walk_members
from gpuguard.orphans.protections import ProcSource, protection
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.verdicts import Evidence, HolderVerdict, Tree
from gpuguard.orphans.vocabulary import Reason, Rule, Verdict


@dataclass(frozen=True)
class MemberJudgement:
    """Why one process of an orphan tree must not be signalled."""

    verdict: Verdict  # PROTECTED or UNKNOWN (or a GPU holder's own verdict)
    reason: Reason  # MEMBER_PROTECTED, MEMBER_UNKNOWN, or member-<verdict>
    evidence: Evidence


def judge_member(member: ProcInfo, view: ProcSource, rules: Rules) -> MemberJudgement | None:
    """Rules 3 and 4 for one process a reap would signal; None when it may be signalled.

    Siblings, helpers and children born during the freeze must pass the protections the
    chain's path did. A fact that cannot be read for a live process makes it `unknown`:
    never signalled on a guess.
    """
    who = f"member {member.pid} ({member.comm})"
    hit, unread = protection(member, view, rules)
    if hit is not None:
        return MemberJudgement(Verdict.PROTECTED, Reason.MEMBER_PROTECTED,
                               Evidence(hit.rule, f"{who} {hit.member_detail}: a reap would "
                                        "signal it", (member.pid,)))
    if unread:
        if not still_same(view.fresh_stat(member.pid), member):
            return None  # exited while being judged: nothing left to signal
        files = ",".join(p.source for p in unread if p.source)
        notes = "".join(p.unread_note for p in unread if p.source)
        what = [f"/proc/{member.pid}/{{{files}}}{notes}"] if files else []
        what += [p.unread_note for p in unread if not p.source]
        return MemberJudgement(Verdict.UNKNOWN, Reason.MEMBER_UNKNOWN,
                               Evidence(Rule.CHAIN, f"{who}: cannot read "
                                        f"{'; nor '.join(what)}", (member.pid,)))
    return None


def holder_below_root(member: ProcInfo, root: ProcInfo,
                      by_pid: Mapping[int, list[HolderVerdict]]) -> MemberJudgement | None:
    """A GPU holder among the members must itself be an orphan of this very root: an
    orphan of another root below this one cannot be (unknown), and a protected, normal or
    unknown holder lends its own verdict to the tree (`member-<verdict>`)."""
    for hv in by_pid.get(member.pid, ()):
        if (hv.verdict != Verdict.ORPHAN or hv.root is None
                or hv.root.identity != root.identity):
            verdict = Verdict.UNKNOWN if hv.verdict == Verdict.ORPHAN else hv.verdict
            return MemberJudgement(
                verdict, Reason(f"member-{verdict}"),
                Evidence(hv.evidence.rule, f"GPU holder {member.pid} ({member.comm}) below "
                         f"root {root.pid} is {hv.verdict} ({hv.reason}: "
                         f"{hv.evidence.detail})", (member.pid, *hv.evidence.pids)))
    return None


def settle_members(tree: Tree, members: tuple[ProcInfo, ...],
                   by_pid: Mapping[int, list[HolderVerdict]],
                   judge: Callable[[ProcInfo], MemberJudgement | None]) -> Tree:
    """An orphan tree stays an orphan only if every process a reap would signal may be:
    the first member that is a holder of another verdict (`holder_below_root`) or that
    its platform's `judge` refuses decides the tree; the members are kept either way.
    Every platform's member judgement ends here."""
    assert tree.root is not None
    found: MemberJudgement | None = None
    for member in members:
        found = holder_below_root(member, tree.root, by_pid) or judge(member)
        if found is not None:
            break
    if found is None:
        return dataclasses.replace(tree, members=members)
    return dataclasses.replace(tree, verdict=found.verdict, reason=found.reason,
                               evidence=found.evidence, members=members)


def not_judged(member: ProcInfo, exc: Exception) -> MemberJudgement:
    """A member whose facts could not be read or judged (ProcUnreadable, or anything a
    rule met in what it read): unknown, never signalled, and never the other trees'."""
    return MemberJudgement(Verdict.UNKNOWN, Reason.MEMBER_UNKNOWN,
                           Evidence(Rule.CHAIN, f"member {member.pid} ({member.comm}) could "
                                    f"not be judged ({failure(exc)})", (member.pid,)))


def judge_or_unknown(member: ProcInfo, view: ProcSource, rules: Rules) -> MemberJudgement | None:
    """judge_member, with whatever goes wrong in it making this member unknown."""
    try:
        return judge_member(member, view, rules)
    except Exception as exc:
        return not_judged(member, exc)


def judge_tree_members(tree: Tree, view: ProcSource, rules: Rules,
                       by_pid: Mapping[int, list[HolderVerdict]]) -> Tree:
    """Linux's member judgement: the root's subtree walked down through /proc. A walk
    that fails (a member's threads or children that cannot be read) makes the tree
    `member-unknown` at its root: what a reap would signal is not known."""
    assert tree.root is not None
    # Children may come from this scan's stat reads; the parent is re-read after its
    # children file, which is what catches a reused pid.
    try:
        members = walk_members(tree.root, view.children, view.stat, view.fresh_stat,
                               view.thread_states)
    except Exception as exc:
        found = not_judged(tree.root, exc)
        return dataclasses.replace(tree, verdict=found.verdict, reason=found.reason,
                                   evidence=found.evidence, members=(tree.root,))
    return settle_members(tree, members, by_pid, lambda m: judge_or_unknown(m, view, rules))
