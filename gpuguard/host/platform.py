"""Which operating system this process runs on, decided once at import: the one place
shared code asks, instead of testing `sys.platform` itself (as psutil chooses its
back-end once).

Linux reads processes from /proc (gpuguard/host/procfs.py) and judges them with the
rules of gpuguard/orphans/classify.py; Windows reads a process table through psutil
(gpuguard/host/windows/processes.py) and judges it with gpuguard/orphans/windows.py.
The pure core never asks: what differs (the `classify:` defaults, the table source) is
handed to it by the loaders and the scanner, which ask `IS_WINDOWS`.
"""

from __future__ import annotations

import sys

#: True on Windows (a native CPython, or one under Wine): psutil's table, the Windows
#: rules, the Windows `classify:` defaults, Job Objects for reaps.
IS_WINDOWS: bool = sys.platform == "win32"
#: The back-end chosen at import, by name: "windows" or "linux" (/proc).
BACKEND: str = "windows" if IS_WINDOWS else "linux"
