"""The kernel's process exit events: how a launcher died, told as it happened.

An orphan's launcher is gone by the time a scan sees the orphan, and /proc keeps nothing
of a reaped process: whether a signal killed it or it exited on purpose (what tells an
abandoned job from a detached one) only the kernel saw. One netlink socket listens to the
process-events connector (connector.py) and keeps a bounded memory of exits
(exit_store.py), and apart from it the exits of the pids a daemon said matter (watched.py:
its GPU holders' chains and their session leaders), which other exits cannot evict.
Exits before `start()` are unknown; what an overrun socket lost is counted as `dropped`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from gpuguard.base.compat import StrEnum
from gpuguard.host.events.connector import (
    CN_IDX_PROC,
    EXIT_DATAGRAM,
    NETLINK_CONNECTOR,
    NLMSG_DONE,
    PROC_CN_MCAST_IGNORE,
    PROC_CN_MCAST_LISTEN,
    PROC_EVENT_COMM,
    PROC_EVENT_EXIT,
    PROC_EVENT_NONE,
    Event,
    decode,
    request,
)
from gpuguard.host.events.exit_store import EvictionCause, Exit, ExitStore, Row
from gpuguard.host.events.privilege import subscription_refused
from gpuguard.host.events.watched import MAX_RECORDS as MAX_WATCHED
from gpuguard.host.events.watched import WatchedExits
from gpuguard.host.procfs import in_host_pid_namespace

log = logging.getLogger("gpuguard.host.procevents")  # its name before the move

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_MEMINFO = 55  # u32[SK_MEMINFO_VARS]; [8] is sk_drops: messages the kernel dropped
SK_MEMINFO_DROPS = 8
PR_SET_NAME = 15


class EventKind(StrEnum):
    """Event kinds counted (gpuguard_process_events_total{kind})."""

    EXIT = "exit"  # a process (thread-group leader) exited: recorded
    OTHER = "other"  # anything else that arrived: a thread's exit, an acknowledgement, ...
    DROPPED = "dropped"  # events the kernel dropped because our socket was full (ENOBUFS)


KINDS: tuple[EventKind, ...] = tuple(EventKind)

RECV_SIZE = 8192
BATCH = 256  # exits recorded per store lock
#: After draining, the reader lets events queue for up to this long before it looks
#: again: a wake-up costs more than the events it brings (Python, a thread switch), so
#: batching cuts the CPU per exit several-fold (benchmarks/procevents_cost.py: ~0.6% of a
#: core at 1,000 exits/s). Shorter when the socket buffer is small, so that a burst of
#: DESIGN_RATE exits a second fills at most half of it meanwhile.
MAX_PACE_S = 0.05
DESIGN_RATE = 10_000
EVENT_TRUESIZE = 1024  # bytes of receive buffer one queued event takes (832 on 6.18 x86-64)


class EventCounts:
    """Thread-safe counts per event kind, from the fixed set KINDS."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(KINDS, 0)

    def add(self, kind: str, n: int = 1) -> None:
        if kind not in self._counts:
            raise KeyError(f"unknown event kind {kind!r}")
        with self._lock:
            self._counts[kind] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class SocketDrops:
    """What the kernel dropped on our full socket (SO_MEMINFO sk_drops), counted as
    `dropped`; on a kernel without it, each overrun counts as one, at least."""

    def __init__(self, counters: EventCounts) -> None:
        self._counters = counters
        self._seen = 0  # the kernel's sk_drops when last read
        self._meminfo = True
        self._last_warning = -float("inf")
        self.total = 0

    def sync(self, sock: socket.socket, *, overrun: bool = False) -> None:
        """Bring `total` up to the kernel's count for `sock`."""
        if self._meminfo:
            try:
                raw = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 64)
                drops = struct.unpack_from(f"={len(raw) // 4}I", raw)[SK_MEMINFO_DROPS]
            except (OSError, IndexError, struct.error):
                self._meminfo = False  # an old kernel
            else:
                delta = drops - self._seen
                self._seen = drops
                if delta > 0:
                    self.total += delta
                    self._counters.add(EventKind.DROPPED, delta)
                return
        if overrun:
            self.total += 1
            self._counters.add(EventKind.DROPPED, 1)

    def warn(self) -> None:
        """Say that exits were lost, at most once a minute."""
        now = time.monotonic()
        if now - self._last_warning >= 60.0:
            self._last_warning = now
            log.warning("process events: socket overrun, %d events dropped since start; "
                        "some exits were not recorded", self.total)


