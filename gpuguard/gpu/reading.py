"""What one pass over a GPU vendor's library gives (gpuguard/gpu/source.py, GpuSource): each
GPU's gauges and identity, its holders, and the reading whole. Vendor-neutral: NVML's reader
(gpuguard/gpu/nvml/) fills it today, and a second vendor fills the same record, so the
exporter's metrics, the remediator's checks and the console read every vendor alike."""

from __future__ import annotations

from dataclasses import dataclass

from gpuguard.base.compat import StrEnum
from gpuguard.orphans.process import Holder


class Listed(StrEnum):
    """What /proc says of a pid a back-end lists on a GPU, where the back-end's list cannot
    be taken at its word (AMD SMI's: docs/gpu-vendors.md): only a HOLDER is one."""

    HOLDER = "holder"
    #: No process at that pid: it exited (ROCm kept dead pids listed for ever until
    #: mid-2026), /proc hides it, or it lives in another PID namespace.
    NO_PROCESS = "no-process"
    #: A process at that pid, but not the one first listed there: it started after the
    #: listing, or its start time differs from the one seen then.
    PID_REUSED = "pid-reused"
    #: A process at that pid that does not have the KFD device (/dev/kfd) open, on a host
    #: that has it: not a ROCm client, so not the one listed (a pid reused, however long
    #: before the first listing gpuguard saw).
    NO_KFD = "no-kfd"
    #: A process at that pid whose open files could not be looked at (not ours to read, or
    #: more than a read's bound of them): whether it holds the GPU is unknown. No holder
    #: (never reaped), and a reset waits for it.
    UNVERIFIED = "unverified"


@dataclass(frozen=True)
class NotHolding:
    """A pid listed on a GPU that is no holder (`why`), with the memory the back-end says it
    holds (None: not given): counted with the unseen processes, its memory unattributed."""

    pid: int
    used_bytes: int | None
    why: Listed


@dataclass(frozen=True)
class GpuSample:
    """One GPU's gauges; any field the driver could not give is None."""

    index: int
    uuid: str
    name: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    utilization_ratio: float | None
    temperature_celsius: float | None
    power_watts: float | None
    #: False when the driver would not list this GPU's processes, or the list may miss
    #: some (DRM: processes whose descriptors could not be read): then the holders on it
    #: are not known to be all, and "used minus what processes hold" would be a guess.
    processes_listed: bool = True
    #: False when memory_used_bytes came from nvmlDeviceGetMemoryInfo (v1), whose "used"
    #: includes the driver's reserved memory: memory no process holds, of unknown size.
    used_excludes_reserved: bool = True
    #: The pids NVML saw use this GPU since the previous read (SM, memory controller,
    #: encoder or decoder above 0 in a sample newer than the previous read's mark); every
    #: other holder used none. None when NVML cannot say (MIG, NOT_SUPPORTED, an error, a
    #: wall-clock step since the previous read): unknown, never "idle".
    busy_pids: frozenset[int] | None = None
    #: The device node's name, "nvidia" and the minor number (dcgm-exporter's `device`).
    device: str | None = None
    #: The PCI address as the driver formats it, "00000000:3B:00.0" (dcgm's `pci_bus_id`).
    pci_bus_id: str | None = None
    #: Who made the GPU ("nvidia", "amd", "intel", or a DRM driver's name): the `vendor`
    #: label, which with `gpu` (each back-end numbers its own GPUs from 0) names a GPU.
    vendor: str = "nvidia"
    #: The driver version of the back-end that read this GPU, where it differs per GPU (a
    #: host with GPUs of two vendors); None: the reading's driver_version.
    driver_version: str | None = None
    #: What the driver asks for before this GPU can be used again ("none", "gpu-reset",
    #: "node-reboot", "drain-p2p", "drain-and-reset", ...: NVML's recovery action, its
    #: name in lower case and dashes; "unknown-N" for a code gpuguard does not know). None
    #: where the driver cannot say (older than the field, another vendor, a failed read):
    #: unknown, never "none".
    recovery_action: str | None = None
    #: The pids listed on this GPU that the back-end checked against /proc and found to be
    #: no holder (NotHolding): never a Holder, never reaped; a reset waits for none of them
    #: only where /proc shows every pid (gpuguard/console/reset/).
    not_holding: tuple[NotHolding, ...] = ()


@dataclass(frozen=True)
class GpuIdentity:
    """What never changes for one GPU while the driver stays loaded: read once, by UUID.

    A field the driver cannot give (NOT_SUPPORTED) is None for good; one whose read
    failed otherwise is None for this scan and read again on the next.
    """

    name: str | None
    device: str | None
    pci_bus_id: str | None
    #: The fields whose read failed (not NOT_SUPPORTED): read again on the next scan.
    unsettled: frozenset[str] = frozenset()


@dataclass(frozen=True)
class BackendState:
    """One GPU back-end's part in a reading (gpuguard/gpu/vendors/): its collector name
    ("nvml", "amdsmi", "drm"), whether it answered, and why not."""

    name: str
    up: bool
    detail: str | None = None


@dataclass(frozen=True)
class GpuReading:
    """One pass over a vendor's GPUs: what could be read, and what failed (stage, message).
    `up` False: the vendor's library itself is unusable (not loaded, no driver)."""

    up: bool
    driver_version: str | None
    gpus: tuple[GpuSample, ...]
    holders: tuple[Holder, ...]
    errors: tuple[tuple[str, str], ...]
    #: Each active back-end's state, in the chooser's order (empty: a single vendor's own
    #: reading, not yet combined).
    backends: tuple[BackendState, ...] = ()
