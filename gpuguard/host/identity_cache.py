"""Facts about a process, kept per identity (pid, start_time) across scans.

A process's command line, cgroup, environment markers and the like do not change while
it lives, so each is read once; exec() keeps the identity but changes what they
describe, so a new comm drops them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import Any

from gpuguard.orphans.process import ProcInfo

Identity = tuple[int, int]  # (pid, start_time)


class IdentityCache:
    """Values by (process identity, key); `lock` is the owner's, shared with its other state."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._values: dict[Identity, dict[object, object]] = {}
        self._comm: dict[Identity, str] = {}
        self._this_scan: dict[Identity, dict[object, object]] = {}  # not settled yet

    def saw(self, info: ProcInfo) -> None:
        """`info` was just read: forget what was cached for its identity if it exec()ed."""
        with self._lock:
            cached_comm = self._comm.get(info.identity)
            if cached_comm is not None and cached_comm != info.comm:
                self._values.pop(info.identity, None)
                self._this_scan.pop(info.identity, None)
            self._comm[info.identity] = info.comm

    def keep_only(self, identities: Collection[Identity]) -> None:
        """Drop every process not in `identities` (those seen by the last scan)."""
        with self._lock:
            self._values = {k: v for k, v in self._values.items() if k in identities}
            self._comm = {k: v for k, v in self._comm.items() if k in identities}
            self._this_scan = {}

    def get(self, info: ProcInfo, key: object, compute: Callable[[], Any],
            settled: Callable[[Any], bool] | None = None) -> Any:
        """The value cached for `info` under `key`, else `compute()`'s (called unlocked).
        A value `settled` says is not final yet is kept for this scan only (until the next
        keep_only()): the next scan computes it again."""
        with self._lock:
            for cached in (self._values, self._this_scan):
                slot = cached.get(info.identity, {})
                if key in slot:
                    return slot[key]
        value = compute()
        if settled is not None and not settled(value):
            with self._lock:
                self._this_scan.setdefault(info.identity, {})[key] = value
            return value
        with self._lock:
            self._values.setdefault(info.identity, {})[key] = value
        return value


class ThreadTurns:
    """Per-thread facts of thread-heavy processes (their children files), read in turns.

    Reading every thread's /proc/PID/task/TID/children each scan costs one read per
    thread: a 20,000-thread process cost every scan half a second. A process of more
    than `per_call` threads is read whole when first seen, then has, per call, only its
    main thread, the threads it did not have at the last call (up to `per_call`) and
    `per_call` others in turn read afresh;
    every other thread's answer is the last one read, so each thread is read again
    within threads / per_call calls. For the exporter's scans only: what a reap signals
    and the remediator's inspection are read whole (their views have no ThreadTurns).
    """

    def __init__(self, per_call: int) -> None:
        self.per_call = per_call
        self._known: dict[Identity, dict[str, bytes]] = {}
        self._cursor: dict[Identity, int] = {}

    def pick(self, identity: Identity, tids: list[str]) -> list[str]:
        """Which of `tids` (sorted) to read afresh now."""
        known = self._known.get(identity)
        if len(tids) <= self.per_call or known is None:
            return tids  # a process seen for the first time is read whole, once
        start = self._cursor.get(identity, 0) % len(tids)
        self._cursor[identity] = start + self.per_call
        turn = tids[start:start + self.per_call] + tids[:max(0, start + self.per_call - len(tids))]
        new = [t for t in tids if t not in known][:self.per_call]
        main = str(identity[0])
        return list(dict.fromkeys(([main] if main in tids else [])
                                  + new + turn))

    def merge(self, identity: Identity, tids: list[str],
              read: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """Every thread's answer: `read` afresh, the rest as last read (a thread gone
        since is dropped; one never read yet counts for nothing until its turn)."""
        known = self._known.get(identity, {})
        fresh = dict(read)
        merged = {t: fresh[t] if t in fresh else known[t] for t in tids
                  if t in fresh or t in known}
        self._known[identity] = merged
        return list(merged.items())

    def keep_only(self, identities: Collection[Identity]) -> None:
        """Forget processes not seen by the last scan."""
        self._known = {k: v for k, v in self._known.items() if k in identities}
        self._cursor = {k: v for k, v in self._cursor.items() if k in identities}
