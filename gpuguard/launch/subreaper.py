"""What the launcher asks of Linux to hold its tree: prctl(), zombies, and the support check.

As a child subreaper it adopts every descendant that loses its parent (double forks and
setsid daemons included), and so collects their zombies too.
"""

from __future__ import annotations

import ctypes
import os

from gpuguard.engine.reap.signalling import PIDFD_OPEN, PIDFD_SEND

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_LIBC = ctypes.CDLL(None, use_errno=True)


def prctl(option: int, value: int) -> None:
    if _LIBC.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {value}): {os.strerror(err)}")


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

