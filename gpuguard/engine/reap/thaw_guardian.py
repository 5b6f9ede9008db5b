"""The thaw guardian: a small process beside the reaper that continues (SIGCONT) every
process a reap stopped when the reaper dies without doing it (SIGKILL, the OOM killer).

The reaper hands it a pidfd of each member right before that member's SIGSTOP (over a
Unix SOCK_SEQPACKET socketpair, SCM_RIGHTS), takes it back once it continued the member
itself, and says "done" when the reap is over. When the reaper goes away (EOF on the
socket, or the reaper's own pidfd turns readable) the guardian sends SIGCONT through each
pidfd it still holds and exits. It sends nothing but SIGCONT, and only through the pidfds
it was given: a reused pid is never reached. It ignores SIGTERM, SIGINT, SIGHUP and the
terminal's stop signals, so a service stop (systemd's SIGTERM to the whole cgroup, a pod's
SIGTERM) takes the reaper first and the guardian then acts on its going.

Both ends live here: `main` (the guardian, stdlib only, started as
`python -I -S -c ...`: no site, no cwd on sys.path) and `ThawGuardian` (the reaper's end).
docs/reap-safety.md "Every freeze thaws" says what is left: a SIGKILL of both at once.
"""

from __future__ import annotations

import array
import errno
import os
import select
import signal
import socket
import sys
import time

#: Not typing's (its import costs the guardian's start some 5 ms): type checkers read
#: a module-level `TYPE_CHECKING = False` as theirs.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging
    import subprocess
    from collections.abc import Iterable

#: What the guardian ignores: a stop of the unit or pod, a terminal's Ctrl-C, Ctrl-Z, hangup.
#: (SIGKILL and SIGSTOP cannot be ignored: a SIGKILL of both at once is what is left.)
IGNORED = tuple(getattr(signal, name) for name in (
    "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGUSR1",
    "SIGUSR2", "SIGPIPE") if hasattr(signal, name))  # all of them on Linux, its only home
#: Messages, one per datagram: HOLD + pid (int32) with one pidfd; LET_GO + pids (int32);
#: DONE (the reap is over); READY, from the guardian once it ignores IGNORED.
HOLD, LET_GO, DONE, READY = b"+", b"-", b".", b"ready"
#: Pids per LET_GO datagram (well under the socket's buffer).
LET_GO_BATCH = 4096
#: The largest datagram the guardian reads.
MAX_MESSAGE = 1 + 4 * LET_GO_BATCH
#: How long the reaper waits for the guardian's READY at its first hold (its start is
#: measured in docs/reap-safety.md), and for one datagram to be queued to it.
READY_SECONDS = 5.0
SEND_SECONDS = 1.0
#: How long close() waits for the guardian to exit once told the reaper is done.
EXIT_SECONDS = 5.0


# -- the guardian ------------------------------------------------------------------------


#: The daemon's --log.format, handed over at the spawn: under json its lines are records.
_log_format = "logfmt"


def _say(text: str) -> None:
    """One line on stderr (the daemon's journal, the console's terminal): its only log."""
    line = f"gpuguard thaw guardian[{os.getpid()}]: {text}"
    if _log_format == "json":
        import json  # only when there is something to say: the start does without it

        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + \
            f".{int((now % 1) * 1000):03d}Z"
        line = json.dumps({"time": stamp, "level": "warn",
                           "logger": "gpuguard.remediator.thaw_guardian", "msg": line})
    try:
        os.write(2, f"{line}\n".encode())
    except OSError:
        pass


def _raise_nofile() -> None:
    """Soft descriptor limit to the hard one: it holds as many pidfds as the reaper does."""
    try:
        import resource

        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, OSError, ValueError):
        pass  # a seccomp filter (systemd's ~@resources): the inherited limit is the reaper's


