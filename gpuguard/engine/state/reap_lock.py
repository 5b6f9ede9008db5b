"""One reap that may signal at a time on a host, whichever program runs it.

The remediator's worker and crash recovery, `gpuguard reap --apply` and MCP `gpu_reap`
each take an exclusive lock on `STATE_DIR/reap.lock` before their first signal and hold
it to their last: a second reaper is refused (`reap-in-progress`), never left to judge a
tree on a freeze it did not make. The lock is the kernel's (flock; on Windows a byte
range lock), so it is released when its holder dies, however it dies. The holder writes
who it is into the file, for the refusal's detail.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpuguard.engine.reap.audit import UnsafePathError, check_private_dir
from gpuguard.engine.state.workstate import WorkState
from gpuguard.orphans.vocabulary import DecisionReason

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
    import msvcrt

LOCK_NAME = "reap.lock"
#: What a lock another holder has answers with (flock: EWOULDBLOCK; msvcrt: EACCES, EDEADLOCK).
_HELD_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES, errno.EDEADLK,
                          getattr(errno, "EDEADLOCK", errno.EDEADLK)})
#: What a holder's note may take (it is read only to name the holder in a refusal).
NOTE_BYTES = 4096


class ReapLockRefused(Exception):
    """The lock was not had: `reason` (reap-in-progress, or reap-lock-unavailable when the
    state directory cannot be used) and a detail naming the holder or the problem."""

    def __init__(self, reason: DecisionReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class ReapLock:
    """The host's reap lock: one in the daemons' runtime directory (the parent of
    `classify.marks_dir`, /run/gpuguard by default) where that exists, and one in
    `remediate.state_dir`; a holder holds both. The first does not depend on which
    state directory a reaper's config names (a person's copy of the config with its own
    `state_dir` still meets the remediator there); the second serves a host without the
    runtime directory (no unit made it). One holder per instance at a time."""

    def __init__(self, state_dir: str | Path, *, runtime_dir: str | Path | None = None,
                 create: bool = False) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / LOCK_NAME
        self.runtime_dir = Path(runtime_dir) if runtime_dir is not None else None
        self._create = create  # make the state directory (0700) if it is missing
        self._fds: list[int] = []

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def places(self) -> list[tuple[Path, str, bool]]:
        """(directory, what it is, create it) of each lock to take, in order."""
        places = []
        if self.runtime_dir is not None and os.path.isdir(self.runtime_dir):
            places.append((self.runtime_dir, "the daemons' runtime directory", False))
        places.append((self.dir, "state_dir", self._create))
        return places

    def acquire(self, who: dict[str, Any]) -> None:
        """Take the locks without waiting, and note `who` holds them; ReapLockRefused if
        another reaper holds one or a directory cannot be used (nothing is held then)."""
        if self._fds:
            raise RuntimeError("the reap lock is held already")
        try:
            for directory, what, create in self.places():
                path = directory / LOCK_NAME
                fd = _open(directory, path, what, create)
                self._fds.append(fd)
                if not _try_lock(fd):
                    raise ReapLockRefused(DecisionReason.REAP_IN_PROGRESS,
                                          f"another reap holds this host's reap lock ({path}): "
                                          f"{_describe(_read_note(fd))}; one reap at a time")
                _write_note(fd, {**who, "pid": os.getpid(), "since": time.time()})
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Let go (closing a descriptor drops its lock); a no-op when not held."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    @contextlib.contextmanager
    def holding(self, who: dict[str, Any]) -> Iterator[ReapLock]:
        self.acquire(who)
        try:
            yield self
        finally:
            self.release()


def host_reap_lock(work: WorkState) -> ReapLock:
    """The remediator's reap lock: its state directory and the runtime directory."""
    return ReapLock(work.ledger.dir, runtime_dir=runtime_dir_of(work.config.classify.marks_dir))


def runtime_dir_of(marks_dir: str) -> str:
    """The daemons' runtime directory: the parent of `classify.marks_dir` (register.sock
    lives there too; systemd's RuntimeDirectory=gpuguard, a hostPath in Kubernetes)."""
    return os.path.dirname(marks_dir.rstrip("/\\")) or marks_dir


def _open(directory: Path, path: Path, what: str, create: bool) -> int:
    unavailable = DecisionReason.REAP_LOCK_UNAVAILABLE
    try:
        if create:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Owned by this uid, as the remediator requires: a lock in a directory another
        # user can write could be swapped under its holder.
        check_private_dir(directory, what)
        flags = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES):
                raise
            # A read-only directory: an existing lock still locks (flock needs no write
            # access); only the holder's note is not written.
            return os.open(path, os.O_RDONLY | flags)
    except UnsafePathError as exc:
        raise ReapLockRefused(unavailable, f"{exc}: the reap lock there cannot be "
                              "trusted") from None
    except OSError as exc:
        raise ReapLockRefused(unavailable, f"{path}: cannot open the host's reap lock "
                              f"({exc.strerror or exc}): whether another reap holds this "
                              "tree cannot be told") from None


def _try_lock(fd: int) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except (BlockingIOError, PermissionError):
        return False
    except OSError as exc:
        if exc.errno in _HELD_ERRNOS:  # Windows: msvcrt answers a held range so
            return False
        raise ReapLockRefused(DecisionReason.REAP_LOCK_UNAVAILABLE,
                              f"cannot lock the host's reap lock: {exc.strerror or exc}") from None
    return True


def _write_note(fd: int, note: dict[str, Any]) -> None:
    """Who holds the lock, over the last holder's note (best effort: only read to name
    the holder in a refusal). On Windows the first byte is the locked range: the note
    starts after it."""
    start = 0 if fcntl is not None else 1
    try:
        data = json.dumps(note, sort_keys=True).encode("utf-8")[:NOTE_BYTES]
        os.ftruncate(fd, start)
        os.lseek(fd, start, os.SEEK_SET)
        os.write(fd, data)
    except OSError:
        pass


def _read_note(fd: int) -> dict[str, Any] | None:
    try:
        os.lseek(fd, 0 if fcntl is not None else 1, os.SEEK_SET)
        note = json.loads(os.read(fd, NOTE_BYTES).decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None


def _describe(note: dict[str, Any] | None) -> str:
    """The holder, as its note says: `gpuguard reap by alice (pid 4242), tree host/1/2,
    for 3s`; its note is only what it wrote (a holder that died released the lock)."""
    if note is None:
        return "a reaper that has not said who it is yet"
    by = str(note.get("by", "a reaper"))[:100]
    parts = [by]
    if note.get("pid") is not None:
        parts.append(f"(pid {str(note['pid'])[:16]})")
    if note.get("key"):
        parts.append(f"on tree {str(note['key'])[:200]}")
    since = note.get("since")
    if isinstance(since, (int, float)):
        parts.append(f"for {max(time.time() - since, 0.0):.0f}s")
    return " ".join(parts)
