"""The C allocator's arenas: one for the whole process where the C library is glibc.

glibc gives each thread that calls malloc an arena of its own (up to 8 per core), so
that threads allocating at once do not wait on one lock. A Python daemon's threads hold
the GIL to allocate almost everything, so they seldom allocate at once, and each arena
keeps its own free pages: in gpuguard-exporter (the scanner, the process-event listener,
waitress's four request threads) that was 1.3 MiB of its 32 (benchmarks/RESULTS.md,
nvitop_footprint). `one_malloc_arena` asks glibc for one arena, as MALLOC_ARENA_MAX=1
would, without asking the user to set it. It must run before a second thread first
allocates: glibc fixes its arena limit then.
"""

from __future__ import annotations

import ctypes
import os

#: glibc's mallopt parameter for the arena limit (malloc.h).
M_ARENA_MAX = -8


def c_library() -> str | None:
    """glibc's version string ("glibc 2.36"), or None for another C library (musl,
    Windows' CRT), which has no arenas to limit."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or not glibc
        return None


def one_malloc_arena() -> str:
    """Limit glibc to one malloc arena; what happened, for the debug log."""
    libc = c_library()
    if libc is None:
        return "malloc arenas: not glibc, left as they are"
    try:
        ok = ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1)
    except (AttributeError, OSError) as exc:
        return f"malloc arenas: cannot call mallopt ({exc}), left as they are"
    if not ok:
        return f"malloc arenas: {libc} refused mallopt(M_ARENA_MAX, 1), left as they are"
    return f"malloc arenas: one for every thread ({libc})"
