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
- Every other catchable signal (SIGUSR1, SIGQUIT, SIGWINCH, SIGALRM, real-time ones...)
  is blocked too and forwarded to CMD, as tini and dumb-init do: unhandled, it would
  kill the launcher without a teardown (a SLURM --signal checkpoint request would lose
  the tree). One from the terminal (SI_KERNEL) reached CMD already and is not forwarded
  again. Left alone: the job-control signals (SIGTSTP, SIGTTIN, SIGTTOU, SIGCONT), so
  that Ctrl-Z stops the launcher with CMD and the shell sees its job stop (a launcher
  that blocked SIGTSTP would never report stopped, and `fg` would hang); the synchronous
  faults (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT), which blocking
  would make undefined. A signal ignored when the launcher starts stays ignored, for it
  and for CMD (Python itself ignores SIGPIPE and SIGXFSZ: those are not passed on, and
  CMD gets them at their default, as from any Python subprocess).
- SIGCHLD is set to its default first: an ignored SIGCHLD (inherited from a caller that
  does not want zombies) makes the kernel reap CMD itself, so its exit would go unseen
  and its pid be free for reuse while the launcher still names CMD by it. CMD gets the
  caller's disposition back in the preexec_fn.
- A teardown caused by SIGINT, SIGTERM or SIGHUP ends with the launcher killing itself
  with that signal (at its default), so a calling shell script stops as it would for a
  plain command (bash goes on after a child that exits 130 and stops after one that
  SIGINT killed). The parent's death is not a signal the caller sent: exit 129.
- The parent the launcher checks against is read when the gpuguard package is first
  imported (gpuguard/__init__.py, ~30 ms after exec), not after the console's imports
  (~0.4 s): a parent dying in between is then noticed and CMD is not started.
- A member whose SIGSTOP the kernel refuses (EPERM: a setuid-root program under an
  unprivileged launcher) is released by the reaper (refused_stop="release"): left
  untouched and named in the stderr line, while the rest of the tree is reaped. The
  remediator aborts instead; the launcher must not keep the whole tree alive for it.
- The launcher refuses to start CMD where it could not see or safely signal its tree:
  no /proc/self/task/TID/children (a kernel without CONFIG_PROC_CHILDREN, or no /proc)
  or no pidfd_open/pidfd_send_signal (an old kernel, a seccomp profile).
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

from gpuguard import PARENT_AT_START, PARENT_READ_BY
from gpuguard.config import Remediate, UserFilter
from gpuguard.host.counters import Counters
from gpuguard.host.marks import MarkError, Marks
from gpuguard.host.nvml import NvmlReading
from gpuguard.host.procfs import RUN_MARKER, ProcessView, boot_id
from gpuguard.orphans.classify import DEFAULT_MARKS_DIR, RUN_MARK, Rules
from gpuguard.orphans.process import ProcInfo, live_children, walk_members
from gpuguard.remediator.inspection import member_of, protected_pids
from gpuguard.remediator.policy import Member, TreeKey
from gpuguard.remediator.reaper import (
    PIDFD_OPEN,
    PIDFD_SEND,
    Outcome,
    Reaper,
    ReapPlan,
    ReapResult,
)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: si_code of a signal the kernel generated itself: a terminal's Ctrl-C (or hangup) sent
#: to the foreground process group, CMD included.
SI_KERNEL = 0x80
#: The signals a terminal sends to its whole foreground group (CMD included): only for
#: these does SI_KERNEL mean "CMD has it already". The kernel raises others itself too
#: (an alarm() inherited across exec, SIGXCPU), meant for the launcher alone.
TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGWINCH})
#: The launcher's own parent-death signal (see the module docstring).
PDEATHSIG = int(signal.SIGRTMIN)
#: Exit status after the parent's death: the shell's for a hangup (128 + SIGHUP).
EXIT_PARENT_DIED = 128 + signal.SIGHUP
EXIT_SIGINT = 128 + signal.SIGINT
DEFAULT_GRACE_SECONDS = 5.0
#: A tree that grows faster than it can be frozen this long is left (and reported).
REAP_DEADLINE_SECONDS = 30.0
#: A teardown reaps every child of the launcher, round after round, until no child is
#: left: each round catches what a dying member handed back to the launcher after the
#: previous one listed its children. Only a tree that keeps handing it new children (a
#: member it may not stop, forking in a loop) keeps it going: no round starts once this
#: long has passed since the first one ended, and what is left then is reported.
MORE_ROUNDS_SECONDS = 60.0

#: The signals that end a run (besides PDEATHSIG and CMD's exit, seen through SIGCHLD).
TEARDOWN_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
#: Left at their defaults (see the module docstring): job control, synchronous faults,
#: and what cannot be caught.
JOB_CONTROL = (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGCONT)
SYNCHRONOUS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP,
               signal.SIGSYS, signal.SIGABRT)
