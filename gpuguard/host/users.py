"""User names for uids: the one lookup behind every user that gpuguard judges or shows.

A uid may have no name: no passwd entry (a container image without the host's users),
or NSS not answering (SSSD or LDAP unreachable, or too slow). That answer is `None`.
A name is kept for `ttl` seconds (a renamed user shows within that), for at most
`max_entries` uids (the oldest entry goes first), so neither cost nor memory grows
with the number of uids ever seen.

Two resolvers, for two kinds of use:

- `USERS`, for decisions: the remediator's live inspection (whose members
  `remediate.users` judges, `user-unresolved`), the reaper's re-reads, `gpuguard reap`,
  and the console's display. It asks NSS and waits for its answer; a failure is never
  cached: the next call asks NSS again, so a user is named as soon as NSS can name them.
- `label_names()`, the exporter's own, for labels and accounting: asked on the scan
  thread, never while serving; each lookup waits at most LOOKUP_TIMEOUT_SECONDS on a
  worker thread (an NSS call cannot be interrupted: one that overruns is abandoned, and
  at most MAX_ABANDONED are left running), and a failure is remembered for
  FAILURE_TTL_SECONDS, so a hung SSSD costs a scan a bounded wait once a minute, not
  one per uid per scan. Nothing it remembers reaches a decision: the remediator,
  the reaper and `gpuguard reap` ask `USERS`.

The groups of a user (`group_names`, for the exporter's `quotas.groups` accounting only)
are asked through a BoundedLookup of their own (`label_groups`): its own MAX_ABANDONED.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

#: How long a name found is believed: a rename (or a uid handed to someone else) shows within it.
DEFAULT_TTL_SECONDS = 300.0
#: The most uids whose names are kept (a host's GPU users fit many times over).
DEFAULT_MAX_ENTRIES = 4096
#: How long a label lookup is waited for: past it, the uid is shown as its number.
LOOKUP_TIMEOUT_SECONDS = 0.5
#: Lookups that overran and still run, at most: past it, none is started (NSS is hung).
MAX_ABANDONED = 4
#: How long a label lookup that failed (no name, NSS down or too slow) is believed.
FAILURE_TTL_SECONDS = 60.0


def passwd_name(uid: int) -> str:
    """NSS's name for `uid`; KeyError when it has none (or cannot say: NSS down)."""
    import pwd  # POSIX only: Windows has no uids (its users come from psutil's username)

    return pwd.getpwuid(uid).pw_name


def group_names(user: str) -> frozenset[str]:
    """NSS's names of the groups `user` is in (primary and supplementary); none for a
    user without a passwd entry. A gid without a name is left out."""
    import grp  # POSIX only, like pwd
    import pwd

    try:
        gids = os.getgrouplist(user, pwd.getpwnam(user).pw_gid)
    except (KeyError, OSError):
        return frozenset()  # a uid without a passwd entry: no groups, only the default applies
    names: set[str] = set()
    for gid in gids:
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return frozenset(names)


K = TypeVar("K")
V = TypeVar("V")


