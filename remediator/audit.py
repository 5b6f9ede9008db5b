"""Append-only JSON-lines audit log, fsynced per record.

A kill must be explainable afterwards from this file alone: who asked (alert
fingerprint, groupKey), what was decided and why, which processes (pid, start
time, owner, comm), how they were signalled and with what result. Records are
written ahead: an `intent` record names every process before its first signal
(and a `joined` one names processes that join the tree while it is reaped);
the `final` record follows the reap. A write that fails raises, and then the
caller signals nothing. One line per
record, written with O_APPEND and fsynced before the call returns, so a crash
loses at most the record being written and never corrupts earlier ones.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

#: Record phases: written before signals (intent, joined) and after the reap (final).
INTENT = "intent"
JOINED = "joined"
FINAL = "final"


def iso_time(when: float) -> str:
    return datetime.fromtimestamp(when, tz=timezone.utc).isoformat(timespec="milliseconds")


class AuditLog:
    """One file, opened per record (survives logrotate's move), one lock per process."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def check_writable(self) -> None:
        """Fail at start-up, not at the first kill, when the log cannot be written."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        os.close(fd)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True, default=str) + "\n"
        data = line.encode("utf-8")
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            try:
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
                os.fsync(fd)
            finally:
                os.close(fd)

    def has_record(self, hostname: str, root_pid: int, root_start_time: int, *,
                   since: float) -> bool:
        """Whether a final record for this tree was written at or after `since`: crash
        recovery for state files from before reaps had ids (it trusts the clock)."""
        want = {"hostname": hostname, "root_pid": root_pid, "root_start_time": root_start_time}
        return any(r.get("key") == want and float(r.get("ts", 0)) >= since
                   and r.get("phase", FINAL) == FINAL
                   for r in self._containing(f'"root_pid": {root_pid}'))

    def has_final(self, reap_id: str) -> bool:
        """Whether the final record of reap `reap_id` was written (crash recovery)."""
        return any(r.get("reap_id") == reap_id and r.get("phase") == FINAL
                   for r in self._containing(f'"reap_id": "{reap_id}"'))

    def _containing(self, needle: str) -> Iterator[dict[str, Any]]:
        """Records whose line contains `needle` (cheap pre-filter before JSON parsing)."""
        try:
            with open(self.path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if needle not in line:
                        continue
                    try:
                        yield json.loads(line)
                    except ValueError:
                        continue  # a torn last line from a crash
        except FileNotFoundError:
            return

    def records(self) -> list[dict[str, Any]]:
        """Every record, oldest first (tests and `/state` debugging; not for hot paths)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]