class _Held:
    """The pidfds the guardian holds, by pid; thawing is its only action on them."""

    def __init__(self) -> None:
        self.fds: dict[int, int] = {}

    def hold(self, pid: int, fd: int) -> None:
        old = self.fds.pop(pid, None)
        if old is not None:
            os.close(old)
        self.fds[pid] = fd

    def let_go(self, pids: Iterable[int]) -> None:
        for pid in pids:
            fd = self.fds.pop(pid, None)
            if fd is not None:
                os.close(fd)

    def thaw(self, why: str) -> None:
        """SIGCONT through every pidfd held (a gone process is skipped), then let go."""
        continued, failed = [], []
        for pid, fd in sorted(self.fds.items()):
            try:
                signal.pidfd_send_signal(fd, signal.SIGCONT)
                continued.append(pid)
            except ProcessLookupError:
                pass  # exited (killed by the reap): nothing to continue
            except OSError as exc:
                failed.append(f"{pid} ({exc.strerror})")
            os.close(fd)
        self.fds.clear()
        if continued or failed:
            _say(f"{why}: continued {len(continued)} process(es) the reap had stopped"
                 + (f" ({' '.join(map(str, continued))})" if continued else "")
                 + (f"; SIGCONT failed for {', '.join(failed)}" if failed else ""))


def _handle(held: _Held, message: bytes, fds: list[int], flags: int) -> None:
    """One datagram from the reaper."""
    if flags & socket.MSG_CTRUNC:
        _say("a pidfd did not arrive (descriptor limit): that process is not guarded")
    kind, body = message[:1], message[1:]
    if kind == HOLD and fds and len(body) == 4:
        held.hold(array.array("i", body)[0], fds[0])
        fds = fds[1:]
    elif kind == LET_GO:
        pids = array.array("i")
        pids.frombytes(body[: len(body) - len(body) % 4])
        held.let_go(pids)
    elif kind == DONE:
        held.let_go(list(held.fds))  # the reaper continued or killed what it stopped
    for extra in fds:
        os.close(extra)


def _drain(sock: socket.socket, held: _Held) -> None:
    """Every datagram the reaper queued before it went, without waiting."""
    while True:
        try:
            message, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, 1, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        if not message and not fds:
            return
        _handle(held, message, fds, flags)


def guard(sock: socket.socket, reaper: int) -> None:
    """Serve the reaper on `sock` until it is gone (EOF, or its pidfd `reaper` readable),
    then continue whatever is still held."""
    held = _Held()
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(reaper, select.POLLIN)
    while True:
        ready = dict(poller.poll())
        if ready.get(sock.fileno()):
            try:
                message, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
            except ConnectionResetError:  # the reaper closed its end with READY unread
                message, fds, flags = b"", [], 0  # an EOF like any other
            except OSError as exc:
                _say(f"reading from the reaper failed ({exc}): acting as if it were gone")
                message, fds, flags = b"", [], 0
            if message or fds:
                _handle(held, message, fds, flags)
                continue
            break  # EOF: every end the reaper had is closed
        if ready.get(reaper):
            _drain(sock, held)  # the reaper exited; its socket end lives on elsewhere
            break
    held.thaw("the reaper is gone")


def main(sock_fd: int, reaper_fd: int, log_format: str = "logfmt") -> int:
    """The guardian's entry: ignore the stop signals first, then serve."""
    global _log_format
    _log_format = log_format
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORED)  # blocked by the spawner until now
    _raise_nofile()
    sock = socket.socket(fileno=sock_fd)
    try:
        sock.send(READY)
    except OSError:
        pass  # the reaper is gone already: EOF below
    guard(sock, reaper_fd)
    return 0


# -- the reaper's end --------------------------------------------------------------------


class GuardianError(Exception):
    """The guardian cannot take a member: then that member is not stopped."""


#: Run by `python -I -S -c`: the package's own directory first, nothing from cwd or site.
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from gpuguard.engine.reap.thaw_guardian import main; "
         "sys.exit(main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))")


def _log() -> logging.Logger:
    """The reaper's log, imported on first use: the guardian's start does without it."""
    import logging

    return logging.getLogger("gpuguard.remediator.reaper")


def _daemon_log_format() -> str:
    from gpuguard.base import logformat

    return logformat.current_format()


def _package_root() -> str:
    import gpuguard

    return os.path.dirname(os.path.dirname(os.path.abspath(gpuguard.__file__)))


