"""Windows' back-end (gpuguard.host.platform.Platform): psutil's process table, WDDM's
per-process GPU memory (what a GPU vendor's library cannot size), the registry's boot
counter, the monotonic clock; no process events, registrations, NSS, PID namespaces or
thaw guardian (a Job Object's handles die with the process that holds them), and ACLs
instead of mode bits. Every module it names imports anywhere (the DLLs load on first
use), so Linux tests build it too. Its modules load on first use as well: a Linux daemon
builds this back-end and never calls it, and the process table with its rules is
0.15 MiB it would carry for nothing."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpuguard.host.backend import WINDOWS, Platform, ProcessGpuMemory, over_table

if TYPE_CHECKING:
    from gpuguard.host.windows.tree import WinProc


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
    windows_defaults=True,
    process_gpu_memory=_wddm_memory,
    processes=over_table(_read_table),
    boot_clock=time.monotonic,  # QueryPerformanceCounter, from boot: never steps
    boot_id=_boot_id,
    process_events=None,
    registrations=False,
    nss_groups=False,
    thaw_guardian=False,
    outside_host_pid_namespace=lambda: False,  # Windows has no PID namespaces
    other_users_problem=lambda: None,
    start_time=_start_time,
    age_seconds=_age_seconds,
    raise_open_file_limit=lambda: "open-file limit: not applicable on Windows",
    posix_permissions=False,
    fsync_directory=lambda _path: None,  # NTFS logs the rename; no directory handle to fsync
)