class BoundedLookup(Generic[K, V]):
    """`lookup(key)` on a worker thread, waited for at most `timeout` seconds.

    NSS calls cannot be interrupted: one that overruns is abandoned to finish (or not)
    on its daemon thread, and TimeoutError is raised. At most `max_abandoned` such
    threads are left running; while that many still hang, no lookup is started (a hung
    SSSD cannot make threads pile up) and TimeoutError is raised at once. `what` and
    `meanwhile` word the warning: NSS did not name WHAT KEY within T: MEANWHILE.
    """

    def __init__(self, lookup: Callable[[K], V], *,
                 timeout: float = LOOKUP_TIMEOUT_SECONDS,
                 max_abandoned: int = MAX_ABANDONED, what: str = "uid",
                 meanwhile: str = "shown as its number") -> None:
        self._lookup = lookup
        self._timeout = timeout
        self._max = max(0, max_abandoned)
        self._what, self._meanwhile = what, meanwhile
        self._lock = threading.Lock()
        self._abandoned = 0

    @property
    def abandoned(self) -> int:
        """Lookups that overran and have not returned yet."""
        with self._lock:
            return self._abandoned

    def __call__(self, key: K) -> V:
        with self._lock:
            if self._abandoned >= self._max:
                raise TimeoutError(f"{self._abandoned} NSS lookups still hang: {self._what} "
                                   f"{key} not asked")
        call: _Call[V] = _Call()

        def run() -> None:
            try:
                call.result = self._lookup(key)
            except BaseException as exc:  # handed to the waiting caller, never lost
                call.error = exc
            with self._lock:
                call.done = True
                if call.abandoned:
                    self._abandoned -= 1
            call.finished.set()

        threading.Thread(target=run, name=f"gpuguard-nss-{key}", daemon=True).start()
        if not call.finished.wait(self._timeout):
            with self._lock:
                if not call.done:
                    call.abandoned = True
                    self._abandoned += 1
                    log.warning("NSS did not name %s %s within %gs: %s (%d lookups left "
                                "running)", self._what, key, self._timeout, self._meanwhile,
                                self._abandoned)
                    raise TimeoutError(f"NSS did not name {self._what} {key} within "
                                       f"{self._timeout:g}s")
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result


class _Call(Generic[V]):
    """One bounded lookup's outcome, shared by its worker thread and its caller."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.done = False  # under BoundedLookup's lock, with `abandoned`
        self.abandoned = False
        self.result: V | None = None
        self.error: BaseException | None = None


class UserNames:
    """uid -> user name through `lookup` (NSS by default); names cached for `ttl`,
    failures for `failure_ttl` (0, never, unless asked: see the module's docstring)."""

    def __init__(self, *, lookup: Callable[[int], str] = passwd_name,
                 ttl: float = DEFAULT_TTL_SECONDS, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = DEFAULT_MAX_ENTRIES, failure_ttl: float = 0.0) -> None:
        self._lookup = lookup
        self._ttl = ttl
        self._failure_ttl = failure_ttl
        self._clock = clock
        self._max = max(1, max_entries)
        self._lock = threading.Lock()  # callers on several threads may share one instance
        #: uid -> (asked at, name or None for a failure), oldest first.
        self._cache: dict[int, tuple[float, str | None]] = {}
        self.lookups = 0  # asks of `lookup` (tests; cost)

    def name(self, uid: int) -> str | None:
        """The user name of `uid`, or None when it cannot be resolved (remembered only
        for `failure_ttl`)."""
        now = self._clock()
        with self._lock:
            hit = self._cache.get(uid)
        if hit is not None and now - hit[0] < (self._ttl if hit[1] is not None
                                               else self._failure_ttl):
            return hit[1]
        self.lookups += 1
        found: str | None
        try:
            found = self._lookup(uid)  # outside the lock: NSS may take its time
        except (KeyError, OSError, OverflowError):
            found = None
        with self._lock:
            self._cache.pop(uid, None)  # an expired name is not kept past a failure
            if found is None and self._failure_ttl <= 0:
                return None
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


    def labels(self, uids: Iterable[int | None]) -> dict[int, str]:
        """label() of each uid, each asked once: one scan's names, which every series
        of one scrape shows."""
        return {uid: self.label(uid) for uid in dict.fromkeys(uids) if uid is not None}


def label_names(lookup: Callable[[int], str] = passwd_name) -> UserNames:
    """A resolver for labels only (the exporter's): bounded lookups, failures remembered
    for FAILURE_TTL_SECONDS. Never for a decision: those ask USERS."""
    return UserNames(lookup=BoundedLookup(lookup), failure_ttl=FAILURE_TTL_SECONDS)


def label_groups(lookup: Callable[[str], frozenset[str]] = group_names
                 ) -> BoundedLookup[str, frozenset[str]]:
    """The exporter's group lookup (for accounting quotas), bounded as label_names's."""
    return BoundedLookup(lookup, what="the groups of",
                         meanwhile="only the user's own quota or \"*\" applies")


#: The resolver of decisions (and the console's display); tests build their own with an
#: injected `lookup`. Its failures are never cached.
USERS = UserNames()
