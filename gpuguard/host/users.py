"""User names for uids: the one lookup behind every user that gpuguard judges or shows.

The exporter's labels (`user`), its accounting, the remediator's live inspection (whose
members `remediate.users` judges), the reaper's re-reads and `gpuguard reap` all ask
`USERS`. A uid may have no name: no passwd entry (a container image without the host's
users), or NSS not answering (SSSD or LDAP unreachable). That answer is `None`, never
cached: the next call asks NSS again, so a user is named as soon as NSS can name them.
A name is kept for `ttl` seconds (a renamed user shows within that), for at most
`max_entries` uids (the oldest entry goes first), so neither cost nor memory grows
with the number of uids ever seen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: How long a name found is believed: a rename (or a uid handed to someone else) shows within it.
DEFAULT_TTL_SECONDS = 300.0
#: The most uids whose names are kept (a host's GPU users fit many times over).
DEFAULT_MAX_ENTRIES = 4096


def passwd_name(uid: int) -> str:
    """NSS's name for `uid`; KeyError when it has none (or cannot say: NSS down)."""
    import pwd  # POSIX only: Windows has no uids (its users come from psutil's username)

    return pwd.getpwuid(uid).pw_name


class UserNames:
    """uid -> user name through `lookup` (NSS by default); names cached, failures not."""

    def __init__(self, *, lookup: Callable[[int], str] = passwd_name,
                 ttl: float = DEFAULT_TTL_SECONDS, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._lookup = lookup
        self._ttl = ttl
        self._clock = clock
        self._max = max(1, max_entries)
        self._lock = threading.Lock()  # the scan thread and scrapes share one instance
        self._cache: dict[int, tuple[float, str]] = {}  # uid -> (found at, name), oldest first
        self.lookups = 0  # asks of `lookup` (tests; cost)

    def name(self, uid: int) -> str | None:
        """The user name of `uid`, or None when it cannot be resolved (not cached)."""
        now = self._clock()
        with self._lock:
            hit = self._cache.get(uid)
        if hit is not None and now - hit[0] < self._ttl:
            return hit[1]
        self.lookups += 1
        try:
            found = self._lookup(uid)  # outside the lock: NSS may take its time
        except (KeyError, OSError, OverflowError):
            with self._lock:
                self._cache.pop(uid, None)  # an expired name is not kept past a failure
            return None
        with self._lock:
            self._cache.pop(uid, None)
            while len(self._cache) >= self._max:
                del self._cache[next(iter(self._cache))]
            self._cache[uid] = (now, found)
        return found

    def label(self, uid: int | None) -> str:
        """For labels and display: the name, or the decimal uid when there is none."""
        if uid is None:
            return ""
        found = self.name(uid)
        return found if found is not None else str(uid)


#: The process-wide resolver; tests build their own with an injected `lookup`.
USERS = UserNames()
