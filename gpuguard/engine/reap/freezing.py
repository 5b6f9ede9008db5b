"""Freezing a tree: hold every member, judge it, SIGSTOP root first and re-collect until
no new member appears, so that a retry loop cannot respawn a child between kills. Every
process, planned or joining, is judged on facts read during this reap.

Each held process costs one descriptor (its pidfd) for the whole reap: a tree larger than
what the open-file limit leaves is refused as a whole (`tree-too-large`) before anything is
signalled, or, when it grows past it while being frozen, before any SIGTERM."""

from __future__ import annotations

import os
from collections.abc import Callable

from gpuguard.base.counters import Counters
from gpuguard.engine.decision.policy import member_refusal
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import Member
from gpuguard.engine.reap.audit import Phase
from gpuguard.engine.reap.outcome import Kept, KillPath
from gpuguard.engine.reap.reap_run import Abort, ReapRun, RefusedStop, Target, check_wanted
from gpuguard.engine.reap.signalling import Signaller
from gpuguard.engine.scan.inspection import member_of
from gpuguard.host.descriptors import Budget, descriptor_budget
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.members import judge_member
from gpuguard.orphans.process import STOPPED_STATES, ProcInfo, ProcUnreadable, is_child_of
from gpuguard.orphans.protections import ProcSource
from gpuguard.orphans.vocabulary import AnyReason, DecisionReason, Reason, Unheld

#: How long one freeze pass waits for SIGSTOPped members to show state T (a process in
#: uninterruptible sleep stops only when it leaves it; the pass then goes on regardless).
FREEZE_CONFIRM_SECONDS = 1.0

#: Why a child found in a children file is simply not part of the tree (not a refusal).
_NOT_OURS = (Unheld.EXITED, Unheld.REPLACED, Unheld.REPARENTED, Unheld.PARENT_REPLACED)

#: Descriptors a reap leaves to the rest of its process: the audit log and state file,
#: the /proc reads of the reap itself, NVML's device files, the sockets of Alertmanager,
#: the webhook and the TLS front (connections beyond this wait at accept, never a reap).
DESCRIPTOR_RESERVE = 128
#: The state letter of a task its tracer (ptrace) has stopped.
TRACING_STOP = "t"


