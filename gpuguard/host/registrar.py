"""The registrar: keep and run registrations written by the daemons, for the caller only.

A registration is a file named for a process's identity (gpuguard/host/marks.py). When
users wrote those files themselves into a world-writable directory, anyone could take a
name first (pid and start time are public in /proc/PID/stat) and so block its owner.
Here the exporter listens on a Unix socket beside the directory; `gpuguard keep` and
`gpuguard run` send one line, the kernel says who they are (SO_PEERCRED, which a client
cannot forge), and the registrar writes the file only when the caller is root or owns
the process that pid and start time still name, into a directory only the daemons' user
may write. One thread serves every connection without blocking: a client that connects
and says nothing holds one slot until its deadline, and a uid holds at most PER_UID
slots. A neighbour with many uids (the subordinate uids of a user namespace) can still
fill all MAX_CONNECTIONS: then a newcomer whose uid holds fewer than the most any uid
holds takes the slot of that uid's oldest connection. A line already sent when its
connection is accepted (the client sends it right after connecting) is answered then,
before any other connection can take its slot.

One registrar per host: it holds a lock beside its socket while it lives, and another
(a second exporter started by hand, a new one while the old one stops) neither removes
the socket a live one answers on nor, at its exit, one it did not bind: it stands by
and serves once the first is gone (docs/exporter.md, The registrar).

Protocol (one line each way, ASCII):
    register KIND PID START_TIME | unregister KIND PID START_TIME
    ok registered | ok removed | ok absent | no CODE MESSAGE
"""

from __future__ import annotations

import errno
import logging
import os
import re
import selectors
import socket
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gpuguard.base.counters import Counters
from gpuguard.host.marks import (
    DIR_MODE,
    MarkError,
    Marks,
    mark_name,
    registrar_socket,
    writable_by_others,
)
from gpuguard.host.procfs import ProcessView, boot_id
from gpuguard.orphans.process import ProcUnreadable
from gpuguard.orphans.rules_config import KEEP_MARK, RUN_MARK

log = logging.getLogger("gpuguard.registrar")

KINDS = (KEEP_MARK, RUN_MARK)
VERBS = ("register", "unregister")
#: A run registration's optional tier (gpuguard/launch/options.TIERS): a word for people.
TIER_WORD = re.compile(r"tier=[a-z]{1,16}")
#: A request is one short line; more is not a request.
MAX_REQUEST = 128
#: Seconds a connection may take to send its line.
REQUEST_DEADLINE = 2.0
#: Open connections one uid may hold, and all together.
PER_UID = 4
MAX_CONNECTIONS = 256
#: Connections the kernel queues before the registrar accepts them. A neighbour's
#: connect() loop keeps it full whatever its size; a client waits in the kernel for room
#: (request()), and a short queue is what keeps that wait short: measured, a user's
#: registration under four connect() loops of another took 92 ms (p50) with 64 and
#: 3.3 s with 4,096, each connection ahead being accepted and closed in turn.
BACKLOG = 64
#: Connections accepted in one turn of the loop before lines already sent are read.
ACCEPT_TURN = 1024
#: The most often an eviction (all slots held) is logged.
EVICTION_LOG_SECONDS = 60.0
#: A refusal is logged at most once this often per uid, and REFUSAL_LOG_LINES times in
#: all (a neighbour's subordinate uids are many), with a count of those left unsaid.
REFUSAL_LOG_SECONDS = 60.0
REFUSAL_LOG_LINES = 60
#: Uids whose last refusal line is remembered (the oldest forgotten first).
REFUSAL_LOG_UIDS = 4096
#: Registrations written (files added, less those removed) between two sweeps of those
#: whose process is gone: re-registering a name already there adds nothing.
PRUNE_EVERY = 256
#: A client waits this long for the answer (the launcher waits before CMD starts).
CLIENT_TIMEOUT = 5.0
#: A registrar standing by (another answers at its socket) tries again this often.
STANDBY_SECONDS = 1.0
#: Health codes (/healthz): another registrar serves this socket and this one waits;
#: this one should serve and does not (its socket was removed or replaced, its thread
#: stopped, or it could not start).
STANDBY, DOWN = "registrar-standby", "registrar-down"
#: Refusal codes (the second word of a `no` answer).
NO_PROCESS, NOT_OWNER, NOT_SELF, BAD_REQUEST, UNAVAILABLE = (
    "no-process", "not-owner", "not-self", "bad-request", "unavailable")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class RegistrarUnavailable(MarkError):
    """Nothing answers at the socket (no exporter on this host, or not yet started)."""