class ProcessEvents:
    """Listens to the kernel's process exits on a daemon thread; answers `exit_of`.

    `start()` never raises: where the connector cannot be used it logs one warning,
    sets `available` False and `unavailable_reason`, and every query answers None.
    """

    def __init__(self, *, retention: float = 600.0, max_records: int = 65536,
                 max_watched: int = MAX_WATCHED, counters: EventCounts | None = None,
                 clock: Callable[[], float] = time.time,
                 receive_buffer: int = 4 << 20, handshake_timeout: float = 1.0,
                 allow_pid_namespace: bool = False) -> None:
        self.counters = counters if counters is not None else EventCounts()
        self._clock = clock
        self._store = ExitStore(max_records=max_records, retention=retention, clock=clock)
        self._watched = WatchedExits(retention=retention, clock=clock, max_records=max_watched)
        self._receive_buffer = receive_buffer
        self._handshake_timeout = handshake_timeout
        self._allow_pid_namespace = allow_pid_namespace
        self.available = False
        self.unavailable_reason = "not started"
        #: Whether the kernel narrowed the stream to exits (6.6+, initial PID namespace).
        self.filtered = False
        #: False when this process sits in a child PID namespace: pids here are the host's.
        self.initial_pid_namespace = True
        #: This process's pid as the kernel reports it (differs from os.getpid() only in a
        #: child PID namespace, where the start-up probe learns it); None until started.
        self.host_pid: int | None = None
        self._sock: socket.socket | None = None
        self._sock_lock = threading.Lock()  # the socket's life vs counts() reading its drops
        self._drops = SocketDrops(self.counters)
        self._wake_r, self._wake_w = -1, -1
        self._stopping = threading.Event()
        #: caught_up(): cuts the reader's pace short, and counts its drains
        self._hurry = threading.Event()
        self._drains = threading.Condition()
        self._drain_starts = 0
        self._drain_ends = 0
        self._thread: threading.Thread | None = None
        self._started = False
        self._buf = bytearray(RECV_SIZE)
        self._pace = MAX_PACE_S
        self._on_watched_exit: Callable[[], object] | None = None

    # -- life ----------------------------------------------------------------------------

    def start(self, *, after_subscribe: Callable[[], object] | None = None) -> None:
        """Subscribe and start the reader thread; on failure, warn once and stay unavailable.

        Once: a later call does nothing. `after_subscribe` runs in this thread right after
        the attempt, whatever came of it, before the reader thread starts (the daemons drop
        CAP_NET_ADMIN there: privilege.py).
        """
        if self._started:
            return
        self._started = True
        try:
            self._subscribe()
        except Exception as exc:  # whatever the kernel says, the exporter runs on without
            if after_subscribe is not None:
                after_subscribe()
            self._close()
            self.available = False
            self.unavailable_reason = (str(exc) if isinstance(exc, _Unavailable)
                                       else f"unexpected error while subscribing: {exc!r}")
            log.warning("process events unavailable (orphans whose launcher is gone "
                        "will read session-ended): %s", self.unavailable_reason)
            return
        if after_subscribe is not None:
            after_subscribe()
        self.available = True
        self.unavailable_reason = ""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe is nudge enough
        self._thread = threading.Thread(target=self._run, name="procevents", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, unsubscribe, close the socket; records stay queryable."""
        self._stopping.set()
        self._hurry.set()
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout)
        self._close()
        # Forgotten before they close: a caught_up() racing this must not write into a
        # number another file has just been given.
        fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- queries -------------------------------------------------------------------------

    def caught_up(self, timeout: float = 0.25) -> bool:
        """Wait (at most `timeout`) until the reader has read every event queued before
        this call: it reads in paced batches (MAX_PACE_S), so an exit that happened just
        now may not be recorded yet. False when it could not be had (no reader, or the
        time ran out)."""
        thread = self._thread
        if not self.available or thread is None or not thread.is_alive() or self._wake_w < 0:
            return False
        with self._drains:
            wanted = self._drain_starts + 1  # a drain that starts after this call
        self._hurry.set()
        wake = self._wake_w
        if wake < 0:
            return False
        try:
            os.write(wake, b"x")
        except BlockingIOError:
            pass  # the pipe is full of nudges already
        except OSError:
            return False
        deadline = time.monotonic() + timeout
        with self._drains:
            while self._drain_ends < wanted:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._drains.wait(left)
        return True

    def exit_of(self, pid: int, *, after: float) -> Exit | None:
        """The latest exit of `pid` recorded at or after `after` (Unix time), else None.

        Pass the start time of a process the launcher outlived (the orphan root), so a
        reused pid's older exit does not answer. `pid` is as the initial PID namespace
        numbers it (the same as this process sees, unless `initial_pid_namespace` is False).
        """
        if not self.available:
            return None
        general = self._store.exit_of(pid, after=after)
        kept = self._watched.exit_of(pid, after=after)
        if general is None or (kept is not None and kept.at > general.at):
            return kept
        return general

    def watch(self, pids: Iterable[int] | Mapping[int, int]) -> None:
        """The pids whose exits must outlast the general ring from now on: a scan's chain
        set (gpuguard/orphans/chain.py `chain_set`), or the remediator's chain watch's
        sessions (`session_set`). A mapping names the uid each pid's record is charged to
        (the holder's): a full store takes room from the uid holding the most records.
        Replaces the last set whole; a newly watched pid's exit the ring still holds is
        kept too. Callable before start() and from any one thread."""
        self._watched.publish(pids, self._store)

    def on_watched_exit(self, wake: Callable[[], object] | None) -> None:
        """Call `wake` (no arguments) from the reader thread after each batch of exits that
        holds a watched pid's, once it is recorded: the exporter's scanner looks again
        early (Periodic.run_soon). It must not block: it delays every exit after it."""
        self._on_watched_exit = wake

    def watched(self) -> frozenset[int]:
        """The pids watched now: what an exit is tested against (one set lookup)."""
        return self._watched.pids

    def records(self) -> list[Exit]:
        """Every exit held now, oldest first (debugging, tests)."""
        return self._store.records() if self.available else []

    def counts(self) -> dict[str, int]:
        """Events by kind since start: exit, other, dropped."""
        self._sync_drops()
        return self.counters.snapshot()

    def evictions(self) -> dict[EvictionCause, int]:
        """Exit records dropped from the general ring since start, by cause (count, age)."""
        return self._store.evictions()

    def watched_evictions(self) -> int:
        """Records of still-watched pids dropped for room: 0 unless a published set
        outgrew the watched store (watched.MAX_RECORDS); the uid holding the most lost
        them."""
        return self._watched.evicted

    # -- subscribing ---------------------------------------------------------------------

    def _subscribe(self) -> None:
        host_ns = in_host_pid_namespace()
        self.initial_pid_namespace = host_ns is not False
        if not self.initial_pid_namespace and not self._allow_pid_namespace:
            raise _Unavailable(
                "this process is in a child PID namespace: the kernel reports host pids, "
                "which name other processes here (allow_pid_namespace=True if callers "
                "pass host pids)")
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
        except OSError as exc:
            raise _Unavailable(f"no netlink connector ({_why(exc)})") from exc
        self._sock = sock
        granted = grow_receive_buffer(sock, self._receive_buffer)
        self._pace = min(MAX_PACE_S, granted / EVENT_TRUESIZE / 2 / DESIGN_RATE)
        cookie = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        try:
            sock.bind((0, CN_IDX_PROC))
            sock.send(request(PROC_CN_MCAST_LISTEN, ack=cookie))
        except OSError as exc:
            raise _Unavailable(f"cannot subscribe to process events ({_why(exc)})") from exc
        sock.setblocking(False)
        # The kernel acknowledges a request from the initial PID and user namespaces only.
        wait = self._handshake_timeout if self.initial_pid_namespace else 0.0
        acked = self._read_until(lambda ev: ev.what == PROC_EVENT_NONE and ev.ack == cookie + 1,
                                 wait)
        if acked is not None:
            if acked.data and acked.data[0]:
                raise _Unavailable(f"the kernel refused the subscription "
                                   f"({os.strerror(acked.data[0])})")
            try:  # narrow to exits; older kernels ignore a request of this size
                sock.send(request(PROC_CN_MCAST_LISTEN, ack=cookie + 1, events=PROC_EVENT_EXIT))
                self.filtered = True
            except OSError:
                pass
            self.host_pid = os.getpid()
            return
        self._probe()

    def _probe(self) -> None:
        """No acknowledgement: a thread of ours renames itself to a random token; if that
        event arrives, events flow, and it names this process as the kernel numbers it."""
        token = os.urandom(6).hex().encode()
        renamed: list[bool] = []
        probe = threading.Thread(target=lambda: renamed.append(_rename_thread(token)),
                                 name="procevents-probe")
        probe.start()
        probe.join()
        seen = None
        if renamed[0]:
            seen = self._read_until(
                lambda ev: ev.what == PROC_EVENT_COMM and ev.comm == token,
                self._handshake_timeout)
        if seen is None:
            raise _Unavailable("the kernel neither acknowledged the subscription nor sent "
                               "events (a child user or PID namespace, on a kernel that "
                               "serves only acknowledged listeners?)")
        self.host_pid = seen.data[1]

    def _read_until(self, match: Callable[[Event], bool], timeout: float) -> Event | None:
        """Handle what arrives (recording as usual) until an event matches or time is up."""
        sock = self._sock
        assert sock is not None
        poller = select.poll()  # not select(): the exporter may hold fds past 1024
        poller.register(sock.fileno(), select.POLLIN)
        deadline = time.monotonic() + timeout
        while True:
            found = self._drain(sock, match)
            if found is not None:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            poller.poll(left * 1000)

    # -- reading -------------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while not self._stopping.is_set():
                poller.poll()
                if self._stopping.is_set():
                    return
                try:
                    os.read(self._wake_r, 4096)  # caught_up()'s nudges
                except BlockingIOError:
                    pass
                with self._drains:
                    self._drain_starts += 1
                self._drain(sock, None)
                with self._drains:
                    self._drain_ends += 1
                    self._drains.notify_all()
                self._hurry.wait(self._pace)  # let the next events queue up
                self._hurry.clear()
        except Exception:  # the thread must say why it died; alive() reports that it did
            log.exception("process-event reader stopped")

    def _drain(self, sock: socket.socket,
               match: Callable[[Event], bool] | None) -> Event | None:
        """Read every queued datagram; record leaders' exits in batches.

        The hot path: one datagram is one exit (76 bytes), unpacked at once; anything
        else, or a handshake looking for its answer, goes through `decode`.
        """
        buf, view = self._buf, memoryview(self._buf)
        wall, mono = self._clock(), time.monotonic_ns()
        rows: list[Row] = []
        found: Event | None = None
        n_exit = n_other = 0
        overrun = False
        recv_into, unpack = sock.recv_into, EXIT_DATAGRAM.unpack_from
        while True:
            try:
                size = recv_into(buf)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    overrun = True
                    continue
                if exc.errno == errno.EINTR:
                    continue
                raise
            if size == EXIT_DATAGRAM.size and match is None:
                fields = unpack(buf)
                if fields[1] == NLMSG_DONE and fields[11] == PROC_EVENT_EXIT:
                    stamp, pid, tgid, code, parent = fields[13:17] + fields[19:]
                    if pid == tgid:
                        lag = (mono - stamp) / 1e9
                        rows.append((pid, code, parent, wall - lag if 0 <= lag <= 60 else wall))
                        n_exit += 1
                    else:
                        n_other += 1  # a thread's exit
                    if len(rows) >= BATCH:
                        self._record(rows)
                        rows = []
                    continue
            for ev in decode(view, size):
                if match is not None and found is None and match(ev):
                    found = ev
                if ev.what == PROC_EVENT_EXIT and ev.data and ev.data[0] == ev.data[1]:
                    pid, _tgid, code, _sig, _ppid, parent = ev.data
                    lag = (mono - ev.timestamp_ns) / 1e9
                    rows.append((pid, code, parent, wall - lag if 0 <= lag <= 60 else wall))
                    n_exit += 1
                else:
                    n_other += 1
        if rows:
            self._record(rows)
        if n_exit:
            self.counters.add(EventKind.EXIT, n_exit)
        if n_other:
            self.counters.add(EventKind.OTHER, n_other)
        if overrun:
            self._overrun()
        return found

    def _record(self, rows: list[Row]) -> None:
        """Into the ring, then the watched pids' into the watched store: one set lookup
        an exit (none while nothing is watched). The ring first, the set read after:
        WatchedExits.publish relies on that order. A batch that kept any wakes whoever
        asked (on_watched_exit), after the record is in: an early scan reads it."""
        self._store.add_rows(rows)
        watched = self._watched.pids
        if watched:
            kept = [row for row in rows if row[0] in watched]
            if kept:
                self._watched.add_rows(kept)
                if (wake := self._on_watched_exit) is not None:
                    wake()

    def _overrun(self) -> None:
        """The socket overflowed: count what the kernel dropped and say so."""
        self._sync_drops(overrun=True)
        self._drops.warn()

    def _sync_drops(self, *, overrun: bool = False) -> None:
        with self._sock_lock:  # vs the socket's close
            if self._sock is not None:
                self._drops.sync(self._sock, overrun=overrun)

    def _close(self) -> None:
        self._sync_drops()
        with self._sock_lock:
            sock, self._sock = self._sock, None
        if sock is None:
            return
        try:  # older kernels count listeners until told otherwise
            sock.send(request(PROC_CN_MCAST_IGNORE, ack=0))
        except OSError:
            pass
        sock.close()


class _Unavailable(Exception):
    """Why the connector cannot be used here."""


def _why(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    hints = {
        errno.EPROTONOSUPPORT: "the kernel has no connector (CONFIG_CONNECTOR/PROC_EVENTS)",
        errno.ECONNREFUSED: "no connector in this network namespace",
        errno.EACCES: "denied by a security policy",
    }
    hint = subscription_refused() if exc.errno == errno.EPERM else hints.get(exc.errno or 0)
    return f"{name}: {hint}" if hint else f"{name}: {exc.strerror}"


def _rename_thread(name: bytes) -> bool:
    """prctl(PR_SET_NAME) on the calling thread: the kernel announces it as a COMM event."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def grow_receive_buffer(sock: socket.socket, size: int) -> int:
    """Ask for a `size` receive buffer (FORCE passes rmem_max where CAP_NET_ADMIN allows):
    a bigger one rides out bursts. The size granted (doubled by the kernel), 0 if unknown."""
    for option in (SO_RCVBUFFORCE, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, size)
            break
        except OSError:
            continue
    try:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    except OSError:
        return 0
