"""waitress's channel (one client connection), bounded against what a client that never
authenticates can make it hold (issues 25 and 48).

- An incomplete request does not count as activity: a request must arrive whole within
  the idle timeout of its first byte, or a client trickling one header line every few
  seconds would hold its connection (and with enough of them, every one) forever.
- Connections share `Slots`: one client address at most a quarter of them, and a
  newcomer over a bound takes the slot of the quietest connection not being served
  (the TLS front does the same in front of it); a request waiting for a login thread
  is not being served yet.
- Pipelining: waitress parses every request of what one read brings (300 and more) and
  queues an answer for each; past its 16 MiB mark a worker thread waits for a client
  that never reads, until the idle timeout. Here a connection has at most
  PIPELINE_DEPTH requests parsed ahead; the rest waits, unparsed, until the client has
  taken the answers before it.
- Unfinished request heads (each up to waitress's 256 KiB) hold HEADS_BUDGET bytes in
  all; past it the connection holding the most gives way.

Why: docs/design.md, Cost rules (HTTP under abuse).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from gpuguard.web.freed import FreedMemory
from gpuguard.web.slots import Slots, client_key

#: Requests of one connection parsed ahead of its answers.
PIPELINE_DEPTH = 4
#: Bytes of unfinished request heads held across every connection of a server.
HEADS_BUDGET = 8 * 2**20
#: Connections waitress may accept beyond the slots' limit: room for those closing to
#: make way, so that it never stops accepting while a slot can be freed.
ACCEPT_SLACK = 32
#: An unfinished head this large, freed, is worth handing back (freed.py).
LARGE_HEAD = 64 * 1024


def bounded_channel(parser: type, *, connection_limit: int, freed: FreedMemory) -> type:
    """A waitress channel class reading requests with `parser` (one class a server: the
    slots and the heads budget are the server's). Large heads freed are noted in
    `freed`, for the server's maintenance to hand back."""
    from waitress.channel import HTTPChannel

    slots: Slots[Any] = Slots(connection_limit)
    heads: dict[Any, int] = {}  # channel -> bytes of unfinished head it holds

    class Pipelined(parser):  # type: ignore[misc, valid-type]
        """The parser, holding back what comes after PIPELINE_DEPTH parsed requests."""

        header_plus: bytes
        headers_finished: bool
        completed: bool
        channel: Any = None  # a weak reference: a cycle would keep a closed one's head
        held = b""
        #: When this request, whole, began waiting for a login thread (serving.Dispatcher
        #: sets it, a login thread clears it): until then its connection counts as quiet.
        waiting_since: float | None = None

        def received(self, data: bytes) -> int:
            started = self.header_plus or self.headers_finished or self.completed
            channel = self.channel() if self.channel is not None else None
            if not started and channel is not None and (
                    len(channel.requests) >= PIPELINE_DEPTH or self.held):
                self.held += data  # not parsed until the answers before it are taken
                return len(data)
            return int(super().received(data))

        def unfinished_bytes(self) -> int:
            return len(self.held) + (0 if self.headers_finished else len(self.header_plus))

    class BoundedChannel(HTTPChannel):  # type: ignore[misc]
        _partial_since: float | None = None
        last_activity: float  # waitress's, seconds since the epoch
        request: Any
        requests: list[Any]

        def __init__(self, server: Any, sock: Any, addr: Any, adj: Any,
                     map: Any = None) -> None:  # noqa: A002 - waitress's name
            super().__init__(server, sock, addr, adj, map)
            host = addr[0] if isinstance(addr, tuple) and addr else "localhost"
            admitted, victim = slots.admit(self, client_key(host), _quiet)
            if victim is not None:
                victim.will_close = True  # the quietest gives way; closed this loop
            if not admitted:
                self.will_close = True

        def parser_class(self, adj: Any) -> Any:  # type: ignore[override]
            parsed = Pipelined(adj)
            parsed.channel = weakref.ref(self)
            return parsed

        def received(self, data: bytes) -> bool:
            result = super().received(data)
            pending = self.request
            if pending is not None and not pending.held:  # part of a request is in
                if self._partial_since is None:
                    self._partial_since = self.last_activity
                self.last_activity = self._partial_since
            else:
                self._partial_since = None
            self._count_head(pending.unfinished_bytes() if pending is not None else 0)
            return bool(result)

        def writable(self) -> bool:
            return bool(super().writable()) or self._may_parse_held()

        def handle_write(self) -> None:
            if self._may_parse_held():
                held, self.request.held = self.request.held, b""
                self.received(held)
            if super().writable():
                super().handle_write()

        def _may_parse_held(self) -> bool:
            """Whether held requests may be parsed now: the answers before them are
            taken (waitress reads a socket on the same terms)."""
            return bool(self.request is not None and self.request.held and not self.requests
                        and not self.total_outbufs_len and not self.will_close
                        and not self.close_when_flushed)

        def _count_head(self, size: int) -> None:
            if size:
                heads[self] = size
            else:
                heads.pop(self, None)
            while sum(heads.values()) > HEADS_BUDGET:
                largest = max(heads, key=heads.__getitem__)
                if heads.pop(largest) >= LARGE_HEAD:
                    freed.note()
                largest.will_close = True  # closed this loop, its head with it

        def del_channel(self, map: Any = None) -> None:  # noqa: A002 - waitress's name
            super().del_channel(map)
            slots.release(self)
            if heads.pop(self, 0) >= LARGE_HEAD:
                freed.note()

    def _quiet(channel: Any) -> float | None:
        """Seconds `channel` has asked nothing (None while a request of it is served):
        since its last byte, or since the first byte of a request still coming in. A
        request waiting for a login thread is not served yet: quiet since it came."""
        if channel.requests:
            waiting = getattr(channel.requests[0], "waiting_since", None)
            return None if waiting is None else max(0.0, time.time() - waiting)
        since = channel._partial_since or channel.last_activity
        return max(0.0, time.time() - since)

    return BoundedChannel
