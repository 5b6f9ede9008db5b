"""Which tier holds the tree: the best this host allows, chosen once, before CMD starts.

cgroup: a leaf (cgroup.py) the launcher moves itself into, and a guardian (guardian.py)
that kills it when the launcher dies. pidns: a PID namespace the launcher creates for
the tree (pidns.py), whose init dies with the launcher and the kernel with it kills the
namespace whole; or the launcher is already PID 1 of one (`unshare --pid --fork gpuguard
run ...`, a container's init). subreaper: what the launcher does anyway (its subreaper,
CMD's parent-death SIGKILL, its teardown), and nothing that outlives it.

The order is the best first: cgroup (atomic, and CMD's environment is the caller's),
then pidns (CMD sees a user namespace and its own /proc, setuid programs lose their
privilege below an unprivileged launcher: docs/run.md), then subreaper.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpuguard.launch import cgroup, guardian, pidns, usermanager
from gpuguard.launch.cgroup import Leaf
from gpuguard.launch.guardian import Guardian
from gpuguard.launch.options import RANK, Options, Unsupported, below
from gpuguard.launch.pidns import Init


@dataclass
class Hold:
    """The tier in force, with what it holds (cgroup: the leaf and its guardian) and why
    the better tiers were not had."""

    tier: str
    why_not: str | None = None
    leaf: Leaf | None = None
    guard: Guardian | None = None
    init: Init | None = None  # pidns: the namespace's init, the launcher's first child

    def describe(self) -> str:
        """The --verbose line's body."""
        if self.leaf is not None and self.guard is not None:
            return f"tier cgroup (leaf {self.leaf.path}, guardian {self.guard.pid})"
        if self.init is not None:
            why = f"; {self.why_not}" if self.why_not else ""
            return f"tier pidns (init {self.init.pid} of a new PID namespace{why})"
        return f"tier {self.tier}" + (f" ({self.why_not})" if self.why_not else "")

    def kept(self) -> frozenset[tuple[int, int]]:
        """Processes of the tier, not of the tree (the init): the teardown reaps what is
        below them, never them (the init's death would SIGKILL the namespace at once)."""
        return frozenset({(self.init.pid, self.init.start_time)} if self.init else ())

    def release(self) -> None:
        """The run ended normally (or never started CMD): nothing is killed."""
        if self.leaf is not None and self.guard is not None:
            self.guard.release(self.leaf)
        if self.init is not None:
            self.init.release()
        self.leaf = self.guard = self.init = None


def hold_cgroup(name: str) -> Hold:
    """The cgroup tier (in the launcher's own cgroup, else in a delegated scope the user's
    systemd manager gives it), or the subreaper tier with the reasons."""
    leaf = cgroup.create_leaf(name)
    if isinstance(leaf, str) and cgroup.NOT_DELEGATED in leaf:
        moved = usermanager.into_scope(name)
        leaf = cgroup.create_leaf(name) if moved is None else f"{leaf}; {moved}"
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


def hold_pidns(why_not: str | None, *, create: bool) -> Hold:
    """The pidns tier (its namespace and init made when `create`, else only probed), or
    the subreaper tier with the reason. Once the launcher entered the namespaces there
    is no way back: a failure then refuses the run (Unsupported), CMD not started."""
    failed = pidns.probe()
    if failed is not None:
        reasons = "; ".join(w for w in (why_not, f"no pidns: {failed}") if w)
        return Hold("subreaper", reasons)
    if not create:
        return Hold("pidns", why_not)
    init = pidns.start_init()
    if isinstance(init, str):
        raise Unsupported(f"the pidns tier failed after its probe passed: {init}")
    return Hold("pidns", why_not, init=init)


def choose(options: Options, start_time: int) -> Hold:
    """The tier for this run: --tier's, else the best to be had."""
    if options.tier == "subreaper":
        return Hold("subreaper")
    if os.getpid() == 1:
        # The launcher is its PID namespace's init: the kernel kills every process in
        # the namespace when it dies, and a guardian would be its own child (adopted).
        return Hold("pidns", "the launcher is PID 1: its namespace dies with it")
    why_not = None
    if options.tier in (None, "cgroup"):
        hold = hold_cgroup(f"{cgroup.LEAF_PREFIX}{os.getpid()}-{start_time}")
        if hold.tier == "cgroup" or options.tier == "cgroup":
            return hold
        why_not = hold.why_not
    # A --require above pidns refuses it anyway: probe it (to name it), make nothing.
    wanted = options.require is None or RANK[options.require] <= RANK["pidns"]
    return hold_pidns(why_not, create=wanted)


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
