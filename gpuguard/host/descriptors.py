"""Open-file descriptors: the process's limit (RLIMIT_NOFILE) and what is left of it.

A reap holds one pidfd per member for as long as it runs (a pidfd keeps naming its
process when the pid is reused), so the soft limit bounds the size of a tree that can be
reaped. The daemons and `gpuguard reap` raise the soft limit to the hard one at
start (`raise_open_file_limit`), and each reap asks first how many it may take
(`descriptor_budget`): a tree larger than that is refused by name, before any signal,
rather than failing member by member half-way (`tree-too-large`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Where the kernel caps any RLIMIT_NOFILE (an unlimited hard limit is clamped to it).
NR_OPEN = "/proc/sys/fs/nr_open"
#: This process's open descriptors, one entry each.
OWN_FDS = "/proc/self/fd"


@dataclass(frozen=True)
class Budget:
    """How many descriptors a reap may hold: the soft limit less those open now less a
    reserve kept for everything else the process opens meanwhile."""

    limit: int
    open: int
    reserve: int

    @property
    def available(self) -> int:
        return max(0, self.limit - self.open - self.reserve)

    def describe(self) -> str:
        return (f"{self.available} descriptor(s) may be used (open-file soft limit "
                f"{self.limit}, {self.open} open, {self.reserve} kept for the audit log, "
                "sockets and NVML)")


def soft_limit() -> int | None:
    """The soft RLIMIT_NOFILE; None where there is none (Windows) or it is unlimited."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return None

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def open_count() -> int:
    """Descriptors open in this process now (the listing's own one not counted)."""
    return max(0, len(os.listdir(OWN_FDS)) - 1)


def descriptor_budget(reserve: int) -> Budget | None:
    """What a reap may hold now; None when there is no limit to keep to (or the count
    cannot be read: a pidfd_open that fails then still refuses, by name)."""
    limit = soft_limit()
    if limit is None:
        return None
    try:
        opened = open_count()
    except OSError:
        return None
    return Budget(limit, opened, reserve)


def raise_open_file_limit() -> str:
    """Raise the soft RLIMIT_NOFILE to the hard limit; what happened, in words.

    Never raises: a limit that cannot be raised (a seccomp filter, Windows) only makes
    the largest reapable tree smaller, and such a tree is refused as `tree-too-large`.
    Linux's (gpuguard.host.platform.linux); Windows' back-end has none to raise.
    """
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard
        if hard == resource.RLIM_INFINITY:
            with open(NR_OPEN, encoding="ascii") as fh:
                target = int(fh.read())
        if soft == resource.RLIM_INFINITY or soft >= target:
            return f"open-file limit: soft {soft} is already the hard limit"
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        return f"open-file limit: could not raise the soft limit ({exc}); it stays as it was"
    return f"open-file limit: soft {soft} raised to {target} (the hard limit)"
