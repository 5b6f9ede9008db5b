"""What an operating system's back-end provides (`Platform`); gpuguard/host/platform/__init__.py
chooses the one this process runs on, once (as psutil picks its `_psplatform` once and
every call goes through it).

A `Platform` holds every difference the shared code needs, as values and functions:
where a scan's or an inspection's process facts come from (`processes`: /proc, or a
process table; the caller hands both ways and never asks which OS it runs on), the OS's
own count of per-process GPU memory (Windows' WDDM; the GPU vendor is chosen apart, in
gpuguard/gpu/), the boot clock and boot id, the config's defaults (`Defaults`: data the
config applies), how keep and run registrations are kept (`Registrations`), where a
user's groups come from, who may read a secret or write a state directory, whether
kernel process events and PID namespaces exist, how a rename is made durable, and how a
process's start time reads and ages. Each is what the caller does, not a yes/no it
branches on (tests/pure/test_platform_behaviour.py); whether a reap has a thaw guardian
is the engine's to say (gpuguard/engine/platforms.py, GUARDIANS). Linux's is
gpuguard/host/platform/linux.py, Windows' gpuguard/host/windows/platform.py;
gpuguard.host.platform.PLATFORM is this process's. The entry points (gpuguard-exporter,
gpuguard-remediator, gpuguard) hand it to what they build; a layer above host/ that must
pick an implementation of its own (the reaper, `gpuguard run`'s launcher) keys it by
`Platform.name`, in one table. CONTRIBUTING.md, How to add a platform, says what a new
one fills in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import os
    from pathlib import Path

    from gpuguard.host.registrar import Registrar
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
class Defaults:
    """What a config file leaves out, as this platform fills it in: data (patterns, names,
    paths), which gpuguard/config/ (above host/) applies; no reader asks which platform
    it runs on."""

    #: classify.protect and classify.adopters.
    protect: tuple[str, ...]
    adopters: tuple[str, ...]
    #: classify.marks_dir (also the console's --marks-dir).
    marks_dir: str
    #: remediate.state_dir and remediate.audit_log.
    state_dir: str
    audit_log: str
    #: Whether a configured directory is absolute here: from "/" on every platform (and
    #: on Windows also a drive's, C:\..., or a share's).
    absolute_path: Callable[[str], bool]


@dataclass(frozen=True)
class Registrations:
    """`gpuguard keep` / `gpuguard run` registrations in classify.marks_dir, as behaviour.
    Linux's are files the exporter's registrar writes (host/marks.py, host/registrar.py);
    a platform without them (Windows) answers as if the directory held nothing: nothing
    to make, no registrar to serve, nothing to read."""

    #: Make the directory, at start and on a reload: why registrations are off, or None.
    prepare: Callable[[str], str | None]
    #: The registrar to serve the directory, or None (none here, or no directory).
    registrar: Callable[[str], Registrar | None]
    #: The directory a tree's registrations are read from, or None: none to read.
    read_from: Callable[[str | None], str | None]


#: A user's group names (for quotas by group), by user name.
GroupLookup = Callable[[str], frozenset[str]]


@dataclass(frozen=True)
class Platform:
    """One operating system's back-end (see the module doc)."""

    name: str
    #: The config's defaults here (classify patterns and adopters, paths): the config
    #: loader applies them where a file names none.
    defaults: Defaults
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
    registrations: Registrations
    #: The group lookup a scan's quotas by group ask (Linux: NSS, bounded), made once per
    #: scanner; where there are no groups (Windows) it answers none for every user.
    group_lookup: Callable[[], GroupLookup]
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
    #: Why a regular file holding a secret (a bearer token) is not private, or None:
    #: (path, its stat). Linux: its owner uid and mode bits; Windows: its ACL decides,
    #: which is not read (None).
    secret_file_problem: Callable[[str, os.stat_result], str | None]
    #: Why a real directory for state or the audit log lets others tamper, or None:
    #: (path, what it is for, its lstat). As secret_file_problem: POSIX owner and mode
    #: bits, or nothing read where an ACL decides.
    private_dir_problem: Callable[[Path, str, os.stat_result], str | None]
    #: Make a rename into a directory durable (Linux: fsync the directory; Windows: no
    #: directory can be opened for that, and NTFS logs the rename itself).
    fsync_directory: Callable[[Path], None]