class ThawGuardian:
    """The reaper's end of one guardian process, spawned by start() (again after it died,
    at the next reap's begin()). One reap at a time: the worker thread's, or the console's."""

    def __init__(self, *, python: str = sys.executable) -> None:
        self.python = python
        self._proc: subprocess.Popen[bytes] | None = None
        self._spawned = 0.0
        self._sock: socket.socket | None = None
        self._ready = False
        self.problem: str | None = None  # why it could not be started
        self.started_ms: float | None = None  # spawn to READY, for the docs and the log

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None

    def start(self) -> None:
        """Spawn the guardian unless it runs; never waits for it, never raises (a guardian
        that cannot start makes hold() refuse, so nothing is stopped)."""
        if self.alive():
            return
        self._forget()
        import subprocess

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        me = -1
        try:
            me = os.pidfd_open(os.getpid())
            # Blocked across fork and exec, so a stop signal that comes before the guardian
            # ignores it stays pending (and is then discarded) instead of killing it.
            old = signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED)
            try:
                self._spawned = time.monotonic()
                self._proc = subprocess.Popen(
                    [self.python, "-I", "-S", "-c", _BOOT, _package_root(),
                     str(theirs.fileno()), str(me), _daemon_log_format()],
                    pass_fds=(theirs.fileno(), me), stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, start_new_session=True)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
            ours.settimeout(SEND_SECONDS)
            self._sock = ours
            self.problem = None
        except (OSError, AttributeError) as exc:  # AttributeError: no os.pidfd_open
            self.problem = f"could not start the thaw guardian: {exc}"
            _log().warning("%s", self.problem)
        finally:
            theirs.close()
            if me >= 0:
                os.close(me)
            if self._sock is not ours:
                ours.close()

    def begin(self) -> None:
        """Before a reap that may stop processes: a guardian that died is started again."""
        self.start()

    def hold(self, pid: int, fd: int) -> None:
        """Give the guardian `fd` (a pidfd of `pid`) before `pid` is stopped; once this
        returns it is queued to the guardian, which continues it if the reaper dies.
        Raises GuardianError when it cannot: then the member must not be stopped."""
        sock = self._sock
        if sock is None or not self.alive():
            raise GuardianError(self.problem or "the thaw guardian is not running")
        self._wait_ready(sock)
        try:
            socket.send_fds(sock, [HOLD + array.array("i", [pid]).tobytes()], [fd])
        except OSError as exc:  # EPIPE: it died; a timeout: it does not read
            raise GuardianError(f"the thaw guardian did not take pid {pid}: "
                                f"{exc.strerror or exc}") from None

    def let_go(self, pids: list[int]) -> None:
        """The reaper continued these itself: the guardian forgets them (never raises: at
        worst the guardian continues a running process once more)."""
        for i in range(0, len(pids), LET_GO_BATCH):
            self._send(LET_GO + array.array("i", pids[i:i + LET_GO_BATCH]).tobytes())

    def done(self) -> None:
        """The reap is over (it continued or killed what it stopped): the guardian forgets
        every pidfd it holds, and sends nothing."""
        self._send(DONE)

    def close(self) -> None:
        """EOF to the guardian (it continues what it holds and exits); wait for it."""
        proc = self._proc
        self._forget()
        if proc is not None:
            try:
                proc.wait(EXIT_SECONDS)
            except Exception:
                _log().warning("the thaw guardian (pid %s) did not exit", proc.pid)

    # -- internals ---------------------------------------------------------------------

    def _wait_ready(self, sock: socket.socket) -> None:
        if self._ready:
            return
        try:
            sock.settimeout(READY_SECONDS)
            answer = sock.recv(16)
        except OSError as exc:
            raise GuardianError(f"the thaw guardian did not start: {exc}") from None
        finally:
            sock.settimeout(SEND_SECONDS)
        if answer != READY:
            raise GuardianError("the thaw guardian did not start (it exited)")
        self._ready = True
        self.started_ms = (time.monotonic() - self._spawned) * 1000
        _log().debug("thaw guardian pid %s ready %.1f ms after its spawn", self.pid,
                  self.started_ms)

    def _send(self, message: bytes) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            sock.send(message)
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                _log().warning("could not tell the thaw guardian: %s", exc)

    def _forget(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._ready = None, False
