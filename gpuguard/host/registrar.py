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
from collections.abc import Callable
from dataclasses import dataclass

from gpuguard.host.counters import Counters
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
#: The most often an eviction (all slots held) is logged.
EVICTION_LOG_SECONDS = 60.0
#: Registrations written between two sweeps of those whose process is gone.
PRUNE_EVERY = 256
#: A client waits this long for the answer (the launcher waits before CMD starts).
CLIENT_TIMEOUT = 5.0
#: Refusal codes (the second word of a `no` answer).
NO_PROCESS, NOT_OWNER, NOT_SELF, BAD_REQUEST, UNAVAILABLE = (
    "no-process", "not-owner", "not-self", "bad-request", "unavailable")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class RegistrarUnavailable(MarkError):
    """Nothing answers at the socket (no exporter on this host, or not yet started)."""


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
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise RegistrarUnavailable(
                f"no gpuguard registrar listens at {socket_path} ({exc.strerror}): the "
                "gpuguard exporter serves it on this host") from None
        except OSError as exc:
            raise RegistrarUnavailable(
                f"cannot reach the gpuguard registrar at {socket_path}: {exc.strerror}"
            ) from None
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
    Only the process's owner or root; a `run` registration only by the launcher itself,
    the one process a subreaper's adoptions are about."""
    view.begin_scan()  # one request is one look: nothing kept from the last
    try:
        info = view.fresh_stat(pid)
    except ProcUnreadable as exc:
        return UNAVAILABLE, f"cannot read the process: {exc}"
    if info is None or info.is_zombie:
        return NO_PROCESS, f"no such process: {pid}"
    if info.start_time != start_time:
        return NO_PROCESS, (f"pid {pid} now names another process (start time "
                            f"{info.start_time}, not {start_time})")
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


class Registrar:
    """Serves registrations for `directory` at registrar_socket(directory)."""

    def __init__(self, directory: str, socket_path: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 prune_every: int = PRUNE_EVERY,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.directory = directory
        self._max_connections = max(1, max_connections)
        self._prune_every = prune_every
        self._written = 0
        self.socket_path = socket_path or registrar_socket(directory)
        self._clock = clock
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
        self._evictions_logged_at = -EVICTION_LOG_SECONDS

    def start(self) -> None:
        """Bind the socket (mode 0666: any local user may ask) and serve in a thread.
        Raises OSError when the socket cannot be made."""
        try:
            st = os.lstat(self.socket_path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise OSError(errno.EEXIST, f"{self.socket_path} exists and is not a socket")
            os.unlink(self.socket_path)  # a previous run's: only the daemons may write here
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.socket_path)
            os.chmod(self.socket_path, 0o666)
            listener.listen(64)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._wake = socket.socketpair()
        self._wake[0].setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake[0], selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, name="gpuguard-registrar",
                                        daemon=True)
        self._thread.start()

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
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass
        if self._wake is not None:
            for end in self._wake:
                end.close()
        self._selector.close()

    @property
    def connections(self) -> int:
        """Connections accepted and not yet answered or closed."""
        return len(self._pending)

    def _now(self) -> float:
        return self._clock()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._once()
            except Exception:  # one bad connection must not stop registrations
                log.exception("registrar: unexpected error; serving on")

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
        assert self._listener is not None
        for _ in range(64):
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
            log.info("registrar: refused %s %s for uid %d (pid %d): %s", verb,
                     mark_name(kind, pid, start_time), caller.uid, caller.pid, message)
            return self._count(code, f"no {code} {message}\n")
        try:
            if verb == "register":
                self._marks.register(kind, pid, start_time, detail)
                self._written += 1
                if self._written >= self._prune_every:
                    self._written = 0
                    self.prune()
                return self._count("registered", "ok registered\n")
            removed = self._marks.unregister(kind, pid, start_time)
        except MarkError as exc:
            return self._count(UNAVAILABLE, f"no {UNAVAILABLE} {exc}\n")
        return self._count("removed", "ok removed\n" if removed else "ok absent\n")

    def _count(self, result: str, answer: str) -> str:
        self.served[result] = self.served.get(result, 0) + 1
        return answer

    def prune(self) -> int:
        """Remove the registrations whose process is gone (a `gpuguard keep` job that
        ended, a SIGKILLed launcher); how many. Every PRUNE_EVERY registrations, so the
        directory holds what lives plus at most that many: a user who registers many
        short-lived processes cannot fill /run. Only the daemons write here, so listing
        it costs what they wrote (and what the old layout left, once)."""
        removed = 0
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
            except ProcUnreadable:
                continue  # cannot tell: kept
            if info is not None and not info.is_zombie and info.start_time == int(parts[2]):
                continue
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


def start_registrar(directory: str) -> tuple[Registrar | None, str | None]:
    """The running registrar for `directory`, or a one-line problem (the daemon runs on:
    `gpuguard keep` then says no registrar listens)."""
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
