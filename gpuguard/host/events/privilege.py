"""CAP_NET_ADMIN: what the process-events subscription needs, held for the bind only.

On the kernels checked (6.18 among them, REFERENCES "fifth round"), bind() of a
NETLINK_CONNECTOR socket to CN_IDX_PROC answers EPERM to any process without CAP_NET_ADMIN,
root with its capabilities dropped included; the socket keeps working once the capability
is gone. So the shipped units and the DaemonSet grant it, and each daemon gives it up
right after its subscription (`release_net_admin`, run by ProcessEvents.start before the
reader thread starts): from the effective, permitted and inheritable sets (capset), the
ambient set (prctl) and, where the process may, the bounding set. Capabilities are per
thread and a new thread copies its creator's: the daemons subscribe before they start any
other thread, and the release names any thread that still holds it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from typing import NamedTuple

log = logging.getLogger("gpuguard.host.procevents")

CAP_NET_ADMIN = 12  # linux/capability.h
_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT, PR_CAP_AMBIENT_LOWER = 47, 3
#: What the EPERM of the subscription means, for the start-up warning.
GRANTED_BY = ("the shipped units grant it (deploy/systemd: AmbientCapabilities= and "
              "CapabilityBoundingSet= both name CAP_NET_ADMIN; deploy/kubernetes: NET_ADMIN "
              "in the container's capabilities.add), and the daemon drops it right after "
              "subscribing")


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


class CapSets(NamedTuple):
    """One thread's capability sets, as 64-bit masks."""

    effective: int
    permitted: int
    inheritable: int

    def holds(self, cap: int) -> bool:
        """Whether the thread may use `cap` now or raise it again (effective or permitted)."""
        return bool((self.effective | self.permitted) >> cap & 1)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def read_sets(tid: int = 0) -> CapSets | None:
    """capget(2) of thread `tid` (0: the calling thread); None where it fails (gone, or
    not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    header, data = _Header(_VERSION_3, tid), (_Data * 2)()
    if _libc().capget(ctypes.byref(header), data) != 0:
        return None
    return CapSets(*(data[0].__getattribute__(f) | data[1].__getattribute__(f) << 32
                     for f in ("effective", "permitted", "inheritable")))


def _write_sets(sets: CapSets) -> int:
    """capset(2) of the calling thread; 0, else the errno."""
    data = (_Data * 2)()
    for word in (0, 1):
        data[word].effective = sets.effective >> 32 * word & 0xFFFFFFFF
        data[word].permitted = sets.permitted >> 32 * word & 0xFFFFFFFF
        data[word].inheritable = sets.inheritable >> 32 * word & 0xFFFFFFFF
    libc = _libc()
    if libc.capset(ctypes.byref(_Header(_VERSION_3, 0)), data) != 0:
        return ctypes.get_errno()
    return 0


def subscription_refused() -> str:
    """The start-up warning's reason for EPERM from the subscription, on this process."""
    sets = read_sets()
    if sets is not None and sets.effective >> CAP_NET_ADMIN & 1:
        return ("refused although this process holds CAP_NET_ADMIN: a seccomp filter or a "
                "security module (SELinux, AppArmor) denies the netlink connector")
    return ("missing CAP_NET_ADMIN, which this kernel requires for the subscription; "
            f"{GRANTED_BY}: check that the unit or container in use still has it (a "
            "drop-in or an overlay that empties the capability sets removes it too)")


def drop_net_admin() -> str | None:
    """Give up CAP_NET_ADMIN in this thread, for good; None when done (or never held),
    else what is left held and why. Other threads keep what they had: see `holders`."""
    sets = read_sets()
    if sets is None:
        return None
    bit = 1 << CAP_NET_ADMIN
    problem = None
    if (sets.effective | sets.permitted | sets.inheritable) & bit:
        # Lowering permitted (and inheritable) also clears it from the ambient set.
        failed = _write_sets(CapSets(sets.effective & ~bit, sets.permitted & ~bit,
                                     sets.inheritable & ~bit))
        if failed:
            problem = (f"capset: {errno.errorcode.get(failed, failed)} (a seccomp filter "
                       "that denies capset? the units allow it)")
    libc = _libc()
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_LOWER, CAP_NET_ADMIN, 0, 0)  # EINVAL before 4.3
    # The bounding set needs CAP_SETPCAP, which the units do not grant: with no_new_privs
    # (NoNewPrivileges=, allowPrivilegeEscalation: false) nothing can raise it again anyway.
    libc.prctl(PR_CAPBSET_DROP, CAP_NET_ADMIN, 0, 0, 0)
    return problem


def holders() -> list[int]:
    """The threads of this process that still hold CAP_NET_ADMIN (effective or permitted)."""
    try:
        tids = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return []
    found = []
    for tid in sorted(tids):
        sets = read_sets(tid)
        if sets is not None and sets.holds(CAP_NET_ADMIN):
            found.append(tid)
    return found


def release_net_admin() -> None:
    """ProcessEvents.start's `after_subscribe` for the daemons: drop CAP_NET_ADMIN and say
    if any of it is left (never fatal: the daemon runs on as it did before)."""
    held = read_sets()
    if held is None or not held.holds(CAP_NET_ADMIN):
        return
    problem = drop_net_admin()
    left = holders()
    if problem is None and not left:
        log.debug("CAP_NET_ADMIN dropped after the process-events subscription")
        return
    log.warning("CAP_NET_ADMIN is still held after the process-events subscription (%s); "
                "the daemon works as before, with more privilege than it needs",
                problem or f"threads {', '.join(map(str, left))} started before it was dropped")
