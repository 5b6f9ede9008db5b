"""`gpuguard run -- CMD` on Windows: CMD in a Job Object that dies with the launcher.

Windows never reparents a process and has no parent-death signal, so what holds the tree
is a Job Object (gpuguard/host/windows/jobs.py): CMD starts suspended, is assigned to a
job created with JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE, and only then runs; everything it
starts joins the job. The job's only handle is the launcher's, so however the launcher
ends (an exit, a crash, TerminateProcess from Task Manager), Windows closes it and ends
every process in the job: the whole tree dies with the launcher.

While CMD runs the launcher waits on CMD and on its own parent (a handle on the process
it was started by, checked by creation time; os.getppid() is never used: it aborts
Python >= 3.12 under Wine). A parent already gone when the launcher starts (a shell or a
scheduler that started it and exited) cannot die during the run: there is none to watch.
The launcher ends the run, as on Linux, when CMD exits (the job is terminated then,
unless --keep-leftovers: then the leftovers are let go of), when its parent dies (exit
129), on a second Ctrl-C or --grace seconds after the first (exit 130: the console's
Ctrl-C reaches CMD as well), or on Ctrl-Break (exit 128 + SIGBREAK).
Windows has no SIGTERM to send a tree, so the teardown is TerminateJobObject at once.
The `run` mark of the daemons' directory is Linux's; on Windows the GPUGUARD_RUN
marker is set and the job itself is what no process of CMD's can leave.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

from gpuguard.host.launchers import RUN_MARKER
from gpuguard.host.windows.handles import (
    PROCESS_QUERY_LIMITED_INFORMATION,
    SYNCHRONIZE,
    ProcessHandle,
    open_process,
    wait_any_interruptibly,
)
from gpuguard.host.windows.jobs import KILLED_EXIT_CODE, JobAssignError, JobObject, spawn_in_job
from gpuguard.host.windows.tree import TOP_PIDS, WinProc, display_name
from gpuguard.launch.options import (
    EXIT_PARENT_DIED,
    EXIT_SIGINT,
    CannotStart,
    Exit,
    Options,
    Unsupported,
)
from gpuguard.launch.stderr import say

#: How long the teardown waits for the job to be empty before it reports who is left.
TEARDOWN_CONFIRM_SECONDS = 5.0
#: The longest one wait lasts before a Ctrl-C is seen (ctypes calls are not interrupted).
WAIT_SLICE_SECONDS = 0.1
WATCH_ACCESS = SYNCHRONIZE | PROCESS_QUERY_LIMITED_INFORMATION


# -- the pure core: what each event leads to -----------------------------------------------

@dataclass(frozen=True)
class CmdExited:
    code: int


@dataclass(frozen=True)
class ParentDied:
    """The process that started the launcher has exited."""


@dataclass(frozen=True)
class CtrlC:
    """Ctrl-C in the console (KeyboardInterrupt): CMD, on the same console, has it too."""


@dataclass(frozen=True)
class Stopped:
    """Ctrl-Break (SIGBREAK) or SIGTERM: end the run now."""

    signo: int


@dataclass(frozen=True)
class GraceOver:
    """--grace seconds passed since the first Ctrl-C and CMD still runs."""


Event = CmdExited | ParentDied | CtrlC | Stopped | GraceOver


@dataclass(frozen=True)
class Finish:
    code: int
    reap: bool  # terminate the job (else: let the leftovers go)
    why: str


def decide(event: Event, *, interrupted: bool, options: Options) -> Finish | None:
    """How the run ends on `event` (None: keep waiting; after a first Ctrl-C the caller
    starts the --grace wait). `interrupted`: a first Ctrl-C was seen."""
    if isinstance(event, CmdExited):
        if interrupted:
            return Finish(EXIT_SIGINT, True, "CMD exited after Ctrl-C")
        return Finish(event.code, not options.keep_leftovers,
                      f"CMD exited with status {event.code}")
    if isinstance(event, GraceOver):
        return Finish(EXIT_SIGINT, True, f"CMD still ran {options.grace:g} s after Ctrl-C")
    if isinstance(event, ParentDied):
        return Finish(EXIT_PARENT_DIED, True, "the parent process died")
    if isinstance(event, Stopped):
        name = signal.Signals(event.signo).name if event.signo in signal.valid_signals() \
            else f"signal {event.signo}"
        return Finish(128 + event.signo, True, name)
    if interrupted:
        return Finish(EXIT_SIGINT, True, "a second Ctrl-C")
    return None


def teardown_line(why: str, reaped: Sequence[tuple[int, str]],
                  left: Sequence[int]) -> str | None:
    """The one stderr line of a teardown; None when there was nothing to end."""
    if not reaped and not left:
        return None
    line = f"gpuguard run: {why}: reaped {len(reaped)} process(es)"
    if reaped:
        line += ": " + ", ".join(f"{pid} ({name})" for pid, name in reaped)
    if left:
        line += (f"; {len(left)} still in the job after {TEARDOWN_CONFIRM_SECONDS:g} s: "
                 + ", ".join(str(pid) for pid in left))
    return line


# -- the shell ----------------------------------------------------------------------------

class _Stop(BaseException):
    """Raised by the Ctrl-Break and SIGTERM handlers into the wait."""

    def __init__(self, signo: int) -> None:
        super().__init__(signo)
        self.signo = signo


@contextmanager
def _stops() -> Iterator[None]:
    """Ctrl-Break and SIGTERM end the wait (as _Stop) while CMD runs; the previous
    handlers come back after. An ignored one stays ignored."""
    saved = {}
    for name in ("SIGBREAK", "SIGTERM"):
        signo = getattr(signal, name, None)
        if signo is None or signal.getsignal(signo) is signal.SIG_IGN:
            continue

        def stop(signum: int, _frame: FrameType | None) -> None:
            raise _Stop(signum)

        saved[signo] = signal.signal(signo, stop)
    try:
        yield
    finally:
        for signo, handler in saved.items():
            signal.signal(signo, handler if handler is not None else signal.SIG_DFL)


def _me_and_parent() -> tuple[WinProc, ProcessHandle | None]:
    """This process's row, and a handle on its parent to watch (None when there is none
    to watch: System at the top, a parent gone before the launcher started, such as a
    shell or scheduler that started it and exited, or one it may not open; CMD's tree
    dies with the launcher either way)."""
    from gpuguard.host.windows.processes import read_one

    me = read_one(os.getpid())
    if me is None or not me.timed:
        raise Unsupported("the launcher could not read its own process (psutil)")
    parent = read_one(me.ppid) if me.ppid not in TOP_PIDS else None
    if parent is None or not parent.timed or parent.create_time > me.create_time:
        return me, None  # gone already, or a later process at its pid
    try:
        handle = open_process(me.ppid, WATCH_ACCESS)
    except OSError as exc:
        say(f"gpuguard run: cannot watch the parent process {me.ppid} ({exc}); CMD's tree "
            "still dies with the launcher")
        return me, None
    if handle is not None and handle.create_time() != parent.create_time:
        handle.close()
        handle = None
    return me, handle


def supervise(cmd_handle: ProcessHandle, wait_code: Callable[[], int],
              parent: ProcessHandle | None, options: Options) -> Finish:
    """Wait until something ends the run (see the module doc)."""
    handles = [cmd_handle, *([parent] if parent is not None else [])]
    interrupted_until: float | None = None
    while True:
        event: Event
        try:
            left = None if interrupted_until is None else max(
                0.0, interrupted_until - time.monotonic())
            index = wait_any_interruptibly(handles, left, WAIT_SLICE_SECONDS)
            event = (GraceOver() if index is None else CmdExited(wait_code()) if index == 0
                     else ParentDied())
        except KeyboardInterrupt:
            event = CtrlC()
        except _Stop as stop:
            event = Stopped(stop.signo)
        finish = decide(event, interrupted=interrupted_until is not None, options=options)
        if finish is not None:
            return finish
        if isinstance(event, CtrlC):
            interrupted_until = time.monotonic() + options.grace


def end_job(job: JobObject, why: str) -> str | None:
    """Terminate every process in the job and wait (bounded) until it is empty: the line."""
    from gpuguard.host.windows.processes import read_one

    pids = job.pids()
    names = []
    for pid in pids:
        row = read_one(pid)
        names.append((pid, display_name(row) if row is not None else "?"))
    if pids:
        job.terminate(KILLED_EXIT_CODE)
    until = time.monotonic() + TEARDOWN_CONFIRM_SECONDS
    left = job.pids()
    while left and time.monotonic() < until:
        time.sleep(0.01)
        left = job.pids()
    return teardown_line(why, [n for n in names if n[0] not in left], left)


def run(argv: Sequence[str], options: Options) -> Exit:
    """Run CMD in a kill-on-close job until something ends the run, then end the job (or
    let the leftovers go): how the launcher must exit."""
    me, parent = _me_and_parent()
    try:
        try:
            job = JobObject(kill_on_close=True)
        except OSError as exc:
            raise Unsupported(f"could not create a Job Object ({exc})") from None
        try:
            return _run_in(job, argv, me, parent, options)
        finally:
            job.close()  # kill on close: whatever is still in the job ends with it
    finally:
        if parent is not None:
            parent.close()


def _run_in(job: JobObject, argv: Sequence[str], me: WinProc, parent: ProcessHandle | None,
            options: Options) -> Exit:
    env = {**os.environ, RUN_MARKER: f"{me.pid}:{me.create_time}"}
    try:
        cmd, _ = spawn_in_job(argv, job=job, env=env, close_fds=False)
    except JobAssignError as exc:
        raise Unsupported(str(exc)) from None
    except OSError as exc:  # CreateProcess failed: nothing was started
        raise CannotStart(exc) from None
    # Popen holds CMD's handle: its pid names CMD until it is waited for.
    handle = open_process(cmd.pid, WATCH_ACCESS)
    if handle is None:  # exited already (and waited for by nobody: its code is there)
        finish = decide(CmdExited(cmd.wait()), interrupted=False, options=options)
    else:
        with handle, _stops():
            finish = supervise(handle, cmd.wait, parent, options)
    assert finish is not None
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the teardown is not interrupted
    try:
        if finish.reap:
            line = end_job(job, finish.why)
            if line is not None:
                say(line)
        else:
            job.set_kill_on_close(False)  # --keep-leftovers: closing the job lets them be
    finally:
        signal.signal(signal.SIGINT, previous)
    if cmd.returncode is None:
        cmd.returncode = finish.code  # ended with the job: Popen must not wait again
    return Exit(finish.code)
