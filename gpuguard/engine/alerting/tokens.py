"""Bearer tokens read from private files: the remediator's own (POST /alerts, /state)
and the one it sends to Alertmanager (remediate.alertmanager.credentials_file).

Re-read on rotation; a file that is not private, or unusable, yields no token, which
refuses every request (fail closed).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable

from gpuguard.host.platform import PLATFORM

log = logging.getLogger("gpuguard.remediator.http")

#: Where a bearer token comes from: None when there is none usable now.
TokenSource = Callable[[], "bytes | None"]


def private_file_problem(path: str, st: os.stat_result) -> str | None:
    """Why a file holding a secret is not private, or None.

    Private means a regular file that only its owner may read or write; who that may be
    is the platform's to say (`Platform.secret_file_problem`: on Linux mode 0600 or
    stricter, owned by this daemon's user or by root; on Windows the file's ACL, which is
    not read here: docs/windows.md, restrict it with icacls)."""
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    return PLATFORM.secret_file_problem(path, st)


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode,
            st.st_uid)


class TokenFile:
    """A bearer token read from a file, re-read whenever the file changes (rotation).

    Each call costs one stat(); the file is read again only when its inode, size,
    mtime or ctime (a chmod or chown) moved. A file that is missing, unreadable, empty
    or not private (private_file_problem) yields None, which rejects every request:
    failing closed is the only safe answer for a kill endpoint. `problem` says why;
    start-up refuses on it.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._signature: tuple[int, ...] | None = None
        self._token: bytes | None = None
        self._called = False
        self.problem: str | None = None

    def __call__(self) -> bytes | None:
        try:
            return self._read()
        finally:
            self._called = True

    def _read(self) -> bytes | None:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            self._fail(f"token file {self.path}: {exc.strerror}")
            return None
        with self._lock:
            if _signature(st) != self._signature:
                self._token, self._signature = None, None
                if (private := private_file_problem(self.path, st)) is not None:
                    self._signature = _signature(st)  # (not opened: it may be a FIFO)
                    self._fail(f"token file {private}")
                    return None
                try:
                    with open(self.path, "rb") as fh:
                        st = os.fstat(fh.fileno())  # what is read is what is checked
                        if (private := private_file_problem(self.path, st)) is not None:
                            self._signature = _signature(st)
                            self._fail(f"token file {private}")
                            return None
                        token = fh.read(64 * 1024).strip()
                except OSError as exc:
                    self._fail(f"token file {self.path}: {exc.strerror}")
                    return None
                self._signature = _signature(st)
                if not token:
                    self._fail(f"token file {self.path} is empty")
                    return None
                self._token = token
            if self._token is not None:
                self.problem = None
            return self._token

    def _fail(self, problem: str) -> None:
        # The first call's failure is the caller's to report (start-up refuses on it).
        if problem != self.problem and self._called:
            log.error("%s; no token until that is fixed", problem)
        self.problem = problem
