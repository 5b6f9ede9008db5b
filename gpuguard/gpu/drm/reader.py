"""Drm: one pass over the host's DRM devices becomes a GpuReading: the devices from sysfs
(devices.py), their clients from /proc (search.py), each client's stats parsed and counted
once (fdinfo.py)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpuguard.base.counters import Counters
from gpuguard.gpu.drm.devices import Devices, device_name, driver_version, find_devices, gauges
from gpuguard.gpu.drm.fdinfo import (
    DrmFd,
    Marks,
    attribute,
    busy_pids,
    marks_of,
    parse_fdinfo,
    per_process,
    vendor_of,
)
from gpuguard.gpu.drm.search import MAX_PROCESSES, MAX_SECONDS, PASS_EVERY, DrmSearch, Step
from gpuguard.gpu.reading import GpuReading, GpuSample
from gpuguard.orphans.process import Holder

log = logging.getLogger("gpuguard.gpu")

#: The kind of a holder the DRM back-end found (NVML's are C, G and C+G).
DRM_KIND = "drm"
#: The vendor label of a device whose driver neither sysfs nor its clients name.
UNKNOWN_DRIVER = "drm"


def uuid_of(pdev: str) -> str:
    """A DRM GPU's uuid: its PCI address, which names it as long as it sits in that slot
    (the kernel gives DRM devices no uuid of their own)."""
    return f"DRM-{pdev}"


class Drm:
    """Reads the GPUs of every DRM driver that publishes usage stats (i915, xe, amdgpu, ...),
    but those whose driver is in `skip_drivers` (read by another active back-end); safe to
    call from several threads. `max_processes`/`max_seconds`: the budget of each read's
    share of the /proc search, `pass_every` how often a pass starts (search.py)."""

    def __init__(self, counters: Counters, *, process_utilization: bool = True,
                 wall: Callable[[], float] | None = None,
                 boot: Callable[[], float] | None = None,
                 proc_root: str = "/proc", sys_root: str = "/sys", dev_root: str = "/dev",
                 skip_drivers: frozenset[str] = frozenset(),
                 max_processes: int = MAX_PROCESSES, max_seconds: float = MAX_SECONDS,
                 pass_every: float = PASS_EVERY) -> None:
        del wall, boot  # engine counters are cumulative: growth needs no clock
        self._counters = counters
        self._process_utilization = process_utilization
        self._sys = sys_root
        self._dev = dev_root
        self._skip = skip_drivers
        self._search = DrmSearch(proc_root=proc_root, counters=counters,
                                 max_processes=max_processes, max_seconds=max_seconds,
                                 pass_every=pass_every)
        self._lock = threading.Lock()
        self._marks: Marks | None = None  # None until a read has seen the clients
        self._names: dict[str, str | None] = {}
        self._warned_unreadable = False

    def skipped(self, driver: str | None) -> bool:
        """Whether another back-end reads this driver's GPUs (nvidia-drm is nvidia's)."""
        return driver is not None and (driver in self._skip
                                       or driver.removesuffix("-drm") in self._skip)

    def read(self) -> GpuReading:
        with self._lock:
            with self._counters.track("drm_sysfs"):
                found = find_devices(self._dev, self._sys)
            if not found.nodes:
                return GpuReading(False, None, (), (), (
                    ("drm_devices", f"no DRM device node under {self._dev}/dri"),))
            nodes = {key: name for key, name in found.nodes.items()
                     if not self._skipped_node(found, name)}
            kernel = driver_version(self._sys, None)
            if not nodes:  # every device is another back-end's: no /proc read at all
                return GpuReading(True, kernel, (), (), ())
            try:
                step = self._search.step(nodes)
            except OSError as exc:
                return GpuReading(False, kernel, (), (), (
                    ("drm_search", f"cannot list processes: {exc.strerror}"),))
            return self._reading(found, step, kernel)

    def close(self) -> None:
        """Nothing to release: the search keeps what it found for the next read."""

    def _skipped_node(self, found: Devices, node: str) -> bool:
        pdev = found.device_of.get(node)
        return pdev is not None and self.skipped(found.devices[pdev].driver)

    def _reading(self, found: Devices, step: Step, kernel: str | None) -> GpuReading:
        errors: list[tuple[str, str]] = []
        fds: list[DrmFd] = []
        drivers = {pdev: d.driver for pdev, d in found.devices.items()}
        for opened in step.opened:
            client = parse_fdinfo(opened.fdinfo) if opened.fdinfo is not None else None
            pdev = (client.pdev if client is not None else None) or found.device_of.get(
                opened.node)
            if pdev is None:
                errors.append(("drm_clients", f"pid {opened.pid} fd {opened.fd}: open on "
                               f"{opened.node}, whose device neither sysfs nor fdinfo names"))
                continue
            if client is not None and drivers.get(pdev) is None:
                drivers[pdev] = client.driver
            if self.skipped(drivers.get(pdev)):
                continue
            fds.append(DrmFd(opened.pid, opened.start_time, opened.fd, pdev, client))
        owned = attribute(fds)
        pdevs = sorted(p for p, driver in drivers.items() if not self.skipped(driver))
        listed = step.passes > 0
        if not listed:
            errors.append(("drm_search", "the first pass over /proc for DRM clients is not "
                           f"complete yet ({step.listed} processes)"))
        elif step.unreadable and not self._warned_unreadable:
            self._warned_unreadable = True
            log.warning("DRM back-end: the descriptors of %d processes could not be read "
                        "(CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH missing?): their GPU use is "
                        "not seen", step.unreadable)
        previous = self._marks
        self._marks = marks_of(owned, previous or {})
        index = {pdev: i for i, pdev in enumerate(pdevs)}
        gpus = tuple(self._sample(found, pdev, index[pdev], drivers.get(pdev), kernel, listed,
                                  busy_pids(owned, previous, pdev)
                                  if listed and self._process_utilization else None)
                     for pdev in pdevs)
        holders = tuple(Holder(use.pid, uuid_of(use.pdev), index[use.pdev], use.memory_bytes,
                               DRM_KIND) for use in per_process(owned) if use.pdev in index)
        return GpuReading(True, kernel, gpus, holders, tuple(errors))

    def _sample(self, found: Devices, pdev: str, index: int, driver: str | None, kernel: str | None,
                listed: bool, busy: frozenset[int] | None) -> GpuSample:
        with self._counters.track("drm_sysfs"):
            if pdev not in self._names:
                self._names[pdev] = device_name(self._sys, pdev, driver)
            now = gauges(self._sys, pdev)
            version = driver_version(self._sys, driver)
        return GpuSample(
            index=index, uuid=uuid_of(pdev), name=self._names[pdev],
            memory_total_bytes=now.memory_total_bytes,
            memory_used_bytes=now.memory_used_bytes,
            utilization_ratio=now.utilization_ratio,
            temperature_celsius=None, power_watts=None,
            processes_listed=listed,
            # sysfs' "used" counts the driver's own buffers too (firmware, display):
            # memory no process holds, of unknown size (gpu/reading.py).
            used_excludes_reserved=False,
            busy_pids=busy, pci_bus_id=pdev,
            device=found.devices[pdev].nodes[0] if pdev in found.devices else None,
            vendor=vendor_of(driver) if driver else UNKNOWN_DRIVER,
            driver_version=version if version != kernel else None)
