"""The tree an alert names, as plain data: its identity (TreeKey), its processes (Member)
and what a live inspection found (LiveTree). Pure: the policy judges these, the
inspection and the reaper fill them in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpuguard.orphans.process import EXITED_STATES, Holder
from gpuguard.orphans.vocabulary import DecisionReason, Reason, Verdict


@dataclass(frozen=True, order=True)
class TreeKey:
    """The dedupe key: one tree on one host, by process identity (pid, start time)."""

    hostname: str
    root_pid: int
    root_start_time: int

    def __str__(self) -> str:
        return f"{self.hostname}/{self.root_pid}/{self.root_start_time}"

    @classmethod
    def parse(cls, text: str) -> TreeKey:
        host, pid, start = text.rsplit("/", 2)
        return cls(host, int(pid), int(start))


@dataclass(frozen=True)
class Member:
    """One process of a tree as read just now (identity, owner, name)."""

    pid: int
    ppid: int
    start_time: int
    uid: int
    user: str  # the owner's name; the decimal uid when NSS could not name it (user_known)
    comm: str
    state: str = "S"
    kernel_thread: bool = False
    user_known: bool = False  # NSS named the uid: `user` is a name, not just the number

    @property
    def user_name(self) -> str | None:
        """The owner's name as remediate.users judges it: None when it could not be resolved."""
        return self.user if self.user_known else None

    @property
    def gone(self) -> bool:
        return self.state in EXITED_STATES


@dataclass(frozen=True)
class ReapMark:
    """One reap in the rate-limit window: when it began (boot clock) and whose tree it
    was: its root's uid, which the per-user share counts (None for a reap recorded before
    owners were), and the user's name then, for people (None: NSS could not name it)."""

    at: float
    uid: int | None = None
    name: str | None = None

    @property
    def owner(self) -> str:
        """Who, for people: the name, else `uid N`."""
        if self.uid is None:
            return "unrecorded"
        return self.name if self.name is not None else f"uid {self.uid}"


def mark_for(at: float, root: Member) -> ReapMark:
    """The window's mark of a reap of `root`'s tree, begun at `at` (boot clock)."""
    return ReapMark(at, root.uid, root.user_name)


@dataclass(frozen=True)
class HolderIdle:
    """One holder of a tree on one GPU, as the remediator's own idle watch saw it."""

    pid: int
    gpu_uuid: str
    idle_seconds: float | None  # since its last SM use or the watch's first sight; None: unknown
    watched_seconds: float | None  # how long the watch has seen it without a gap


@dataclass(frozen=True)
class LiveTree:
    """What a fresh local inspection found for the tree an alert names."""

    root: Member | None  # the process at root_pid now; None when there is none
    tree_found: bool = False  # classify() has a tree with exactly this root identity
    verdict: Verdict | Literal[""] = ""
    reason: Reason | Literal[""] = ""
    detail: str = ""  # the classifier's evidence for verdict and reason
    members: tuple[Member, ...] = ()  # root first, then descendants (breadth first)
    holders: tuple[Holder, ...] = ()
    gpu_bytes: int = 0
    nvml_error: str | None = None  # NVML could not confirm the holders: nothing is verified
    nvml_reason: DecisionReason = DecisionReason.NVML_UNAVAILABLE  # or NVML_INCOMPLETE
    gpus: tuple[str, ...] = ()  # GPU uuids this reading reported
    #: Each holder's idleness from the remediator's IdleWatch, read at this inspection;
    #: empty when no idle requirement is in force (nobody asked).
    idle: tuple[HolderIdle, ...] = ()
