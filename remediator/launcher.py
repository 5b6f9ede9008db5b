"""`gpuguard run -- CMD`: a launcher whose whole process tree dies with it.

Detection and reaping are the cure; this is prevention. The launcher ties together
what Linux already has: it becomes a child subreaper (every descendant that loses its
parent, double forks and `setsid` daemons included, is adopted by the launcher and
stays in its tree), asks for a parent-death signal on itself (so the death of whoever
started it, even by SIGKILL, reaches it) and sets a parent-death SIGKILL on CMD (so a
SIGKILLed launcher still takes CMD down). It tears the tree down with the remediator's
own verified reap (remediator/reaper.py: identity by pidfd + start time, freeze, TERM,
grace, KILL, confirm), never with a pid list or a process-group kill.

Decisions (README "Prevention: gpuguard run" has the user's side):

- CMD stays in the launcher's process group: a terminal's job control then works as
  without the launcher (CMD may read the terminal, Ctrl-Z stops both), and a caller's
  `killpg` still reaches CMD and everything that stayed in the group. A terminal's
  Ctrl-C therefore reaches CMD and the launcher together; the kernel marks such a
  SIGINT SI_KERNEL, and the launcher then does not forward it (no double delivery).
  A SIGINT sent to the launcher alone (kill(2): SI_USER) is forwarded to CMD.
- The launcher's own parent-death signal is SIGRTMIN, not a signal anybody sends by
  hand: the kernel also sends it when the *thread* that started the launcher exits
  while its process lives on (a thread pool), so it counts as the parent's death only
  when getppid() changed; the launcher then exits 129, as for a hangup.
- CMD is spawned by subprocess with a preexec_fn, which is safe because the launcher
  is single-threaded (checked before the fork): it sets CMD's parent-death SIGKILL,
  checks the launcher did not die in between, and restores the signal mask. A
  parent-death signal also fires when the parent *thread* exits, another reason to
  keep one thread.
- Signals are blocked and taken with sigwaitinfo/sigtimedwait: the launcher sleeps in
  the kernel while CMD runs (no polling) and handles one event at a time.
"""

from __future__ import annotations

import ctypes
import enum
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gpuguard.exporter.classify import Rules
from gpuguard.exporter.config import Remediate, UserFilter
from gpuguard.exporter.counters import Counters
from gpuguard.exporter.nvml import NvmlReading
from gpuguard.exporter.procfs import RUN_MARKER, ProcessView, ProcInfo, is_child_of, walk_members
from gpuguard.remediator.inspection import member_of, protected_pids
from gpuguard.remediator.policy import Member, TreeKey
from gpuguard.remediator.reaper import Outcome, Reaper, ReapPlan, ReapResult

#: The pid that started us, read at import: the start-up before the parent-death request
#: is the window in which a parent's death would go unnoticed; this check narrows it.
PARENT_AT_IMPORT = os.getppid()

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: si_code of a signal the kernel generated itself: a terminal's Ctrl-C (or hangup) sent
#: to the foreground process group, CMD included.
SI_KERNEL = 0x80
#: The launcher's own parent-death signal (see the module docstring).
PDEATHSIG = int(signal.SIGRTMIN)
#: Exit status after the parent's death: the shell's for a hangup (128 + SIGHUP).
EXIT_PARENT_DIED = 128 + signal.SIGHUP
EXIT_SIGINT = 128 + signal.SIGINT
DEFAULT_GRACE_SECONDS = 5.0
#: A tree that grows faster than it can be frozen this long is left (and reported).
REAP_DEADLINE_SECONDS = 30.0
#: Rounds of "reap every child of the launcher": each round catches what a dying
#: member handed back to the launcher after the previous one listed its children.
MAX_ROUNDS = 5

#: The signals that end a run (besides PDEATHSIG and CMD's exit, seen through SIGCHLD).
TEARDOWN_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)


# -- the pure part: which event leads to what ---------------------------------------------


@dataclass(frozen=True)
class Options:
    grace: float = DEFAULT_GRACE_SECONDS  # SIGINT -> reap wait, and the reap's TERM -> KILL
    keep_leftovers: bool = False  # when CMD exits by itself, leave its leftovers running


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


class Next(enum.Enum):
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


