"""Windows' back-end (gpuguard.host.platform.Platform): psutil's process table, WDDM's
per-process GPU memory (what a GPU vendor's library cannot size), the registry's boot
counter, the monotonic clock, the config's defaults under C:\\ProgramData\\gpuguard; no
process events, registrations, NSS groups, PID namespaces or thaw guardian (a Job
Object's handles die with the process that holds them), and ACLs instead of mode bits
(not read: those hooks answer "nothing to do"). Every module it names imports anywhere
(the DLLs load on first use), so Linux tests build it too. Its modules load on first use
as well: a Linux daemon builds this back-end and never calls it, and the process table
with its rules is 0.15 MiB it would carry for nothing."""

from __future__ import annotations

import ntpath
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpuguard.host.backend import (
    WINDOWS,
    Defaults,
    Platform,
    ProcessGpuMemory,
    Registrations,
    over_table,
)
from gpuguard.orphans.rules_config import (
    WINDOWS_ADOPTERS,
    WINDOWS_DATA_DIR,
    WINDOWS_MARKS_DIR,
    WINDOWS_PROTECT,
)

if TYPE_CHECKING:
    from gpuguard.host.windows.tree import WinProc


def _absolute_path(path: str) -> bool:
    """From "/", or a drive's (C:\\...) or a share's (\\\\server\\share\\...)."""
    return path.startswith("/") or bool(ntpath.isabs(path) and ntpath.splitdrive(path)[0])


#: What a config file leaves out, on Windows (no /run, /var or /etc there).
DEFAULTS = Defaults(protect=WINDOWS_PROTECT, adopters=WINDOWS_ADOPTERS,
                    marks_dir=WINDOWS_MARKS_DIR, state_dir=WINDOWS_DATA_DIR + "\\state",
                    audit_log=WINDOWS_DATA_DIR + "\\log\\audit.jsonl",
                    absolute_path=_absolute_path)

#: No keep or run registrations (no registrar, no SO_PEERCRED): nothing to make, serve
#: or read.
NO_REGISTRATIONS = Registrations(prepare=lambda _marks_dir: None,
                                 registrar=lambda _marks_dir: None,
                                 read_from=lambda _marks_dir: None)


def _no_groups(_user: str) -> frozenset[str]:
    """No NSS: every user is in no group (only per-user quotas and "*" apply)."""
    return frozenset()


def _wddm_memory() -> ProcessGpuMemory:
    """WDDM's per-process memory, for the holders NVML (any vendor) cannot size."""
    from gpuguard.host.windows.wddm import WddmMemory

    return WddmMemory()


def _read_table() -> Mapping[int, WinProc]:
    from gpuguard.host.windows.processes import read_table

    return read_table()


def _boot_id() -> str:
    from gpuguard.host.windows.boot import boot_id

    return boot_id()


def _start_time(pid: int) -> int | None:
    """The creation time (integer ms, gpuguard.host.windows.tree.encode_create_time)."""
    from gpuguard.host.windows.processes import read_one

    row = read_one(pid)
    return row.create_time if row is not None else None


def _age_seconds(start_time: int) -> float:
    """A creation time is ms since the epoch: the age is against the wall clock."""
    return max(0.0, time.time() - start_time / 1000)


BACKEND = Platform(
    name=WINDOWS,
    defaults=DEFAULTS,
    process_gpu_memory=_wddm_memory,
    processes=over_table(_read_table),
    boot_clock=time.monotonic,  # QueryPerformanceCounter, from boot: never steps
    boot_id=_boot_id,
    process_events=None,
    registrations=NO_REGISTRATIONS,
    group_lookup=lambda: _no_groups,
    outside_host_pid_namespace=lambda: False,  # Windows has no PID namespaces
    other_users_problem=lambda: None,
    start_time=_start_time,
    age_seconds=_age_seconds,
    raise_open_file_limit=lambda: "open-file limit: not applicable on Windows",
    # No uid and no mode bits: who may read a token or write a state folder is its ACL,
    # which is not read here (docs/windows.md: icacls, an Administrators-only folder).
    secret_file_problem=lambda _path, _st: None,
    private_dir_problem=lambda _path, _what, _st: None,
    fsync_directory=lambda _path: None,  # NTFS logs the rename; no directory handle to fsync
)
