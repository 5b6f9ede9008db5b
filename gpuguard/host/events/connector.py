"""The process-events connector's wire format: datagrams decoded, requests built.

Each event is one datagram: nlmsghdr (16 bytes), cn_msg (20), struct proc_event (40):
`what`, `cpu`, `timestamp_ns` (CLOCK_MONOTONIC), then a union; an exit's is
process_pid/tgid, exit_code (a wait status), exit_signal, parent_pid/tgid.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import NamedTuple

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_NONE = 0x00000000  # an acknowledgement of a LISTEN/IGNORE request
PROC_EVENT_COMM = 0x00000200  # a thread renamed itself (the start-up probe's beacon)
PROC_EVENT_EXIT = 0x80000000
NLMSG_DONE = 3  # the connector sends every message as one NLMSG_DONE

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, port id
_CN_MSG = struct.Struct("=IIIIHH")  # id.idx, id.val, seq, ack, len, flags
_EVENT = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_EXIT = struct.Struct("=iiIIii")  # process_pid/tgid, exit_code/signal, parent_pid/tgid
_ACK = struct.Struct("=I")  # event_data.ack.err
_COMM = struct.Struct("=ii16s")  # process_pid, process_tgid, comm
#: A whole one-exit datagram, for the hot path: nlmsghdr, cn_msg, proc_event head, exit.
EXIT_DATAGRAM = struct.Struct("=IHHII" "IIIIHH" "IIQ" "iiIIii")
_HEADERS = _NLMSGHDR.size + _CN_MSG.size  # 36: where struct proc_event starts
_DATA = _HEADERS + _EVENT.size  # 52: where its union starts
assert EXIT_DATAGRAM.size == _DATA + _EXIT.size == 76


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
