"""The kernel's process exit events: how a launcher died, told as it happened.

Why: an orphan tree's launcher is gone by the time a scan sees the orphan, and
/proc keeps nothing of a reaped process. Whether the launcher was killed (a
signal: an agent stopping its shell, the OOM killer, `kill -9`) or exited on
purpose (a launch script that ran `cmd &` and finished) is what tells an
abandoned job from a detached one, and only the kernel saw it. So one socket
listens to the process-events connector and keeps a short memory of exits.

What the kernel gives: `socket(AF_NETLINK, SOCK_DGRAM, NETLINK_CONNECTOR)`
bound to the CN_IDX_PROC group, then PROC_CN_MCAST_LISTEN, brings one datagram
per event: nlmsghdr (16 bytes), cn_msg (20), struct proc_event (40): `what`
u32, `cpu` u32, `timestamp_ns` u64 (CLOCK_MONOTONIC), then the union; an exit
(`what` 0x80000000) carries process_pid, process_tgid, exit_code, exit_signal,
parent_pid, parent_tgid (i32, i32, u32, u32, i32, i32). exit_code is a wait
status: low 7 bits the killing signal, else the exit status in bits 8-15.
Since Linux 6.6 a listener may narrow the stream to exits (struct proc_input)
and needs no privilege (6.18: an unprivileged user listens; older kernels want
CAP_NET_ADMIN); the listener asks for the filter once the kernel acknowledged
its LISTEN, and reads the full stream where a kernel ignores that. Only
thread-group leaders (pid == tgid) are recorded; threads' exits count as other.
The kernel builds the event after the exit is announced to the parent, so a
parent that reaps at once can win the race: the parent fields are then 0 (our
`parent_pid` None); the pid and exit code are always there.

Cost: a process exit costs the listener one recv and a row in the store; the
reader wakes at most every 50 ms and drains what queued meanwhile. Measured
(benchmarks/procevents_cost.py, 6.18): about 0.6% of one core at 1,000 exits/s
(~6 us per exit), ~0.01-0.1% on an idle host; unfiltered (below) about 1.2%.
The socket buffer asks for 4 MiB (doubled by the kernel: ~10,000 queued
events; past rmem_max only with CAP_NET_ADMIN), kernel memory taken only by
events waiting to be read. The store is bounded by count and age (defaults:
65,536 records, 600 s) in flat arrays of about 20 bytes a record (1.3 MiB,
allocated up front), so it never grows with uptime.

Limits: exits before `start()` are unknown (a launcher that died before gpuguard
started reads `launcher-unrecorded`: a listener runs and holds no record). A burst
can overrun the socket (ENOBUFS): the kernel counts what it dropped on the socket
(SO_MEMINFO), and so do we, under kind `dropped`, with a warning. The kernel reports
pids of the initial PID namespace; a listener in a child PID namespace (a container
without hostPID, `unshare --pid`) gets pids that name other processes there, so it
refuses to start unless `allow_pid_namespace=True` says its callers query with
initial-namespace pids. (With `--mount-proc`, not even NSpid shows those: the
namespace cannot translate them; `host_pid` is this process's, learned from the
kernel by a start-up probe.) There the kernel ignores the subscription request (no
acknowledgement, no filter: every event kind arrives, about twice the cost) and yet
delivers events to the bound socket (verified on 6.18; older kernels, which count
subscribers instead, may send none: the probe then says so).
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
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from gpuguard.host.procfs import in_host_pid_namespace

log = logging.getLogger(__name__)

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_NONE = 0x00000000  # an acknowledgement of a LISTEN/IGNORE request
PROC_EVENT_COMM = 0x00000200  # a thread renamed itself (the start-up probe's beacon)
PROC_EVENT_EXIT = 0x80000000
NLMSG_DONE = 3  # the connector sends every message as one NLMSG_DONE
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_MEMINFO = 55  # u32[SK_MEMINFO_VARS]; [8] is sk_drops: messages the kernel dropped
SK_MEMINFO_DROPS = 8

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, port id
_CN_MSG = struct.Struct("=IIIIHH")  # id.idx, id.val, seq, ack, len, flags
_EVENT = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_EXIT = struct.Struct("=iiIIii")  # process_pid/tgid, exit_code/signal, parent_pid/tgid
_ACK = struct.Struct("=I")  # event_data.ack.err
_COMM = struct.Struct("=ii16s")  # process_pid, process_tgid, comm
PR_SET_NAME = 15
_I32 = struct.Struct("=i")
#: A whole one-exit datagram, for the hot path: nlmsghdr, cn_msg, proc_event head, exit.
_EXIT_DATAGRAM = struct.Struct("=IHHII" "IIIIHH" "IIQ" "iiIIii")
_Row = tuple[int, int, int, float]  # pid, exit_code, parent pid (0: unknown), at
_HEADERS = _NLMSGHDR.size + _CN_MSG.size  # 36: where struct proc_event starts
_DATA = _HEADERS + _EVENT.size  # 52: where its union starts
assert _EXIT_DATAGRAM.size == _DATA + _EXIT.size == 76

#: Event kinds counted (gpuguard_process_events_total{kind}); a fixed set, as callsites are.
KINDS: tuple[str, ...] = (
    "exit",  # a process (thread-group leader) exited: recorded
    "other",  # anything else that arrived: a thread's exit, an acknowledgement, other kinds
    "dropped",  # events the kernel dropped because our socket was full (ENOBUFS)
)

#: Why records left the store: room for newer ones, or older than retention.
EVICTION_CAUSES: tuple[str, ...] = ("count", "age")

RECV_SIZE = 8192
BATCH = 256  # exits recorded per store lock
#: After draining, the reader lets events queue for up to this long before it looks
#: again: a wake-up costs more than the events it brings (Python, a thread switch), so
#: batching cuts the CPU per exit several-fold. Shorter when the socket buffer is small,
#: so that a burst of DESIGN_RATE exits a second fills at most half of it meanwhile.
MAX_PACE_S = 0.05
DESIGN_RATE = 10_000
EVENT_TRUESIZE = 1024  # bytes of receive buffer one queued event takes (832 on 6.18 x86-64)


@dataclass(frozen=True, slots=True)
class Exit:
    """One process's exit as the kernel reported it; `at` is Unix time."""

    pid: int
    exit_code: int  # the raw wait status
    signal: int | None  # the signal that killed it; None when it exited by itself
    status: int | None  # its exit status; None when a signal killed it
    parent_pid: int | None  # its parent (parent_tgid); None: reaped before the event was made
    at: float

    @property
    def core_dumped(self) -> bool:
        return bool(self.exit_code & 0x80)


