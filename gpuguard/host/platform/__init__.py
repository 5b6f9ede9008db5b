"""The operating system's back-end, chosen once: the one place gpuguard asks which
platform it runs on (as psutil picks its `_psplatform` once and every call goes through
it). What a back-end holds is gpuguard/host/backend.py's `Platform`; Linux's is
gpuguard/host/platform/linux.py, Windows' gpuguard/host/windows/platform.py (each importable on
either platform: the Windows DLLs load on first use).
"""

from __future__ import annotations

import sys

from gpuguard.host.backend import LINUX, WINDOWS, Platform, TableSource
from gpuguard.host.platform.linux import BACKEND as LINUX_BACKEND
from gpuguard.host.windows.platform import BACKEND as WINDOWS_BACKEND

__all__ = ["LINUX", "PLATFORM", "WINDOWS", "Platform", "TableSource", "BACKENDS"]

#: Every back-end by name.
BACKENDS: dict[str, Platform] = {LINUX: LINUX_BACKEND, WINDOWS: WINDOWS_BACKEND}

#: The platform this process runs on, chosen at first import: the one test of
#: `sys.platform` outside the Windows DLL loader (gpuguard/host/windows/winapi.py).
PLATFORM: Platform = WINDOWS_BACKEND if sys.platform == "win32" else LINUX_BACKEND

