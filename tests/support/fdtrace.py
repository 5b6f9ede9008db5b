"""An opt-in pytest plugin that catches a close of a file descriptor its closer does not own.

Why: two failures seen once each in whole runs (the thaw guardian's socket seeing EOF
mid-test, waitress's trigger pipe answering EBADF) look like a double close in the test
process: something closes an fd *number* after it was closed and handed to someone else.
Only whole runs show it, so the tracer watches whole runs:

    GPUGUARD_FD_TRACE=/tmp/fd.txt python -m pytest -p tests.support.fdtrace tests/live

It does nothing unless GPUGUARD_FD_TRACE names a report file. It remembers which live
object (socket, file, waitress trigger) owns each fd and that fd's (st_dev, st_ino),
and reports, with the test, the thread and stacks:
  - os.close or os.dup2 onto an fd a live object still owns (the wrong closer itself),
  - os.close that fails with EBADF (a double close; the tell when it is swallowed),
  - a socket closed or finalised after its fd was closed or replaced under it,
  - a live owner whose fd a 20 ms watcher finds closed or replaced,
  - a waitress trigger pulled after its close (a byte written to a stale fd number).
Each report ends with the last opens and closes of that fd number. docs/development.md
says when to use it; it is never loaded by the product.
"""

from __future__ import annotations

import _socket
import builtins
import collections
import contextlib
import errno
import io
import os
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

PATH = os.environ.get("GPUGUARD_FD_TRACE", "")
#: Owner identity: (st_dev, st_ino) of the fd when its owner got it.
Ident = tuple[int, int]

_lock = threading.RLock()
_owners: dict[int, tuple[weakref.ref[Any], Ident, str, str]] = {}
_own: weakref.WeakKeyDictionary[Any, tuple[int, Ident, str, str]] = \
    weakref.WeakKeyDictionary()
_history: collections.defaultdict[int, collections.deque[str]] = \
    collections.defaultdict(lambda: collections.deque(maxlen=8))
_test = ["(collection)"]
_reports = [0]
_real_close, _real_dup2, _real_fstat, _real_open = os.close, os.dup2, os.fstat, io.open


def _stack(skip: int) -> str:
    frames = traceback.extract_stack()[:-skip][-10:]
    return "".join(f"      {f.filename}:{f.lineno} {f.name}: {f.line}\n" for f in frames)


def _ident(fd: int) -> Ident | None:
    try:
        st = _real_fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _note(fd: int, what: str) -> None:
    with _lock:
        _history[fd].append(f"    {time.monotonic():.4f} [{threading.current_thread().name}] "
                            f"{_test[0]} {what}\n{_stack(3)}")


def _report(kind: str, fd: int, extra: str = "") -> None:
    with _lock:
        _reports[0] += 1
        threads = sorted(t.name for t in threading.enumerate())
        text = (f"=== {kind}: fd {fd} in test {_test[0]} thread "
                f"{threading.current_thread().name}\n  threads: {threads}\n"
                f"  closer/reporter:\n{_stack(3)}{extra}  recent on fd {fd}:\n"
                + "".join(_history.get(fd, ())))
        with _real_open(PATH, "a") as out:
            out.write(text + "\n")


class IntOwner:
    """An owner that keeps its fds as ints (waitress's trigger pipe and its dup)."""

    def __init__(self, obj: object, is_open: Callable[[Any], bool]) -> None:
        self.ref, self._is_open = weakref.ref(obj), is_open

    def is_open(self) -> bool:
        obj = self.ref()
        return obj is not None and bool(self._is_open(obj))


_int_owners: list[IntOwner] = []  # kept alive: _owners holds weak references


def _live_owner(fd: int) -> tuple[Any, str, str] | None:
    """The live object that owns `fd` now (its opener stack and test), or None."""
    entry = _owners.get(fd)
    obj = entry[0]() if entry is not None else None
    if entry is None or obj is None:
        return None
    try:
        if isinstance(obj, IntOwner):
            still = obj.is_open()
        elif isinstance(obj, socket.socket):
            still = obj.fileno() == fd
        else:
            still = not obj.closed and obj.fileno() == fd
    except (OSError, ValueError):
        return None
    return (obj, entry[2], entry[3]) if still else None


def _register(obj: object, fd: int) -> None:
    ident = _ident(fd) if fd > 2 else None
    if ident is None:
        return
    with _lock:
        prior = _live_owner(fd)
        # ssl's wrap_socket builds its socket on the fd first, then detaches the plain one.
        wrap = type(obj).__name__ == "SSLSocket" and isinstance(prior and prior[0],
                                                                 socket.socket)
        if prior is not None and prior[0] is not obj and _owners[fd][1] == ident and not wrap:
            _report("fd owned by two live objects", fd,
                    f"  first owner {type(prior[0]).__name__} from {prior[2]}:\n{prior[1]}")
        stack = _stack(3)
        _owners[fd] = (weakref.ref(obj), ident, stack, _test[0])
        if isinstance(obj, socket.socket):
            _own[obj] = (fd, ident, stack, _test[0])
        _note(fd, f"owned by {type(obj).__name__}")


