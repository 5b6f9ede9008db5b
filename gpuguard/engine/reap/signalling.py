"""Signals to held processes, identity checked: a handle (pidfd) is opened first, then
/proc says whether it is still the process meant; a pidfd keeps naming that process even
once its pid is reused. Also the bounded waits on what the signals did."""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import time
from collections.abc import Callable, Iterable

from gpuguard.engine.reap.outcome import KillPath, SignalRecord, SignalResult
from gpuguard.engine.reap.reap_run import Abort, NoPidfd, ReapRun, Target
from gpuguard.engine.reap.thaw_guardian import GuardianError, ThawGuardian
from gpuguard.engine.scan.inspection import member_of
from gpuguard.orphans.process import (
    EXITED_STATES,
    STOPPED_STATES,
    ProcInfo,
    ProcUnreadable,
    is_child_of,
    still_same,
)
from gpuguard.orphans.vocabulary import DecisionReason, Unheld

log = logging.getLogger("gpuguard.remediator.reaper")  # the reaper's log: one for all its parts

PidfdOpen = Callable[[int], int]
PidfdSend = Callable[[int, int], None]

#: The kernel's pidfd calls where this Python has them (3.9+ on Linux).
PIDFD_OPEN: PidfdOpen | None = getattr(os, "pidfd_open", None)
PIDFD_SEND: PidfdSend | None = getattr(signal, "pidfd_send_signal", None)

#: Poll granularity of the bounded waits.
POLL_SECONDS = 0.01
#: A thread in one of these states has stopped or has exited.
_STOPPED_OR_EXITED = STOPPED_STATES | EXITED_STATES
_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)


