"""The member judgement: a reap signals an orphan root's whole subtree, so every process in
it must pass the protections its chain did, and each must be readable."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gpuguard.orphans.process import ProcInfo, still_same, walk_members
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


def judge_tree_members(tree: Tree, view: ProcSource, rules: Rules,
                       by_pid: dict[int, list[HolderVerdict]]) -> Tree:
    """An orphan tree stays an orphan only if every process a reap would signal may be."""
    assert tree.root is not None
    # Children may come from this scan's stat reads; the parent is re-read after its
    # children file, which is what catches a reused pid.
    members = walk_members(tree.root, view.children, view.stat, view.fresh_stat, view.thread_states)
    found: MemberJudgement | None = None
    for member in members:
        for hv in by_pid.get(member.pid, ()):
            if (hv.verdict != Verdict.ORPHAN or hv.root is None
                    or hv.root.identity != tree.root.identity):
                # An orphan of another root below this one cannot be: call it unknown.
                verdict = Verdict.UNKNOWN if hv.verdict == Verdict.ORPHAN else hv.verdict
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
