"""The launcher's wait: asleep in sigwaitinfo() until CMD's exit or a signal ends the run.

Signals are blocked and taken one at a time (no polling); what decide() says to forward
is sent to CMD here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from gpuguard.launch.events import (
    SI_KERNEL,
    TERMINAL_SIGNALS,
    CmdExited,
    Event,
    GraceOver,
    Next,
    Options,
    Signalled,
    Step,
    decide,
)
from gpuguard.launch.subreaper import collect_zombies


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