def split_exit_code(code: int) -> tuple[int | None, int | None]:
    """(signal, status) of a wait status: killed when the low 7 bits are set."""
    sig = code & 0x7F
    if sig:
        return sig, None
    return None, (code >> 8) & 0xFF


class Event(NamedTuple):
    """One decoded proc_event: `data` is the exit fields, (err,) for an ack, (pid, tgid)
    for a rename (with `comm`), else ()."""

    what: int
    ack: int  # cn_msg.ack: the kernel answers a request with its ack + 1
    timestamp_ns: int
    data: tuple[int, ...]
    comm: bytes = b""


def decode(buf: bytes | bytearray | memoryview, size: int | None = None) -> Iterator[Event]:
    """The proc_events in one datagram (normally one); malformed parts are skipped."""
    end = len(buf) if size is None else size
    offset = 0
    while offset + _NLMSGHDR.size <= end:
        length, kind = _NLMSGHDR.unpack_from(buf, offset)[:2]
        if length < _NLMSGHDR.size or offset + length > end:
            return
        if kind == NLMSG_DONE and length >= _DATA:
            ack = _CN_MSG.unpack_from(buf, offset + _NLMSGHDR.size)[3]
            what, _cpu, stamp = _EVENT.unpack_from(buf, offset + _HEADERS)
            data: tuple[int, ...] = ()
            comm = b""
            if what == PROC_EVENT_EXIT and length >= _DATA + _EXIT.size:
                data = _EXIT.unpack_from(buf, offset + _DATA)
            elif what == PROC_EVENT_NONE and length >= _DATA + _ACK.size:
                data = _ACK.unpack_from(buf, offset + _DATA)
            elif what == PROC_EVENT_COMM and length >= _DATA + _COMM.size:
                pid, tgid, raw = _COMM.unpack_from(buf, offset + _DATA)
                data, comm = (pid, tgid), raw.split(b"\0", 1)[0]
            yield Event(what, ack, stamp, data, comm)
        offset += (length + 3) & ~3  # NLMSG_ALIGN


def request(op: int, *, ack: int, events: int | None = None) -> bytes:
    """A LISTEN/IGNORE request; with `events`, the 6.6+ form that also sets a filter."""
    payload = struct.pack("=I", op) if events is None else struct.pack("=II", op, events)
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, ack, len(payload), 0) + payload
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, 0, 0) + cn


