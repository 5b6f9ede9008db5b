"""This boot's id on Windows: what Linux's /proc/sys/kernel/random/boot_id is to the
remediator's ledger (a pid and creation time, or a crash's held marks, belong to one boot).

Windows has no random boot id. Its boot counter comes first, `BootId` under
HKLM\\SYSTEM\\CurrentControlSet\\Control\\Session Manager\\Memory Management\\
PrefetchParameters (Windows 8 and later; it grows by one each boot); else the boot time
the kernel keeps (NtQuerySystemInformation, SystemTimeOfDayInformation), which is fixed
for the boot unless the wall clock is set (then the ledger takes it for a new boot, and
a crash's held marks are not continued: it fails towards leaving a tree as it is).
Importable on Linux; a call there raises OSError.
"""

from __future__ import annotations

import ctypes
import sys

from gpuguard.host.windows.winapi import dll, nt_error

PREFETCH_KEY = (r"SYSTEM\CurrentControlSet\Control\Session Manager\Memory Management"
                r"\PrefetchParameters")
SYSTEM_TIME_OF_DAY_INFORMATION = 3


class SYSTEM_TIMEOFDAY_INFORMATION(ctypes.Structure):  # noqa: N801 (the Windows name)
    _fields_ = [("BootTime", ctypes.c_int64), ("CurrentTime", ctypes.c_int64),
                ("TimeZoneBias", ctypes.c_int64), ("TimeZoneId", ctypes.c_uint32),
                ("Reserved", ctypes.c_uint32), ("BootTimeBias", ctypes.c_uint64),
                ("SleepTimeBias", ctypes.c_uint64)]


def registry_boot_counter() -> int | None:
    """The registry's boot counter, or None where it is missing or unreadable."""
    if sys.platform != "win32":
        return None
    import winreg

    try:
        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, PREFETCH_KEY) as key:
            value, kind = winreg.QueryValueEx(key, "BootId")
    except OSError:
        return None
    return int(value) if kind == winreg.REG_DWORD else None


def kernel_boot_time() -> int:
    """The kernel's boot time (FILETIME, 100 ns since 1601); OSError when unreadable."""
    ntdll = dll("ntdll")
    info = SYSTEM_TIMEOFDAY_INFORMATION()
    returned = ctypes.c_uint32(0)
    status = ntdll.NtQuerySystemInformation(SYSTEM_TIME_OF_DAY_INFORMATION, ctypes.byref(info),
                                            ctypes.sizeof(info), ctypes.byref(returned))
    if status < 0 or returned.value < 8 or info.BootTime <= 0:
        raise nt_error("NtQuerySystemInformation(SystemTimeOfDayInformation)", status)
    return int(info.BootTime)


def boot_id() -> str:
    """This boot's id (see the module doc); OSError when neither source can be read."""
    counter = registry_boot_counter()
    if counter is not None:
        return f"windows-boot-{counter}"
    return f"windows-booted-{kernel_boot_time()}"
