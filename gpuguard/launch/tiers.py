"""Which tier holds the tree: the best this host allows, chosen once, before CMD starts.

cgroup: a leaf (cgroup.py) the launcher moves itself into, and a guardian (guardian.py)
that kills it when the launcher dies. pidns: the launcher is already PID 1 of a PID
namespace (`unshare --pid --fork gpuguard run ...`, a container's init), which the
kernel kills whole when it dies; the launcher does not create one itself (yet).
subreaper: what the launcher does anyway (its subreaper, CMD's parent-death SIGKILL, its
teardown), and nothing that outlives it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpuguard.launch import cgroup, guardian
from gpuguard.launch.cgroup import Leaf
from gpuguard.launch.guardian import Guardian
from gpuguard.launch.options import Options, below


@dataclass
class Hold:
    """The tier in force, with what it holds (cgroup: the leaf and its guardian) and why
    the better tiers were not had."""

    tier: str
    why_not: str | None = None
    leaf: Leaf | None = None
    guard: Guardian | None = None

    def describe(self) -> str:
        """The --verbose line's body."""
        if self.leaf is not None and self.guard is not None:
            return f"tier cgroup (leaf {self.leaf.path}, guardian {self.guard.pid})"
        return f"tier {self.tier}" + (f" ({self.why_not})" if self.why_not else "")

    def release(self) -> None:
        """The run ended normally (or never started CMD): nothing is killed."""
        if self.leaf is not None and self.guard is not None:
            self.guard.release(self.leaf)
        self.leaf = self.guard = None


def hold_cgroup(name: str) -> Hold:
    """The cgroup tier, or the subreaper tier with the reason."""
    leaf = cgroup.create_leaf(name)
    if isinstance(leaf, str):
        return Hold("subreaper", f"no cgroup: {leaf}")
    guard = guardian.start(leaf)
    if isinstance(guard, str):
        leaf.close()
        cgroup.remove(leaf.path)
        return Hold("subreaper", f"no cgroup guardian: {guard}")
    why = cgroup.enter(leaf.path)
    hold = Hold("cgroup", None, leaf, guard)
    if why is not None:
        hold.release()  # the guardian removes the leaf, kills nothing
        return Hold("subreaper", f"no cgroup: {why}")
    return hold


def choose(options: Options, start_time: int) -> Hold:
    """The tier for this run: --tier's, else the best to be had."""
    if options.tier == "subreaper":
        return Hold("subreaper")
    if os.getpid() == 1:
        # The launcher is its PID namespace's init: the kernel kills every process in
        # the namespace when it dies, and a guardian would be its own child (adopted).
        return Hold("pidns", "the launcher is PID 1: its namespace dies with it")
    if options.tier == "pidns":
        return Hold("subreaper", "the launcher is not PID 1 of a PID namespace")
    return hold_cgroup(f"{cgroup.LEAF_PREFIX}{os.getpid()}-{start_time}")


def refusal(hold: Hold, options: Options) -> str | None:
    """Why this run must not start (not --tier's tier, or below --require), or None."""
    why = f" ({hold.why_not})" if hold.why_not else ""
    if options.tier is not None and hold.tier != options.tier:
        return f"--tier {options.tier}: this host gives the {hold.tier} tier{why}"
    if below(hold.tier, options.require):
        if options.tier is not None:
            return f"--require {options.require}: --tier {options.tier} is below it"
        return f"--require {options.require}: this host gives the {hold.tier} tier{why}"
    return None
