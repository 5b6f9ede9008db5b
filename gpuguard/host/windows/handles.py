"""Process handles: Windows's pidfd. A reap opens a handle on a process first and only then
checks that it is the process meant (its creation time); while the handle is open the
process object lives on, even after it exits, and its pid is not handed to anyone else, so
every suspend, resume and terminate made through it reaches that process and no other.

kernel32 and ntdll over ctypes (winapi.py), touched only when called: importable on Linux.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import time
from collections.abc import Sequence
from typing import Any

from gpuguard.host.windows.tree import encode_create_time
from gpuguard.host.windows.winapi import (
    ERROR_ACCESS_DENIED,
    ERROR_INVALID_PARAMETER,
    dll,
    nt_error,
    win_error,
)

PROCESS_TERMINATE = 0x0001
PROCESS_SET_QUOTA = 0x0100
PROCESS_SUSPEND_RESUME = 0x0800
PROCESS_QUERY_LIMITED_INFORMATION = 0x1000
SYNCHRONIZE = 0x00100000
#: What a reap needs of a member: its creation time, suspend and resume, terminate, wait
#: for its exit, and (Job Objects) being assigned to a job.
REAP_ACCESS = (PROCESS_QUERY_LIMITED_INFORMATION | PROCESS_SUSPEND_RESUME | PROCESS_TERMINATE
               | SYNCHRONIZE | PROCESS_SET_QUOTA)

WAIT_OBJECT_0 = 0x000
WAIT_TIMEOUT = 0x102
WAIT_FAILED = 0xFFFFFFFF
#: WaitForMultipleObjects takes at most this many handles.
MAXIMUM_WAIT_OBJECTS = 64
#: FILETIME counts 100 ns since 1601-01-01; this many of them precede the Unix epoch.
EPOCH_AS_FILETIME = 116444736000000000
#: NtQueryInformationProcess's class for PROCESS_BASIC_INFORMATION (the parent pid).
PROCESS_BASIC_INFORMATION_CLASS = 0


class FILETIME(ctypes.Structure):
    _fields_ = [("dwLowDateTime", ctypes.c_uint32), ("dwHighDateTime", ctypes.c_uint32)]

    @property
    def value(self) -> int:
        return (self.dwHighDateTime << 32) | self.dwLowDateTime


class PROCESS_BASIC_INFORMATION(ctypes.Structure):  # noqa: N801 (the Windows name)
    _fields_ = [("ExitStatus", ctypes.c_long), ("PebBaseAddress", ctypes.c_void_p),
                ("AffinityMask", ctypes.c_size_t), ("BasePriority", ctypes.c_long),
                ("UniqueProcessId", ctypes.c_size_t),
                ("InheritedFromUniqueProcessId", ctypes.c_size_t)]


def filetime_seconds(filetime: int) -> float:
    """A FILETIME as Unix seconds, computed exactly as psutil's create_time() does
    (`(double)(ft - EPOCH) / 1e7`), so that encode_create_time() of either gives the same
    integer for the same process."""
    return float(filetime - EPOCH_AS_FILETIME) / 10_000_000.0


@functools.cache
def _kernel32() -> Any:
    k32 = dll("kernel32")
    handle, dword, boolean = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int
    k32.OpenProcess.restype = handle
    k32.OpenProcess.argtypes = [dword, boolean, dword]
    k32.CloseHandle.restype = boolean
    k32.CloseHandle.argtypes = [handle]
    k32.GetProcessTimes.restype = boolean
    k32.GetProcessTimes.argtypes = [handle] + [ctypes.POINTER(FILETIME)] * 4
    k32.TerminateProcess.restype = boolean
    k32.TerminateProcess.argtypes = [handle, ctypes.c_uint32]
    k32.WaitForSingleObject.restype = dword
    k32.WaitForSingleObject.argtypes = [handle, dword]
    k32.WaitForMultipleObjects.restype = dword
    k32.WaitForMultipleObjects.argtypes = [dword, ctypes.POINTER(handle), boolean, dword]
    return k32


@functools.cache
def _ntdll() -> Any:
    nt = dll("ntdll")
    for name in ("NtSuspendProcess", "NtResumeProcess"):
        getattr(nt, name).restype = ctypes.c_int32  # NTSTATUS
        getattr(nt, name).argtypes = [ctypes.c_void_p]
    nt.NtQueryInformationProcess.restype = ctypes.c_int32
    nt.NtQueryInformationProcess.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                             ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]
    return nt


def _millis(seconds: float) -> int:
    return max(0, min(int(seconds * 1000), 0xFFFFFFFE))  # 0xFFFFFFFF is INFINITE


class ProcessHandle:
    """One open handle on one process; close() it (or use it as a context manager)."""

    def __init__(self, pid: int, raw: int) -> None:
        self.pid = pid
        self.raw: int | None = raw

    def __enter__(self) -> ProcessHandle:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _handle(self) -> int:
        if self.raw is None:
            raise OSError(f"the handle on process {self.pid} is closed")
        return self.raw

    def create_time(self) -> int:
        """The process's creation time in the one integer encoding (ms since the epoch)."""
        times = [FILETIME() for _ in range(4)]
        if not _kernel32().GetProcessTimes(self._handle(), *(ctypes.byref(t) for t in times)):
            raise win_error(f"GetProcessTimes({self.pid})")
        return encode_create_time(filetime_seconds(times[0].value))

    def parent_pid(self) -> int:
        """The pid of the process that created this one (InheritedFromUniqueProcessId of
        ProcessBasicInformation), read through the handle: unlike a table row's ppid,
        which comes from a system snapshot taken at another moment, it belongs to the
        process this handle names. OSError when it cannot be read."""
        info = PROCESS_BASIC_INFORMATION()
        returned = ctypes.c_uint32(0)
        status = _ntdll().NtQueryInformationProcess(
            self._handle(), PROCESS_BASIC_INFORMATION_CLASS, ctypes.byref(info),
            ctypes.sizeof(info), ctypes.byref(returned))
        if status < 0:
            raise nt_error(f"NtQueryInformationProcess({self.pid}, ProcessBasicInformation)",
                           status)
        if info.UniqueProcessId != self.pid:
            raise OSError(f"ProcessBasicInformation of {self.pid} names process "
                          f"{info.UniqueProcessId}")
        return int(info.InheritedFromUniqueProcessId)

    def running(self) -> bool:
        """Whether the process has not exited yet (its handle is not signalled)."""
        return not self.wait(0)

    def wait(self, seconds: float) -> bool:
        """Wait up to `seconds` for the process to exit; True once it has."""
        result = _kernel32().WaitForSingleObject(self._handle(), _millis(seconds))
        if result == WAIT_FAILED:
            raise win_error(f"WaitForSingleObject({self.pid})")
        return bool(result == WAIT_OBJECT_0)

    def suspend(self) -> None:
        """Suspend every thread (NtSuspendProcess: each thread's suspend count goes up by
        one, so a process suspended before stays suspended after our resume)."""
        status = _ntdll().NtSuspendProcess(self._handle())
        if status < 0:
            raise nt_error(f"NtSuspendProcess({self.pid})", status)

    def resume(self) -> None:
        """Undo one suspend (NtResumeProcess)."""
        status = _ntdll().NtResumeProcess(self._handle())
        if status < 0:
            raise nt_error(f"NtResumeProcess({self.pid})", status)

    def suspended(self) -> bool:
        """Whether every thread of the process waits suspended (psutil's status()
        "stopped"; asked by pid, which names this process while the handle is open).
        False when that cannot be told."""
        try:
            psutil = importlib.import_module("psutil")
            return bool(psutil.Process(self.pid).status() == psutil.STATUS_STOPPED)
        except Exception:  # psutil missing, AccessDenied, gone: not known to be suspended
            return False

    def terminate(self, exit_code: int) -> None:
        """TerminateProcess. Access denied from a process that has already exited is no
        failure: it is gone, which is what was asked."""
        if _kernel32().TerminateProcess(self._handle(), exit_code & 0xFFFFFFFF):
            return
        error = win_error(f"TerminateProcess({self.pid})")
        if getattr(error, "winerror", None) == ERROR_ACCESS_DENIED and not self.running():
            return
        raise error

    def close(self) -> None:
        if self.raw is not None:
            raw, self.raw = self.raw, None
            _kernel32().CloseHandle(raw)


