"""`gpuguard run -- CMD`: a launcher whose whole process tree dies with it (prevention).

It becomes a child subreaper, asks for a parent-death signal, starts CMD with a
parent-death SIGKILL, in the launcher's own process group (so that job control works as
without it), and at the end reaps every descendant with the remediator's verified reap
(teardown/). README "Prevention: gpuguard run" has the user's side.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from gpuguard import PARENT_AT_START, PARENT_READ_BY
from gpuguard.launch.events import (
    EXIT_PARENT_DIED,
    FORWARDED_SIGNALS,
    PDEATHSIG,
    TEARDOWN_SIGNALS,
    Exit,
    Options,
)
from gpuguard.launch.options import CannotStart, Unsupported
from gpuguard.launch.registration import (
    Registered,
    own_start_time,
    register_launcher,
    unregister_launcher,
)
from gpuguard.launch.spawn import spawn
from gpuguard.launch.stderr import say
from gpuguard.launch.subreaper import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    collect_zombies,
    prctl,
    unsupported,
)
from gpuguard.launch.supervision import supervise
from gpuguard.launch.teardown.keeping import INHERITED, honoured, inherits_keep, read_ahead
from gpuguard.launch.teardown.report import audit_line, teardown_line
from gpuguard.launch.teardown.rounds import reap_tree
from gpuguard.launch.tiers import Hold, choose, refusal

#: Bound on the signals dropped at the end (real-time signals queue, one by one).
DRAIN_LIMIT = 4096


def parent_at_start() -> int:
    """The parent read when gpuguard was imported (before the console's imports, so a
    parent dying during them is noticed), if this process did the reading; else (a library
    caller that forked since) the parent now."""
    return PARENT_AT_START if os.getpid() == PARENT_READ_BY else os.getppid()


def run(argv: Sequence[str], options: Options, *, parent: int | None = None) -> Exit:
    """Run CMD until it exits or a signal or the parent's death ends the run, then reap
    the tree; say how the launcher must end (`end()` does it)."""
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
    # SIGCHLD at its default before anything starts: an ignored one makes the kernel reap
    # CMD itself, unseen, its pid free for reuse while we still name CMD by it.
    sigchld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    registered: Registered | None = None
    hold: Hold | None = None
    # The tier is released (nothing killed) only after a run that ended cleanly: CMD
    # never started, its leftovers kept on purpose, or a teardown that left nothing.
    # Otherwise (an exception, a teardown that gave up on a member) the launcher's exit
    # leaves the tier to do what it exists for: the guardian's cgroup.kill, the pidns
    # init's death taking the namespace.
    clean = True
    try:
        prctl(PR_SET_PDEATHSIG, PDEATHSIG)
        if os.getppid() != parent:
            say(f"gpuguard run: the parent process {parent} died before the launcher could "
                "watch it; CMD not started")
            return Exit(EXIT_PARENT_DIED)
        read_ahead()
        # Before the subreaper: the guardian's middle process must hand it to PID 1 (or
        # the next subreaper up), never to this launcher's teardown.
        hold = choose(options, own_start_time())
        refused = refusal(hold, options)
        if refused is not None:
            raise Unsupported(refused)
        if options.verbose:
            say(f"gpuguard run: {hold.describe()}")
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        registered = register_launcher(options.marks_dir, hold.tier)
        # CMD is given this environment: a keep mark in it would be every member's.
        inherited = inherits_keep(os.environb)
        if inherited:
            say(INHERITED)
        try:
            cmd = spawn(argv, mask, sigint_default=sigint_default,
                        sigchld_ignored=sigchld is signal.SIG_IGN, in_pidns=hold.init is not None)
        except OSError as exc:  # exec failed in the child: subprocess re-raises it here
            raise CannotStart(exc) from None
        except subprocess.SubprocessError:  # the pidns tier's /proc, which its probe mounted
            raise Unsupported("the pidns tier could not mount CMD's /proc") from None
        clean = False  # CMD runs: clean again only once its teardown left nothing
        step = supervise(cmd, waited, options, parent)
        cmd.returncode = step.code  # collected by our own waitpid(); Popen must not wait
        if step.reap:
            clean = tear_down(step.why, options, hold, inherited)
        else:
            clean = True  # --keep-leftovers: what is left is meant to outlive the run
        collect_zombies()
        return Exit(step.code, step.dies_of)
    finally:
        if registered is not None:
            unregister_launcher(*registered)
        if hold is not None and clean:
            hold.release()
        # What arrived during the teardown is dropped, not delivered at its default
        # (a late SIGUSR1 would otherwise kill the launcher with the wrong status).
        for _ in range(DRAIN_LIMIT):
            if signal.sigtimedwait(waited, 0) is None:
                break
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if sigchld is not None:
            signal.signal(signal.SIGCHLD, sigchld)


def tear_down(why: str, options: Options, hold: Hold, inherited: bool) -> bool:
    """Reap the tree, keeping what its user marked to keep, and say on stderr what became
    of it; whether the tier may be released (nothing left for it to kill)."""
    teardown = reap_tree(options, kept=hold.kept(), marks=honoured(inherited))
    for line in (teardown_line(why, teardown),
                 audit_line(why, teardown, (os.getpid(), own_start_time()))):
        if line is not None:
            say(line)
    # A member let go of and gone by the end still leaves the tier armed: what it handed
    # over after the last listing is the guardian's (or the init's) to take. What its
    # user marked to keep must outlive the run, so it releases the tier, as
    # --keep-leftovers does (what the teardown gave up on then lives on too).
    return bool(teardown.kept) or not (teardown.survivors or teardown.refused
                                       or teardown.exited or teardown.problems)


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

