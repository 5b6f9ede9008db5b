"""The remediator's reaper as the launcher uses it: one reap per root, of its own tree.

The same verified reap as the remediator's (identity by pidfd, freeze, TERM, grace, KILL,
confirm), never a pid list or a process-group kill, forced past the classifier's
protections but for the keep marks (keeping.py), with no audit file: the launcher's
record is its stderr (report.py).
"""

from __future__ import annotations

import socket
import time

from gpuguard.base.counters import Counters
from gpuguard.config.remediate import Mode, Remediate, UserFilter
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import Member, TreeKey
from gpuguard.engine.reap.outcome import ReapResult
from gpuguard.engine.reap.reaper import Reaper
from gpuguard.engine.scan.inspection import member_of, proc_protected_pids
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.procfs import ProcessView
from gpuguard.launch.options import Options
from gpuguard.launch.teardown.keeping import spare_for
from gpuguard.orphans.process import ProcInfo, walk_members
from gpuguard.orphans.protections import Protection
from gpuguard.orphans.rules_config import Rules

#: A tree that grows faster than it can be frozen this long is left (and reported).
REAP_DEADLINE_SECONDS = 30.0


class _NoGpus:
    """The reaper's NVML, for a reap that GPU holders do not decide.

    The remediator's reap re-reads NVML to confirm no unjudged holder joined; the
    launcher reaps its own tree whoever holds GPU memory (force=True: no holder check),
    so it answers "up, nothing held" instead of loading NVML into every launcher.
    """

    #: read_within() calls it in place, on no thread (the pidns tier's launcher has none).
    never_blocks = True

    def read(self) -> GpuReading:
        return GpuReading(True, None, (), (), ())


def _no_audit(_phase: str, _members: tuple[Member, ...]) -> None:
    """The reaper's write-ahead journal: the launcher reaps the user's own tree,
    unprivileged, and writes no audit file; its record is its audit line on stderr."""


def policy_for(options: Options) -> Remediate:
    """The reaper's guards for the launcher's own tree: every descendant, whoever owns it
    (a root launcher's tree is root-owned); pid 1, kernel threads, the launcher and its
    ancestors stay refused by the reaper itself."""
    return Remediate(mode=Mode.ENFORCE, term_timeout_seconds=options.grace, allow_root_owned=True,
                     users=UserFilter(allow=("*",), deny=()), allow_without_pidfd=False)


class RootReaper:
    """Reaps the subtree of one root at a time (a child of the launcher, or of a member
    let go of), keeping what `marks` name (keeping.honoured)."""

    def __init__(self, options: Options, counters: Counters,
                 marks: tuple[Protection, ...]) -> None:
        # A member whose SIGSTOP the kernel refuses (a setuid-root helper under an
        # unprivileged launcher) is let go of; the rest of the tree is still reaped.
        self._reaper = Reaper(nvml=_NoGpus(), counters=counters, refused_stop="release")
        self._policy = policy_for(options)
        self._guarded = proc_protected_pids()  # Linux's Reaper: /proc's
        self._hostname = socket.gethostname()
        self._rules = Rules(marks_dir=options.marks_dir)  # where `gpuguard keep` registers
        self._spare = spare_for(marks, self._rules)

    def reap(self, root: ProcInfo, view: ProcessView) -> ReapResult:
        """One reap of `root` and what is below it (walked with the classifier's walk)."""
        members = walk_members(root, view.children, view.stat, view.fresh_stat,
                               view.thread_states)
        plan = ReapPlan(key=TreeKey(self._hostname, root.pid, root.start_time),
                        members=tuple(member_of(m, view) for m in members),
                        holders=(), gpu_bytes=0, dry_run=False,
                        classified=False)  # its own tree: no verdict to re-derive
        return self._reaper.reap(plan, policy=self._policy, rules=self._rules,
                                 protected_pids=self._guarded,
                                 deadline=time.monotonic() + REAP_DEADLINE_SECONDS,
                                 journal=_no_audit, force=True, spare=self._spare)
