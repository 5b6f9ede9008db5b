"""The pidns tier: a PID namespace for the tree, whose init dies with the launcher.

The launcher unshares a PID namespace (with a user namespace first where it is not root,
its uid and gid mapped 1:1 so files and GPU devices stay the user's) and forks the
namespace's init: PID 1, with a parent-death SIGKILL. The launcher stays in its own
namespace (host pids: its reaper, its registration, the exporter see what they always
saw), but everything it forks after the init is born inside: CMD stays its own child,
so forwarding and the exit status are today's, and every orphan below CMD (a double
fork, a `setsid` daemon) is adopted by the init. When the init dies (the launcher
SIGKILLed, its process group, its session) the kernel SIGKILLs every process of the
namespace. CMD gets a mount namespace of its own with a fresh /proc, so that its
getpid() and /proc/self agree (psutil and its kind read /proc/PID for their own pid).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
from dataclasses import dataclass

from gpuguard.base.counters import Counters
from gpuguard.host.procfs import ProcessView
from gpuguard.launch.subreaper import PR_SET_PDEATHSIG, prctl

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_REC = 0x4000
MS_SLAVE = 1 << 19
#: The byte the launcher writes when its run ended normally: the init then stays until
#: the namespace is empty (what --keep-leftovers kept), instead of dying with it.
RELEASE = b"r"
#: The longest the launcher waits for the init to take RELEASE (it answers in
#: milliseconds; one that is gone answers at once).
RELEASE_ACK_SECONDS = 2.0

_LIBC = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    """unshare(2) through libc (os.unshare is Python 3.12 and later)."""
    _check(_LIBC.unshare(ctypes.c_int(flags)), "unshare")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enter_namespaces() -> str | None:
    """Unshare the PID namespace for this process's next children (root: it alone; else a
    user namespace with this uid and gid mapped to themselves, then the PID namespace);
    why not, or None. Call only single-threaded (unshare refuses otherwise)."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        if uid == 0:
            try:
                unshare(CLONE_NEWPID)
                return None
            except OSError:
                pass  # root without CAP_SYS_ADMIN (a container): as any user
        unshare(CLONE_NEWUSER | CLONE_NEWPID)
        _write("/proc/self/setgroups", "deny")  # an unprivileged gid_map needs it
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        return f"cannot create a PID namespace ({why}{restriction()})"
    return None


def restriction() -> str:
    """What the kernel's settings say about unprivileged user namespaces, for the reason."""
    for path, blocks in (("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1"),
                         ("/proc/sys/kernel/unprivileged_userns_clone", "0"),
                         ("/proc/sys/user/max_user_namespaces", "0")):
        try:
            with open(path, encoding="ascii") as fh:
                if fh.read().strip() == blocks:
                    return f"; {path.removeprefix('/proc/sys/').replace('/', '.')}={blocks}"
        except OSError:
            continue
    return ""


def _mount(source: str | None, target: str, fstype: str | None, flags: int) -> None:
    _check(_LIBC.mount(source and source.encode(), target.encode(),
                       fstype and fstype.encode(), ctypes.c_ulong(flags), None),
           f"mount {target}")


