"""What each orphan root's launcher was first seen to have done, kept past the exit record.

The process-event listener's exit records are bounded and die with the daemon, so a
tree would read more reapable over time, on less evidence. The first reason
established for a root (pid, start time, session) is the one every later scan gives it
while that process lives, across restarts where a file is given (this boot's entries
only, at most MAX_ENTRIES). Why: docs/design.md, Orphan rules (launcher memory).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpuguard.host.boot_rows import read_rows, write_rows
from gpuguard.orphans.vocabulary import Reason

log = logging.getLogger(__name__)

MAX_ENTRIES = 4096
LAUNCHER_MEMORY_FILE = "launchers.json"  # in a daemon's state directory
#: Launcher reasons that rest on no exit record (launcher-unrecorded, session-ended).
UNRECORDED = frozenset(r for r in Reason if r.launcher_gone and not r.recorded)
Key = tuple[int, int, int]  # root pid, root start time, root session id


class LauncherMemory:
    """First-established launcher reasons by root identity; thread-safe."""

    def __init__(self, path: str | None = None, *, boot: str = "",
                 alive: Callable[[int, int], bool] | None = None,
                 read_only: bool = False) -> None:
        """`read_only`: another process's memory (the console reading the remediator's):
        recalled from, never written to or added to."""
        self._path = path
        self._boot = boot
        self._alive = alive
        self._read_only = read_only
        self._lock = threading.Lock()
        self._entries: dict[Key, tuple[str, str]] = {}
        if path is not None:
            self._load(path)

    def recall(self, key: Key, reason: str, detail: str, *,
               recorded: bool = False) -> tuple[str, str]:
        """The (reason, detail) first established for `key`; `reason` is remembered when
        it is the first. `recorded`: it rests on the kernel's exit record, which replaces a
        remembered reason that rested on none (the record was read late: an exit record
        of the session id after the root started can only be its leader's)."""
        with self._lock:
            known = self._entries.get(key)
            if known is not None and not (recorded and known[0] in UNRECORDED):
                return known
            if self._read_only:
                return reason, detail
            if known is None and len(self._entries) >= MAX_ENTRIES:
                self._prune()
            if known is None and len(self._entries) >= MAX_ENTRIES:
                # Full of live roots: forget the oldest (its tree then reads what the
                # listener can still say, launcher-unrecorded at most).
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = (reason, detail)
            self._save()
            return reason, detail

    @classmethod
    def recorded(cls, paths: list[str], *, boot: str,
                 alive: Callable[[int, int], bool] | None = None) -> LauncherMemory:
        """What the daemons' memories at `paths` recorded, read-only; for a root in more
        than one, the first path's entry."""
        merged = cls(None, boot=boot, alive=alive, read_only=True)
        for path in paths:
            one = cls(path, boot=boot, alive=alive, read_only=True)
            for key, entry in one._entries.items():
                merged._entries.setdefault(key, entry)
        return merged

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _prune(self) -> None:
        if self._alive is None:
            return
        self._entries = {k: v for k, v in self._entries.items() if self._alive(k[0], k[1])}

    def _load(self, path: str) -> None:
        try:
            rows = read_rows(path, self._boot)
        except PermissionError as exc:
            if self._read_only:  # the daemon's own directory: not every user may read it
                log.debug("launcher memory %s unreadable here (%s)", path, exc.strerror)
                return
            log.warning("launcher memory %s unreadable (%s): starting empty; trees whose "
                        "launcher's exit is no longer recorded read launcher-unrecorded",
                        path, exc)
            return
        except (OSError, ValueError) as exc:
            log.warning("launcher memory %s unreadable (%s): starting empty; trees whose "
                        "launcher's exit is no longer recorded read launcher-unrecorded",
                        path, exc)
            return
        for row in rows:
            try:
                pid, start, sid, reason, detail = row
                self._entries[(int(pid), int(start), int(sid))] = (str(reason), str(detail))
            except (TypeError, ValueError):
                continue
        self._prune()

    def _save(self) -> None:
        if self._path is None:
            return
        self._prune()
        rows = [[*key, reason, detail] for key, (reason, detail) in self._entries.items()]
        try:
            write_rows(self._path, self._boot, rows)
        except OSError as exc:
            log.warning("cannot write launcher memory %s: %s (kept in memory)",
                        self._path, exc.strerror)
