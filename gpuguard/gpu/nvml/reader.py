"""Nvml: one pass over every GPU becomes a GpuReading (the library's lifetime, each
GPU's gauges and its holders); what each GPU is (identity.py) and who used it
(utilization.py) are read by objects of their own."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import pynvml

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.gpu.nvml.failures import (
    DRIVER_GONE,
    LOGGER,
    NVML_LOCK,
    DeviceGone,
    DriverGone,
    field,
    raise_if_gone,
)
from gpuguard.gpu.nvml.identity import GpuIdentities
from gpuguard.gpu.nvml.recovery import RecoveryActions
from gpuguard.gpu.nvml.utilization import ProcessUse
from gpuguard.gpu.reading import GpuReading, GpuSample
from gpuguard.host.procfs import boottime
from gpuguard.orphans.process import Holder

#: The package's one logger name, which operators filter on.
log = logging.getLogger(LOGGER)

T = TypeVar("T")


class Nvml:
    """Reads GPUs and their GPU-holding processes; safe to call from several threads."""

    def __init__(self, *, counters: Counters = COUNTERS, process_utilization: bool = True,
                 wall: Callable[[], float] = time.time,
                 boot: Callable[[], float] = boottime) -> None:
        """`process_utilization` False: no per-process utilization calls (busy_pids None).
        Each call answers the samples since this instance's previous one, so only the
        reader who keeps the idle clock (the scanner, the remediator's IdleWatch) asks.
        `wall` is the clock NVML stamps samples with, `boot` one no step moves: their
        offset moving is a wall-clock step (gpuguard/orphans/idleness.py, SampleMark)."""
        self._counters = counters
        self._process_utilization = process_utilization
        self._use = ProcessUse(self._call, wall, boot)
        self._identities = GpuIdentities(self._call)
        self._recovery = RecoveryActions(self._call)
        self._initialised = False
        self._driver_version: str | None = None
        self._warned = False
        # Newer calls first; fall back for good once the driver says it lacks them.
        self._temperature_v = hasattr(pynvml, "nvmlDeviceGetTemperatureV")
        self._memory_v2 = True

    def read(self) -> GpuReading:
        """One pass: initialise if needed, then every GPU's gauges and holders."""
        with NVML_LOCK:
            try:
                if not self._initialised:
                    self._init()
                return self._read_devices()
            except DriverGone as gone:
                self._drop()
                if not self._warned:
                    log.warning(
                        "NVML unavailable (%s: %s); retrying on every scan",
                        gone.stage,
                        gone.message,
                    )
                    self._warned = True
                return GpuReading(False, None, (), (), ((gone.stage, gone.message),))

    def close(self) -> None:
        """Shut NVML down if this instance initialised it."""
        with NVML_LOCK:
            self._drop()

    # Library lifetime

    def _init(self) -> None:
        try:
            self._call("nvml_init", pynvml.nvmlInit)
        except pynvml.NVMLError as err:
            raise DriverGone("nvml_init", str(err)) from None
        self._initialised = True
        try:
            self._driver_version = self._call("nvml_init", pynvml.nvmlSystemGetDriverVersion)
        except pynvml.NVMLError as err:
            if err.value in DRIVER_GONE:
                raise DriverGone("nvml_init", str(err)) from None
            self._driver_version = None
        if self._warned:
            log.info("NVML available again (driver %s)", self._driver_version)
            self._warned = False

    def _drop(self) -> None:
        if self._initialised:
            try:
                self._call("nvml_init", pynvml.nvmlShutdown)
            except pynvml.NVMLError:
                pass  # already unusable; all we want is a fresh init next time
        self._initialised = False
        self._driver_version = None
        self._use.clear()  # a driver that comes back may be another one
        self._identities.clear()
        self._recovery.clear()

    def _call(self, callsite: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Every NVML call goes through here, so its cost shows at /metrics."""
        with self._counters.track(callsite):
            return fn(*args, **kwargs)

    # One pass

    def _read_devices(self) -> GpuReading:
        try:
            count = self._call("nvml_device", pynvml.nvmlDeviceGetCount)
        except pynvml.NVMLError as err:
            raise DriverGone("nvml_device", f"device count: {err}") from None
        gpus: list[GpuSample] = []
        holders: list[Holder] = []
        errors: list[tuple[str, str]] = []
        for index in range(count):
            device_errors: list[tuple[str, str]] = []
            try:
                gpu, gpu_holders = self._read_device(index, device_errors)
            except DeviceGone as gone:
                errors.append(("nvml_device", gone.message))
                continue
            gpus.append(gpu)
            holders.extend(gpu_holders)
            errors.extend(device_errors)
        return GpuReading(True, self._driver_version, tuple(gpus), tuple(holders), tuple(errors))

    def _read_device(
        self, index: int, errors: list[tuple[str, str]]
    ) -> tuple[GpuSample, list[Holder]]:
        try:
            handle = self._call("nvml_device", pynvml.nvmlDeviceGetHandleByIndex, index)
            uuid: str = self._call("nvml_device", pynvml.nvmlDeviceGetUUID, handle)
        except pynvml.NVMLError as err:
            # Without a handle and a uuid there is nothing to label the GPU with.
            raise_if_gone(index, "nvml_device", err)
            raise DeviceGone(f"GPU {index}: {err}") from None
        identity = self._identities.of(index, uuid, handle, errors)
        read = field(index, "memory", errors, lambda: self._memory(handle))
        memory, memory_v2 = (None, True) if read is None else read
        util = field(
            index,
            "utilization",
            errors,
            lambda: self._call("nvml_device", pynvml.nvmlDeviceGetUtilizationRates, handle),
        )
        temp = field(index, "temperature", errors, lambda: self._temperature(handle))
        power_mw = field(
            index,
            "power",
            errors,
            lambda: self._call("nvml_device", pynvml.nvmlDeviceGetPowerUsage, handle),
        )
        recovery = self._recovery.of(index, uuid, handle, errors)
        holders = self._holders(index, uuid, handle, errors)
        busy = self._use.busy(index, uuid, handle) if self._process_utilization else None
        gpu = GpuSample(
            index=index,
            uuid=uuid,
            name=identity.name,
            memory_total_bytes=None if memory is None else int(memory.total),
            memory_used_bytes=None if memory is None else int(memory.used),
            utilization_ratio=None if util is None else util.gpu / 100,
            temperature_celsius=None if temp is None else float(temp),
            power_watts=None if power_mw is None else power_mw / 1000,
            processes_listed=holders is not None,
            used_excludes_reserved=memory_v2,
            busy_pids=busy,
            device=identity.device,
            pci_bus_id=identity.pci_bus_id,
            recovery_action=recovery,
        )
        return gpu, holders or []

    def _memory(self, handle: Any) -> tuple[Any, bool]:
        """The memory struct, and whether its "used" leaves out reserved memory (_v2).

        _v2 reports "used" without the driver's reserved memory, like nvidia-smi (and
        the unattributed-memory arithmetic needs exactly that); _v1's includes it.
        """
        if self._memory_v2:
            try:
                info = self._call(
                    "nvml_device",
                    pynvml.nvmlDeviceGetMemoryInfo,
                    handle,
                    version=pynvml.nvmlMemory_v2,
                )
                return info, True
            except pynvml.NVMLError as err:
                if err.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
                self._memory_v2 = False
        return self._call("nvml_device", pynvml.nvmlDeviceGetMemoryInfo, handle), False

    def _temperature(self, handle: Any) -> int:
        # nvmlDeviceGetTemperature is deprecated (gone in CUDA 14); older drivers lack the V form.
        if self._temperature_v:
            try:
                return self._call(
                    "nvml_device",
                    pynvml.nvmlDeviceGetTemperatureV,
                    handle,
                    pynvml.NVML_TEMPERATURE_GPU,
                )
            except pynvml.NVMLError as err:
                if err.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
                self._temperature_v = False
        return self._call(
            "nvml_device", pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
        )

    def _holders(
        self, index: int, uuid: str, handle: Any, errors: list[tuple[str, str]]
    ) -> list[Holder] | None:
        """Compute and graphics processes; on error None, since half a list misleads."""
        try:
            compute = self._call(
                "nvml_processes", pynvml.nvmlDeviceGetComputeRunningProcesses_v3, handle
            )
            graphics = self._call(
                "nvml_processes", pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3, handle
            )
        except pynvml.NVMLError as err:
            raise_if_gone(index, "nvml_processes", err)
            errors.append(("nvml_processes", f"GPU {index}: {err}"))
            return None
        return merge_holders(index, uuid, compute, graphics)


def merge_holders(
    index: int, uuid: str, compute: Iterable[Any], graphics: Iterable[Any]
) -> list[Holder]:
    """One Holder per pid on this GPU; its usage None when any of its entries has none.

    NVML documents usedGpuMemory as "all of the memory used by the application", so a
    pid in both lists is one application seen twice: kind "C+G" with the larger figure,
    never the sum. A pid listed twice in one list (one entry per MIG instance) holds
    separate memory in each, so those figures add up. If the driver cannot size any
    one entry ("not available", e.g. MIG without privileges, WDDM), the pid's usage on
    this GPU is unknown: the sum of the rest is only a lower bound, and reading it as
    the figure would show memory that the pid holds as held by nobody.
    """
    per_pid: dict[int, dict[str, list[int | None]]] = {}
    for kind, procs in (("C", compute), ("G", graphics)):
        for proc in procs:
            per_pid.setdefault(int(proc.pid), {}).setdefault(kind, []).append(
                proc.usedGpuMemory
            )
    holders: list[Holder] = []
    for pid, kinds in per_pid.items():
        lists = kinds.values()
        unknown = any(used is None for entries in lists for used in entries)
        holders.append(
            Holder(
                pid=pid,
                gpu_uuid=uuid,
                gpu_index=index,
                used_bytes=None if unknown else max(sum(e or 0 for e in es) for es in lists),
                kind="C+G" if len(kinds) == 2 else next(iter(kinds)),
            )
        )
    return holders
