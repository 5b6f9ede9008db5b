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
