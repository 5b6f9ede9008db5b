"""Registrations a process cannot erase: keep marks and `gpuguard run` launchers.

An environment marker lives in memory the process may overwrite (setproctitle
zero-fills it), so `gpuguard keep PID` and `gpuguard run` also leave a file named for
the process's identity in the daemons' sticky directory. Only a file its owner (or
root) wrote for this boot counts; anything else at that name reads "cannot tell".
Why: docs/design.md, Protections.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from gpuguard.host.counters import COUNTERS, Counters

#: Sticky, writable and searchable by everyone, readable by its owner (the daemons).
DIR_MODE = 0o1733


class MarkError(Exception):
    """A registration could not be written or removed (one line, for the console)."""


def mark_name(kind: str, pid: int, start_time: int) -> str:
    """The file of one registration (kinds: rules_config.KEEP_MARK, rules_config.RUN_MARK)."""
    if not kind.isalpha():
        raise ValueError(f"bad mark kind {kind!r}")
    return f"{kind}-{int(pid)}-{int(start_time)}"


@dataclass(frozen=True)
class Marks:
    """The registration directory of one boot (`boot`: /proc/sys/kernel/random/boot_id)."""

    path: str
    boot: str
    counters: Counters = COUNTERS

    def has(self, kind: str, pid: int, start_time: int, uid: int) -> bool | None:
        """Whether a trusted registration of `kind` names the process (pid, start_time)
        owned by `uid`; None: cannot tell (the directory or the file cannot be read)."""
        path = os.path.join(self.path, mark_name(kind, pid, start_time))
        with self.counters.track("marks"):  # not a /proc read: calls and seconds only
            try:
                st = os.lstat(path)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    return False
                return None
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid not in (0, uid):
                # Not a registration anyone may make for this process, but its name is
                # taken (another user squatted it): whether the owner's own mark would
                # be there cannot be told. Unknown, never "no mark".
                return None
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
        """Write the registration (idempotent); its path. Raises MarkError. `detail`, a
        second line, is for people (a run's tier); only the first line is ever trusted."""
        path = os.path.join(self.path, mark_name(kind, pid, start_time))
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, f"{self.boot}\n{detail}\n".encode() if detail
                         else f"{self.boot}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)  # a file another user planted is replaced (sticky: or EPERM)
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


def ensure_marks_dir(path: str) -> str | None:
    """Create the registration directory with DIR_MODE if it is missing (the daemons do,
    at start) inside its parent, which the service manager provides (systemd's
    RuntimeDirectory=gpuguard, a hostPath): a one-line problem when it cannot be used."""
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
    except OSError as exc:
        return (f"cannot create {path} ({exc.strerror}): keep and run registrations are "
                "off (environment markers still count)")
    return None
