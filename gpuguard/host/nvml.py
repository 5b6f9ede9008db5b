"""The only module that imports pynvml: one pass over NVML becomes an NvmlReading.

NVML fails in pieces on real hosts: the driver is not loaded yet, one GPU falls
off the bus, a consumer card does not report power. A scan must report what it
can and say what failed, so every call has a fallback: a field becomes None, a
lost GPU is skipped, and only a dead library marks the whole reading down (and
is initialised again on the next read, so a driver that appears later is used).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import pynvml

from gpuguard.host.counters import COUNTERS, Counters
from gpuguard.host.procfs import boottime
from gpuguard.orphans.idleness import (
    STEP_TOLERANCE_SECONDS,
    SampleMark,
    next_mark,
    rebased_mark,
)
from gpuguard.orphans.process import Holder

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Serialises every NVML call in the process: the scanner thread and the
#: remediator's worker both read NVML, and one read must see one driver state.
_NVML_LOCK = threading.Lock()

#: Return codes that mean the library as a whole is unusable: report down, re-init next read.
_DRIVER_GONE = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    }
)

#: The per-process utilization calls, first choice first (gpuguard/host/nvml.py, _use).
USE_INFO = "nvmlDeviceGetProcessesUtilizationInfo"  # R550 and later: a versioned struct
USE_LEGACY = "nvmlDeviceGetProcessUtilization"
#: Answers that mean this GPU will not give that call: use the next one, for good (a
#: driver that does not know pynvml's struct version is one that cannot give it either).
_USE_REFUSED = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                          pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH})

#: Return codes that mean one GPU is unusable: skip it, keep reporting the others.
_DEVICE_GONE = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED})


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
    #: False when the driver would not list this GPU's processes: then no holder on it
    #: is known, and "used minus what processes hold" would be a guess.
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
class NvmlReading:
    """One pass over NVML: what could be read, and what failed (stage, message)."""

    up: bool
    driver_version: str | None
    gpus: tuple[GpuSample, ...]
    holders: tuple[Holder, ...]
    errors: tuple[tuple[str, str], ...]


class _DriverGone(Exception):
    """The library is unusable; the whole reading is down."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message