class EventCounts:
    """Thread-safe counts per event kind, from the fixed set KINDS."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(KINDS, 0)

    def add(self, kind: str, n: int = 1) -> None:
        if kind not in self._counts:
            raise KeyError(f"unknown event kind {kind!r}")
        with self._lock:
            self._counts[kind] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class ExitStore:
    """Exits in a ring of fixed size, bounded by count and by age (oldest evicted first).

    Columns in flat arrays, about 20 bytes a record (a dict of objects would take ten
    times that): the store's size is paid up front and never grows. A query is rare (a
    launcher per orphan tree per scan) and finds a pid's latest record with one rfind
    over the packed pids.
    """

    def __init__(self, *, max_records: int, retention: float,
                 clock: Callable[[], float]) -> None:
        if max_records < 1 or retention <= 0:
            raise ValueError("max_records and retention must be positive")
        self.max_records = max_records
        self.retention = retention
        self._clock = clock
        self._lock = threading.Lock()
        self._pids = bytearray(4 * max_records)  # native i32, searched with rfind
        self._codes = array("I", [0]) * max_records
        self._parents = array("i", [0]) * max_records
        self._at = array("d", [0.0]) * max_records
        self._next = 0  # records ever added; record n lives in slot n % max_records
        self._first = 0  # the oldest record still held
        #: Records dropped to make room (count) or for their age: what the launcher
        #: memory (gpuguard/host/launcher_memory.py) answers for after they are gone.
        self.evicted = dict.fromkeys(EVICTION_CAUSES, 0)

    def add(self, *exits: Exit) -> None:
        self.add_rows([(e.pid, e.exit_code, e.parent_pid or 0, e.at) for e in exits])

    def add_rows(self, rows: list[_Row]) -> None:
        """Record (pid, exit_code, parent pid or 0, at) rows: the reader's form, no objects."""
        with self._lock:
            size, n = self.max_records, self._next
            pids, codes, parents, ats, pack = (self._pids, self._codes, self._parents,
                                               self._at, _I32.pack_into)
            for pid, code, parent, at in rows:
                slot = n % size
                pack(pids, 4 * slot, pid)
                codes[slot], parents[slot], ats[slot] = code, parent, at
                n += 1
            self._next = n
            if n - size > self._first:
                self.evicted["count"] += n - size - self._first
                self._first = n - size
            self._evict(self._clock())

    def exit_of(self, pid: int, *, after: float) -> Exit | None:
        """The latest record of `pid` if it is at or after `after`: if the latest is older,
        every earlier one is too."""
        with self._lock:
            now = self._clock()
            self._evict(now)
            slot = self._latest_slot(pid)
            # Eviction goes in arrival order; a record can be older than one before it.
            if slot is None or self._at[slot] < max(after, now - self.retention):
                return None
            return self._record(slot)

    def records(self) -> list[Exit]:
        """Every record still held, oldest first."""
        with self._lock:
            self._evict(self._clock())
            size = self.max_records
            return [self._record(n % size) for n in range(self._first, self._next)]

    def __len__(self) -> int:
        with self._lock:
            return self._next - self._first

    def _evict(self, now: float) -> None:
        """Drop records older than retention from the old end (arrival order)."""
        oldest, size = now - self.retention, self.max_records
        first = self._first
        while first < self._next and self._at[first % size] < oldest:
            first += 1
        self.evicted["age"] += first - self._first
        self._first = first

    def _latest_slot(self, pid: int) -> int | None:
        held = self._next - self._first
        if held <= 0:
            return None
        size = self.max_records
        start, stop = self._first % size, self._next % size or size
        # Newest first: [0, stop) then [start, size) when the held range wraps.
        segments = [(start, stop)] if start < stop else [(0, stop), (start, size)]
        needle = _I32.pack(pid)
        for lo, hi in segments:
            end = 4 * hi
            while True:
                at = self._pids.rfind(needle, 4 * lo, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    return at // 4
                end = at + 3  # straddles two pids: look further back
        return None

    def _record(self, slot: int) -> Exit:
        code = self._codes[slot]
        signal, status = split_exit_code(code)
        return Exit(_I32.unpack_from(self._pids, 4 * slot)[0], code, signal, status,
                    self._parents[slot] or None, self._at[slot])


class ProcessEvents:
    """Listens to the kernel's process exits on a daemon thread; answers `exit_of`.

    `start()` never raises: where the connector cannot be used it logs one warning,
    sets `available` False and `unavailable_reason`, and every query answers None.
    """

    def __init__(self, *, retention: float = 600.0, max_records: int = 65536,
                 counters: EventCounts | None = None,
                 clock: Callable[[], float] = time.time,
                 receive_buffer: int = 4 << 20, handshake_timeout: float = 1.0,
                 allow_pid_namespace: bool = False) -> None:
        self.counters = counters if counters is not None else EventCounts()
        self._clock = clock
        self._store = ExitStore(max_records=max_records, retention=retention, clock=clock)
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
        self._drops_seen = 0  # the kernel's sk_drops when last read
        self._dropped = 0
        self._meminfo = True
        self._last_warning = -float("inf")
        self._wake_r, self._wake_w = -1, -1
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._buf = bytearray(RECV_SIZE)
        self._pace = MAX_PACE_S

    # -- life ----------------------------------------------------------------------------

    def start(self) -> None:
        """Subscribe and start the reader thread; on failure, warn once and stay unavailable."""
        if self._thread is not None or self._sock is not None:
            return
        try:
            self._subscribe()
        except Exception as exc:  # whatever the kernel says, the exporter runs on without
            self._close()
            self.available = False
            self.unavailable_reason = (str(exc) if isinstance(exc, _Unavailable)
                                       else f"unexpected error while subscribing: {exc!r}")
            log.warning("process events unavailable (orphans whose launcher is gone "
                        "will read session-ended): %s", self.unavailable_reason)
            return
        self.available = True
        self.unavailable_reason = ""
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="procevents", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, unsubscribe, close the socket; records stay queryable."""
        self._stopping.set()
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout)
        self._close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r, self._wake_w = -1, -1

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- queries -------------------------------------------------------------------------

    def exit_of(self, pid: int, *, after: float) -> Exit | None:
        """The latest exit of `pid` recorded at or after `after` (Unix time), else None.

        Pass the start time of a process the launcher outlived (the orphan root), so a
        reused pid's older exit does not answer. `pid` is as the initial PID namespace
        numbers it (the same as this process sees, unless `initial_pid_namespace` is False).
        """
        if not self.available:
            return None
        return self._store.exit_of(pid, after=after)

    def records(self) -> list[Exit]:
        """Every exit held now, oldest first (debugging, tests)."""
        return self._store.records() if self.available else []

    def counts(self) -> dict[str, int]:
        """Events by kind since start: exit, other, dropped."""
        self._sync_drops()
        return self.counters.snapshot()

    def evictions(self) -> dict[str, int]:
        """Exit records dropped from the store since start, by cause (count, age)."""
        with self._store._lock:
            return dict(self._store.evicted)

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
        self._grow_receive_buffer(sock)
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

    def _grow_receive_buffer(self, sock: socket.socket) -> None:
        """A bigger buffer rides out bursts; FORCE passes rmem_max where CAP_NET_ADMIN allows."""
        for option in (SO_RCVBUFFORCE, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, self._receive_buffer)
                break
            except OSError:
                continue
        try:
            granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        except OSError:
            granted = 0
        self._pace = min(MAX_PACE_S, granted / EVENT_TRUESIZE / 2 / DESIGN_RATE)

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
                self._drain(sock, None)
                self._stopping.wait(self._pace)  # let the next events queue up
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
        rows: list[_Row] = []
        found: Event | None = None
        n_exit = n_other = 0
        overrun = False
        recv_into, unpack = sock.recv_into, _EXIT_DATAGRAM.unpack_from
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
            if size == _EXIT_DATAGRAM.size and match is None:
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
                        self._store.add_rows(rows)
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
            self._store.add_rows(rows)
        if n_exit:
            self.counters.add("exit", n_exit)
        if n_other:
            self.counters.add("other", n_other)
        if overrun:
            self._overrun()
        return found

    def _overrun(self) -> None:
        """The socket overflowed: count what the kernel dropped and say so (once a minute)."""
        self._sync_drops(overrun=True)
        now = time.monotonic()
        if now - self._last_warning >= 60.0:
            self._last_warning = now
            log.warning("process events: socket overrun, %d events dropped since start; "
                        "some exits were not recorded", self._dropped)

    def _sync_drops(self, *, overrun: bool = False) -> None:
        """Bring `dropped` up to the kernel's count for our socket (SO_MEMINFO sk_drops)."""
        with self._sock_lock:
            sock = self._sock
            if sock is None:
                return
            if self._meminfo:
                try:
                    raw = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 64)
                    drops = struct.unpack_from(f"={len(raw) // 4}I", raw)[SK_MEMINFO_DROPS]
                except (OSError, IndexError, struct.error):
                    self._meminfo = False  # an old kernel: count each overrun as one, at least
                else:
                    delta = drops - self._drops_seen
                    self._drops_seen = drops
                    if delta > 0:
                        self._dropped += delta
                        self.counters.add("dropped", delta)
                    return
            if overrun:
                self._dropped += 1
                self.counters.add("dropped", 1)

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
        errno.EPERM: "needs CAP_NET_ADMIN on kernels before 6.6",
        errno.EACCES: "denied by a security policy",
    }
    hint = hints.get(exc.errno or 0)
    return f"{name}: {hint}" if hint else f"{name}: {exc.strerror}"


def _rename_thread(name: bytes) -> bool:
    """prctl(PR_SET_NAME) on the calling thread: the kernel announces it as a COMM event."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