#: Bound on the signals dropped at the end (real-time signals queue, one by one).
DRAIN_LIMIT = 4096
#: The signals the launcher passes on to CMD: every other one it can catch.
FORWARDED_SIGNALS = frozenset(signal.valid_signals()) - {
    *TEARDOWN_SIGNALS, *JOB_CONTROL, *SYNCHRONOUS, signal.SIGCHLD, PDEATHSIG,
    signal.SIGKILL, signal.SIGSTOP}


# -- the pure part: which event leads to what ---------------------------------------------


@dataclass(frozen=True)
class Options:
    grace: float = DEFAULT_GRACE_SECONDS  # SIGINT -> reap wait, and the reap's TERM -> KILL
    keep_leftovers: bool = False  # when CMD exits by itself, leave its leftovers running
    #: Where the launcher registers itself (gpuguard/host/marks.py): what CMD cannot erase.
    marks_dir: str = DEFAULT_MARKS_DIR


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
    dies_of: int | None = None  # with FINISH: end by this signal instead of exit(code)


@dataclass(frozen=True)
class Exit:
    """How the launcher ends: exit(code), or killed by `dies_of` (a shell shows 128+N)."""

    code: int
    dies_of: int | None = None


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


@dataclass(frozen=True)
class Teardown:
    """What the reaps of one teardown did, for the one stderr line."""

    killed: tuple[Member, ...] = ()
    survivors: tuple[Member, ...] = ()  # survived SIGKILL
    refused: tuple[Member, ...] = ()  # the kernel refused their SIGSTOP: left untouched
    problems: tuple[str, ...] = ()  # reaps that refused or failed, and why; each once


def launcher_words(detail: str) -> str:
    """The reaper's details are written for the remediator; the launcher's line names
    itself and its own deadline instead."""
    return (detail.replace("remediate.worker_timeout_seconds",
                           f"the launcher's {REAP_DEADLINE_SECONDS:g} s reap deadline")
            .replace("the remediator", "the launcher"))


def summarise(results: Sequence[ReapResult], left: Sequence[ProcInfo],
              rounds: int = 0) -> Teardown:
    """`left`: children still below the launcher after the last of `rounds` rounds, not
    accounted for."""
    killed: list[Member] = []
    survivors: list[Member] = []
    refused: list[Member] = []
    problems: list[str] = []
    for result in results:
        refused += result.released
        if result.outcome in (Outcome.REAPED, Outcome.FAILED):
            gone = set(result.survivors)
            killed += [m for m in result.members if m.pid not in gone]
            survivors += [m for m in result.members if m.pid in gone]
        elif result.reason not in ("root-gone", "root-replaced"):  # exited by itself: fine
            problem = f"{result.reason}: {launcher_words(result.detail)}"
            if problem not in problems:
                problems.append(problem)
    if left:
        problems.append(f"{len(left)} process(es) still below the launcher after "
                        f"{rounds} rounds (the tree kept handing it new children for "
                        f"{MORE_ROUNDS_SECONDS:g} s)")
    return Teardown(tuple(killed), tuple(survivors), tuple(refused), tuple(problems))


def teardown_line(why: str, teardown: Teardown) -> str | None:
    """The one stderr line a teardown writes; None when there was nothing to reap."""
    if not (teardown.killed or teardown.survivors or teardown.refused or teardown.problems):
        return None

    def names(members: Sequence[Member]) -> str:
        return ", ".join(f"{m.pid} ({m.comm})" for m in members)

    parts = [f"gpuguard run: {why}: reaped {len(teardown.killed)} process(es)"
             + (f": {names(teardown.killed)}" if teardown.killed else "")]
    if teardown.survivors:
        parts.append(f"{len(teardown.survivors)} survived SIGKILL: {names(teardown.survivors)}")
    if teardown.refused:
        parts.append(f"{len(teardown.refused)} survived, not signalled (the kernel refused "
                     "the launcher's SIGSTOP: another user's process, such as a setuid-root "
                     f"program; needs root or CAP_KILL): {names(teardown.refused)}")
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


def children(view: ProcessView, parent: ProcInfo) -> tuple[ProcInfo, ...]:
    """`parent`'s live children, by identity, read now (for the launcher: CMD and every
    descendant adopted since; for a released member, what it started). A released
    member's pid may be reused after `released_alive` read it: `live_children` re-reads
    the parent after its children file, as the walk does. A child whose main thread
    called pthread_exit() while others run (state Z) is a live child."""
    return live_children(parent, view.children, view.fresh_stat, view.fresh_stat,
                         view.thread_states)


