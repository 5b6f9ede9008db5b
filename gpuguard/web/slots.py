"""Connection slots shared between client addresses, for both fronts (waitress, and the
TLS front before it).

A front holds at most `limit` connections, and one client address at most `share` of
them: otherwise one address that opens `limit` connections and sends nothing stops
every scrape until its connections time out (issue 48). A newcomer over either bound
takes the slot of the quietest connection that is not being served (never sent a byte,
idle between requests, trickling a head), so a scraper gets in even when it shares its
address with the flood; it is refused only when every candidate is busy. Why: docs/design.md,
Cost rules (HTTP under abuse).
"""

from __future__ import annotations

import socket
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

#: One client address may hold this share of a front's connections (1/4: four addresses
#: at least to fill a front, and each newcomer still displaces the quietest).
SHARE_DIVISOR = 4

C = TypeVar("C", bound=Hashable)


def client_key(host: object) -> str:
    """Whose slots a connection takes: its IPv4 address, or its IPv6 address's /64 (one
    host holds a whole /64; a v4-mapped address is its IPv4 one); anything else (a Unix
    socket's "localhost") as it is. Cheap: no `ipaddress` in a plain exporter."""
    text = str(host)
    if ":" not in text:
        return text
    try:
        packed = socket.inet_pton(socket.AF_INET6, text.split("%", 1)[0])
    except (OSError, ValueError):
        return text
    if packed[:12] == bytes(10) + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, packed[12:])
    return socket.inet_ntop(socket.AF_INET6, packed[:8] + bytes(8)) + "/64"


class Slots(Generic[C]):
    """Who holds which slot. `quiet(conn)` says for how long a connection has asked
    nothing of the server (seconds), or None while it is being served: the larger, the
    sooner it gives its slot up. Thread-safe."""

    def __init__(self, limit: int, share: int | None = None) -> None:
        self.limit = max(1, limit)
        self.share = max(1, share if share is not None else self.limit // SHARE_DIVISOR)
        self._owner: dict[C, str] = {}
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._owner)

    def held_by(self, client: str) -> int:
        return self._held[client]

    def admit(self, conn: C, client: str,
              quiet: Callable[[C], float | None]) -> tuple[bool, C | None]:
        """Take a slot for `conn` of `client`: (whether it has one, the connection the
        caller must close to make room, already released here)."""
        with self._lock:
            victim = None
            if self._held[client] >= self.share:
                victim = self._quietest((c for c, o in self._owner.items() if o == client),
                                        quiet)
                if victim is None:
                    return False, None
            elif len(self._owner) >= self.limit:
                victim = self._quietest(iter(self._owner), quiet)
                if victim is None:
                    return False, None
            if victim is not None:
                self._release(victim)
            self._owner[conn] = client
            self._held[client] += 1
            return True, victim

    def release(self, conn: C) -> None:
        """`conn` is closed (again is harmless)."""
        with self._lock:
            self._release(conn)

    def _release(self, conn: C) -> None:
        client = self._owner.pop(conn, None)
        if client is not None:
            self._held[client] -= 1
            if self._held[client] <= 0:
                del self._held[client]

    @staticmethod
    def _quietest(candidates: Iterable[C], quiet: Callable[[C], float | None]) -> C | None:
        best: C | None = None
        best_quiet = -1.0
        for conn in candidates:
            q = quiet(conn)
            if q is not None and q > best_quiet:
                best, best_quiet = conn, q
        return best
