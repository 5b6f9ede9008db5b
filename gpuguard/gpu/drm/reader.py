"""Drm: one pass over the host's DRM devices becomes a GpuReading: the devices from sysfs
(devices.py), their clients from /proc (search.py), each client's stats parsed and counted
once (fdinfo.py)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpuguard.base.counters import Counters
from gpuguard.gpu.drm.devices import (
    RENDER,
    Devices,
    device_name,
    driver_version,
    find_devices,
    gauges,
    read_by,
)
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
from gpuguard.gpu.drm.search import (
    FIRST_MAX_PROCESSES,
    FIRST_MAX_SECONDS,
    MAX_PROCESSES,
    MAX_SECONDS,
    PASS_EVERY,
    DrmSearch,
    Step,
)
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
    share of the /proc search, `first_max_processes`/`first_max_seconds` the first read's
    (a whole pass on ordinary hosts), `pass_every` how often a pass starts (search.py).

    A GPU is a device with a render node, or one whose clients publish usage stats: a
    display-only device (a BMC's ast, a framebuffer) runs no work, and its one client,
    the display server, is no GPU holder."""

    def __init__(self, counters: Counters, *, process_utilization: bool = True,
                 wall: Callable[[], float] | None = None,
                 boot: Callable[[], float] | None = None,
                 proc_root: str = "/proc", sys_root: str = "/sys", dev_root: str = "/dev",
                 skip_drivers: frozenset[str] = frozenset(),
                 max_processes: int = MAX_PROCESSES, max_seconds: float = MAX_SECONDS,
                 first_max_processes: int = FIRST_MAX_PROCESSES,
                 first_max_seconds: float = FIRST_MAX_SECONDS,
                 pass_every: float = PASS_EVERY) -> None:
        del wall, boot  # engine counters are cumulative: growth needs no clock
        self._counters = counters
        self._process_utilization = process_utilization
        self._sys = sys_root
        self._dev = dev_root
        self._skip = skip_drivers
        self._search = DrmSearch(proc_root=proc_root, counters=counters,
                                 max_processes=max_processes, max_seconds=max_seconds,
                                 first_max_processes=first_max_processes,
                                 first_max_seconds=first_max_seconds, pass_every=pass_every)
        self._lock = threading.Lock()
        self._marks: Marks | None = None  # None until a read has seen the clients
        self._names: dict[str, str | None] = {}
        self._unreadable_said = 0  # the count of unreadable processes last logged

    def skipped(self, driver: str | None) -> bool:
        """Whether another back-end reads this driver's GPUs (nvidia-drm is nvidia's)."""
        return read_by(driver, self._skip)

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
        """Close what the search holds open (a process's descriptor directory it stopped
        part-way through); it keeps what it found for the next read."""
        with self._lock:
            self._search.close()

    def _skipped_node(self, found: Devices, node: str) -> bool:
        pdev = found.device_of.get(node)
        return pdev is not None and self.skipped(found.devices[pdev].driver)

    def _reading(self, found: Devices, step: Step, kernel: str | None) -> GpuReading:
        errors: list[tuple[str, str]] = []
        fds: list[DrmFd] = []
        drivers = {pdev: d.driver for pdev, d in found.devices.items()}
        gpus = {pdev for pdev, d in found.devices.items() if d.renders}
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
            if opened.node.startswith(RENDER) or (client is not None and client.usage):
                gpus.add(pdev)
            fds.append(DrmFd(opened.pid, opened.start_time, opened.fd, pdev, client))
        owned = attribute(fd for fd in fds if fd.pdev in gpus)
        pdevs = sorted(p for p in gpus if not self.skipped(drivers.get(p)))
        searched = step.passes > 0
        if not searched:
            errors.append(("drm_search", "the first pass over /proc for DRM clients is not "
                           f"complete yet ({step.listed} processes)"))
        else:
            self._say_unreadable(step.unreadable)
        # A process whose descriptors could not be read may hold any GPU unseen.
        listed = searched and not step.unreadable
        previous = self._marks
        self._marks = marks_of(owned, previous or {})
        index = {pdev: i for i, pdev in enumerate(pdevs)}
        samples = tuple(self._sample(found, pdev, index[pdev], drivers.get(pdev), kernel,
                                     listed, busy_pids(owned, previous, pdev)
                                     if searched and self._process_utilization else None)
                        for pdev in pdevs)
        holders = tuple(Holder(use.pid, uuid_of(use.pdev), index[use.pdev], use.memory_bytes,
                               DRM_KIND) for use in per_process(owned) if use.pdev in index)
        return GpuReading(True, kernel, samples, holders, tuple(errors))

    def _say_unreadable(self, unreadable: int) -> None:
        """Log the count of processes whose descriptors the last complete pass could not
        read, each time it changes."""
        if unreadable == self._unreadable_said:
            return
        self._unreadable_said = unreadable
        if unreadable:
            log.warning("DRM back-end: the descriptors of %d processes could not be read "
                        "(CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH missing?): their GPU use is "
                        "not seen, and no DRM GPU's process list reads complete", unreadable)
        else:
            log.info("DRM back-end: every process's descriptors could be read again")

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
