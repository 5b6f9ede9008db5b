"""Holder verdicts grouped into trees: the step after the rules, shared by every platform.

Linux's rules (classify.py) and Windows' (gpuguard/host/windows/tree.py) each judge one
holder at a time; what they answer is grouped, ordered and settled here once: holders
under one root identity make one tree, the safest verdict speaks for it (the least
reapable reason among orphans: `Reason.reapability`), and an orphan tree is then handed
to its platform's member judgement (members.settle_members).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from gpuguard.orphans.process import Holder, ProcInfo
from gpuguard.orphans.verdicts import HolderVerdict, Tree
from gpuguard.orphans.vocabulary import Verdict

#: Tree verdict when its holders disagree: the safest one wins.
SAFETY_ORDER = {Verdict.PROTECTED: 0, Verdict.NORMAL: 1, Verdict.UNKNOWN: 2, Verdict.ORPHAN: 3}

#: A platform's member judgement of an orphan tree, given every holder's verdicts by pid.
JudgeMembers = Callable[[Tree, Mapping[int, list[HolderVerdict]]], Tree]


def tree_of(hvs: list[HolderVerdict]) -> Tree:
    """One tree from the verdicts of its holders: the decisive one speaks for it."""
    decisive = min(hvs, key=lambda h: (SAFETY_ORDER[h.verdict], h.reason.reapability))
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
    return Tree(
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


def build_trees(verdicts: Iterable[HolderVerdict], judge_members: JudgeMembers) -> list[Tree]:
    """Group every holder's verdict into trees by root identity (an unknown holder stands
    alone), settle each orphan tree's members, orphans first, then by root pid."""
    groups: dict[tuple[object, ...], list[HolderVerdict]] = {}
    for hv in verdicts:
        key: tuple[object, ...] = (hv.root.identity if hv.root is not None
                                   else ("pid", hv.holder.pid))
        if hv.verdict == Verdict.UNKNOWN:
            key = ("unknown", hv.holder.pid)
        groups.setdefault(key, []).append(hv)
    by_pid: dict[int, list[HolderVerdict]] = {}
    for hvs in groups.values():
        for hv in hvs:
            by_pid.setdefault(hv.holder.pid, []).append(hv)
    trees = [tree_of(hvs) for hvs in groups.values()]
    trees = [judge_members(t, by_pid) if t.verdict == Verdict.ORPHAN else t for t in trees]
    trees.sort(key=lambda t: (t.verdict != Verdict.ORPHAN, t.root_pid))
    return trees
