"""Holding and acting on Windows processes for a reap: the back-end protocol (a handle by
pid, the process table), the state of one reap (WinRun, WinTarget) and the hands that
suspend, resume and terminate targets, each step checked and recorded
(gpuguard/engine/windows/reaper.py runs the phases).

A handle is opened before a process's identity (pid and creation time) is checked; while
it is open the process object, and so its pid, outlives the process's exit, so every
step through it reaches the process checked and no other (a pidfd's guarantee). Steps
are recorded as SignalRecords named SUSPEND, RESUME and TERMINATE: Windows has no signals.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from gpuguard.engine.reap.outcome import KillPath, SignalRecord, SignalResult
from gpuguard.engine.reap.reap_run import Abort, Held, Run
from gpuguard.host.windows.tree import WinProc
from gpuguard.orphans.vocabulary import Reason, Unheld

log = logging.getLogger("gpuguard.remediator.reaper")  # the reaper's log: one for all its parts

#: What the records call each step (SignalRecord.signal): Windows has no signals.
SUSPEND, RESUME, TERMINATE = "SUSPEND", "RESUME", "TERMINATE"
#: Exit code a terminated member gets: 128 + SIGKILL, what a shell shows for a kill.
TERMINATE_EXIT_CODE = 137
#: How long one freeze pass waits for suspended members to show every thread suspended
#: (a thread inside a system call, CreateProcess say, suspends when it returns: its
#: child is then in the table); the pass goes on regardless after it.
SUSPEND_CONFIRM_SECONDS = 1.0
#: Poll granularity of that wait.
POLL_SECONDS = 0.005

class Handle(Protocol):
    """An open handle on one process (gpuguard.host.windows.handles.ProcessHandle)."""

    pid: int

    def create_time(self) -> int: ...
    def parent_pid(self) -> int: ...
    def running(self) -> bool: ...
    def wait(self, seconds: float) -> bool: ...
    def suspend(self) -> None: ...
    def resume(self) -> None: ...
    def suspended(self) -> bool: ...
    def terminate(self, exit_code: int) -> None: ...
    def close(self) -> None: ...


class ProcessControl(Protocol):
    """What the reaper asks of Windows: a handle by pid (None: no such process; OSError:
    there is one and it may not be opened), and the process table now."""

    def open(self, pid: int) -> Handle | None: ...
    def table(self) -> Mapping[int, WinProc]: ...


class WindowsControl:
    """The real back-end: kernel32/ntdll handles and psutil's table (host/windows/)."""

    def open(self, pid: int) -> Handle | None:
        from gpuguard.host.windows.handles import open_process

        return open_process(pid)

    def table(self) -> Mapping[int, WinProc]:
        from gpuguard.host.windows.processes import read_table

        return read_table()


@dataclass
class WinTarget(Held):
    """A process the reap holds: as judged, its row as read, and its handle."""

    row: WinProc
    handle: Handle | None
    suspended: bool = False  # suspended by this reap (once): every way out resumes it
    exited: bool = False


@dataclass(kw_only=True)
class WinRun(Run[WinTarget]):
    """One reap on Windows (recheck.FrozenRun reads it too): through handles, always;
    its steps are suspends and terminates."""

    STOPPED: ClassVar[str] = "suspended"
    SENT: ClassVar[str] = "suspended or terminated"
    CONTINUED: ClassVar[str] = "resumed"
    KILL_STEPS: ClassVar[tuple[str, ...]] = (TERMINATE,)
    KILLED: ClassVar[str] = "members had been terminated"

    path: KillPath = KillPath.HANDLE


