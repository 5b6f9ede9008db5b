"""Memory a burst of hostile connections freed, handed back to the kernel.

glibc keeps freed memory for reuse: the buffers of 2,000 TLS handshakes (256 KiB each)
or of 160 half-sent 250 KiB request heads stayed resident after their connections had
closed (issue 48), and a burst is no reuse. Two remedies, both glibc's own: blocks of
128 KiB and more are mapped on their own and unmapped when freed (its default, before
its "dynamic threshold" raises the mark to the largest block freed, 256 KiB here, and
heap-allocates them from then on, fragmenting), and malloc_trim(0), once a burst is
over, returns the free pages of the heap. Elsewhere than glibc, nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable

#: glibc's mallopt parameter for the mapping threshold (malloc.h), and the mark: its
#: default, fixed (setting it turns the dynamic threshold off).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 * 1024


class FreedMemory:
    """`note()` when something large was freed; `settle()` (from a timer or a periodic
    task) hands it back if anything was noted since the last time."""

    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self._due = False
        self._lock = threading.Lock()
        if self._trim is not None:
            with contextlib.suppress(AttributeError, OSError):
                ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)

    def note(self) -> None:
        self._due = self._trim is not None

    def settle(self) -> bool:
        """Trim if anything was noted; whether it did."""
        with self._lock:
            if not self._due or self._trim is None:
                return False
            self._due = False
            self._trim(0)
            return True


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # not glibc (Windows: CDLL(None) raises TypeError)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]
