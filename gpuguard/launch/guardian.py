"""The cgroup tier's guardian: a small process that kills the leaf when the launcher dies.

Forked (twice, through a `setsid` middle) before the launcher becomes a subreaper, so
it is neither the launcher's descendant nor in its process group, its session or its
leaf: a SIGKILL of the launcher, of its process group or of its session, and the OOM
killer's choice of the launcher, leave the guardian running. It holds a pidfd on the
launcher (opened by the launcher on itself, so it names the launcher and no reused pid)
and the read end of a pipe, and sleeps in poll(). When the launcher ends its run
normally it writes RELEASE first: the guardian removes the leaf once it is empty
(at once, but for what --keep-leftovers kept) and exits. When
the launcher exits without it (SIGKILL), the guardian writes `cgroup.kill` (one atomic
SIGKILL of every process in the leaf, forks in flight included), waits (bounded) until
the leaf is empty, removes it and exits. It has no handlers, no threads and no output.
"""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass

from gpuguard.engine.reap.signalling import PIDFD_OPEN
from gpuguard.launch.cgroup import Leaf, enter, populated, remove

#: The byte the launcher writes when its run ended normally: do not kill.
RELEASE = b"r"
#: How long the guardian waits for the killed leaf to empty before it gives up on rmdir.
EMPTY_WAIT_MS = 5000
#: Signals a terminal, a session's end or a job-control stop would send the guardian.
IGNORED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGTTIN,
           signal.SIGTTOU, signal.SIGPIPE)


@dataclass
class Guardian:
    """The launcher's side: the guardian's pid and the write end of its pipe."""

    pid: int
    release_fd: int

    def release(self, leaf: Leaf) -> None:
        """The run ended normally: back to the launcher's own cgroup, then tell the
        guardian not to kill (what --keep-leftovers kept stays in the leaf)."""
        enter(leaf.parent)
        try:
            os.write(self.release_fd, RELEASE)
        except OSError:
            pass
        os.close(self.release_fd)
        leaf.close()


def start(leaf: Leaf) -> Guardian | str:
    """Fork the guardian of `leaf` (call before entering the leaf, before becoming a
    subreaper); the Guardian, or why it could not start."""
    if PIDFD_OPEN is None:
        return "no pidfd_open"
    try:
        pidfd = PIDFD_OPEN(os.getpid())
    except OSError as exc:
        return f"pidfd_open failed ({exc.strerror})"
    release_r, release_w = os.pipe()
    pid_r, pid_w = os.pipe()
    try:
        middle = os.fork()
    except OSError as exc:
        for fd in (pidfd, release_r, release_w, pid_r, pid_w):
            os.close(fd)
        return f"fork failed ({exc.strerror})"
    if middle == 0:  # pragma: no cover - the child's side (measured by the tests' trees)
        code = 1
        try:
            os.setsid()
            guardian = os.fork()
            if guardian == 0:
                guard(pidfd, release_r, leaf)
            os.write(pid_w, str(guardian).encode())
            code = 0
        finally:
            os._exit(code)
    for fd in (pidfd, release_r, pid_w):
        os.close(fd)
    _, status = os.waitpid(middle, 0)
    text = os.read(pid_r, 32)
    os.close(pid_r)
    if status != 0 or not text.isdigit():
        os.close(release_w)
        return "the guardian could not be started"
    return Guardian(int(text), release_w)


def guard(pidfd: int, release_fd: int, leaf: Leaf) -> None:  # pragma: no cover - child
    """The guardian's whole life; never returns."""
    try:
        for signum in IGNORED:
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        keep = {pidfd, release_fd, leaf.kill_fd, leaf.events_fd}
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        keep |= {0, 1, 2}
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        os.chdir("/")
        with open("/proc/self/comm", "w") as comm:  # ps shows it for what it is
            comm.write("gpuguard-guard")
        os.set_blocking(release_fd, False)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(release_fd, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            try:
                said = os.read(release_fd, 1)
            except BlockingIOError:
                said = None
            if said == RELEASE:
                # Empty, or what --keep-leftovers kept: asleep until that ends too.
                until_empty(leaf, None)
                os._exit(0)
            if said == b"" or pidfd in ready:
                break  # the launcher is gone and did not release the leaf
        os.write(leaf.kill_fd, b"1")
        until_empty(leaf, time.monotonic() + EMPTY_WAIT_MS / 1000)
    finally:
        os._exit(0)


def until_empty(leaf: Leaf, deadline: float | None) -> None:  # pragma: no cover - child
    """Sleep on cgroup.events until the leaf is empty (or the deadline), then rmdir it."""
    events = select.poll()
    events.register(leaf.events_fd, select.POLLPRI)
    while populated(leaf.events_fd):
        if deadline is None:
            events.poll()
        elif time.monotonic() < deadline:
            events.poll(50)
        else:
            break
    remove(leaf.path)
