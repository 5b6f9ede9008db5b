"""The launcher's pure core: which signals it takes, and what each event leads to.

An event is a signal, CMD's exit or the end of the --grace wait; decide() answers with a
Step (wait, forward a signal, start the grace wait, or finish), so that it is tested
without processes.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from gpuguard.base.compat import StrEnum
from gpuguard.launch.options import DEFAULT_GRACE_SECONDS as DEFAULT_GRACE_SECONDS
from gpuguard.launch.options import EXIT_PARENT_DIED, EXIT_SIGINT, Options
from gpuguard.launch.options import Exit as Exit

#: si_code of a signal the kernel generated itself: a terminal's Ctrl-C (or hangup) sent
#: to the foreground process group, CMD included.
SI_KERNEL = 0x80
#: The signals a terminal sends to its whole foreground group (CMD included): only for
#: these does SI_KERNEL mean "CMD has it already". The kernel raises others itself too
#: (an alarm() inherited across exec, SIGXCPU), meant for the launcher alone.
TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGWINCH})
#: The launcher's own parent-death signal: one nobody sends by hand. The kernel also sends
#: it when the parent's *thread* exits, so it means the parent died only if getppid() changed.
PDEATHSIG = int(signal.SIGRTMIN)
# EXIT_PARENT_DIED (128 + SIGHUP), EXIT_SIGINT (128 + SIGINT), DEFAULT_GRACE_SECONDS,
# Options and Exit live in options.py, which the Windows launcher shares.

#: The signals that end a run (besides PDEATHSIG and CMD's exit, seen through SIGCHLD).
TEARDOWN_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
#: Left at their defaults: job control (so Ctrl-Z stops the launcher with CMD and the shell
#: sees its job stop), synchronous faults (blocking them is undefined), and the uncatchable.
JOB_CONTROL = (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGCONT)
SYNCHRONOUS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP,
               signal.SIGSYS, signal.SIGABRT)
#: The signals the launcher passes on to CMD: every other one it can catch (unhandled, one
#: would kill the launcher without a teardown).
FORWARDED_SIGNALS = frozenset(signal.valid_signals()) - {
    *TEARDOWN_SIGNALS, *JOB_CONTROL, *SYNCHRONOUS, signal.SIGCHLD, PDEATHSIG,
    signal.SIGKILL, signal.SIGSTOP}


@dataclass(frozen=True)
class Signalled:
    signo: int
    from_terminal: bool  # the kernel sent it to the whole foreground group (si_code SI_KERNEL)
    parent_changed: bool  # getppid() differs from the pid that started us


@dataclass(frozen=True)
class CmdExited:
    status: int  # as waitpid() returns it


@dataclass(frozen=True)
class GraceOver:
    """--grace seconds passed since the first SIGINT and CMD still runs."""


Event = Signalled | CmdExited | GraceOver


class Next(StrEnum):
    WAIT = "wait"  # keep waiting (maybe after forwarding a signal)
    INTERRUPT = "interrupt"  # the first SIGINT: start the --grace wait
    FINISH = "finish"  # tear down (unless `reap` is False) and exit with `code`


@dataclass(frozen=True)
class Step:
    next: Next
    forward: int | None = None  # a signal to send CMD now
    code: int = 0  # the exit status, with FINISH
    reap: bool = True  # with FINISH: reap what is left of the tree first
    why: str = ""  # what the stderr line says happened
    dies_of: int | None = None  # with FINISH: end by this signal instead of exit(code)


def exit_status(status: int) -> int:
    """A waitpid() status as a shell reports it: the exit code, or 128 + the signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def decide(event: Event, *, interrupted: bool, options: Options) -> Step:
    """What the launcher does on `event`; `interrupted`: a first SIGINT was seen."""
    if isinstance(event, CmdExited):
        if interrupted:
            return Step(Next.FINISH, code=EXIT_SIGINT, why="CMD exited after SIGINT",
                        dies_of=signal.SIGINT)
        return Step(Next.FINISH, code=exit_status(event.status), reap=not options.keep_leftovers,
                    why=f"CMD exited with status {exit_status(event.status)}")
    if isinstance(event, GraceOver):
        return Step(Next.FINISH, code=EXIT_SIGINT,
                    why=f"CMD still ran {options.grace:g} s after SIGINT", dies_of=signal.SIGINT)
    if event.signo == PDEATHSIG:
        if not event.parent_changed:  # a thread of the parent exited; the parent lives
            return Step(Next.WAIT)
        return Step(Next.FINISH, code=EXIT_PARENT_DIED, why="the parent process died")
    if event.signo not in TEARDOWN_SIGNALS:
        # Passed on (a terminal's SIGQUIT or SIGWINCH reached CMD already).
        return Step(Next.WAIT, forward=None if event.from_terminal else event.signo)
    name = signal.Signals(event.signo).name
    if event.signo != signal.SIGINT:
        return Step(Next.FINISH, code=128 + event.signo, why=name, dies_of=event.signo)
    if interrupted:
        return Step(Next.FINISH, code=EXIT_SIGINT, why="a second SIGINT", dies_of=signal.SIGINT)
    # A terminal's Ctrl-C reached CMD with us: forwarding it would deliver it twice.
    return Step(Next.INTERRUPT, forward=None if event.from_terminal else signal.SIGINT)
