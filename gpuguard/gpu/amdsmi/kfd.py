"""Whether the process at a pid AMD SMI lists has the KFD device (/dev/kfd) open: the one
fact about a listed pid that no remembered sighting is needed for. Every ROCm compute
client holds /dev/kfd open for as long as it has a context, so a process at a listed pid
without it is not the one listed (ROCm's stale entry whose pid was reused, however long
before gpuguard first read it), and one whose descriptors cannot be looked at is not
verified. Where the host has no such device (no ROCm driver: a test machine) there is
nothing to check and pids.py's first-sighting rules stand alone (docs/gpu-vendors.md).

Matched by what the descriptor IS (stat() through /proc/PID/fd/N follows the kernel's link
to the open file), as host/fdsearch.py matches device files: a character device by its
number, so a container's own /dev/kfd node counts, any other file (a test's) by its inode.
"""

from __future__ import annotations

import os
import stat
import time

from gpuguard.base.counters import Counters
from gpuguard.host.fdsearch import file_key

#: Where the amdgpu driver's KFD device lives on every ROCm host.
KFD = "/dev/kfd"
#: The most descriptors of one process stat()ed in one read: past it, unverified.
MAX_FDS = 4096


class Kfd:
    """The device's identity, taken once per pass, and the descriptor each process was
    last found holding it on (looked at first: one stat per holder on later reads)."""

    def __init__(self, path: str, proc_root: str, counters: Counters) -> None:
        self._path = path
        self._root = proc_root
        self._counters = counters
        #: The device's file key; None: no such device here; (): it could not be stat()ed.
        self._key: tuple[int, ...] | None = None
        self._hits: dict[tuple[int, int], int] = {}
        self._last_hits: dict[tuple[int, int], int] = {}

    def begin_pass(self) -> None:
        """A new read: the device stat()ed afresh, the last read's descriptors kept."""
        self._last_hits, self._hits = self._hits, {}
        self.refresh()

    def refresh(self) -> None:
        """Stat the device afresh (a driver loaded since is picked up)."""
        try:
            st = os.stat(self._path)
        except (FileNotFoundError, NotADirectoryError):
            self._key = None
            return
        except OSError:
            self._key = ()  # there, but not ours to stat: no pid can be verified
            return
        self._key = file_key(st.st_dev, st.st_ino,
                             st.st_rdev if stat.S_ISCHR(st.st_mode) else None)

    @property
    def path(self) -> str:
        return self._path

    @property
    def present(self) -> bool:
        """Whether this host has the device (the check applies)."""
        return self._key is not None

    def holds(self, pid: int, start_time: int) -> bool | None:
        """Whether the process at `pid` (started at `start_time`) has the device open: True,
        False (every descriptor looked at), or None (its descriptors could not be read, or
        it has more than MAX_FDS and none of the first held it). A process gone since its
        stat was read holds nothing."""
        if not self._key:
            return None
        reads = 0
        t0 = time.perf_counter()
        try:
            remembered = self._last_hits.get((pid, start_time))
            if remembered is not None:
                reads += 1
                if self._is_kfd(pid, remembered):
                    self._hits[(pid, start_time)] = remembered
                    return True
            reads += 1
            try:
                names = os.listdir(f"{self._root}/{pid}/fd")
            except (FileNotFoundError, ProcessLookupError):
                return False
            except OSError:
                return None
            fds = sorted(int(n) for n in names if n.isascii() and n.isdigit() and len(n) <= 10)
            unsure = len(fds) > MAX_FDS
            for fd in fds[:MAX_FDS]:
                reads += 1
                found = self._is_kfd(pid, fd)
                if found:
                    self._hits[(pid, start_time)] = fd
                    return True
                unsure = unsure or found is None
            return None if unsure else False
        finally:
            self._counters.add("amdsmi_kfd", seconds=time.perf_counter() - t0, proc_reads=reads)

    def _is_kfd(self, pid: int, fd: int) -> bool | None:
        """Whether descriptor `fd` of `pid` is the device (None: it cannot be stat()ed)."""
        try:
            st = os.stat(f"{self._root}/{pid}/fd/{fd}")
        except (FileNotFoundError, ProcessLookupError):
            return False  # closed since the listing
        except OSError:
            return None
        rdev = st.st_rdev if stat.S_ISCHR(st.st_mode) else None
        return file_key(st.st_dev, st.st_ino, rdev) == self._key
