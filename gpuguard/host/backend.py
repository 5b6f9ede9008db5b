"""What an operating system's back-end provides (`Platform`); gpuguard/host/platform/__init__.py
chooses the one this process runs on, once (as psutil picks its `_psplatform` once and
every call goes through it).

A `Platform` holds every difference the shared code needs, as values and functions:
where a scan's or an inspection's process facts come from (`processes`: /proc, or a
process table; the caller hands both ways and never asks which OS it runs on), the OS's own count of
per-process GPU memory (Windows' WDDM; the GPU vendor is chosen apart, in gpuguard/gpu/),
the boot clock and boot id, whether kernel process events, registrations, NSS groups, PID
namespaces, a thaw guardian and POSIX permissions exist, how a rename is made durable,
and how a process's start time reads and ages. Linux's is gpuguard/host/platform/linux.py, Windows'
gpuguard/host/windows/platform.py; gpuguard.host.platform.PLATFORM is this process's. The
entry points (gpuguard-exporter, gpuguard-remediator, gpuguard) hand it to what they
build; a layer above host/ that must pick an implementation of its own (the reaper,
`gpuguard run`'s launcher) keys it by `Platform.name`, in one table.
CONTRIBUTING.md, How to add a platform, says what a new one fills in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from pathlib import Path

    from gpuguard.orphans.process import Holder

#: Platform names: the keys of every per-platform table above host/.
LINUX = "linux"
WINDOWS = "windows"



class ProcessGpuMemory(Protocol):
    """The operating system's own count of each process's GPU memory, for the holders a GPU
    vendor's library lists but cannot size (Windows: WDDM's counters, any vendor's
    adapter). The GPU seam applies it (gpuguard/gpu/os_memory.py); the GPU vendor is
    chosen apart from the OS (gpuguard/gpu/vendors/__init__.py)."""

    def size(self, holders: tuple[Holder, ...]) -> tuple[Holder, ...]:
        """`holders` with the OS's figure for each one unsized (used_bytes None) where it
        is certain, else as given; `holders` itself when nothing changed."""
        ...

    def close(self) -> None: ...


#: A process table read in one snapshot per scan (Windows: psutil's), by pid. Its rows are
#: the back-end's own (gpuguard/host/windows/tree.py's WinProc), which this interface does
#: not name: host/windows/ builds on this module, and naming its type here would make the
#: two folders import each other.
TableSource = Callable[[], "Mapping[int, Any]"]

T = TypeVar("T")


class Processes(Protocol):
    """Where this platform's process facts come from, as behaviour: a scan, an inspection
    or `gpuguard explain` hands what it does over /proc (`procfs`) and what it does over a
    process table (`table`, given the function that reads the table in one snapshot), and
    the platform runs the one it has. The caller never asks which OS it runs on."""

    def __call__(self, *, procfs: Callable[[], T], table: Callable[[TableSource], T]) -> T: ...


def over_procfs(*, procfs: Callable[[], T], table: Callable[[TableSource], T]) -> T:
    """Processes for a platform with /proc (Linux): `procfs()`."""
    return procfs()


def over_table(read: TableSource) -> Processes:
    """Processes for a platform whose processes come in a table that `read` reads
    (Windows): `table(read)`."""

    def processes(*, procfs: Callable[[], T], table: Callable[[TableSource], T]) -> T:
        return table(read)

    return processes


@dataclass(frozen=True)
class Platform:
    """One operating system's back-end (see the module doc)."""

    name: str
    #: The config's defaults are this platform's (classify patterns and adopters, paths):
    #: passed as `windows=` to the pure config readers, which never ask themselves.
    windows_defaults: bool
    #: The OS's own per-process GPU memory, opened per GPU source (None: the vendor's
    #: library sizes every process itself, as NVML does on Linux).
    process_gpu_memory: Callable[[], ProcessGpuMemory] | None
    #: Where a scan's and an inspection's process facts come from (Processes).
    processes: Processes
    #: The clock orphan ages count on (never stepped), and this boot's id.
    boot_clock: Callable[[], float]
    boot_id: Callable[[], str]
    #: The kernel's process events (how a launcher went): a listener factory, or None.
    process_events: Callable[[], Any] | None
    #: `gpuguard keep` / `gpuguard run` registrations in classify.marks_dir.
    registrations: bool
    #: NSS groups for quotas by group.
    nss_groups: bool
    #: A thaw guardian continues a reap's frozen members if the reaper dies.
    thaw_guardian: bool
    #: Whether this process sits outside the host PID namespace (NVML's pids name others).
    outside_host_pid_namespace: Callable[[], bool]
    #: What this process lacks to inspect other users' processes (None: nothing).
    other_users_problem: Callable[[], str | None]
    #: A live process's start time now, in the platform's one encoding (None: none).
    start_time: Callable[[int], int | None]
    #: Seconds since a start time of that encoding.
    age_seconds: Callable[[int], float]
    #: Raise the open-file limit a reap's descriptors count against; what happened.
    raise_open_file_limit: Callable[[], str]
    #: Files have an owner uid and mode bits to check (else their ACL decides, unread).
    posix_permissions: bool
    #: Make a rename into a directory durable (Linux: fsync the directory; Windows: no
    #: directory can be opened for that, and NTFS logs the rename itself).
    fsync_directory: Callable[[Path], None]


