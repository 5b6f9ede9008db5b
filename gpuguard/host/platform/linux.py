"""Linux's back-end (gpuguard.host.platform.Platform): /proc, CLOCK_BOOTTIME and the
kernel's boot id, the process-events connector, registrations, NSS, PID namespaces,
pidfds with a thaw guardian, POSIX permissions."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from gpuguard.host.backend import LINUX, Platform, over_procfs
from gpuguard.host.descriptors import raise_open_file_limit
from gpuguard.host.procfs import (
    ProcessView,
    boottime,
    in_host_pid_namespace,
    other_users_problem,
    read_boot_id,
)


def _process_events() -> Any:
    from gpuguard.host.events.listener import ProcessEvents

    return ProcessEvents()


def _start_time(pid: int) -> int | None:
    """stat's start time (ticks since boot) of a live, non-zombie process."""
    info = ProcessView().fresh_stat(pid)
    return info.start_time if info is not None and not info.is_zombie else None


def _fsync_directory(path: Path) -> None:
    """fsync the directory, so that a rename into it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _age_seconds(start_time: int) -> float:
    """Age from stat's start time against CLOCK_BOOTTIME: no /proc read."""
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_time / os.sysconf(
        "SC_CLK_TCK"))


BACKEND = Platform(
    name=LINUX,
    windows_defaults=False,
    process_gpu_memory=None,
    processes=over_procfs,
    boot_clock=boottime,
    boot_id=read_boot_id,
    process_events=_process_events,
    registrations=True,
    nss_groups=True,
    thaw_guardian=True,
    outside_host_pid_namespace=lambda: not in_host_pid_namespace(),
    other_users_problem=other_users_problem,
    start_time=_start_time,
    age_seconds=_age_seconds,
    raise_open_file_limit=raise_open_file_limit,
    posix_permissions=True,
    fsync_directory=_fsync_directory,
)