class Signaller:
    """Holds, signals and watches the targets of a reap; the only code that sends them."""

    def __init__(self, *, pidfd_open: PidfdOpen | None, pidfd_send: PidfdSend | None,
                 kill: Callable[[int, int], None], monotonic: Callable[[], float],
                 guardian: ThawGuardian | None = None) -> None:
        self._pidfd_open = pidfd_open if pidfd_send is not None else None
        self._pidfd_send = pidfd_send
        self._kill = kill
        self.monotonic = monotonic
        self.guardian = guardian  # continues what a reap stopped if this process dies

    @property
    def path(self) -> KillPath:
        """The kill path a new reap takes."""
        return KillPath.PIDFD if self._pidfd_open else KillPath.PID

    def drop_pidfd(self) -> None:
        """The kernel has no pidfd_open: every later reap takes the pid path."""
        self._pidfd_open = None

    # -- handles ---------------------------------------------------------------------

    def open(self, run: ReapRun, pid: int, start_time: int | None,
             parent: ProcInfo | None = None) -> tuple[Target | None, Unheld | str]:
        """Hold `pid`, then check it is the process we mean: (target, "") or (None, why).

        With `parent`, the process must (read after the handle is open) be a live
        child of it, and `parent` itself must still be the process the walk saw: a
        pid reused in between names someone else, and so do its children.
        """
        fd = None
        if run.path == KillPath.PIDFD:
            assert self._pidfd_open is not None
            try:
                fd = self._pidfd_open(pid)
            except OSError as exc:
                if exc.errno in (errno.ESRCH, errno.EINVAL):
                    return None, Unheld.EXITED
                if exc.errno == errno.ENOSYS:
                    raise NoPidfd() from exc
                if exc.errno in _NO_DESCRIPTOR:
                    return None, Unheld.NO_DESCRIPTOR
                return None, f"could not be opened ({exc.strerror})"
        try:
            info = run.view.fresh_stat(pid)
            # A zombie main thread with a live thread (pthread_exit()) is a live process.
            live = info is not None and info.is_live(run.view.thread_states)
        except ProcUnreadable as exc:
            if fd is not None:
                os.close(fd)
            cause = exc.__cause__
            if isinstance(cause, OSError) and cause.errno in _NO_DESCRIPTOR:
                return None, Unheld.NO_DESCRIPTOR
            return None, f"unreadable ({exc})"
        why: Unheld | str = ""
        if info is None or not live:
            why = Unheld.EXITED
        elif start_time is not None and info.start_time != start_time:
            why = Unheld.REPLACED
        elif parent is not None and not is_child_of(info, parent, run.view.thread_states):
            why = Unheld.REPARENTED
        elif parent is not None and not still_same(self.fresh(run, parent.pid), parent):
            why = Unheld.PARENT_REPLACED
        if why:
            if fd is not None:
                os.close(fd)
            return None, why
        assert info is not None
        return Target(member_of(info, run.view), info, fd), ""

    @staticmethod
    def release(target: Target) -> None:
        if target.fd is not None:
            os.close(target.fd)
            target.fd = None

    @staticmethod
    def close(run: ReapRun) -> None:
        for target in run.targets.values():
            if target.fd is not None:
                try:
                    os.close(target.fd)
                except OSError:
                    pass
                target.fd = None

    # -- signals ---------------------------------------------------------------------

    def send(self, run: ReapRun, target: Target, sig: int) -> str:
        """Signal `target`: its SignalResult, or "error: <why>"; recorded in `run`."""
        pid = target.member.pid
        result: str
        try:
            if target.fd is not None:
                assert self._pidfd_send is not None
                self._pidfd_send(target.fd, sig)
            else:
                # The weaker path: re-verify right before signalling (a small reuse window stays).
                info = run.view.fresh_stat(pid)
                if info is None or info.start_time != target.member.start_time:
                    result = SignalResult.GONE
                    target.exited = True
                    run.signals.append(self._record(run, pid, sig, result))
                    return result
                self._kill(pid, sig)
            result = SignalResult.SENT
        except ProcessLookupError:
            result = SignalResult.GONE
            target.exited = True
        except OSError as exc:
            result = f"{SignalResult.ERROR}: {exc.strerror}"
        run.signals.append(self._record(run, pid, sig, result))
        return result

    def _record(self, run: ReapRun, pid: int, sig: int, result: str) -> SignalRecord:
        return SignalRecord(pid, signal.Signals(sig).name, result,
                            (self.monotonic() - run.started) * 1000)

    def stop(self, run: ReapRun, target: Target,
             check: Callable[[], None] | None = None) -> None:
        """SIGSTOP, and from here on the member is this reap's: flagged before the signal
        (an exception, a signal's Interrupted, landing right after the kernel took the
        SIGSTOP still finds the member to continue) and handed to the thaw guardian first,
        whatever /proc said before: "ours" is what this reap did. `check` (Freezer.stop:
        is it stopped by someone else?) runs after the hand-over, which may wait for the
        guardian, right before the signal; when it raises, the member was never this
        reap's: the flag goes back and the guardian lets go of it."""
        previous = target.stopped
        target.stopped = True
        if not previous:
            self._guard(run, target, previous)
            if check is not None:
                try:
                    check()
                except BaseException:
                    target.stopped = previous
                    self.unguard([target])
                    raise
        if self.send(run, target, signal.SIGSTOP) != SignalResult.SENT:
            target.stopped = previous

    def _guard(self, run: ReapRun, target: Target, previous: bool) -> None:
        """The thaw guardian takes the member's pidfd before its SIGSTOP; when it cannot,
        the member is not stopped and the reap ends (what it stopped is continued)."""
        if self.guardian is None or run.path == KillPath.PID:
            return  # no guardian (a test's reaper, `gpuguard run`), or nothing to hand it
        try:
            if target.fd is None:
                raise GuardianError(f"no pidfd of {target.member.pid} to hand over")
            self.guardian.hold(target.member.pid, target.fd)
        except GuardianError as exc:
            target.stopped = previous
            raise Abort(DecisionReason.GUARDIAN_FAILED,
                        f"{exc}; {target.member.pid} was not stopped: a "
                        "freeze nothing would continue if this process died") from None

    def thaw(self, run: ReapRun) -> None:
        """Undo a partial freeze: an aborted reap must leave the tree as it found it (a
        member someone else had stopped was refused, never signalled: it stays stopped).
        Every member this reap stopped gets its SIGCONT even when one of them raises (that
        is raised at the end); a thaw that runs again sends only what is still owed. The
        crash ledger then holds none it did not stop, or has continued, as held."""
        failure: BaseException | None = None
        continued: list[Target] = []
        for target in list(run.targets.values()):
            if target.stopped and not target.exited:
                try:
                    if self.send(run, target, signal.SIGCONT) in (SignalResult.SENT,
                                                                  SignalResult.GONE):
                        target.stopped = False
                        continued.append(target)
                except BaseException as exc:  # the next member is still continued
                    failure = failure or exc
        run.mark([t for t in run.targets.values() if not t.stopped], held=False)
        self.unguard(continued)
        if failure is not None:
            raise failure

    def resume(self, run: ReapRun, targets: list[Target]) -> None:
        """SIGCONT each of `targets`; the ones it reached are no longer the reap's to
        continue, nor held stopped as far as crash recovery is concerned."""
        continued = []
        for target in targets:
            if self.send(run, target, signal.SIGCONT) in (SignalResult.SENT, SignalResult.GONE):
                target.stopped = False
                continued.append(target)
        run.mark(continued, held=False)
        self.unguard(continued)

    def unguard(self, targets: list[Target]) -> None:
        """Continued by the reap itself: the guardian lets go of them."""
        if self.guardian is not None and targets:
            self.guardian.let_go([t.member.pid for t in targets if t.fd is not None])

    # -- what /proc shows now ----------------------------------------------------------

    @staticmethod
    def fresh(run: ReapRun, pid: int) -> ProcInfo | None:
        """stat now; unreadable counts as unknown, which every caller treats as not-same."""
        try:
            return run.view.fresh_stat(pid)
        except ProcUnreadable:
            return None

    @staticmethod
    def alive_info(run: ReapRun, target: Target) -> ProcInfo | None:
        """The member as /proc shows it now; None (and marked exited) once every thread of
        it has exited (gone, or a zombie with no live thread), or the pid names someone
        else. A zombie main thread with a live thread (pthread_exit()) is alive, and so
        is a member whose stat or threads cannot be read (its last known facts are
        returned): it is never confirmed gone on a guess."""
        if target.exited:
            return None
        try:
            info = run.view.fresh_stat(target.member.pid)
            live = (info is not None and info.start_time == target.member.start_time
                    and info.is_live(run.view.thread_states))
        except ProcUnreadable:
            return target.info
        if not live:
            target.exited = True
            return None
        return info

    def gone(self, run: ReapRun, target: Target) -> bool:
        return self.alive_info(run, target) is None

    @staticmethod
    def maybe_stopped(run: ReapRun, target: Target) -> bool:
        """Whether a thread of the process may be stopped: its main thread shows T, or it
        is a zombie main thread (pthread_exit()) with a thread in T, or one whose threads
        cannot be read (a SIGCONT too many changes nothing; one too few leaves it stopped)."""
        if target.info.is_stopped:
            return True
        if not target.info.is_zombie:
            return False
        try:
            states = run.view.thread_states(target.member.pid)
        except ProcUnreadable:
            return True
        return states is not None and any(state in STOPPED_STATES for state in states)

    def stopped_or_gone(self, run: ReapRun, target: Target) -> bool:
        info = self.alive_info(run, target)
        if info is None:
            return True
        if not info.is_stopped and not info.is_zombie:
            return False
        # Every thread, not just the main one: a thread mid-fork links its child first.
        # (A zombie main thread is alive through its other threads: they must show T.)
        try:
            states = run.view.thread_states(target.member.pid)
        except ProcUnreadable:
            return False  # not known to be stopped; the wait is bounded
        if states is None:
            target.exited = True
            return True
        return all(state in _STOPPED_OR_EXITED for state in states)

    # -- bounded waits ---------------------------------------------------------------

    def wait_stopped(self, run: ReapRun, until: float,
                     targets: list[Target] | None = None) -> None:
        """Poll (bounded) until every member (or every one of `targets`) is stopped or gone."""
        while not all(self.stopped_or_gone(run, t)
                      for t in (targets if targets is not None else list(run.targets.values()))):
            if self.monotonic() >= until:
                return
            time.sleep(POLL_SECONDS / 5)

    @staticmethod
    def sleep_until_exit(alive: Iterable[Target], seconds: float) -> None:
        fds = [t.fd for t in alive if t.fd is not None]
        if fds:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            poller.poll(seconds * 1000)  # a pidfd turns readable when its process exits
        else:
            time.sleep(min(seconds, POLL_SECONDS))
