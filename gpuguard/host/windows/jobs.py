"""Job Objects: a Windows process tree that dies with one handle.

A process assigned to a job takes every process it creates from then on into the job
(nobody here grants breakaway), and a job created with JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE
terminates all of them when its last handle closes, which the kernel does for a process
however it ends, TerminateProcess included. `spawn_in_job` starts a command suspended,
assigns it and only then resumes it, so not one instruction of it runs outside the job.
Since Windows 8 a process that is already in a job can be assigned to another (jobs
nest); before that, or under a job that forbids it, assign() fails (OSError).

kernel32 over ctypes (winapi.py), touched only when called: importable on Linux.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from collections.abc import Sequence
from typing import Any

from gpuguard.host.windows.handles import ProcessHandle, open_process
from gpuguard.host.windows.winapi import dll, win_error

#: CreateProcess flag: the main thread starts suspended (resumed once assigned).
CREATE_SUSPENDED = 0x00000004
JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE = 0x00002000
#: JOBOBJECTINFOCLASS values.
JOB_OBJECT_BASIC_PROCESS_ID_LIST = 3
JOB_OBJECT_EXTENDED_LIMIT_INFORMATION = 9
#: ERROR_MORE_DATA: the pid list did not fit.
ERROR_MORE_DATA = 234
#: The exit code terminate() gives every process of the job by default: 128 + SIGKILL,
#: what a shell shows for a process killed outright.
KILLED_EXIT_CODE = 137


class JOBOBJECT_BASIC_LIMIT_INFORMATION(ctypes.Structure):  # noqa: N801 (the Windows name)
    _fields_ = [
        ("PerProcessUserTimeLimit", ctypes.c_int64),
        ("PerJobUserTimeLimit", ctypes.c_int64),
        ("LimitFlags", ctypes.c_uint32),
        ("MinimumWorkingSetSize", ctypes.c_size_t),
        ("MaximumWorkingSetSize", ctypes.c_size_t),
        ("ActiveProcessLimit", ctypes.c_uint32),
        ("Affinity", ctypes.c_size_t),
        ("PriorityClass", ctypes.c_uint32),
        ("SchedulingClass", ctypes.c_uint32),
    ]


class IO_COUNTERS(ctypes.Structure):  # noqa: N801
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "ReadOperationCount", "WriteOperationCount", "OtherOperationCount",
        "ReadTransferCount", "WriteTransferCount", "OtherTransferCount")]


class JOBOBJECT_EXTENDED_LIMIT_INFORMATION(ctypes.Structure):  # noqa: N801
    _fields_ = [
        ("BasicLimitInformation", JOBOBJECT_BASIC_LIMIT_INFORMATION),
        ("IoInfo", IO_COUNTERS),
        ("ProcessMemoryLimit", ctypes.c_size_t),
        ("JobMemoryLimit", ctypes.c_size_t),
        ("PeakProcessMemoryUsed", ctypes.c_size_t),
        ("PeakJobMemoryUsed", ctypes.c_size_t),
    ]


class JobAssignError(OSError):
    """A process could not be put into a job (an enclosing job that forbids nesting, or
    breakaway rules): for `spawn_in_job`, nothing of the command ran."""


@functools.cache
def _kernel32() -> Any:
    k32 = dll("kernel32")
    handle, dword, boolean = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int
    k32.CreateJobObjectW.restype = handle
    k32.CreateJobObjectW.argtypes = [ctypes.c_void_p, ctypes.c_wchar_p]
    k32.SetInformationJobObject.restype = boolean
    k32.SetInformationJobObject.argtypes = [handle, ctypes.c_int, ctypes.c_void_p, dword]
    k32.QueryInformationJobObject.restype = boolean
    k32.QueryInformationJobObject.argtypes = [handle, ctypes.c_int, ctypes.c_void_p, dword,
                                              ctypes.POINTER(dword)]
    k32.AssignProcessToJobObject.restype = boolean
    k32.AssignProcessToJobObject.argtypes = [handle, handle]
    k32.TerminateJobObject.restype = boolean
    k32.TerminateJobObject.argtypes = [handle, ctypes.c_uint32]
    k32.CloseHandle.restype = boolean
    k32.CloseHandle.argtypes = [handle]
    return k32


class JobObject:
    """One anonymous job. Its handle is not inheritable (CreateJobObjectW without security
    attributes), so no child holds it open: the last handle is ours, and closing it, or
    this process ending in any way, ends every process in the job when `kill_on_close`."""

    def __init__(self, *, kill_on_close: bool = True) -> None:
        raw = _kernel32().CreateJobObjectW(None, None)
        if not raw:
            raise win_error("CreateJobObjectW")
        self.raw: int | None = raw
        self.kill_on_close = False
        if kill_on_close:
            try:
                self.set_kill_on_close(True)
            except BaseException:
                self.close()
                raise

    def __enter__(self) -> JobObject:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _handle(self) -> int:
        if self.raw is None:
            raise OSError("the job object is closed")
        return self.raw

    def set_kill_on_close(self, on: bool) -> None:
        """Set or clear JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE (cleared: closing the job leaves
        its processes running, as `gpuguard run --keep-leftovers` wants)."""
        info = JOBOBJECT_EXTENDED_LIMIT_INFORMATION()
        info.BasicLimitInformation.LimitFlags = JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE if on else 0
        if not _kernel32().SetInformationJobObject(
                self._handle(), JOB_OBJECT_EXTENDED_LIMIT_INFORMATION, ctypes.byref(info),
                ctypes.sizeof(info)):
            raise win_error("SetInformationJobObject(KILL_ON_JOB_CLOSE)")
        self.kill_on_close = on

    def assign_handle(self, process: ProcessHandle) -> None:
        """Put the process behind `process` (opened with PROCESS_SET_QUOTA and
        PROCESS_TERMINATE) into this job; what it starts from now on joins too."""
        if not _kernel32().AssignProcessToJobObject(self._handle(), process._handle()):
            raise win_error(f"AssignProcessToJobObject({process.pid})")

    def pids(self) -> tuple[int, ...]:
        """The pids in the job now (JobObjectBasicProcessIdList)."""
        room = 64
        while True:
            class PidList(ctypes.Structure):
                _fields_ = [("NumberOfAssignedProcesses", ctypes.c_uint32),
                            ("NumberOfProcessIdsInList", ctypes.c_uint32),
                            ("ProcessIdList", ctypes.c_size_t * room)]

            info = PidList()
            if _kernel32().QueryInformationJobObject(
                    self._handle(), JOB_OBJECT_BASIC_PROCESS_ID_LIST, ctypes.byref(info),
                    ctypes.sizeof(info), None):
                if info.NumberOfAssignedProcesses <= room:
                    return tuple(int(p) for p in info.ProcessIdList[:info.NumberOfProcessIdsInList])
            else:
                error = win_error("QueryInformationJobObject(BasicProcessIdList)")
                if getattr(error, "winerror", None) != ERROR_MORE_DATA:
                    raise error
            room = max(room * 2, int(info.NumberOfAssignedProcesses) + 16)

    def terminate(self, exit_code: int = KILLED_EXIT_CODE) -> None:
        """End every process in the job now (TerminateJobObject)."""
        if not _kernel32().TerminateJobObject(self._handle(), exit_code & 0xFFFFFFFF):
            raise win_error("TerminateJobObject")

    def close(self) -> None:
        """Close our handle: with kill_on_close, every process still in the job ends."""
        if self.raw is not None:
            raw, self.raw = self.raw, None
            _kernel32().CloseHandle(raw)


def spawn_in_job(argv: Sequence[str], *, job: JobObject | None = None,
                 **popen: Any) -> tuple[subprocess.Popen[bytes], JobObject]:
    """Start `argv` suspended (CREATE_SUSPENDED), assign it to `job` (a new kill-on-close
    job by default), then resume it: (the Popen, the job).

    Fails closed: if the assignment fails (an enclosing job that forbids nesting), the
    suspended child is terminated before it ran, a job made here is closed, and
    JobAssignError is raised; an OSError from Popen itself means the command could not
    be started at all.
    """
    owned = job is None
    job = job if job is not None else JobObject(kill_on_close=True)
    flags = int(popen.pop("creationflags", 0)) | CREATE_SUSPENDED
    try:
        child: subprocess.Popen[bytes] = subprocess.Popen(list(argv), creationflags=flags,
                                                          **popen)
    except BaseException:
        if owned:
            job.close()
        raise
    try:
        # Popen holds the child's handle, so its pid names this child until we wait.
        handle = open_process(child.pid)
        if handle is None:
            raise ProcessLookupError(f"the new process {child.pid} is gone before it ran")
        with handle:
            try:
                job.assign_handle(handle)
            except OSError as exc:
                raise JobAssignError(getattr(exc, "errno", None) or 0,
                                     f"could not put the command into a Job Object: {exc}"
                                     ) from exc
            handle.resume()
    except BaseException:
        child.kill()  # TerminateProcess: it never ran a single instruction of its own
        child.wait()
        if owned:
            job.close()
        raise
    return child, job
