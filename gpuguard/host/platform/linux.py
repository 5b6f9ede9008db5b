"""Linux's back-end (gpuguard.host.platform.Platform): /proc, CLOCK_BOOTTIME and the
kernel's boot id, the process-events connector, registrations served by the registrar,
NSS groups, PID namespaces, pidfds with a thaw guardian, POSIX permissions, and the
config's defaults under /run, /var/lib and /var/log."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuguard.host.backend import (
    LINUX,
    Defaults,
    GroupLookup,
    Platform,
    Registrations,
    over_procfs,
)
from gpuguard.host.descriptors import raise_open_file_limit
from gpuguard.host.marks import ensure_marks_dir
from gpuguard.host.permissions import private_dir_problem, secret_file_problem
from gpuguard.host.procfs import (
    ProcessView,
    boottime,
    in_host_pid_namespace,
    other_users_problem,
    read_boot_id,
)
from gpuguard.orphans.rules_config import DEFAULT_ADOPTERS, DEFAULT_MARKS_DIR, DEFAULT_PROTECT

if TYPE_CHECKING:
    from gpuguard.host.registrar import Registrar

#: What a config file leaves out, on Linux (gpuguard.config's `Rules()` and `Remediate()`
#: hold the same: tests/pure/test_platform_behaviour.py checks that they agree).
DEFAULTS = Defaults(protect=DEFAULT_PROTECT, adopters=DEFAULT_ADOPTERS,
                    marks_dir=DEFAULT_MARKS_DIR, state_dir="/var/lib/gpuguard",
                    audit_log="/var/log/gpuguard/audit.jsonl",
                    absolute_path=lambda path: path.startswith("/"))


def _registrar(marks_dir: str) -> Registrar | None:
    """The registrar for `marks_dir`, where the directory is there: where it could not be
    made, ensure_marks_dir has said why registrations are off (and none is expected).
    Its module loads on first use: only the exporter serves registrations."""
    if not os.path.isdir(marks_dir):
        return None
    from gpuguard.host.registrar import Registrar

    return Registrar(marks_dir)


#: Keep and run registrations: files in classify.marks_dir, written by the registrar.
REGISTRATIONS = Registrations(prepare=ensure_marks_dir, registrar=_registrar,
                              read_from=lambda marks_dir: marks_dir)


def _group_lookup() -> GroupLookup:
    """NSS's groups, each lookup bounded (a hung SSSD must not hold the scan thread)."""
    from gpuguard.host.users import label_groups

    return label_groups()


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
    defaults=DEFAULTS,
    process_gpu_memory=None,
    processes=over_procfs,
    boot_clock=boottime,
    boot_id=read_boot_id,
    process_events=_process_events,
    registrations=REGISTRATIONS,
    group_lookup=_group_lookup,
    outside_host_pid_namespace=lambda: not in_host_pid_namespace(),
    other_users_problem=other_users_problem,
    start_time=_start_time,
    age_seconds=_age_seconds,
    raise_open_file_limit=raise_open_file_limit,
    secret_file_problem=secret_file_problem,
    private_dir_problem=private_dir_problem,
    fsync_directory=_fsync_directory,
)