class Hands:
    """Holds, checks, suspends, resumes and terminates targets; records each step."""

    def __init__(self, control: ProcessControl, monotonic: Callable[[], float]) -> None:
        self.control = control
        self.monotonic = monotonic

    def record(self, run: WinRun, pid: int, step: str, result: str) -> str:
        run.signals.append(SignalRecord(pid, step, result, (self.monotonic() - run.started)
                                        * 1000))
        return result

    def hold(self, row: WinProc, *, parent: int | None = None) -> tuple[Handle | None, str]:
        """A handle on the process of `row`, checked to be that process: (handle, "") or
        (None, why): "exited", "replaced" (a later process at the pid), or "could not be
        opened (...)" / "could not be checked (...)" / "has parent ...".

        `parent`, when given, is the parent pid the process must have, read through the
        handle (its own, not a table row's: a row's ppid comes from a system snapshot
        taken at another moment, and a pid reused in between mixes a dead process's
        ppid with a stranger's identity)."""
        try:
            handle = self.control.open(row.pid)
        except OSError as exc:
            return None, f"could not be opened ({exc})"
        if handle is None:
            return None, Unheld.EXITED
        try:
            created, running = handle.create_time(), handle.running()
            why: Unheld | str = (Unheld.REPLACED if created != row.create_time
                                  else "" if running else Unheld.EXITED)
            if not why and parent is not None:
                actual = handle.parent_pid()
                if actual != parent:
                    why = (f"has parent {actual} by its handle, not {parent}: its table row "
                           "mixed two processes, or it is not the process judged")
        except OSError as exc:
            handle.close()
            return None, f"could not be checked ({exc})"
        if why:
            handle.close()
            return None, why
        return handle, ""

    def same(self, target: WinTarget) -> bool:
        """Right before a step: the handle still names the member's process and it runs.
        False (and exited) once it is gone; Abort when it can no longer be checked."""
        if target.exited or target.handle is None:
            return False
        try:
            same = (target.handle.create_time() == target.member.start_time
                    and target.handle.running())
        except OSError as exc:
            raise Abort(Reason.MEMBER_UNKNOWN, f"member {target.member.pid} "
                        f"({target.member.comm}) could not be checked ({exc})") from None
        if not same:
            target.exited = True
        return same

    def suspend(self, run: WinRun, target: WinTarget) -> None:
        """NtSuspendProcess, the identity checked right before, its crash-ledger mark
        (held) set for this target alone: right before the call for a process that runs,
        right after it for one its owner had suspended already. Crash recovery resumes
        only what is marked, so it never resumes a process the reap had not suspended
        yet whose owner had (a crash between the call and the mark leaves that one with
        the reap's suspension too: suspended, as its owner left it)."""
        if not self.same(target):
            self.record(run, target.member.pid, SUSPEND, SignalResult.GONE)
            return
        assert target.handle is not None
        already = self._already_suspended(target)
        if not already:
            run.mark([target], held=True)
        # Flagged before the call: an Interrupted landing right after it took effect
        # still finds the member to resume.
        target.suspended = True
        try:
            target.handle.suspend()
        except OSError as exc:
            target.suspended = False
            self.record(run, target.member.pid, SUSPEND, f"{SignalResult.ERROR}: {exc}")
            if not already:
                run.mark([target], held=False)
            return
        self.record(run, target.member.pid, SUSPEND, SignalResult.SENT)
        if already:
            run.mark([target], held=True)

    @staticmethod
    def _already_suspended(target: WinTarget) -> bool:
        """Whether the owner had suspended it before this reap (False: cannot tell)."""
        assert target.handle is not None
        try:
            return target.handle.suspended()
        except OSError:
            return False

    def resume(self, run: WinRun, targets: Iterable[WinTarget]) -> None:
        """Resume every one of `targets` this reap suspended; each is tried even when one
        raises (raised at the end); resuming again sends only what is still owed."""
        failure: BaseException | None = None
        resumed: list[WinTarget] = []
        for target in list(targets):
            if not target.suspended or target.handle is None:
                continue
            if self._replaced(target):  # never resume a process that is not ours
                target.suspended = False
                self.record(run, target.member.pid, RESUME, SignalResult.GONE)
                continue
            try:
                target.handle.resume()
                result: str = SignalResult.SENT
            except OSError as exc:
                result = (SignalResult.GONE if not self._running(target)
                          else f"{SignalResult.ERROR}: {exc}")
            except BaseException as exc:  # the next member is still resumed
                failure = failure or exc
                continue
            self.record(run, target.member.pid, RESUME, result)
            if result in (SignalResult.SENT, SignalResult.GONE):
                target.suspended = False
                resumed.append(target)
        run.mark(resumed, held=False)
        if failure is not None:
            raise failure

    def terminate(self, run: WinRun, target: WinTarget) -> None:
        """TerminateProcess, the identity checked right before (after every audit record
        naming it was written)."""
        try:
            same = self.same(target)
        except Abort as abort:
            self.record(run, target.member.pid, TERMINATE, f"{SignalResult.ERROR}: "
                        f"{abort.detail}")
            return
        if not same:
            self.record(run, target.member.pid, TERMINATE, SignalResult.GONE)
            return
        assert target.handle is not None
        try:
            target.handle.terminate(TERMINATE_EXIT_CODE)
        except OSError as exc:
            self.record(run, target.member.pid, TERMINATE, f"{SignalResult.ERROR}: {exc}")
            return
        self.record(run, target.member.pid, TERMINATE, SignalResult.SENT)

    def wait_suspended(self, run: WinRun, seconds: float) -> None:
        """Poll (bounded) until every target this reap suspended shows every thread
        suspended, or is gone; a target that cannot say counts as not yet."""
        until = self.monotonic() + seconds
        pending = [t for t in run.targets.values() if t.suspended and t.handle is not None]
        while pending and self.monotonic() < until:
            pending = [t for t in pending if not self._settled(t)]
            if pending:
                time.sleep(POLL_SECONDS)

    @staticmethod
    def _settled(target: WinTarget) -> bool:
        assert target.handle is not None
        try:
            return target.handle.suspended() or not target.handle.running()
        except OSError:
            return False

    def wait_gone(self, run: WinRun, seconds: float) -> list[WinTarget]:
        """Wait (bounded) until every target has exited: the ones that have not."""
        until = self.monotonic() + seconds
        alive = []
        for target in run.targets.values():
            if target.exited or target.handle is None:
                continue
            try:
                gone = target.handle.wait(max(0.0, until - self.monotonic()))
            except OSError:
                gone = False  # never confirmed gone on a guess
            if gone:
                target.exited = True
            else:
                alive.append(target)
        return alive

    @staticmethod
    def _replaced(target: WinTarget) -> bool:
        """The handle names another process than the member (a back-end that names by
        pid): only a positive read says so; one that fails still resumes."""
        try:
            return target.handle is not None and (
                target.handle.create_time() != target.member.start_time)
        except OSError:
            return False

    @staticmethod
    def _running(target: WinTarget) -> bool:
        try:
            return target.handle is not None and target.handle.running()
        except OSError:
            return True

    @staticmethod
    def close(run: WinRun) -> None:
        for target in run.targets.values():
            if target.handle is not None:
                try:
                    target.handle.close()
                except OSError:
                    pass
                target.handle = None

