"""Starting CMD: a parent-death SIGKILL, the caller's signal mask and fds, the run marker."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Sequence

from gpuguard.base.counters import Counters
from gpuguard.host.launchers import RUN_MARKER
from gpuguard.host.procfs import ProcessView
from gpuguard.launch.pidns import fresh_proc
from gpuguard.launch.subreaper import PR_SET_PDEATHSIG, prctl


def spawn(argv: Sequence[str], mask: set[int], *, sigint_default: bool,
          sigchld_ignored: bool, in_pidns: bool = False) -> subprocess.Popen[bytes]:
    """Start CMD with a parent-death SIGKILL, the caller's signal mask, SIGCHLD disposition
    and fds; `in_pidns`: CMD is born in the pidns tier's namespace (pidns.py) and gets a
    /proc of it."""
    # A preexec_fn is safe only in a single-threaded parent; and a parent-death signal
    # also fires when the parent *thread* exits.
    if threading.active_count() != 1:
        raise RuntimeError("the launcher must be single-threaded to fork with a preexec_fn")
    launcher = os.getpid()
    # In the namespace the launcher, outside it, reads as parent 0; after its death the
    # init (1) is the parent.
    parent = 0 if in_pidns else launcher

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before the request took
            os.kill(os.getpid(), signal.SIGKILL)
        if in_pidns:
            fresh_proc()
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

