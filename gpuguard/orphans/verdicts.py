"""What the classifier answers: a holder's verdict with its evidence, and the trees that
alerts name and reaps kill."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuguard.orphans.process import Holder, ProcInfo
from gpuguard.orphans.vocabulary import Reason, Rule, Verdict


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


def unknown(holder: Holder, rule: Rule, reason: Reason, detail: str,
            chain: Sequence[ProcInfo] = (), pids: Iterable[int] = ()) -> HolderVerdict:
    """An unknown verdict for `holder`, rooted at the first process of `chain`."""
    return HolderVerdict(
        holder=holder,
        verdict=Verdict.UNKNOWN,
        reason=reason,
        evidence=Evidence(rule=rule, detail=detail, pids=tuple(pids)),
        chain=tuple(chain),
        root=chain[0] if chain else None,
    )


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