class RegistrarBusy(OSError):
    """Another registrar holds this socket (its lock, or it answers there)."""


class Refused(MarkError):
    """The registrar answered no: `code` is one of the refusal codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- the client (gpuguard keep, gpuguard run) -------------------------------------------


def request(socket_path: str, verb: str, kind: str, pid: int, start_time: int,
            timeout: float = CLIENT_TIMEOUT, *, tier: str | None = None) -> str:
    """Ask the registrar; its `ok` answer's word (registered, removed, absent).
    `tier`: a `gpuguard run` registration's tier, written as the file's second line (for
    people; only the first is trusted). Raises RegistrarUnavailable (nothing listens),
    Refused, or MarkError."""
    extra = f" tier={tier}" if tier else ""
    line = f"{verb} {kind} {int(pid)} {int(start_time)}{extra}\n".encode()
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            _connect(sock, socket_path, deadline)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise RegistrarUnavailable(
                f"no gpuguard registrar listens at {socket_path} ({exc.strerror}): the "
                "gpuguard exporter serves it on this host") from None
        except OSError as exc:
            raise RegistrarUnavailable(
                f"cannot reach the gpuguard registrar at {socket_path}: {exc.strerror}"
            ) from None
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.sendall(line)
            answer = b""
            while b"\n" not in answer and len(answer) < 512:
                chunk = sock.recv(512)
                if not chunk:
                    break
                answer += chunk
        except TimeoutError:
            raise MarkError(f"the gpuguard registrar at {socket_path} did not answer "
                            f"within {timeout:g}s") from None
        except OSError as exc:
            raise MarkError(f"the gpuguard registrar at {socket_path}: {exc.strerror}"
                            ) from None
    words = answer.decode("ascii", "replace").strip().split(" ", 2)
    if len(words) >= 2 and words[0] == "ok":
        return words[1]
    if len(words) == 3 and words[0] == "no":
        raise Refused(words[1], words[2])
    raise MarkError(f"the gpuguard registrar at {socket_path} gave no answer")


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """connect(), waiting in the kernel for room while the registrar's backlog is full,
    until `deadline`. A Unix socket's connect() with Python's timeout (non-blocking)
    fails at once with EAGAIN there, so a neighbour's connect() loop, which keeps the
    backlog full, would turn every other user away; a blocking one with SO_SNDTIMEO
    sleeps until the registrar accepts and is woken then."""
    left = max(0.001, deadline - time.monotonic())
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", int(left), int(left % 1 * 1_000_000)))
    sock.connect(path)  # EAGAIN once SO_SNDTIMEO has passed without room


# -- the server (the exporter) ----------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    pid: int
    uid: int


def peer_of(sock: socket.socket) -> Caller:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                               _CRED.size))
    return Caller(pid, uid)


def decide(caller: Caller, verb: str, kind: str, pid: int, start_time: int,
           view: ProcessView) -> tuple[str, str] | None:
    """Why the caller may not (un)register this process (code, message); None: it may.
    Only a process (not one of its threads' ids) that runs (ProcInfo.is_live: a main
    thread that called pthread_exit() with a thread still running is alive); only its
    owner (ProcessView's, from /proc/PID/status where the inode says root) or root; a
    `run` registration only by the launcher itself, the one process a subreaper's
    adoptions are about."""
    view.begin_scan()  # one request is one look: nothing kept from the last
    try:
        info = view.fresh_stat(pid)
        if info is None or not info.is_live(view.thread_states):
            return NO_PROCESS, f"no such process: {pid}"
    except ProcUnreadable as exc:
        return UNAVAILABLE, f"cannot read the process: {exc}"
    if info.start_time != start_time:
        return NO_PROCESS, (f"pid {pid} now names another process (start time "
                            f"{info.start_time}, not {start_time})")
    status = view.status(info)
    if status is None or status.tgid is None:
        return UNAVAILABLE, f"cannot read /proc/{pid}/status"
    if status.tgid != pid:
        return NO_PROCESS, (f"pid {pid} is a thread of process {status.tgid}, not a "
                            f"process: register {status.tgid}")
    if caller.uid != 0 and caller.uid != info.uid:
        return NOT_OWNER, (f"pid {pid} belongs to uid {info.uid}, not to the caller (uid "
                           f"{caller.uid}): only its owner or root may register it")
    if kind == RUN_MARK and verb == "register" and caller.uid != 0 and caller.pid != pid:
        return NOT_SELF, "a run registration is made by the launcher itself"
    return None


@dataclass
class _Pending:
    sock: socket.socket
    caller: Caller
    deadline: float
    data: bytes = b""


class RefusalLog:
    """Whether a refusal gets a log line: one per uid per REFUSAL_LOG_SECONDS and
    REFUSAL_LOG_LINES in all per REFUSAL_LOG_SECONDS; a line says how many of that uid's
    went unsaid before it. The answer itself and `served` count every one."""

    def __init__(self, clock: Callable[[], float], every: float = REFUSAL_LOG_SECONDS,
                 lines: int = REFUSAL_LOG_LINES, uids: int = REFUSAL_LOG_UIDS) -> None:
        self._clock = clock
        self._every = every
        self._lines = lines
        self._uids = uids
        self._last: OrderedDict[int, tuple[float, int]] = OrderedDict()  # uid: at, unsaid
        self._window = -every
        self._said = 0

    def admit(self, uid: int) -> int | None:
        """None: say nothing (counted); else how many of `uid`'s went unsaid before."""
        now = self._clock()
        at, unsaid = self._last.pop(uid, (-self._every, 0))
        if now >= self._window + self._every:
            self._window, self._said = now, 0
        if now < at + self._every or self._said >= self._lines:
            self._remember(uid, at, unsaid + 1)
            return None
        self._said += 1
        self._remember(uid, now, 0)
        return unsaid

    def _remember(self, uid: int, at: float, unsaid: int) -> None:
        self._last[uid] = (at, unsaid)
        while len(self._last) > self._uids:
            self._last.popitem(last=False)


class OwnSocket:
    """The registrar's socket path, held as its own: a lock beside it (flock, let go by
    the kernel however the holder ends) says a registrar lives; a socket a live one
    answers on is never removed (a registrar of a version without the lock answers
    too); at the end only the inode this one bound is removed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock_path = path + ".lock"
        self._lock_fd: int | None = None
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of what we bound

    def take(self, backlog: int) -> socket.socket:
        """Lock, remove a stale socket, bind and listen (mode 0666: any local user may
        ask). Raises RegistrarBusy while another registrar holds the path, OSError when
        the socket cannot be made."""
        import fcntl  # Linux's registrar; this module is imported on Windows too

        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)  # only the daemons may open it, and so hold it
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RegistrarBusy(errno.EBUSY, f"another registrar holds {self.lock_path}"
                                    ) from None
            listener = self._bind(backlog)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        return listener

    def _bind(self, backlog: int) -> socket.socket:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise OSError(errno.EEXIST, f"{self.path} exists and is not a socket")
            if answers(self.path):
                raise RegistrarBusy(errno.EBUSY, f"another registrar answers at {self.path}")
            os.unlink(self.path)  # a previous registrar's, which nothing answers on
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
            st = os.lstat(self.path)
            self._bound = (st.st_dev, st.st_ino)
            os.chmod(self.path, 0o666)
            listener.listen(backlog)
            listener.setblocking(False)
        except OSError:
            listener.close()
            self.release()
            raise
        return listener

    def intact(self) -> bool:
        """Whether the socket at the path is still the one bound here."""
        if self._bound is None:
            return False
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._bound

    def release(self) -> None:
        """Remove the socket if it is still the one bound here, then let go of the lock."""
        if self.intact():
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self._bound = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def answers(path: str, timeout: float = 1.0) -> bool:
    """Whether a listener is behind the socket at `path` (connect() is taken, or waits
    in a full backlog); False only when the kernel says nobody listens."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # a full backlog (EAGAIN), a timeout: someone listens
    finally:
        probe.close()
    return True


class Registrar:
    """Serves registrations for `directory` at registrar_socket(directory)."""

    def __init__(self, directory: str, socket_path: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 prune_every: int = PRUNE_EVERY,
                 max_connections: int = MAX_CONNECTIONS,
                 standby_seconds: float = STANDBY_SECONDS) -> None:
        self.directory = directory
        self._max_connections = max(1, max_connections)
        self._prune_every = prune_every
        self._added = 0  # files added, less those removed, since the last sweep
        self.socket_path = socket_path or registrar_socket(directory)
        self._own = OwnSocket(self.socket_path)
        self._clock = clock
        self._standby_seconds = standby_seconds
        self._marks = Marks(directory, boot_id())
        self._view = ProcessView(counters=Counters())
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._pending: dict[int, _Pending] = {}
        #: Answers given, by result (registered, removed, or a refusal code).
        self.served: dict[str, int] = {}
        #: Silent connections closed to give their slot to a uid that held fewer.
        self.evicted = 0
        #: Sweeps of registrations whose process is gone.
        self.sweeps = 0
        self._evictions_logged_at = -EVICTION_LOG_SECONDS
        self._refusals = RefusalLog(clock)

    def start(self) -> None:
        """Take the socket and serve in a thread; where another registrar holds it, stand
        by in that thread and serve once it is gone (health() says which). Raises
        OSError when the socket cannot be made."""
        self._wake = socket.socketpair()
        self._wake[0].setblocking(False)
        self._selector.register(self._wake[0], selectors.EVENT_READ, "wake")
        try:
            self._take()
        except RegistrarBusy as exc:
            log.warning("registrar standing by: %s (another gpuguard-exporter on this "
                        "host?); this one serves once it is gone", exc.strerror)
        except OSError:
            self._close_wake()
            raise
        self._thread = threading.Thread(target=self._serve, name="gpuguard-registrar",
                                        daemon=True)
        self._thread.start()

    def _take(self) -> None:
        listener = self._own.take(BACKLOG)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, "accept")

    def health(self) -> str | None:
        """None while this registrar serves its socket; else STANDBY (another serves it)
        or DOWN (nobody here does: the socket was removed or replaced, or the thread
        stopped)."""
        if self._thread is None or not self._thread.is_alive():
            return DOWN
        if self._listener is None:
            return STANDBY
        return None if self._own.intact() else DOWN

    def stop(self) -> None:
        self._stop.set()
        if self._wake is not None:
            try:
                self._wake[1].send(b"x")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        for pending in list(self._pending.values()):
            pending.sock.close()
        self._pending.clear()
        if self._listener is not None:
            self._listener.close()
            self._own.release()  # only the socket bound here, never another's
        self._close_wake()
        self._selector.close()

    def _close_wake(self) -> None:
        if self._wake is not None:
            for end in self._wake:
                end.close()
            self._wake = None

    @property
    def connections(self) -> int:
        """Connections accepted and not yet answered or closed."""
        return len(self._pending)

    def _now(self) -> float:
        return self._clock()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if self._listener is None:
                    self._stand_by()
                else:
                    self._once()
            except Exception:  # one bad connection must not stop registrations
                log.exception("registrar: unexpected error; serving on")

    def _stand_by(self) -> None:
        """Wait a turn, then try to take the socket again."""
        if self._selector.select(self._standby_seconds):
            return  # woken: stopping
        try:
            self._take()
        except RegistrarBusy:
            return
        except OSError as exc:
            log.warning("registrar: cannot listen at %s: %s", self.socket_path, exc.strerror)
            return
        log.info("registrar: the other registrar is gone; registrations served at %s",
                 self.socket_path)

    def _once(self) -> None:
        timeout = min((p.deadline for p in self._pending.values()), default=None)
        wait = None if timeout is None else max(0.0, timeout - self._now())
        # Lines that came first, then new connections (which may take a silent one's slot).
        ready = sorted(self._selector.select(wait), key=lambda event: event[0].data == "accept")
        for key, _ in ready:
            if key.data == "accept":
                self._accept()
            elif key.data == "wake":
                return
            else:
                self._read(key.fileobj)  # type: ignore[arg-type]
        now = self._now()
        for fd, pending in list(self._pending.items()):
            if pending.deadline <= now:
                self._close(fd)

    def _accept(self) -> None:
        """Accept what waits, up to ACCEPT_TURN: a uid over its share is closed at once,
        so one uid's connect() loop keeps the backlog moving, not full."""
        assert self._listener is not None
        for _ in range(ACCEPT_TURN):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("registrar: accept failed: %s", exc.strerror)
                return
            try:
                caller = peer_of(sock)
            except OSError:
                sock.close()  # no credentials, no registration
                continue
            if not self._admit(caller.uid):
                sock.close()  # a flood from one uid fills its own slots, not others'
                continue
            sock.setblocking(False)
            self._pending[sock.fileno()] = _Pending(sock, caller,
                                                    self._now() + REQUEST_DEADLINE)
            self._selector.register(sock, selectors.EVENT_READ, "client")
            self._read(sock)  # its line is usually there already: answered, slot freed

    def _admit(self, uid: int) -> bool:
        """Whether a connection of `uid` gets a slot: fewer than PER_UID of its own, and
        a free slot, or else the oldest connection of the uid holding the most, when that
        is more than `uid` holds (it is closed unanswered, as its deadline would)."""
        held: dict[int, int] = {}
        for pending in self._pending.values():
            held[pending.caller.uid] = held.get(pending.caller.uid, 0) + 1
        mine = held.get(uid, 0)
        if mine >= PER_UID:
            return False
        if len(self._pending) < self._max_connections:
            return True
        most = max(held.values())
        if most <= mine:
            return False
        fd, _ = min(((fd, p) for fd, p in self._pending.items() if held[p.caller.uid] == most),
                    key=lambda item: item[1].deadline)
        self._close(fd)
        self.evicted += 1
        now = self._now()
        if now >= self._evictions_logged_at + EVICTION_LOG_SECONDS:
            self._evictions_logged_at = now
            log.warning("registrar: all %d connection slots held by silent clients: closed "
                        "the oldest of a uid holding %d for uid %d (%d closed so far)",
                        self._max_connections, most, uid, self.evicted)
        return True

    def _read(self, sock: socket.socket) -> None:
        pending = self._pending.get(sock.fileno())
        if pending is None:
            return
        try:
            chunk = sock.recv(MAX_REQUEST + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(sock.fileno())
            return
        pending.data += chunk
        if b"\n" not in pending.data and len(pending.data) <= MAX_REQUEST:
            return
        answer = self._answer(pending.caller, pending.data)
        try:
            sock.send(answer.encode())  # a few bytes into an empty buffer
        except OSError:
            pass
        self._close(sock.fileno())

    def _close(self, fd: int) -> None:
        pending = self._pending.pop(fd, None)
        if pending is not None:
            try:
                self._selector.unregister(pending.sock)
            except (KeyError, ValueError):
                pass
            pending.sock.close()

    def _answer(self, caller: Caller, data: bytes) -> str:
        line = data.split(b"\n", 1)[0].decode("ascii", "replace")
        words = line.split()
        detail = ""
        if len(words) == 5 and words[:2] == ["register", RUN_MARK] and TIER_WORD.fullmatch(
                words[4]):
            detail = "tier " + words.pop().removeprefix("tier=")
        if (len(words) != 4 or words[0] not in VERBS or words[1] not in KINDS
                or not words[2].isdigit() or not words[3].isdigit()):
            return self._count(BAD_REQUEST, f"no {BAD_REQUEST} expected: "
                               "register|unregister keep|run PID START_TIME "
                               "[tier=NAME]\n")
        verb, kind, pid, start_time = words[0], words[1], int(words[2]), int(words[3])
        problem = self.directory_problem()
        if problem is not None:
            return self._count(UNAVAILABLE, f"no {UNAVAILABLE} {problem}\n")
        refusal = decide(caller, verb, kind, pid, start_time, self._view)
        if refusal is not None:
            code, message = refusal
            unsaid = self._refusals.admit(caller.uid)
            if unsaid is not None:
                log.info("registrar: refused %s %s for uid %d (pid %d): %s%s", verb,
                         mark_name(kind, pid, start_time), caller.uid, caller.pid, message,
                         f" ({unsaid} more of this uid's refused, unlogged, before)"
                         if unsaid else "")
            return self._count(code, f"no {code} {message}\n")
        try:
            if verb == "register":
                new = not os.path.lexists(os.path.join(self.directory,
                                                       mark_name(kind, pid, start_time)))
                self._marks.register(kind, pid, start_time, detail)
                if new:
                    self._added += 1
                if self._added >= self._prune_every:
                    self.prune()
                return self._count("registered", "ok registered\n")
            removed = self._marks.unregister(kind, pid, start_time)
        except MarkError as exc:
            return self._count(UNAVAILABLE, f"no {UNAVAILABLE} {exc}\n")
        if removed:
            self._added = max(0, self._added - 1)
        return self._count("removed", "ok removed\n" if removed else "ok absent\n")

    def _count(self, result: str, answer: str) -> str:
        self.served[result] = self.served.get(result, 0) + 1
        return answer

    def prune(self) -> int:
        """Remove the registrations whose process is gone (a `gpuguard keep` job that
        ended, a SIGKILLed launcher); how many. Every PRUNE_EVERY files added, so the
        directory holds what lives plus at most that many: a user who registers many
        short-lived processes cannot fill /run, and re-registering one adds nothing.
        Gone is what the classifier calls gone (ProcInfo.is_live): a main thread that
        called pthread_exit() with a thread still running holds its registration, and
        one that cannot be read is kept. Only the daemons write here, so listing it
        costs what they wrote (and what the old layout left, once)."""
        removed = 0
        self._added = 0
        self.sweeps += 1
        self._view.begin_scan()
        try:
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            log.warning("registrar: cannot list %s: %s", self.directory, exc.strerror)
            return 0
        for entry in entries:
            parts = entry.name.split("-")
            if (len(parts) != 3 or parts[0] not in KINDS or not parts[1].isdigit()
                    or not parts[2].isdigit()):
                continue
            try:
                info = self._view.fresh_stat(int(parts[1]))
                if (info is not None and info.start_time == int(parts[2])
                        and info.is_live(self._view.thread_states)):
                    continue
            except ProcUnreadable:
                continue  # cannot tell: kept
            try:
                os.unlink(entry.path)
                removed += 1
            except OSError:
                pass
        return removed

    def directory_problem(self) -> str | None:
        """Whether the directory is still one only the daemons may write (checked per
        request: an operator may have changed it since the start)."""
        try:
            st = os.lstat(self.directory)
        except OSError as exc:
            return f"{self.directory}: {exc.strerror}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{self.directory} is not a directory"
        if st.st_uid != os.geteuid() or writable_by_others(st):
            return (f"{self.directory} is not the daemons' own (owner uid {st.st_uid}, mode "
                    f"{stat.S_IMODE(st.st_mode):o}, wanted {DIR_MODE:o}): registrations "
                    "there could be taken first")
        return None


def start_registrar(directory: str, registrar: Registrar | None = None
                    ) -> tuple[Registrar | None, str | None]:
    """The running registrar for `directory` (`registrar`, where the caller made it
    first: the exporter's health reads it before it starts), serving or standing by
    while another serves; or a one-line problem (the daemon runs on: `gpuguard keep` then
    says no registrar listens, and the registrar's health says registrar-down)."""
    if registrar is None:
        registrar = Registrar(directory)
    problem = registrar.directory_problem()
    if problem is not None:
        return None, f"registrar not started: {problem}"
    try:
        registrar.start()
    except OSError as exc:
        return None, (f"registrar not started: cannot listen at {registrar.socket_path}: "
                      f"{exc.strerror}")
    return registrar, None