def reap_tree(options: Options, *, counters: Counters | None = None) -> Teardown:
    """Reap every live descendant of this process with the remediator's reaper.

    The reaper reaps one tree under one root; a subreaper's descendants hang under
    each of its children, so each child roots one reap (members walked with the
    classifier's walk_members), CMD first. A member dying mid-reap hands its children
    to us, already held by that reap; a round lists our children again until none is
    left, so whatever was handed over after a listing is caught by the next round
    (for at most MORE_ROUNDS_SECONDS after the first round).
    """
    counters = counters if counters is not None else Counters()
    # A member whose SIGSTOP the kernel refuses (a setuid-root helper under an
    # unprivileged launcher) is let go of; the rest of the tree is still reaped.
    reaper = Reaper(nvml=_NoGpus(), counters=counters, refused_stop="release")
    policy = policy_for(options)
    guarded = protected_pids()
    hostname = socket.gethostname()
    results: list[ReapResult] = []
    left: list[ProcInfo] = []
    # Processes a reap could not kill (survivors, released members, roots a reap refused):
    # not tried again by the next rounds, and reported once.
    done: set[tuple[int, int]] = set()
    released: set[tuple[int, int]] = set()
    rounds = 0
    more_until: float | None = None  # no round starts after this (set by the first)
    while True:
        view = ProcessView(counters=counters)
        me = view.fresh_stat(os.getpid())
        assert me is not None
        # The children of a released member are ours to reap too (the reaper never walks
        # below a member it let go of); so are theirs, walked from there.
        left = [c for parent in (me, *released_alive(view, released))
                for c in children(view, parent) if c.identity not in done]
        if not left or (more_until is not None and time.monotonic() >= more_until):
            break
        rounds += 1
        for root in left:
            members = walk_members(root, view.children, view.stat, view.fresh_stat,
                                   view.thread_states)
            plan = ReapPlan(key=TreeKey(hostname, root.pid, root.start_time),
                            members=tuple(member_of(m, view) for m in members),
                            holders=(), gpu_bytes=0, dry_run=False,
                            classified=False)  # its own tree: no verdict to re-derive
            result = reaper.reap(plan, policy=policy, rules=Rules(), protected_pids=guarded,
                                 deadline=time.monotonic() + REAP_DEADLINE_SECONDS,
                                 journal=_no_audit, force=True)
            results.append(result)
            done |= {(m.pid, m.start_time) for m in result.members if m.pid in result.survivors}
            done |= {(m.pid, m.start_time) for m in result.released}
            released |= {(m.pid, m.start_time) for m in result.released}
            if result.outcome is Outcome.ABORTED:
                done.add(root.identity)
        collect_zombies()
        if more_until is None:
            more_until = time.monotonic() + MORE_ROUNDS_SECONDS
    return summarise(results, left, rounds)


def released_alive(view: ProcessView, released: set[tuple[int, int]]) -> list[ProcInfo]:
    """The members a reap let go of that still run (ProcInfo.is_live), as read now."""
    out = []
    for pid, start_time in sorted(released):
        info = view.fresh_stat(pid)
        if (info is not None and info.start_time == start_time
                and info.is_live(view.thread_states)):
            out.append(info)
    return out


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


def spawn(argv: Sequence[str], mask: set[int], *, sigint_default: bool,
          sigchld_ignored: bool) -> subprocess.Popen[bytes]:
    """Start CMD with a parent-death SIGKILL, the caller's signal mask, SIGCHLD disposition
    and fds."""
    if threading.active_count() != 1:
        raise RuntimeError("the launcher must be single-threaded to fork with a preexec_fn")
    launcher = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:  # the launcher died before the request took
            os.kill(os.getpid(), signal.SIGKILL)
        if sigint_default:  # Python's KeyboardInterrupt handler must not run here
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        if sigchld_ignored:  # as the caller gave it to the launcher
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)
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


def register_launcher(directory: str) -> tuple[Marks, int, int] | None:
    """Register this launcher by identity with the daemons (a `run` mark): a CMD that
    overwrites its environment (setproctitle) loses GPUGUARD_RUN, not this. Without the
    daemons' directory there is nothing to register with; the marker still counts."""
    me = ProcessView(counters=Counters()).fresh_stat(os.getpid())
    if me is None or not os.path.isdir(directory):
        return None
    marks = Marks(directory, boot_id())
    try:
        marks.register(RUN_MARK, me.pid, me.start_time)
    except MarkError as exc:
        say(f"gpuguard run: {exc}; only the GPUGUARD_RUN environment marker names this "
            "launcher")
        return None
    return marks, me.pid, me.start_time