def _foreign(fd: int, how: str) -> None:
    with _lock:
        owner = _live_owner(fd) if fd > 2 else None
        if owner is not None and _owners[fd][1] == _ident(fd):
            _report(f"{how} of an fd a live {type(owner[0]).__name__} owns", fd,
                    f"  owner opened in {owner[2]}:\n{owner[1]}")


def close(fd: int) -> None:
    _foreign(fd, "os.close")
    try:
        _real_close(fd)
    except OSError as exc:
        if exc.errno == errno.EBADF and fd >= 0:
            _report("os.close EBADF (closed already: a double close)", fd)
        raise
    _note(fd, "os.close")


def dup2(fd: int, fd2: int, inheritable: bool = True) -> int:
    _foreign(fd2, "os.dup2 onto")
    _note(fd2, f"os.dup2 target (from {fd})")
    return _real_dup2(fd, fd2, inheritable)


def _traced_opener(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def opener(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        for fd in result if isinstance(result, tuple) else (result,):
            _note(fd, f"os.{name}")
        return result

    return opener


def _verify_own(sock: socket.socket, how: str) -> None:
    """A socket about to close its fd: is it still the one it was given?"""
    fd = _socket.socket.fileno(sock)
    entry = _own.get(sock)
    if fd < 3 or entry is None or entry[0] != fd:
        return
    now = _ident(fd)
    if now != entry[1]:
        _report(f"socket {how} on an fd that is no longer its own "
                f"({'closed already' if now is None else 'reused'})", fd,
                f"  socket opened in {entry[3]}:\n{entry[2]}")
    _note(fd, f"socket {how}")


def _install() -> None:
    sock_init, sock_close = socket.socket.__init__, socket.socket._real_close

    def init(self: socket.socket, *args: Any, **kwargs: Any) -> None:
        sock_init(self, *args, **kwargs)
        _register(self, self.fileno())

    def real_close(self: socket.socket, _ss: Any = _socket.socket) -> None:
        _verify_own(self, "close")
        sock_close(self)

    def finalise(self: socket.socket) -> None:
        with contextlib.suppress(Exception):  # a finaliser must not raise
            _verify_own(self, "finaliser (GC)")
        _socket.socket.__del__(self)  # type: ignore[attr-defined]

    def open_(file: Any, *args: Any, **kwargs: Any) -> Any:
        f = _real_open(file, *args, **kwargs)
        raw = getattr(getattr(f, "buffer", f), "raw", getattr(f, "buffer", f))
        if getattr(raw, "closefd", True):
            try:
                _register(f, f.fileno())
            except (OSError, ValueError, AttributeError):
                pass
        return f

    os.close, os.dup2 = close, dup2  # type: ignore[assignment]
    for name in ("open", "pipe", "pidfd_open", "dup", "openpty"):
        if hasattr(os, name):
            setattr(os, name, _traced_opener(name, getattr(os, name)))
    socket.socket.__init__ = init  # type: ignore[method-assign]
    socket.socket._real_close = real_close  # type: ignore[method-assign]
    socket.socket.__del__ = finalise  # type: ignore[attr-defined]
    io.open = builtins.open = open_
    _hook_waitress()
    threading.Thread(target=_watch, name="fdtrace-watch", daemon=True).start()


def _hook_waitress() -> None:
    """waitress keeps its trigger pipe (and file_dispatcher's dup of it) as ints."""
    try:
        from waitress import trigger as wt
    except ImportError:
        return
    real_init = wt.trigger.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        owners = [(IntOwner(self, lambda t: not t._closed), fd) for fd in self._fds]
        dup = self.socket.fd
        owners.append((IntOwner(self.socket, lambda w: w.fd == dup), dup))
        for owner, fd in owners:
            _int_owners.append(owner)
            _register(owner, fd)

    real_pull = wt.trigger._physical_pull

    def pull(self: Any) -> None:
        if self._closed:  # its number may be someone else's by now: a byte written there
            _report("waitress trigger pulled after its close (a write to a stale fd)",
                    self.trigger)
        real_pull(self)

    wt.trigger.__init__ = init
    wt.trigger._physical_pull = pull


def _watch() -> None:
    while True:
        time.sleep(0.02)
        with _lock:
            for fd, (ref, ident, stack, test) in list(_owners.items()):
                if _live_owner(fd) is None:
                    continue
                now = _ident(fd)
                if now != ident and _live_owner(fd) is not None:
                    _report(f"watcher: a live {type(ref()).__name__}'s fd was "
                            f"{'closed' if now is None else 'replaced'} under it", fd,
                            f"  owner opened in {test}:\n{stack}")
                    del _owners[fd]


if PATH:
    _install()


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _test[0] = nodeid


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if PATH:
        terminalreporter.write_line(f"fdtrace: {_reports[0]} report(s) in {PATH}")