class Freezer:
    """Holds, judges and stops the members of a reap (through its Signaller)."""

    def __init__(self, signaller: Signaller, *, counters: Counters,
                 refused_stop: RefusedStop) -> None:
        self.signaller = signaller
        self.counters = counters
        self.on_refused_stop = refused_stop
        #: What the current reap may hold (hold_planned sets it); None: no limit applies.
        self.budget: Budget | None = None

    def hold_planned(self, run: ReapRun, plan: ReapPlan) -> None:
        """Open a handle on every planned member, verify it is still that process and still
        below the root, judge it. Root first, then breadth first: parents come first.
        A tree with more members than descriptors left is refused before any is held."""
        self.budget = (descriptor_budget(DESCRIPTOR_RESERVE) if run.path == KillPath.PIDFD
                       else None)  # the pid path holds no descriptor per member
        if self.budget is not None and len(plan.members) > self.budget.available:
            raise Abort(DecisionReason.TREE_TOO_LARGE,
                        f"the tree has {len(plan.members)} member(s), each "
                        f"held by a descriptor for the whole reap, and {self.budget.describe()}"
                        ": nothing was signalled; raise the open-file limit (LimitNOFILE=) "
                        "to reap it")
        for member in plan.members:
            target, why = self.signaller.open(run, member.pid, member.start_time)
            if why == Unheld.NO_DESCRIPTOR:
                raise self._too_large(run, f"member {member.pid} ({member.comm})",
                                      len(plan.members))
            if target is None:
                if member.pid == plan.key.root_pid:
                    reason = (DecisionReason.ROOT_REPLACED if why == Unheld.REPLACED
                              else DecisionReason.ROOT_GONE)
                    raise Abort(reason, f"root {member.pid} {why} before the reap")
                if why in (Unheld.EXITED, Unheld.REPLACED):
                    continue  # exited since the inspection: nothing to do for it
                raise Abort(Reason.MEMBER_UNKNOWN, f"member {member.pid} ({member.comm}) {why}: "
                            "a process that cannot be held cannot be judged")
            parent = run.targets.get(target.info.ppid)
            if member.pid != plan.key.root_pid and (
                    parent is None
                    or not is_child_of(target.info, parent.info, run.view.thread_states)):
                self.signaller.release(target)  # its parent exited and it was adopted elsewhere
                continue
            self._admit(run, target)

    def freeze(self, run: ReapRun, deadline: float, cancelled: Callable[[], bool]) -> None:
        """SIGSTOP root first, then breadth first; re-collect until no new member appears.

        A fork already under way when SIGSTOP arrives still links its child, so each
        pass first waits (bounded) until every member shows state T: a stopped
        process is back from fork(), and its children file is then complete.
        """
        signaller = self.signaller
        run.mark(list(run.targets.values()), held=True)
        for target in list(run.targets.values()):
            self.stop(run, target)
        self.refused_stop(run)
        while True:
            signaller.wait_stopped(run, min(deadline,
                                            signaller.monotonic() + FREEZE_CONFIRM_SECONDS))
            if not self.collect(run, stop=True):
                break
            self.refused_stop(run)
            if signaller.monotonic() > deadline:
                raise Abort(DecisionReason.WORKER_TIMEOUT,
                            "the tree kept growing while being frozen")
        check_wanted(cancelled, deadline, signaller.monotonic)

    def refused_stop(self, run: ReapRun) -> None:
        """A SIGSTOP the kernel refused (EPERM: another user's process, and no CAP_KILL)
        ends the reap before any SIGTERM, so the tree is left as it was found rather than
        signalled in part and reported as survivors of a SIGKILL that was never sent.
        With refused_stop="release" that member is let go of instead (never signalled
        again, reported in `released`) and the reap of the others goes on."""
        for record in run.signals:
            if record.signal == "SIGSTOP" and record.failed:
                if self.on_refused_stop == "release":
                    target = run.targets.pop(record.pid, None)
                    if target is not None:
                        self.signaller.release(target)
                        run.released.append(target.member)
                        run.notes.append(f"left {record.pid} ({target.member.comm}) alone: "
                                         f"SIGSTOP refused ({record.error})")
                    continue
                raise Abort(DecisionReason.SIGNAL_FAILED, f"SIGSTOP to {record.pid} failed "
                            f"({record.error}): the remediator may "
                            "not signal this tree (another user's processes need root or "
                            "CAP_KILL); nothing was terminated")

    def rejudge(self, run: ReapRun, targets: list[Target], *, refuse: bool) -> list[Target]:
        """Every rule again, on facts read now from a new view, for stopped targets.

        A member judged while running could exec into a protected program or start
        ignoring SIGHUP before its SIGSTOP landed; once stopped it can do neither.
        Refused: abort (`refuse`), or continue it, let go of it and note why.
        """
        signaller = self.signaller
        signaller.wait_stopped(run, signaller.monotonic() + FREEZE_CONFIRM_SECONDS, targets)
        view = ProcessView(counters=self.counters)
        kept: list[Target] = []
        for target in targets:
            if target.exited or run.targets.get(target.member.pid) is not target:
                continue  # exited, or let go of with a kept member above it
            info = view.fresh_stat(target.member.pid)
            if (info is None or info.start_time != target.member.start_time
                    or not info.is_live(view.thread_states)):
                target.exited = True
                continue
            why = run.spare(info, view) if run.spare is not None else None
            if why is not None:
                self.let_go_kept(run, target, why)
                continue
            member = member_of(info, view)
            refused = self._refusal(run, member, info, view, threads=True)
            if refused is None:
                target.member, target.info = member, info
                kept.append(target)
            elif refuse:
                raise Abort(*refused)
            else:
                if target.stopped:
                    signaller.resume(run, [target])
                del run.targets[target.member.pid]
                signaller.release(target)
                run.notes.append(f"left {target.member.pid} alone: {refused[1]}")
        return kept

    def let_go_kept(self, run: ReapRun, target: Target, why: str) -> None:
        """Let go of a held member that `spare` keeps, and of every held member below it:
        continued if this reap stopped them, never signalled again, reported in `kept`."""
        below = {target.member.pid}
        for other in list(run.targets.values()):  # parents were held before their children
            if other.info.ppid in below:
                below.add(other.member.pid)
        group = [run.targets.pop(pid) for pid in sorted(below) if pid in run.targets]
        self.signaller.resume(run, [t for t in group if t.stopped])
        for held in group:
            self.signaller.release(held)
        run.kept.append(Kept(target.member, why))
        run.notes.append(f"kept {target.member.pid} ({target.member.comm}) and "
                         f"{len(group) - 1} held below it: {why}")

    @staticmethod
    def traced(info: ProcInfo, view: ProcSource, *, threads: bool) -> tuple[AnyReason, str] | None:
        """A member in a tracing stop (state `t`: a debugger, strace, a ptrace sandbox), as
        a refusal; with `threads`, any of its threads (read now), not only the main one.

        Such a process only looks frozen: its tracer can resume it at any moment (then it
        may fork, exec a protected program or start ignoring SIGHUP between the last
        judgement and SIGTERM), and it sees every signal but SIGKILL before the process
        does, so it may swallow our SIGSTOP and SIGTERM. The reap cannot hold what someone
        else holds: it refuses the tree (fail closed) instead of reading `t` as stopped by
        us. A person tracing a job is also a person working on it.
        """
        states: tuple[str, ...] = (info.state,)
        if threads:
            try:
                states += view.thread_states(info.pid) or ()
            except ProcUnreadable as exc:
                return Reason.MEMBER_UNKNOWN, (f"{info.pid} ({info.comm}): its threads "
                                               f"cannot be read ({exc}), so whether a "
                                               "tracer holds one cannot be told")
        if TRACING_STOP not in states:
            return None
        return DecisionReason.MEMBER_TRACED, (
            f"{info.pid} ({info.comm}) is in a tracing stop (state t): "
            "its tracer, not this reap, decides when it runs again, and "
            "sees every signal but SIGKILL first")

    @staticmethod
    def stopped_elsewhere(info: ProcInfo, view: ProcSource) -> tuple[AnyReason, str] | None:
        """A member stopped (state T) by someone other than this reap, as a refusal: read
        before this reap sent it SIGSTOP, so its owner (Ctrl-Z), a debugger, another
        reaper or one that died holds it, and decides when it runs again. A tree judged
        and killed on that stop would rest on a freeze this reap does not hold: whoever
        holds it may continue it between the last judgement and SIGTERM (to exec a
        protected program), and a reap that gives up must leave it stopped, not running.
        A zombie main thread (pthread_exit()) counts its live threads' states; threads
        that cannot be read leave it unknown."""
        stopped = info.is_stopped
        if not stopped and info.is_zombie:
            try:
                states = view.thread_states(info.pid) or ()
            except ProcUnreadable as exc:
                return Reason.MEMBER_UNKNOWN, (f"{info.pid} ({info.comm}): its threads "
                                               f"cannot be read ({exc}), so whether someone "
                                               "else holds it stopped cannot be told")
            stopped = any(state in STOPPED_STATES for state in states)
        if not stopped:
            return None
        return DecisionReason.MEMBER_STOPPED, (
            f"{info.pid} ({info.comm}) was stopped (state {info.state}) before this reap "
            "stopped it: whoever stopped it (its owner, a debugger, another reaper) decides "
            "when it runs again; nothing is terminated, and it is left stopped")

    def stop(self, run: ReapRun, target: Target) -> None:
        """SIGSTOP a member during the freeze, unless /proc, read right before the signal,
        shows it stopped by someone else: then the tree is refused (`member-stopped`) with
        nothing sent to it. Whoever catches the Abort thaws (Signaller.thaw): it continues
        what this reap stopped and takes back the held marks of the rest, this member's
        included (crash recovery continues only what this reap may have stopped)."""
        pid = target.member.pid

        def check() -> None:  # read after the guardian took it, right before the signal
            try:
                info = run.view.fresh_stat(pid)
                refused = (None if info is None or info.start_time != target.member.start_time
                           else self.stopped_elsewhere(info, run.view))
            except ProcUnreadable as exc:
                refused = (Reason.MEMBER_UNKNOWN,
                           f"{pid} ({target.member.comm}): its state cannot be read right "
                           f"before its SIGSTOP ({exc}), so whether someone else holds it "
                           "stopped cannot be told")
            if refused is not None:
                raise Abort(*refused)

        self.signaller.stop(run, target, check)  # exited since (or ours already): send says so

    @classmethod
    def _refusal(cls, run: ReapRun, member: Member, info: ProcInfo, view: ProcSource, *,
                 threads: bool = False) -> tuple[AnyReason, str] | None:
        """Every rule one process must pass to be signalled, as (reason, detail), or None:
        the policy's refusals, a tracer's hold (its threads too with `threads`), then
        (unless a person forced it) the classifier's protections, judged from `view`."""
        refused = member_refusal(member, run.policy, run.protected)
        if refused is None:
            refused = cls.traced(info, view, threads=threads)
        if refused is None and not run.force:
            judged = judge_member(info, view, run.rules)
            if judged is not None:
                refused = (judged.reason, judged.evidence.detail)
        return refused

    def _admit(self, run: ReapRun, target: Target, *, refuse: bool = True) -> bool:
        """Add a held process to the reap unless `spare` keeps it (then it is let go of)
        or a rule refuses it (then abort or skip).

        The policy's refusals (pid 1, root-owned, users) and the classifier's own
        protections (protect pattern, SIGHUP ignored, keep marker, unreadable facts)
        apply to every process a reap would signal, read now; so does a stop this reap did
        not make (stopped_elsewhere): a member found stopped is never recorded, never
        signalled, so the ledger's "stopped already" is never true of what it records.
        """
        why = run.spare(target.info, run.view) if run.spare is not None else None
        if why is not None:  # kept: neither held nor walked below (hold_planned, collect)
            self.signaller.release(target)
            run.kept.append(Kept(target.member, why))
            return False
        refused = self._refusal(run, target.member, target.info, run.view)
        if refused is None:
            refused = self.stopped_elsewhere(target.info, run.view)
        if refused is not None:
            if target.fd is not None:
                os.close(target.fd)
            if refuse:
                raise Abort(refused[0], refused[1])
            run.notes.append(f"left {target.member.pid} alone: {refused[1]}")
            return False
        run.targets[target.member.pid] = target
        return True

    def collect(self, run: ReapRun, *, stop: bool, refuse: bool = True) -> list[Target]:
        """Children of live members not held yet: hold, admit, record and (when freezing)
        stop them, one generation at a time."""
        joined: list[Target] = []
        frontier = [t for t in run.targets.values() if not t.exited]
        while frontier:
            generation = self._next_generation(run, frontier, refuse=refuse)
            if generation and run.journal is not None:
                try:
                    run.write(Phase.JOINED, generation)
                    if stop:
                        run.mark(generation, held=True)
                except Abort:
                    if refuse:
                        raise
                    for target in generation:  # not recorded: not signalled
                        del run.targets[target.member.pid]
                        if target.fd is not None:
                            os.close(target.fd)
                            target.fd = None
                    run.notes.append(f"left {len(generation)} late joiner(s) unsignalled: "
                                     "the record naming them could not be written")
                    return joined
            if stop:
                for target in generation:
                    if refuse:  # the freeze: someone else's stop refuses the tree
                        self.stop(run, target)
                    else:  # after SIGTERM: a joiner found stopped was left alone
                        self.signaller.stop(run, target)
            joined.extend(generation)
            frontier = generation
        return joined

    def _too_large(self, run: ReapRun, who: str, members: int) -> Abort:
        """The refusal of a tree this reap cannot hold whole: `who` could not be held for
        want of a descriptor, with at least `members` members; what the reap stopped is
        continued by whoever catches the Abort."""
        limit = self.budget.describe() if self.budget is not None else "none was left"
        return Abort(DecisionReason.TREE_TOO_LARGE,
                     f"{who} could not be held: the tree has at least "
                     f"{members} member(s), each held by a descriptor for the whole reap, "
                     f"and {limit}; raise the open-file limit (LimitNOFILE=) to reap it")

    def _full(self, run: ReapRun) -> bool:
        """Whether one more held process would pass the budget (every target holds one)."""
        return self.budget is not None and len(run.targets) >= self.budget.available

    def _next_generation(self, run: ReapRun, frontier: list[Target], *,
                         refuse: bool) -> list[Target]:
        """The children of `frontier` not held yet, held and admitted."""
        generation: list[Target] = []
        for parent in frontier:
            for child in run.view.children(parent.member.pid) or ():
                if (child in run.targets or any(m.pid == child for m in run.released)
                        or any(k.member.pid == child for k in run.kept)):
                    continue
                full = self._full(run)
                target, why = ((None, Unheld.NO_DESCRIPTOR) if full else
                               self.signaller.open(run, child, None, parent=parent.info))
                if why == Unheld.NO_DESCRIPTOR:
                    abort = self._too_large(run, f"child {child} of member {parent.member.pid}",
                                            len(run.targets) + 1)
                    if refuse:
                        raise abort
                    run.notes.append(f"left {child} unsignalled: {abort.detail}")
                    continue
                if target is None and why not in _NOT_OURS:
                    detail = (f"child {child} of member {parent.member.pid} {why}: a "
                              "process that cannot be held cannot be judged")
                    if refuse:
                        raise Abort(Reason.MEMBER_UNKNOWN, detail)
                    run.notes.append(detail)
                if target is None or not self._admit(run, target, refuse=refuse):
                    continue
                generation.append(target)
        return generation