def unregister_launcher(marks: Marks, pid: int, start_time: int) -> None:
    try:
        marks.unregister(RUN_MARK, pid, start_time)
    except MarkError as exc:
        say(f"gpuguard run: {exc}")


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


class Unsupported(Exception):
    """The launcher could not see or safely signal its tree here; nothing was started."""


def unsupported() -> str | None:
    """Why this kernel (or sandbox) cannot carry the launcher, or None.

    Without a children file the launcher could not find what was adopted below it;
    without pidfds the reaper refuses to signal (a pid alone may name a reused pid).
    Failing before CMD starts is the closed failure: a launcher that started CMD and
    then could not reap it would leave the tree the user asked it to take down.
    """
    children_file = f"/proc/self/task/{os.getpid()}/children"
    if not os.path.exists(children_file):
        return (f"{children_file} does not exist (a kernel without CONFIG_PROC_CHILDREN, "
                "or no /proc mounted): the launcher could not find the processes of its tree")
    if PIDFD_OPEN is None or PIDFD_SEND is None:
        return ("this Python has no pidfd_open/pidfd_send_signal: the launcher signals its "
                "tree only through pidfds")
    try:
        fd = PIDFD_OPEN(os.getpid())
        try:
            PIDFD_SEND(fd, 0)  # signal 0: a permission check, nothing is sent
        finally:
            os.close(fd)
    except OSError as exc:
        return (f"pidfd_open/pidfd_send_signal failed ({exc.strerror}; a kernel before 5.3, "
                "or a seccomp profile): the launcher signals its tree only through pidfds")
    return None


def parent_at_start() -> int:
    """The parent read when gpuguard was imported, if this process did the reading; else
    (a library caller that forked since) the parent now."""
    return PARENT_AT_START if os.getpid() == PARENT_READ_BY else os.getppid()


def run(argv: Sequence[str], options: Options, *, parent: int | None = None) -> Exit:
    """Run CMD as described in the module docstring; say how the launcher must end
    (`end()` does it)."""
    parent = parent_at_start() if parent is None else parent
    why = unsupported()
    if why is not None:
        raise Unsupported(why)
    # An ignored SIGHUP (nohup) or SIGINT (a script's background job) stays ignored, for
    # the launcher and for CMD, as does any other: a blocked signal is queued even when
    # ignored, so it must not be waited for either.
    handled = {s for s in (*TEARDOWN_SIGNALS, *FORWARDED_SIGNALS)
               if signal.getsignal(s) is not signal.SIG_IGN}
    waited = {*handled, signal.SIGCHLD, PDEATHSIG}
    sigint_default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # SIGCHLD at its default before anything is started (see the module docstring).
    sigchld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    registered: tuple[Marks, int, int] | None = None
    try:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        prctl(PR_SET_PDEATHSIG, PDEATHSIG)
        if os.getppid() != parent:
            say(f"gpuguard run: the parent process {parent} died before the launcher could "
                "watch it; CMD not started")
            return Exit(EXIT_PARENT_DIED)
        registered = register_launcher(options.marks_dir)
        try:
            cmd = spawn(argv, mask, sigint_default=sigint_default,
                        sigchld_ignored=sigchld is signal.SIG_IGN)
        except OSError as exc:  # exec failed in the child: subprocess re-raises it here
            raise CannotStart(exc) from None
        step = supervise(cmd, waited, options, parent)
        cmd.returncode = step.code  # collected by our own waitpid(); Popen must not wait
        if step.reap:
            line = teardown_line(step.why, reap_tree(options))
            if line is not None:
                say(line)
        collect_zombies()
        return Exit(step.code, step.dies_of)
    finally:
        if registered is not None:
            unregister_launcher(*registered)
        # What arrived during the teardown is dropped, not delivered at its default
        # (a late SIGUSR1 would otherwise kill the launcher with the wrong status).
        for _ in range(DRAIN_LIMIT):
            if signal.sigtimedwait(waited, 0) is None:
                break
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if sigchld is not None:
            signal.signal(signal.SIGCHLD, sigchld)


def end(how: Exit) -> int:
    """Die of `how.dies_of` (reset to its default, unblocked), as a plain command killed
    by it would, so that a calling shell script stops (bash goes on after a child that
    exits 130 and stops after one that SIGINT killed); return the exit status where the
    signal does not kill (PID 1 of a PID namespace ignores what it sends itself)."""
    if how.dies_of is not None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        signal.signal(how.dies_of, signal.SIG_DFL)
        os.kill(os.getpid(), how.dies_of)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {how.dies_of})
    return how.code


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
            event = Signalled(info.si_signo, from_terminal=info.si_code == SI_KERNEL
                              and info.si_signo in TERMINAL_SIGNALS,
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
