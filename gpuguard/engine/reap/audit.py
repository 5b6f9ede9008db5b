"""Append-only JSON-lines audit log, one fsynced O_APPEND line per record.

A kill must be explainable from this file alone: who asked, what was decided and why,
which processes, how they were signalled. Records are written ahead (`intent`, `joined`
before any signal, `final` after the reap); a write that fails raises, and then the
caller signals nothing. A crash loses at most the record being written.

Every record is whole or absent (AuditLog.append says how): a write the disk cut short
is undone, a line a crash left without its newline is ended before the next record, and
readers skip a damaged line (and count it) instead of failing on the whole file.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpuguard.base.compat import StrEnum
from gpuguard.engine.decision.pending import PendingItem
from gpuguard.engine.decision.policy import Decision
from gpuguard.engine.decision.tree import LiveTree, Member, TreeKey
from gpuguard.engine.reap.outcome import ReapResult, SignalRecord
from gpuguard.host.platform import PLATFORM

try:
    import fcntl
except ImportError:  # Windows: no lock across processes (docs/windows.md)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("gpuguard.remediator")

#: Damaged lines remembered (by file and end offset) so a re-read counts each once.
MAX_DAMAGED_REMEMBERED = 4096


#: The longest an append or a read waits for another process's lock on the log: a write
#: takes milliseconds, so a lock held longer is a stuck or hostile holder, and a reap
#: (its tree may be frozen) must not wait on it without bound.
LOCK_WAIT_SECONDS = 2.0


def _flock_within(fd: int, operation: int, seconds: float = LOCK_WAIT_SECONDS) -> bool:
    """flock(fd, operation) waited for at most `seconds`; False when it was not had."""
    assert fcntl is not None
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


class Phase(StrEnum):
    """When a record was written: before any signal (intent, joined) or after the reap."""

    INTENT = "intent"  # every planned member, before the first SIGSTOP
    JOINED = "joined"  # processes that joined the tree while it was reaped
    FINAL = "final"



#: The one field a record written late gets: when it was written (it keeps its own `ts`).
RETRIED_AT = "retried_at"


def as_written(record: dict[str, Any]) -> dict[str, Any]:
    """`record` as the log holds it (plain JSON), so that one kept to write later is
    written byte for byte as it would have been, and compares equal to its line."""
    return dict(json.loads(json.dumps(record, sort_keys=True, default=str)))


def iso_time(when: float) -> str:
    return datetime.fromtimestamp(when, tz=timezone.utc).isoformat(timespec="milliseconds")


def audit_record(hostname: str, now: float, decision: Decision, live: LiveTree | None,
                 result: ReapResult | None, *, key: TreeKey, mode: str,
                 item: PendingItem | None = None, fingerprint: str | None = None,
                 phase: str = Phase.FINAL, members: tuple[Member, ...] | None = None,
                 member_ids: list[tuple[int, int]] | None = None,
                 signals: tuple[SignalRecord, ...] = (),
                 reap_id: str | None = None,
                 manual: dict[str, Any] | None = None) -> dict[str, Any]:
    """One audit line; the worker and the manual `gpuguard reap` write the same shape.

    `phase` (a Phase) intent/joined records name `members` before they are signalled; a final
    record lists the reap's members and signals. `member_ids` and `signals` describe
    a crash recovery, which knows members only as (pid, start_time). A manual reap
    (`manual`: who ran it, with which flags) has no alert: `alert` is null.
    """
    if members is None:
        members = result.members if result is not None else (live.members if live else ())
    listed = [{"pid": m.pid, "ppid": m.ppid, "start_time": m.start_time, "uid": m.uid,
               "user": m.user, "comm": m.comm} for m in members]
    listed += [{"pid": pid, "start_time": start} for pid, start in member_ids or ()]
    record: dict[str, Any] = {
        "time": iso_time(now),
        "ts": now,
        "phase": phase,
        "reap_id": reap_id,
        "hostname": hostname,
        "key": {"hostname": key.hostname, "root_pid": key.root_pid,
                "root_start_time": key.root_start_time},
        "alert": None if manual is not None else {
            "fingerprint": item.alert.fingerprint if item else (fingerprint or ""),
            "group_key": item.group_key if item else "",
            "alertname": item.alert.label("alertname") if item else None,
            "starts_at": item.alert.starts_at if item else None,
        },
        "decision": decision.to_json(),
        "mode": mode,
        "tree": {
            "verdict": live.verdict if live else None,
            "reason": live.reason if live else None,
            "gpu_bytes": live.gpu_bytes if live else None,
            "members": listed,
        },
        "kill_path": result.kill_path if result else None,
        "outcome": result.outcome if result else None,
        "signals": [s.to_json() for s in (result.signals if result else signals)],
    }
    if result is not None:
        # How and why the reap ended, also when the decision stands (a reap that failed
        # after SIGTERM, refused or interrupted before SIGKILL, says so here).
        record.update(outcome_reason=result.reason, outcome_detail=result.detail)
        record.update(survivors=list(result.survivors),
                      gpu_bytes_after=result.gpu_bytes_after,
                      reclaimed_bytes=result.reclaimed_bytes,
                      duration_seconds=round(result.duration_seconds, 6),
                      confirmed_ms=(round(result.confirmed_ms, 3)
                                    if result.confirmed_ms is not None else None))
    if manual is not None:
        record["manual"] = manual
    return record


class UnsafePathError(Exception):
    """A state or audit path others could tamper with; refusing to start is the answer."""


def _reparse_point(st: os.stat_result) -> bool:
    """Windows: a symlink or junction (a reparse point) at the path; never on Linux."""
    return bool(getattr(st, "st_reparse_tag", 0))


def check_private_dir(path: Path, what: str) -> None:
    """`path` must be a real directory (no symlink), owned by us, writable by no one else
    (as the platform says who owns and may write it).

    The remediator runs as root and writes where its config says; a directory someone
    else owns or can write lets them plant a symlink at the audit log or swap the
    state file (and with it the dedupe keys) under it.
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafePathError(f"{path}: {what}: {exc.strerror}") from None
    if (stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode)
            or _reparse_point(st)):
        raise UnsafePathError(f"{path}: {what} must be a directory, not a symlink or file")
    # Who else may write it is the platform's to say: POSIX owner and mode bits, or on
    # Windows the folder's ACL, which is not read here (docs/windows.md: an
    # Administrators-only folder).
    if (problem := PLATFORM.private_dir_problem(path, what, st)) is not None:
        raise UnsafePathError(problem)


