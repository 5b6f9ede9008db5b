"""What classify() walked for a holder: the chain up to its root, each member's role, a
tree's members, and how old each process is."""

from __future__ import annotations

from gpuguard.base.compat import StrEnum
from gpuguard.host.platform import PLATFORM, Platform
from gpuguard.orphans.process import ProcInfo
from gpuguard.orphans.verdicts import HolderVerdict, Tree


class ChainRole(StrEnum):
    """A chain member's role, as `explain` shows it and its --json "role" says."""

    HOLDER = "holder"
    ANCESTOR = "ancestor"
    ROOT = "root"
    HOLDER_ROOT = "holder,root"  # the holder is its own tree's root
    ABOVE_ROOT = "above-root"

    @property
    def is_root(self) -> bool:
        return self in (ChainRole.ROOT, ChainRole.HOLDER_ROOT)


def upto_root(hv: HolderVerdict) -> tuple[ProcInfo, ...]:
    """The chain from the holder up to and including its root (not the adopter above)."""
    if hv.root is None or hv.root not in hv.chain:
        return hv.chain
    return hv.chain[: hv.chain.index(hv.root) + 1]


def tree_members(tree: Tree) -> list[ProcInfo]:
    """Every process classify() walked for this tree, holder up to root; root first."""
    seen: dict[int, ProcInfo] = {}
    for hv in tree.holder_verdicts:
        for info in upto_root(hv):
            seen.setdefault(info.pid, info)
    members = list(seen.values())
    members.sort(key=lambda m: (m.pid != tree.root_pid, m.start_time, m.pid))
    return members


def chain_roles(hv: HolderVerdict) -> list[tuple[ChainRole, ProcInfo]]:
    """Each chain member with its role: holder, ancestor, root, above-root."""
    root_pid = hv.root.pid if hv.root is not None else None
    out: list[tuple[ChainRole, ProcInfo]] = []
    above = False
    for i, info in enumerate(hv.chain):
        if above:
            role = ChainRole.ABOVE_ROOT
        elif info.pid == root_pid:
            role = ChainRole.HOLDER_ROOT if i == 0 else ChainRole.ROOT
            above = True
        else:
            role = ChainRole.HOLDER if i == 0 else ChainRole.ANCESTOR
        out.append((role, info))
    return out


def process_age(start_time: int | None, platform: Platform = PLATFORM) -> float | None:
    """Age from a start time in the platform's encoding, no /proc read: Linux's ticks
    since boot against CLOCK_BOOTTIME, Windows' creation time in ms since the epoch
    (gpuguard.host.windows.tree.encode_create_time) against the wall clock."""
    if start_time is None:
        return None
    return platform.age_seconds(start_time)