class _DeviceGone(Exception):
    """One GPU is unusable; skip it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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
        self._wall = wall
        self._boot = boot
        #: Per GPU uuid: the utilization calls it may still answer, first choice first,
        #: and the mark the next read asks from (the newest sample read, never past the
        #: wall time of that read).
        self._use_calls: dict[str, tuple[str, ...]] = {}
        self._marks: dict[str, SampleMark] = {}
        self._step_warned: float | None = None  # the wall-minus-boot offset last warned of
        self._use_warned: set[tuple[str, str, int]] = set()  # (uuid, call, code)
        #: GPUs that cannot be in MIG mode (NOT_SUPPORTED, or the driver lacks the call).
        self._no_mig: set[str] = set()
        self._initialised = False
        self._driver_version: str | None = None
        self._warned = False
        # Newer calls first; fall back for good once the driver says it lacks them.
        self._temperature_v = hasattr(pynvml, "nvmlDeviceGetTemperatureV")
        self._memory_v2 = True
        #: Per UUID, dropped with the library: a GPU moved to another slot is only seen
        #: after a driver reload.
        self._identities: dict[str, GpuIdentity] = {}

    def read(self) -> NvmlReading:
        """One pass: initialise if needed, then every GPU's gauges and holders."""
        with _NVML_LOCK:
            try:
                if not self._initialised:
                    self._init()
                return self._read_devices()
            except _DriverGone as gone:
                self._drop()
                if not self._warned:
                    log.warning(
                        "NVML unavailable (%s: %s); retrying on every scan",
                        gone.stage,
                        gone.message,
                    )
                    self._warned = True
                return NvmlReading(False, None, (), (), ((gone.stage, gone.message),))

    def close(self) -> None:
        """Shut NVML down if this instance initialised it."""
        with _NVML_LOCK:
            self._drop()

    # Library lifetime

    def _init(self) -> None:
        try:
            self._call("nvml_init", pynvml.nvmlInit)
        except pynvml.NVMLError as err:
            raise _DriverGone("nvml_init", str(err)) from None
        self._initialised = True
        try:
            self._driver_version = self._call("nvml_init", pynvml.nvmlSystemGetDriverVersion)
        except pynvml.NVMLError as err:
            if err.value in _DRIVER_GONE:
                raise _DriverGone("nvml_init", str(err)) from None
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
        self._use_calls.clear()  # a driver that comes back may be another one
        self._marks.clear()
        self._no_mig.clear()
        self._identities.clear()

    def _call(self, callsite: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Every NVML call goes through here, so its cost shows at /metrics."""
        with self._counters.track(callsite):
            return fn(*args, **kwargs)

    # One pass

    def _read_devices(self) -> NvmlReading:
        try:
            count = self._call("nvml_device", pynvml.nvmlDeviceGetCount)
        except pynvml.NVMLError as err:
            raise _DriverGone("nvml_device", f"device count: {err}") from None
        gpus: list[GpuSample] = []
        holders: list[Holder] = []
        errors: list[tuple[str, str]] = []
        for index in range(count):
            device_errors: list[tuple[str, str]] = []
            try:
                gpu, gpu_holders = self._read_device(index, device_errors)
            except _DeviceGone as gone:
                errors.append(("nvml_device", gone.message))
                continue
            gpus.append(gpu)
            holders.extend(gpu_holders)
            errors.extend(device_errors)
        return NvmlReading(True, self._driver_version, tuple(gpus), tuple(holders), tuple(errors))

    def _read_device(
        self, index: int, errors: list[tuple[str, str]]
    ) -> tuple[GpuSample, list[Holder]]:
        try:
            handle = self._call("nvml_device", pynvml.nvmlDeviceGetHandleByIndex, index)
            uuid: str = self._call("nvml_device", pynvml.nvmlDeviceGetUUID, handle)
        except pynvml.NVMLError as err:
            # Without a handle and a uuid there is nothing to label the GPU with.
            self._raise_if_gone(index, "nvml_device", err)
            raise _DeviceGone(f"GPU {index}: {err}") from None
        identity = self._identity(index, uuid, handle, errors)
        read = self._field(index, "memory", errors, lambda: self._memory(handle))
        memory, memory_v2 = (None, True) if read is None else read
        util = self._field(
            index,
            "utilization",
            errors,
            lambda: self._call("nvml_device", pynvml.nvmlDeviceGetUtilizationRates, handle),
        )
        temp = self._field(index, "temperature", errors, lambda: self._temperature(handle))
        power_mw = self._field(
            index,
            "power",
            errors,
            lambda: self._call("nvml_device", pynvml.nvmlDeviceGetPowerUsage, handle),
        )
        holders = self._holders(index, uuid, handle, errors)
        busy = self._use(index, uuid, handle) if self._process_utilization else None
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
        )
        return gpu, holders or []

    def _identity(
        self, index: int, uuid: str, handle: Any, errors: list[tuple[str, str]]
    ) -> GpuIdentity:
        """Model, device node and PCI address: NVML calls on the first scan that sees this
        GPU only, so labels that never change cost nothing per scan. Each field falls back
        alone: a failed read leaves that label empty (and is tried again next scan), never
        the GPU unreported."""
        known = self._identities.get(uuid)
        if known is not None and not known.unsettled:
            return known
        values: dict[str, str | None] = {} if known is None else {
            "name": known.name, "minor": known.device, "pci": known.pci_bus_id}
        reads: dict[str, Callable[[], Any]] = {
            "name": lambda: self._call("nvml_device", pynvml.nvmlDeviceGetName, handle),
            "minor": lambda: _device_node(
                self._call("nvml_device", pynvml.nvmlDeviceGetMinorNumber, handle)),
            "pci": lambda: _bus_id(
                self._call("nvml_device", pynvml.nvmlDeviceGetPciInfo, handle).busId),
        }
        unsettled: set[str] = set()
        for what, read in reads.items():
            if known is not None and what not in known.unsettled:
                continue
            before = len(errors)
            values[what] = self._field(index, what, errors, read)
            if len(errors) > before:
                unsettled.add(what)
        identity = GpuIdentity(name=values["name"], device=values["minor"],
                               pci_bus_id=values["pci"], unsettled=frozenset(unsettled))
        self._identities[uuid] = identity
        return identity

    def _field(
        self, index: int, what: str, errors: list[tuple[str, str]], get: Callable[[], T]
    ) -> T | None:
        """One gauge: None when unsupported or the driver lacks the call (no error), or
        failing (with an error)."""
        try:
            return get()
        except pynvml.NVMLError as err:
            if err.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                return None
            self._raise_if_gone(index, "nvml_device", err)
            errors.append(("nvml_device", f"GPU {index}: {what}: {err}"))
            return None

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
            self._raise_if_gone(index, "nvml_processes", err)
            errors.append(("nvml_processes", f"GPU {index}: {err}"))
            return None
        return _merge_holders(index, uuid, compute, graphics)

    def _use(self, index: int, uuid: str, handle: Any) -> frozenset[int] | None:
        """The pids that used this GPU since its previous read; None when NVML cannot say.

        One call per GPU per read: R550's call where the GPU answers it, else the legacy
        one (a NOT_SUPPORTED or missing call is not asked again until NVML is initialised
        anew). NVML keeps samples only for processes that used something, and the legacy
        call answers NOT_FOUND when there are none: that is zero use, not an error, unless
        the wall clock stepped since the mark (then the read says nothing and the mark
        starts again at the new wall time). Errors are logged once per GPU and code and
        leave the answer unknown; they are not scan errors (a reap that does not ask for
        idleness must not be refused).
        """
        calls = self._use_calls.setdefault(uuid, (USE_INFO, USE_LEGACY))
        if not calls:
            return None  # neither call answers on this GPU: the MIG mode changes nothing
        mig = self._mig(index, uuid, handle)
        if mig is not False:  # on, or NVML cannot say: samples would not be per process
            return None
        wall, boot = self._wall(), self._boot()
        mark = self._marks.get(uuid)
        if mark is not None and mark.stepped(wall, boot):
            self._stepped(index, uuid, wall, boot)
            return None
        since = 0 if mark is None else mark.since_us
        while calls:
            fn = getattr(pynvml, calls[0])
            try:
                samples = self._call("nvml_processes", fn, handle, since)
            except pynvml.NVMLError as err:
                if err.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_SUCCESS):
                    samples = []  # no sample newer than `since`: nobody used anything
                elif err.value in _USE_REFUSED:
                    calls = self._use_calls[uuid] = calls[1:]
                    continue
                else:
                    self._raise_if_gone(index, "nvml_processes", err)
                    self._warn_use(index, uuid, calls[0], err.value, str(err))
                    return None
            after_wall, after_boot = self._wall(), self._boot()
            if SampleMark(since, wall - boot).stepped(after_wall, after_boot):
                self._stepped(index, uuid, after_wall, after_boot)  # during the call
                return None
            self._marks[uuid] = next_mark(since, (int(s.timeStamp) for s in samples),
                                          after_wall, after_boot)
            return frozenset(int(s.pid) for s in samples if _used(s))
        return None  # neither call: MIG, vGPU, or a GPU too old to sample processes

    def _stepped(self, index: int, uuid: str, wall: float, boot: float) -> None:
        """A wall-clock step: this GPU's read says nothing (its holders' idleness is
        unknown, so their clocks restart) and its mark starts again at the new wall time."""
        self._marks[uuid] = rebased_mark(wall, boot)
        offset = wall - boot
        if (self._step_warned is None
                or abs(offset - self._step_warned) > STEP_TOLERANCE_SECONDS):
            self._step_warned = offset
            log.warning("GPU %d: the wall clock stepped (wall minus boot clock now %.3f s): "
                        "per-process utilization unknown for one read, idle clocks restart",
                        index, offset)

    def _mig(self, index: int, uuid: str, handle: Any) -> bool | None:
        """Whether MIG is on (current or pending mode) on this GPU; None when NVML cannot
        say. Neither utilization call gives per-process samples under MIG, and what one
        would answer there (NOT_FOUND reads as "nobody used the GPU") must not make a busy
        job idle, so the mode is asked on every read rather than left to the driver. A
        GPU or driver without MIG (NOT_SUPPORTED, no such call) is not asked again."""
        if uuid in self._no_mig:
            return False
        try:
            current, pending = self._call("nvml_device", pynvml.nvmlDeviceGetMigMode, handle)
        except pynvml.NVMLError as err:
            if err.value in (pynvml.NVML_ERROR_NOT_SUPPORTED,
                             pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                self._no_mig.add(uuid)
                return False
            self._raise_if_gone(index, "nvml_device", err)
            self._warn_use(index, uuid, "mig", err.value, f"MIG mode unknown: {err}")
            return None
        on = pynvml.NVML_DEVICE_MIG_ENABLE in (current, pending)
        if on:
            self._warn_use(index, uuid, "mig", -1, "MIG mode: NVML gives no per-process samples")
        return on

    def _warn_use(self, index: int, uuid: str, call: str, code: int, why: str) -> None:
        """Once per GPU, call and `code`: why per-process utilization is unknown there."""
        if (uuid, call, code) not in self._use_warned:
            self._use_warned.add((uuid, call, code))
            log.warning("GPU %d: per-process utilization unavailable: %s", index, why)

    @staticmethod
    def _raise_if_gone(index: int, stage: str, err: pynvml.NVMLError) -> None:
        if err.value in _DRIVER_GONE:
            raise _DriverGone(stage, f"GPU {index}: {err}") from None
        if err.value in _DEVICE_GONE:
            raise _DeviceGone(f"GPU {index}: {err}") from None


def _used(sample: Any) -> bool:
    """Whether one utilization sample shows use: SM, memory controller (copies), encoder
    or decoder above 0, and R550's JPEG and optical-flow engines where the struct has
    them. A job busy only copying or on NVENC/NVDEC is not idle."""
    return any(int(getattr(sample, name, 0)) > 0
               for name in ("smUtil", "memUtil", "encUtil", "decUtil", "jpgUtil", "ofaUtil"))


def _device_node(minor: int) -> str:
    """/dev/nvidiaN's name, as dcgm-exporter's `device` label spells it."""
    return f"nvidia{int(minor)}"


def _bus_id(raw: bytes | str) -> str | None:
    """nvmlPciInfo_t.busId ("00000000:3B:00.0", the form dcgm-exporter labels with)."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    return text.strip("\x00 ") or None


def _merge_holders(
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