def exit_status(status: int) -> int:
    """A waitpid() status as a shell reports it: the exit code, or 128 + the signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def decide(event: Event, *, interrupted: bool, options: Options) -> Step:
    """What the launcher does on `event`; `interrupted`: a first SIGINT was seen."""
    if isinstance(event, CmdExited):
        if interrupted:
            return Step(Next.FINISH, code=EXIT_SIGINT, why="CMD exited after SIGINT")
        return Step(Next.FINISH, code=exit_status(event.status), reap=not options.keep_leftovers,
                    why=f"CMD exited with status {exit_status(event.status)}")
    if isinstance(event, GraceOver):
        return Step(Next.FINISH, code=EXIT_SIGINT,
                    why=f"CMD still ran {options.grace:g} s after SIGINT")
    if event.signo == PDEATHSIG:
        if not event.parent_changed:  # a thread of the parent exited; the parent lives
            return Step(Next.WAIT)
        return Step(Next.FINISH, code=EXIT_PARENT_DIED, why="the parent process died")
    name = signal.Signals(event.signo).name
    if event.signo != signal.SIGINT:
        return Step(Next.FINISH, code=128 + event.signo, why=name)
    if interrupted:
        return Step(Next.FINISH, code=EXIT_SIGINT, why="a second SIGINT")
    # A terminal's Ctrl-C reached CMD with us: forwarding it would deliver it twice.
    return Step(Next.INTERRUPT, forward=None if event.from_terminal else signal.SIGINT)


@dataclass(frozen=True)
class Teardown:
    """What the reaps of one teardown did, for the one stderr line."""

    killed: tuple[Member, ...] = ()
    survivors: tuple[Member, ...] = ()
    problems: tuple[str, ...] = ()  # reaps that refused or failed, and why


def summarise(results: Sequence[ReapResult], left: Sequence[ProcInfo]) -> Teardown:
    killed: list[Member] = []
    survivors: list[Member] = []
    problems: list[str] = []
    for result in results:
        if result.outcome in (Outcome.REAPED, Outcome.FAILED):
            gone = set(result.survivors)
            killed += [m for m in result.members if m.pid not in gone]
            survivors += [m for m in result.members if m.pid in gone]
        elif result.reason not in ("root-gone", "root-replaced"):  # exited by itself: fine
            problems.append(f"{result.reason}: {result.detail}")
    if left and not survivors:
        problems.append(f"{len(left)} process(es) still below the launcher after "
                        f"{MAX_ROUNDS} rounds")
    return Teardown(tuple(killed), tuple(survivors), tuple(problems))


def teardown_line(why: str, teardown: Teardown) -> str | None:
    """The one stderr line a teardown writes; None when there was nothing to reap."""
    if not (teardown.killed or teardown.survivors or teardown.problems):
        return None

    def names(members: Sequence[Member]) -> str:
        return ", ".join(f"{m.pid} ({m.comm})" for m in members)

    parts = [f"gpuguard run: {why}: reaped {len(teardown.killed)} process(es)"
             + (f": {names(teardown.killed)}" if teardown.killed else "")]
    if teardown.survivors:
        parts.append(f"{len(teardown.survivors)} survived SIGKILL: {names(teardown.survivors)}")
    parts += teardown.problems
    return "; ".join(parts)


# -- the imperative shell ------------------------------------------------------------------


_LIBC = ctypes.CDLL(None, use_errno=True)


def prctl(option: int, value: int) -> None:
    if _LIBC.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {value}): {os.strerror(err)}")


class _NoGpus:
    """The reaper's NVML, for a reap that GPU holders do not decide.

    The remediator's reap re-reads NVML to confirm no unjudged holder joined; the
    launcher reaps its own tree whoever holds GPU memory (force=True: no holder check),
    so it answers "up, nothing held" instead of loading NVML into every launcher.
    """

    def read(self) -> NvmlReading:
        return NvmlReading(True, None, (), (), ())


def _no_audit(_phase: str, _members: tuple[Member, ...]) -> None:
    """The reaper's write-ahead journal: the launcher reaps the user's own tree,
    unprivileged, and writes no audit file; its record is the one stderr line."""


def policy_for(options: Options) -> Remediate:
    """The reaper's guards for the launcher's own tree: every descendant, whoever owns it
    (a root launcher's tree is root-owned); pid 1, kernel threads, the launcher and its
    ancestors stay refused by the reaper itself."""
    return Remediate(mode="enforce", term_timeout_seconds=options.grace, allow_root_owned=True,
                     users=UserFilter(allow=("*",), deny=()), allow_without_pidfd=False)


def children(view: ProcessView, me: ProcInfo) -> list[ProcInfo]:
    """The launcher's live children (CMD, and every descendant adopted since), by identity."""
    out = []
    for pid in view.children(me.pid) or ():
        info = view.fresh_stat(pid)
        if is_child_of(info, me):
            assert info is not None
            out.append(info)
    return out


def reap_tree(options: Options, *, counters: Counters | None = None) -> Teardown:
    """Reap every live descendant of this process with the remediator's reaper.

    The reaper reaps one tree under one root; a subreaper's descendants hang under
    each of its children, so each child roots one reap (members walked with the
    classifier's walk_members), CMD first. A member dying mid-reap hands its children
    to us, already held by that reap; a round lists our children again until none is
    left, so whatever was handed over after a listing is caught by the next round.
    """
    counters = counters if counters is not None else Counters()
    reaper = Reaper(nvml=_NoGpus(), counters=counters)
    policy = policy_for(options)
    guarded = protected_pids()
    hostname = socket.gethostname()
    results: list[ReapResult] = []
    left: list[ProcInfo] = []
    survived: set[tuple[int, int]] = set()
    for _ in range(MAX_ROUNDS):
        view = ProcessView(counters=counters)
        me = view.fresh_stat(os.getpid())
        assert me is not None
        left = [c for c in children(view, me) if c.identity not in survived]
        if not left:
            break
        for root in left:
            members = walk_members(root, view.children, view.stat, view.fresh_stat)
            plan = ReapPlan(key=TreeKey(hostname, root.pid, root.start_time),
                            members=tuple(member_of(m, view) for m in members),
                            holders=(), gpu_bytes=0, dry_run=False)
            result = reaper.reap(plan, policy=policy, rules=Rules(), protected_pids=guarded,
                                 deadline=time.monotonic() + REAP_DEADLINE_SECONDS,
                                 journal=_no_audit, force=True)
            results.append(result)
            survived |= {(m.pid, m.start_time) for m in result.members
                         if m.pid in result.survivors}
        collect_zombies()
    return summarise(results, left)


def collect_zombies(cmd: int | None = None) -> int | None:
    """waitpid() every exited child (a subreaper inherits every orphan's zombie);
    return CMD's status if CMD was among them."""
    status = None
    while True:
        try:
            pid, got = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == cmd:
            status = got


def spawn(argv: Sequence[str], mask: set[int], *,
          sigint_default: bool) -> subprocess.Popen[bytes]:
    """Start CMD with a parent-death SIGKILL, the caller's signal mask and fds."""
    if threading.active_count() != 1:
        raise RuntimeError("the launcher must be single-threaded to fork with a preexec_fn")
    launcher = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:  # the launcher died before the request took
            os.kill(os.getpid(), signal.SIGKILL)
        if sigint_default:  # Python's KeyboardInterrupt handler must not run here
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    # GPUGUARD_RUN names this launcher by pid and start time: the classifier then reads a
    # process this launcher adopted (a double-forked daemon) as attached to a live
    # launcher (run-launcher), not as an orphan the remediator may reap under it.
    me = ProcessView(counters=Counters()).fresh_stat(launcher)
    assert me is not None
    env = {**os.environ, RUN_MARKER: f"{launcher}:{me.start_time}"}
    # close_fds=False: CMD gets exactly what the launcher was given (Python's own fds
    # are close-on-exec); a jobserver or `3>file` passes through the launcher.
    return subprocess.Popen(list(argv), preexec_fn=in_child, close_fds=False, env=env)


def say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed or gone: the reap happened regardless
        pass


class CannotStart(Exception):
    """CMD could not be executed (`error` says why); nothing was started."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror)
        self.error = error


def run(argv: Sequence[str], options: Options, *, parent: int = PARENT_AT_IMPORT) -> int:
    """Run CMD as described in the module docstring; return the launcher's exit status."""
    handled = {s for s in TEARDOWN_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    # An ignored SIGHUP (nohup) or SIGINT (a script's background job) stays ignored, for
    # the launcher and for CMD: a blocked signal is queued even when ignored, so it must
    # not be waited for either.
    waited = {*handled, signal.SIGCHLD, PDEATHSIG}
    sigint_default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    try:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        prctl(PR_SET_PDEATHSIG, PDEATHSIG)
        if os.getppid() != parent:
            say(f"gpuguard run: the parent process {parent} died before the launcher could "
                "watch it; CMD not started")
            return EXIT_PARENT_DIED
        try:
            cmd = spawn(argv, mask, sigint_default=sigint_default)
        except OSError as exc:  # exec failed in the child: subprocess re-raises it here
            raise CannotStart(exc) from None
        step = supervise(cmd, waited, options, parent)
        cmd.returncode = step.code  # collected by our own waitpid(); Popen must not wait
        if step.reap:
            line = teardown_line(step.why, reap_tree(options))
            if line is not None:
                say(line)
        collect_zombies()
        return step.code
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def supervise(cmd: subprocess.Popen[bytes], waited: set[int], options: Options,
              parent: int) -> Step:
    """Sleep in sigwaitinfo() until something ends the run; forward what must be forwarded.

    CMD is our child and we alone collect it, so its pid names CMD until our own
    waitpid() returns it: signalling it by pid is exact, and nothing is sent after.
    """
    interrupted_until: float | None = None
    while True:
        info: signal.struct_siginfo | None
        if interrupted_until is None:
            info = signal.sigwaitinfo(waited)
        else:
            info = signal.sigtimedwait(waited, max(0.0, interrupted_until - time.monotonic()))
        event: Event
        if info is None:
            event = GraceOver()
        elif info.si_signo == signal.SIGCHLD:
            status = collect_zombies(cmd.pid)
            if status is None:
                continue  # an adopted orphan exited, or a child stopped
            event = CmdExited(status)
        else:
            event = Signalled(info.si_signo, from_terminal=info.si_code == SI_KERNEL,
                              parent_changed=os.getppid() != parent)
        step = decide(event, interrupted=interrupted_until is not None, options=options)
        if step.forward is not None:
            try:
                os.kill(cmd.pid, step.forward)
            except ProcessLookupError:
                pass
        if step.next is Next.INTERRUPT:
            interrupted_until = time.monotonic() + options.grace
        elif step.next is Next.FINISH:
            return step
