"""Who has a GPU's device files open, for `gpuguard reset`: the clients no back-end lists
(graphics, VA-API and Mesa OpenCL clients hold the GPU's DRM nodes without ROCm's KFD, and
AMD SMI does not list them), found the only way the kernel allows: one whole look over
/proc/*/fd, every descriptor stat()ed and matched by what it is (host/fdsearch.py).

A one-shot command's look, not the scan's resumable one: it must finish within a time cap
and read every process's descriptors, or it cannot show the GPU free and the reset is
refused (fail closed). The files are the GPU's own DRM nodes, as sysfs names them
(/sys/bus/pci/devices/PCI/drm/card*, renderD*, each /dev/dri/NAME), and the KFD device
where the host has it (one for every AMD GPU: any process with it open may use any)."""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase

from gpuguard.base.counters import COUNTERS
from gpuguard.gpu.vendors import KFD_DEVICE
from gpuguard.host.fdsearch import DeviceFile, FdSearch

#: The look's time cap (seconds): a host whose process table takes longer is refused.
MAX_SECONDS = 10.0
#: The DRM nodes a client may hold the GPU through (drm/devices.py's NODE_PATTERNS).
NODES = ("card[0-9]*", "renderD[0-9]*")


@dataclass(frozen=True)
class Places:
    """Where the look reads: the real roots, or a test's trees."""

    sys_root: str = "/sys"
    dev_root: str = "/dev"
    proc_root: str = "/proc"
    kfd: str = KFD_DEVICE
    max_seconds: float = MAX_SECONDS


@dataclass(frozen=True)
class Opener:
    """A process (other than this one) that has one of the GPU's device files open."""

    pid: int
    path: str


class Unknown(Exception):
    """The GPU's device files, or who has them open, cannot be known: no reset."""


def gpu_files(pci_bus_id: str | None, places: Places) -> tuple[DeviceFile, ...]:
    """The GPU's DRM nodes and the KFD device (where the host has it), each stat()ed;
    Unknown where any of them cannot be."""
    if not pci_bus_id:
        raise Unknown("the GPU's PCI address is not known, so neither are its DRM nodes")
    drm = os.path.join(places.sys_root, "bus", "pci", "devices", pci_bus_id.lower(), "drm")
    try:
        names = sorted(n for n in os.listdir(drm) if any(fnmatchcase(n, p) for p in NODES))
    except OSError as exc:
        raise Unknown(f"its DRM nodes cannot be listed ({drm}: {exc.strerror})") from None
    if not names:
        raise Unknown(f"no DRM node under {drm}")
    found = [stat_file(os.path.join(places.dev_root, "dri", name)) for name in names]
    files = [f for f in found if f is not None]  # never None: not optional
    kfd = stat_file(places.kfd, optional=True)  # none: no ROCm driver, nobody holds KFD
    return tuple(files) if kfd is None else (*files, kfd)


def stat_file(path: str, *, optional: bool = False) -> DeviceFile | None:
    """`path` as the look matches it; None for an `optional` one that does not exist;
    Unknown where it cannot be stat()ed."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if optional:
            return None
        raise Unknown(f"{path} does not exist here, so who has it open cannot be told"
                      ) from None
    except OSError as exc:
        raise Unknown(f"{path} cannot be stat()ed ({exc.strerror})") from None
    return DeviceFile(path, st.st_dev, st.st_ino,
                      st.st_rdev if stat.S_ISCHR(st.st_mode) else None)


def openers(files: tuple[DeviceFile, ...], places: Places) -> tuple[Opener, ...]:
    """Every process but this one that has any of `files` open, from one whole look over
    /proc/*/fd within places.max_seconds; Unknown where the look could not finish or a
    process's descriptors could not be read."""
    search = FdSearch(proc_root=places.proc_root, counters=COUNTERS,
                      exclude=frozenset({os.getpid()}))
    step = search.step(files, max_processes=sys.maxsize, max_seconds=places.max_seconds)
    if not step.complete:
        raise Unknown(f"the look over {places.proc_root}/*/fd for its device files did not "
                      f"finish within {places.max_seconds:g} s")
    if step.unreadable:
        raise Unknown(f"the open files of {step.unreadable} process(es) could not be read, "
                      "so whether they have its device files open cannot be told")
    return tuple(Opener(pid, path) for pid, path in sorted(step.found.items()))