def fresh_proc() -> None:
    """In CMD before its exec: its own mount namespace (the host's mounts still propagate
    in, none goes out) and a /proc of its PID namespace over the host's."""
    unshare(CLONE_NEWNS)
    _mount(None, "/", None, MS_REC | MS_SLAVE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def probe() -> str | None:
    """Whether this host gives the tier, tried in a throw-away child (the launcher cannot
    leave a namespace once it entered it): the namespaces, PID 1, a fresh /proc. Why not,
    or None."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the probe's side
        why = b"the probe failed"
        try:
            os.close(r)
            failed = enter_namespaces()
            if failed is not None:
                why = failed.encode()
            else:
                init = os.fork()
                if init == 0:
                    code = 1
                    try:
                        fresh_proc()
                        code = 0 if os.getpid() == 1 and os.readlink("/proc/self") == "1" else 3
                    except OSError:
                        code = 2
                    finally:
                        os._exit(code)
                _, status = os.waitpid(init, 0)
                code = os.waitstatus_to_exitcode(status)
                why = {0: b"", 2: b"cannot mount a /proc for the PID namespace",
                       3: b"the new PID namespace's /proc does not show it"}.get(
                           code, b"the PID namespace's init failed")
            os.write(w, why)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        said = fh.read(4096).decode(errors="replace")
    os.waitpid(child, 0)
    return said or None


@dataclass
class Init:
    """The launcher's side of the namespace's init: its pid (ours, the host's) and the
    write end of its pipe."""

    pid: int
    start_time: int
    release_fd: int

    def release(self) -> None:
        """The run ended normally: the init stays until the namespace is empty. Waits
        (RELEASE_ACK_SECONDS at most) until the init has dropped its parent-death SIGKILL
        and closed its end of the pipe: a launcher that dies of a signal right after (a
        teardown that kept a member, then SIGTERM's own death) would otherwise kill the
        namespace, what was kept in it included, before the init read RELEASE."""
        try:
            os.write(self.release_fd, RELEASE)
            acked = select.poll()
            acked.register(self.release_fd, 0)  # POLLERR: no reader left
            acked.poll(int(RELEASE_ACK_SECONDS * 1000))
        except OSError:
            pass
        os.close(self.release_fd)


def start_init() -> Init | str:
    """Enter the namespaces and fork their init (the first child: PID 1); call before
    CMD and before anything else forks. The Init, or why not."""
    why = enter_namespaces()
    if why is not None:
        return why
    release_r, release_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(release_r)
        os.close(release_w)
        return f"cannot fork the PID namespace's init ({exc.strerror})"
    if pid == 0:  # pragma: no cover - the init's side (measured by the tests' trees)
        try:
            os.close(release_w)
            init(release_r)
        finally:
            os._exit(1)
    os.close(release_r)
    info = ProcessView(counters=Counters()).fresh_stat(pid)
    if info is None:  # died at once (the launcher's parent-death check raced it)
        os.close(release_w)
        return "the PID namespace's init died at start"
    return Init(pid, info.start_time, release_w)


def init(release_fd: int) -> None:  # pragma: no cover - the init's side
    """PID 1's whole life: collect every zombie of the namespace; die with the launcher
    (parent-death SIGKILL, or the pipe's end without RELEASE); after RELEASE, exit once
    no process is left below it. Never returns."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # As PID 1 it gets only the signals it handles (and SIGKILL/SIGSTOP from the
    # launcher's side): ignoring them all leaves a terminal's Ctrl-C, a group's SIGTERM
    # and a forwarded signal to CMD and the tree.
    for signum in signal.valid_signals():
        if signum not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            try:
                signal.signal(signum, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w, release_fd):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # a `$(gpuguard run ...)` waits for no lingering init
        os.dup2(devnull, fd)
    keep = {0, 1, 2, release_fd, wake_r, wake_w}
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass
    os.chdir("/")
    with open("/proc/self/comm", "w") as comm:
        comm.write("gpuguard-init")
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    poller = select.poll()
    poller.register(release_fd, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    released = False
    while True:
        children = True
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children = False
                break
            if pid == 0:
                break
        if released and not children:
            os._exit(0)
        for fd, _ in poller.poll():
            if fd == wake_r:
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    pass
                continue
            try:
                said = os.read(release_fd, 1)
            except BlockingIOError:
                continue
            if said != RELEASE:
                # The launcher is gone (its parent-death SIGKILL raced this, or it died
                # before the request took) and did not release the namespace.
                os._exit(0)
            released = True
            prctl(PR_SET_PDEATHSIG, 0)
            poller.unregister(release_fd)
            os.close(release_fd)  # the launcher's Init.release waits for this