def open_process(pid: int, access: int = REAP_ACCESS) -> ProcessHandle | None:
    """A handle on `pid`; None when no process has that pid. OSError when one does and
    it may not be opened (another user's, a protected process): that is never "gone"."""
    raw = _kernel32().OpenProcess(access, False, pid)
    if raw:
        return ProcessHandle(pid, raw)
    error = win_error(f"OpenProcess({pid})")
    if getattr(error, "winerror", None) == ERROR_INVALID_PARAMETER:
        return None
    raise error


def wait_any(handles: Sequence[ProcessHandle], seconds: float) -> int | None:
    """Wait up to `seconds` for any of `handles` (at most 64) to exit: its index, or None.

    ctypes releases the GIL for the call but Python runs no signal handler until it
    returns, so callers that must stay interruptible (Ctrl-C) wait in short slices.
    """
    if not 0 < len(handles) <= MAXIMUM_WAIT_OBJECTS:
        raise ValueError(f"wait_any takes 1 to {MAXIMUM_WAIT_OBJECTS} handles")
    array = (ctypes.c_void_p * len(handles))(*(h._handle() for h in handles))
    result = _kernel32().WaitForMultipleObjects(len(handles), array, False, _millis(seconds))
    if result == WAIT_FAILED:
        raise win_error("WaitForMultipleObjects")
    if result == WAIT_TIMEOUT:
        return None
    return int(result - WAIT_OBJECT_0)


def wait_any_interruptibly(handles: Sequence[ProcessHandle], seconds: float | None,
                           slice_seconds: float = 0.1) -> int | None:
    """wait_any() in slices of `slice_seconds`, so that a KeyboardInterrupt (Ctrl-C)
    arrives within one slice; `seconds` None waits until one exits."""
    until = None if seconds is None else time.monotonic() + seconds
    while True:
        left = slice_seconds if until is None else min(slice_seconds, until - time.monotonic())
        found = wait_any(handles, max(left, 0.0))
        if found is not None or (until is not None and time.monotonic() >= until):
            return found
