"""Registrations a process cannot erase: keep marks and `gpuguard run` launchers.

An environment marker lives in memory the process may overwrite (setproctitle
zero-fills it), so `gpuguard keep PID` and `gpuguard run` also have a file named for
the process's identity written in the daemons' directory. Only the registrar
(gpuguard/host/registrar.py, served by the exporter) writes there, after checking over
SO_PEERCRED that the caller owns the process: the directory is writable by the daemons'
user alone, so no neighbour can take a name first. A file anyone else wrote (left from
the old world-writable layout) is foreign: ignored, counted and logged once, never
"cannot tell". Why: docs/design.md, Protections.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass

from gpuguard.base.counters import COUNTERS, Counters

log = logging.getLogger("gpuguard.marks")

#: Writable by the daemons' user only (the registrar); readable and searchable by all.
DIR_MODE = 0o755
#: The registrar's socket, beside the registration directory (registrar_socket()).
SOCKET_NAME = "register.sock"


class MarkError(Exception):
    """A registration could not be written or removed (one line, for the console)."""


def mark_name(kind: str, pid: int, start_time: int) -> str:
    """The file of one registration (kinds: rules_config.KEEP_MARK, rules_config.RUN_MARK)."""
    if not kind.isalpha():
        raise ValueError(f"bad mark kind {kind!r}")
    return f"{kind}-{int(pid)}-{int(start_time)}"


def registrar_socket(directory: str) -> str:
    """Where the registrar for `directory` listens: beside it, in the daemons' runtime
    directory (/run/gpuguard/register.sock for the default /run/gpuguard/marks)."""
    parent = os.path.dirname(directory.rstrip("/")) or "/"
    return os.path.join(parent, SOCKET_NAME)


class ForeignMarks:
    """Files at a registration's name that no trusted writer made: each is counted and
    logged once (by device, inode, owner and name), however many scans find it. The
    memory of which were seen is bounded; one forgotten and found again counts again."""

    def __init__(self, limit: int = 4096) -> None:
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[int, int, int, str], None] = OrderedDict()
        self._limit = limit
        self._total = 0

    def note(self, path: str, st: os.stat_result, why: str) -> None:
        key = (st.st_dev, st.st_ino, st.st_uid, path)
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return
            self._seen[key] = None
            if len(self._seen) > self._limit:
                self._seen.popitem(last=False)
            self._total += 1
        log.warning("ignoring foreign registration %s (%s, owner uid %d): a file the "
                    "registrar did not write protects nothing", path, why, st.st_uid)

    def total(self) -> int:
        with self._lock:
            return self._total


#: This process's count (gpuguard_foreign_marks_total on the exporter and the remediator).
FOREIGN = ForeignMarks()


def _foreign(st: os.stat_result, trusted: tuple[int, ...]) -> str | None:
    """Why a file at a registration's name is not one (None: it is, as far as the inode
    goes). `trusted`: root, the directory's owner (the daemons' user) and the
    process's owner (a file from the old layout, written by the owner itself)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_nlink != 1:
        return f"{st.st_nlink} links"
    if st.st_uid not in trusted:
        return "written by another user"
    return None


@dataclass(frozen=True)
class Marks:
    """The registration directory of one boot (`boot`: /proc/sys/kernel/random/boot_id)."""

    path: str
    boot: str
    counters: Counters = COUNTERS
    foreign: ForeignMarks = FOREIGN

    def has(self, kind: str, pid: int, start_time: int, uid: int) -> bool | None:
        """Whether a trusted registration of `kind` names the process (pid, start_time)
        owned by `uid`; None: cannot tell (the directory or the file cannot be read).
        A foreign file (another user's, a link, not a regular file) is no registration:
        False, counted and logged once. It cannot block one either: the registrar
        replaces whatever is at the name."""
        path = os.path.join(self.path, mark_name(kind, pid, start_time))
        with self.counters.track("marks"):  # not a /proc read: calls and seconds only
            try:
                st = os.lstat(path)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    return False
                return None
            trusted: tuple[int, ...] = (0, uid)
            if st.st_uid not in trusted:
                try:
                    trusted = (0, uid, os.stat(self.path).st_uid)
                except OSError:
                    return None
            why = _foreign(st, trusted)
            if why is not None:
                self.foreign.note(path, st, why)
                return False
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError as exc:
                return False if exc.errno == errno.ENOENT else None
            try:
                again = os.fstat(fd)
                if (again.st_ino, again.st_dev) != (st.st_ino, st.st_dev):
                    return False  # replaced between the two looks
                data = os.read(fd, 128)
            except OSError:
                return None
            finally:
                os.close(fd)
        return data.decode("ascii", "replace").partition("\n")[0].strip() == self.boot

    def register(self, kind: str, pid: int, start_time: int, detail: str = "") -> str:
        """Write the registration (idempotent), replacing anything at its name; its path.
        The registrar's, in a directory only it may write. Raises MarkError. `detail`, a
        second line, is for people (a run's tier); only the first line is ever trusted."""
        name = mark_name(kind, pid, start_time)
        path = os.path.join(self.path, name)
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                os.fchmod(fd, 0o644)  # readable by every console, whatever the umask
                os.write(fd, f"{self.boot}\n{detail}\n".encode() if detail
                         else f"{self.boot}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)  # a foreign file at the name is replaced with it
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise MarkError(f"cannot register in {self.path}: {exc.strerror}") from None
        return path

    def unregister(self, kind: str, pid: int, start_time: int) -> bool:
        """Remove the registration; False when there was none. Raises MarkError."""
        path = os.path.join(self.path, mark_name(kind, pid, start_time))
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise MarkError(f"cannot remove {path}: {exc.strerror}") from None
        return True


def writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def ensure_marks_dir(path: str) -> str | None:
    """Create the registration directory with DIR_MODE if it is missing (the daemons do,
    at start) inside its parent, which the service manager provides (systemd's
    RuntimeDirectory=gpuguard, a hostPath): a one-line problem when it cannot be used.
    A directory of the old layout (mode 1733, writable by every user) that the daemons
    own is closed to DIR_MODE in place: what its users wrote stays, read as before when
    its owner wrote it, ignored as foreign when anyone else did."""
    parent = os.path.dirname(path.rstrip("/")) or "/"
    try:
        if not os.path.isdir(parent):
            return (f"{parent} does not exist: keep and run registrations are off "
                    "(environment markers still count)")
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a directory: keep and run registrations are off"
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != DIR_MODE:
            os.chmod(path, DIR_MODE)  # mkdir's mode is filtered by the umask
        elif st.st_uid != os.geteuid() and writable_by_others(st):
            return (f"{path} is owned by uid {st.st_uid} and writable by others: the "
                    "registrar will not write there (keep and run registrations are off; "
                    "files in it count only if root or the process's owner wrote them)")
    except OSError as exc:
        return (f"cannot create {path} ({exc.strerror}): keep and run registrations are "
                "off (environment markers still count)")
    return None
