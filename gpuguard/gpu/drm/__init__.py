"""The DRM back-end: GPUs of every kernel driver that publishes the DRM client usage stats
(Intel's i915 and xe, amdgpu, and others), read from /proc/PID/fdinfo and sysfs with no
vendor library (docs/gpu-vendors.md, DRM fdinfo). `probe` says whether this host has any
DRM render node; `privileges` what this process lacks to see every user's clients."""

from __future__ import annotations

import os

from gpuguard.gpu.drm.devices import node_driver, read_by, render_nodes
from gpuguard.gpu.drm.reader import Drm
from gpuguard.host.events.privilege import read_sets
from gpuguard.host.procfs import CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE

__all__ = ["Drm", "privilege_lines", "privileges", "probe"]


def probe(dev_root: str = "/dev", sys_root: str = "/sys",
          others: frozenset[str] = frozenset()) -> str | None:
    """None where `dev_root`/dri has a render node that no other active back-end reads
    (`others`: the drivers they read); else why the back-end cannot run. It lists a
    directory and reads one sysfs link per render node: a host without DRM devices, and
    one whose render nodes are all NVML's (an NVIDIA host, a BMC's display chip beside),
    pay nothing more, ever."""
    nodes = render_nodes(dev_root)
    if not nodes:
        return f"no DRM render node ({dev_root}/dri/renderD*)"
    drivers = {node_driver(sys_root, os.path.basename(node)) for node in nodes}
    if others and all(read_by(driver, others) for driver in drivers):
        names = ", ".join(sorted(d for d in drivers if d is not None))
        return f"every render node is read by another back-end ({names})"
    return None


def privilege_lines(effective: int | None) -> list[str]:
    """What a process with effective capability set `effective` (None: unknown) lacks to
    read every user's DRM clients: another user's /proc/PID/fd is mode 0500 (a DAC bypass)
    and stat() through it and fdinfo are ptrace-read checked (CAP_SYS_PTRACE)."""
    if effective is None:
        return []

    def has(bit: int) -> bool:
        return bool(effective >> bit & 1)

    missing = [name for name, ok in (
        ("CAP_SYS_PTRACE", has(CAP_SYS_PTRACE)),
        ("CAP_DAC_READ_SEARCH", has(CAP_DAC_READ_SEARCH) or has(CAP_DAC_OVERRIDE))) if not ok]
    if not missing:
        return []
    return [f"cannot read other users' /proc/PID/fd and fdinfo (missing {' and '.join(missing)})"
            ": their DRM clients (Intel, AMD without ROCm) are not seen; run as root or with "
            "the capabilities of deploy/systemd/"]


def privileges() -> list[str]:
    """privilege_lines of this process (capget(2): no file is read)."""
    sets = read_sets()
    return privilege_lines(None if sets is None else sets.effective)