class AuditLog:
    """One file, opened per record (survives logrotate's move), one lock per process and,
    across processes (the remediator and `gpuguard reap --apply`), an flock per write."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()  # readers count too, on other threads
        #: (device, inode, end offset) of each damaged line met, so each counts once
        self._damaged: set[tuple[int, int, int]] = set()
        self.damaged_lines = 0  # damaged lines met by a read or repaired by a write

    def check_writable(self) -> None:
        """Fail at start-up, not at the first kill, when the log cannot be written safely."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        check_private_dir(self.path.parent, "the audit log's directory")
        os.close(self._open())

    def _open(self) -> int:
        """Append-only, and never through a symlink planted where the log should be
        (Windows has no O_NOFOLLOW: a reparse point at the path is refused before the
        open; there the file is opened binary, so a line ends in \\n as on Linux).
        Read-write: append() reads the last byte to end a torn line."""
        nofollow = getattr(os, "O_NOFOLLOW", None)
        if nofollow is None:
            try:
                if _reparse_point(os.lstat(self.path)):
                    raise UnsafePathError(f"{self.path}: the audit log is a symlink or "
                                          "junction")
            except FileNotFoundError:
                pass
            return os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT
                           | getattr(os, "O_BINARY", 0), 0o640)
        return os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | nofollow, 0o640)

    def append(self, record: dict[str, Any]) -> None:
        """Write `record` as one line, durably, or leave the file as it was and raise.

        Whole or absent, by two rules. A failed write is undone: the size before it is
        remembered and, on any failure (ENOSPC part-way, an fsync error), the file is cut
        back to it, so no half line is left for the next record to be glued onto, and a
        record the caller was told failed (and so signalled nothing for) is not left
        behind looking written. And a line some earlier writer left without its newline
        (a crash or power loss mid-write, which nothing can undo; a cut back that failed
        too) is ended first with a newline of our own, so the new record always starts
        a line and parses. Size, repair, write and fsync happen under an exclusive flock
        that every writer takes, so no other process's record is cut by our undo.
        A repaired line is a damaged one: counted and logged like one a reader meets.
        """
        line = json.dumps(record, sort_keys=True, default=str) + "\n"
        data = line.encode("utf-8")
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = self._open()
            try:
                if fcntl is not None and not _flock_within(fd, fcntl.LOCK_EX):
                    raise OSError(errno.EWOULDBLOCK, "the audit log stayed locked by "
                                  f"another process for {LOCK_WAIT_SECONDS:g}s",
                                  str(self.path))  # released by the close otherwise
                st = os.fstat(fd)
                size = st.st_size
                if size and not self._ends_a_line(fd, size):
                    self._note_damaged(st, size + 1, "a line without its end (a write "
                                       "cut short by a crash) was ended before this record")
                    data = b"\n" + data
                try:
                    written = 0
                    while written < len(data):
                        written += os.write(fd, data[written:])
                    os.fsync(fd)
                except BaseException:
                    self._undo(fd, size)
                    raise
            finally:
                os.close(fd)

    @staticmethod
    def _ends_a_line(fd: int, size: int) -> bool:
        os.lseek(fd, size - 1, os.SEEK_SET)  # O_APPEND: writes still go to the end
        return os.read(fd, 1) == b"\n"

    def _undo(self, fd: int, size: int) -> None:
        """Cut the file back to `size`: the record is absent, not torn. Cutting back
        needs no space; if it fails anyway, the next append ends the torn line."""
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        except OSError as exc:
            log.error("audit log %s: a failed write could not be undone (%s); the next "
                      "record starts a new line", self.path, exc.strerror or exc)

    def _note_damaged(self, st: os.stat_result, end: int, what: str) -> None:
        """Count a damaged line once (by file and where it ends) and log it."""
        where = (st.st_dev, st.st_ino, end)
        with self._count_lock:
            if where in self._damaged:
                return
            if len(self._damaged) < MAX_DAMAGED_REMEMBERED:
                self._damaged.add(where)
            self.damaged_lines += 1
        log.warning("audit log %s: damaged line ending at byte %d: %s", self.path, end, what)

    def has_record(self, hostname: str, root_pid: int, root_start_time: int, *,
                   since: float) -> bool:
        """Whether a final record for this tree was written at or after `since`: crash
        recovery for state files from before reaps had ids (it trusts the clock)."""
        want = {"hostname": hostname, "root_pid": root_pid, "root_start_time": root_start_time}
        return any(r.get("key") == want and float(r.get("ts", 0)) >= since
                   and r.get("phase", Phase.FINAL) == Phase.FINAL
                   for r in self._read(f'"root_pid": {root_pid}'))

    def has_written(self, record: dict[str, Any]) -> bool:
        """Whether `record` (an owed one, as_written) is in the log already, retried or
        not: a crash (or a state file that could not say it was paid) between its write
        and the state file's note must not write it twice."""
        needle = '"ts": ' + json.dumps(record.get("ts"))
        return any({k: v for k, v in r.items() if k != RETRIED_AT} == record
                   for r in self._read(needle))

    def has_final(self, reap_id: str) -> bool:
        """Whether the final record of reap `reap_id` was written (crash recovery)."""
        return any(r.get("reap_id") == reap_id and r.get("phase") == Phase.FINAL
                   for r in self._read(f'"reap_id": "{reap_id}"'))

    def _read(self, needle: str | None = None) -> list[dict[str, Any]]:
        """Every record (of lines containing `needle`: a cheap pre-filter before JSON),
        oldest first. A damaged line is skipped and counted, never fatal: the record a
        crash-era writer glued onto a torn line is still read (salvaged). Read whole
        under a shared flock, released before returning (a writer of this process
        waits for no reader left half-way)."""
        want = needle.encode("utf-8") if needle is not None else None
        found: list[dict[str, Any]] = []
        try:
            with open(self.path, "rb") as fh:
                if fcntl is not None:  # no writer is half-way through a line meanwhile
                    # (one that holds the lock longer than any write takes is waited
                    # for no longer: read as it is, a half line counted as damaged)
                    _flock_within(fh.fileno(), fcntl.LOCK_SH)
                st = os.fstat(fh.fileno())
                end = 0
                for raw in fh:
                    # Where the line's newline is (or, for a torn last line, would be):
                    # the same place append() counts a line it ends.
                    end += len(raw) + (0 if raw.endswith(b"\n") else 1)
                    if want is not None and want not in raw:
                        continue
                    text = raw.decode("utf-8", errors="replace").strip()
                    if not text:
                        continue
                    record, damaged = parse_line(text)
                    if damaged:
                        self._note_damaged(st, end, "skipped" + (
                            "; the record written after it was read" if record is not None
                            else ""))
                    if record is not None:
                        found.append(record)
        except FileNotFoundError:
            pass
        return found

    def records(self) -> list[dict[str, Any]]:
        """Every whole record, oldest first (tests and `/state` debugging; not for hot
        paths); damaged lines are skipped and counted (`damaged_lines`)."""
        return self._read()


def parse_line(text: str) -> tuple[dict[str, Any] | None, bool]:
    """(the record on one line or None, whether the line was damaged).

    A whole line is one JSON object. A damaged one (a write cut short, with a later
    record appended onto it by a version without the repair) may still end in a whole
    record: the first `{"` from which the rest of the line is one object with a `key`
    is taken as that record (the torn head never parses through to the line's end).
    """
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    else:
        if isinstance(record, dict):
            return record, False
        return None, True
    start = text.find('{"', 1)
    while start != -1:
        try:
            record = json.loads(text[start:])
        except ValueError:
            pass
        else:
            if isinstance(record, dict) and "key" in record:
                return record, True
        start = text.find('{"', start + 1)
    return None, True
