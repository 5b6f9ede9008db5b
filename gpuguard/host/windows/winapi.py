"""The Windows DLLs gpuguard calls through ctypes (kernel32, ntdll, pdh), loaded on first
use: importing this module on Linux touches nothing, so every module above it imports
everywhere and only a call made on Linux fails (with OSError)."""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any

#: The Windows errors that mean "no such process" when opening one by pid.
ERROR_INVALID_PARAMETER = 87
ERROR_ACCESS_DENIED = 5


@functools.cache
def dll(name: str) -> Any:
    """`ctypes.WinDLL(name)` with the thread's last error kept for `win_error`; OSError
    anywhere but Windows (this is the only place ctypes.WinDLL is touched)."""
    if sys.platform != "win32":
        raise OSError(f"{name}.dll exists only on Windows")
    return ctypes.WinDLL(name, use_last_error=True)


def win_error(what: str) -> OSError:
    """The calling thread's last Windows error as an OSError (with `winerror` set)."""
    if sys.platform != "win32":
        return OSError(what)
    code = ctypes.get_last_error()
    return ctypes.WinError(code, f"{what}: {ctypes.FormatError(code).strip()}")


def nt_error(what: str, status: int) -> OSError:
    """A failed NTSTATUS as an OSError naming it (ntdll's calls do not set the last error)."""
    return OSError(f"{what} failed with NTSTATUS 0x{status & 0xFFFFFFFF:08X}")
