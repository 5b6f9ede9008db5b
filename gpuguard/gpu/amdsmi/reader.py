"""AmdSmi: one pass over AMD SMI becomes a GpuReading (the library's lifetime, each GPU's
gauges, its processes checked against /proc), and the reset of one GPU."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.gpu.amdsmi.kfd import KFD
from gpuguard.gpu.amdsmi.library import load
from gpuguard.gpu.amdsmi.listing import Listing
from gpuguard.gpu.amdsmi.pids import Identity, busy
from gpuguard.gpu.reading import GpuReading, GpuSample, NotHolding
from gpuguard.gpu.source import ResetError
from gpuguard.host.procfs import PROC, boottime, other_users_problem
from gpuguard.orphans.process import Holder, ProcUnreadable

log = logging.getLogger("gpuguard.gpu.amdsmi")

T = TypeVar("T")
MIB = 2**20
#: The vendor label of every GPU this back-end reads.
VENDOR = "amd"
#: Serialises every AMD SMI call in the process (the scan, the remediator's watches).
LOCK = threading.Lock()
#: What the wrapper answers for a figure the GPU does not report.
NA = "N/A"

#: Status codes that mean the library as a whole is unusable: down, initialised again.
LIBRARY_GONE = frozenset({4, 5, 18, 32, 34, 51})  # FAIL_LOAD_MODULE, _SYMBOL, INIT_ERROR,
#                                                    NOT_INIT, DRIVER_NOT_LOADED, NO_DRV
#: Status codes that mean one GPU is unusable: skipped, the others read.
GPU_GONE = frozenset({31, 54})  # NOT_FOUND, AMDGPU_RESTART_ERR
#: A figure this GPU does not give: None, no error.
UNSUPPORTED = frozenset({2, 3, 40})  # NOT_SUPPORTED, NOT_YET_IMPLEMENTED, NO_DATA
NO_PERM = 10


class LibraryGone(Exception):
    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage, self.message = stage, message


class GpuGone(Exception):
    pass


def code_of(err: Exception) -> int | None:
    code = getattr(err, "err_code", None)
    return code if isinstance(code, int) else None


def words(err: Exception) -> str:
    """An AMD SMI failure in one line (the wrapper's own text spans lines)."""
    info = getattr(err, "err_info", None)
    return str(info).split(" - ")[0] if info else f"{type(err).__name__}: {err}"


def value(raw: Any) -> float | None:
    """A figure as the wrapper gives it: a number, or N/A."""
    return None if raw == NA or raw is None else float(raw)


class AmdSmi:
    """Reads AMD GPUs and the processes AMD SMI lists on them, each checked against /proc;
    safe to call from several threads (one lock per process)."""

    def __init__(self, counters: Counters = COUNTERS, *, process_utilization: bool = True,
                 wall: Callable[[], float] | None = None,
                 boot: Callable[[], float] | None = None, proc_root: str = PROC,
                 kfd_path: str = KFD) -> None:
        """`process_utilization` False: no busy pids (readers that keep no idle clock).
        `boot` dates each listing (the pid checks); `wall` is not used: AMD SMI's engine
        time is a counter, compared between this reader's reads, not a dated sample.
        `kfd_path`: the KFD device every listed holder must have open, where it exists."""
        del wall
        #: The wrapper, bound to the library now (it raises where there is none: the
        #: probe, AmdSmiSource, makes no reader before it finds one).
        self._smi = load()
        self._counters = counters
        self._process_utilization = process_utilization
        self._listing = Listing(counters, boot if boot is not None else boottime, proc_root,
                                kfd_path)
        self._initialised = False
        self._warned = False
        self._identities: dict[str, tuple[str | None, str | None, str | None]] = {}
        #: Per GPU: each holder's gfx engine time (ns) at the last read.
        self._gfx: dict[str, dict[Identity, int]] = {}
        #: Engine time is read from /proc/PID/fdinfo by the library: a caller short of the
        #: rights to read another user's shows it as 0, which must not read as idle.
        self._engine_blind = other_users_problem() is not None
        self._handles: dict[str, Any] = {}

    # -- the library's lifetime ----------------------------------------------------------

    def read(self) -> GpuReading:
        """One pass: initialise if needed, then every GPU's gauges and holders."""
        with LOCK:
            try:
                if not self._initialised:
                    self._call("amdsmi_init", self._smi.amdsmi_init, stage="amdsmi_init")
                    self._initialised = True
                    if self._warned:
                        log.info("AMD SMI available again")
                        self._warned = False
                return self._read_gpus()
            except LibraryGone as gone:
                self._drop()
                if not self._warned:
                    log.warning("AMD SMI unavailable (%s: %s); retrying on every scan",
                                gone.stage, gone.message)
                    self._warned = True
                return GpuReading(False, None, (), (), ((gone.stage, gone.message),))

    def close(self) -> None:
        with LOCK:
            self._drop()

    def _drop(self) -> None:
        if self._initialised:
            try:
                self._counted("amdsmi_init", self._smi.amdsmi_shut_down)
            except Exception:  # already unusable: all we want is a fresh init next time
                pass
        self._initialised = False
        self._identities.clear()
        self._handles.clear()
        self._gfx.clear()  # a driver that comes back may count from 0 again

    def _counted(self, callsite: str, fn: Callable[..., T], *args: Any) -> T:
        with self._counters.track(callsite):
            return fn(*args)

    def _call(self, callsite: str, fn: Callable[..., T], *args: Any, stage: str) -> T:
        """One call, counted; a status that costs the library raises LibraryGone."""
        try:
            return self._counted(callsite, fn, *args)
        except self._smi.AmdSmiException as err:
            if code_of(err) in LIBRARY_GONE or stage == "amdsmi_init":
                raise LibraryGone(stage, words(err)) from None
            raise

    # -- one pass ----------------------------------------------------------------------

    def _read_gpus(self) -> GpuReading:
        try:
            handles = self._call("amdsmi_device", self._smi.amdsmi_get_processor_handles,
                                 stage="amdsmi_device")
        except self._smi.AmdSmiException as err:
            raise LibraryGone("amdsmi_device", f"processor handles: {words(err)}") from None
        self._listing.begin_pass()
        gpus: list[GpuSample] = []
        holders: list[Holder] = []
        errors: list[tuple[str, str]] = []
        self._handles = {}
        for index, handle in enumerate(handles):
            gpu_errors: list[tuple[str, str]] = []
            try:
                gpu, gpu_holders = self._read_gpu(index, handle, gpu_errors)
            except GpuGone as gone:
                errors.append(("amdsmi_device", str(gone)))
                continue
            gpus.append(gpu)
            holders.extend(gpu_holders)
            errors.extend(gpu_errors)
            self._handles[gpu.uuid] = handle
        for uuid in set(self._gfx) - set(self._handles):  # forget the GPUs no longer read
            del self._gfx[uuid]
        self._listing.end_pass(set(self._handles))
        driver = next((g.driver_version for g in gpus if g.driver_version), None)
        return GpuReading(True, driver, tuple(gpus), tuple(holders), tuple(errors))

    def _field(self, index: int, what: str, errors: list[tuple[str, str]],
               get: Callable[[], T]) -> T | None:
        """One figure: None where the GPU does not give it (no error) or the call failed
        (an error); a GPU gone raises GpuGone."""
        try:
            return get()
        except self._smi.AmdSmiException as err:
            code = code_of(err)
            if code in UNSUPPORTED:
                return None
            if code in GPU_GONE:
                raise GpuGone(f"GPU {index}: {what}: {words(err)}") from None
            errors.append(("amdsmi_device", f"GPU {index}: {what}: {words(err)}"))
            return None

    def _read_gpu(self, index: int, handle: Any,
                  errors: list[tuple[str, str]]) -> tuple[GpuSample, list[Holder]]:
        try:
            uuid: str = self._call("amdsmi_device", self._smi.amdsmi_get_gpu_device_uuid,
                                   handle, stage="amdsmi_device")
        except self._smi.AmdSmiException as err:  # nothing to label the GPU with
            raise GpuGone(f"GPU {index}: uuid: {words(err)}") from None
        name, pci, driver = self._identity(index, uuid, handle, errors)

        def device(fn: Callable[..., T], *args: Any) -> Callable[[], T]:
            return lambda: self._call("amdsmi_device", fn, handle, *args, stage="amdsmi_device")

        smi = self._smi
        vram = self._field(index, "VRAM", errors, device(smi.amdsmi_get_gpu_vram_usage))
        activity = self._field(index, "activity", errors, device(smi.amdsmi_get_gpu_activity))
        temp = self._field(index, "temperature", errors, lambda: self._temperature(handle))
        power = self._field(index, "power", errors, device(smi.amdsmi_get_power_info))
        listed = self._processes(index, handle, errors)
        holders: list[Holder] = []
        not_holding: list[NotHolding] = []
        previous = gfx = None  # no list, no busy pids: what is remembered stays
        if listed is not None:
            holders, not_holding, gfx = self._listing.check(index, uuid, listed)
            previous, self._gfx[uuid] = self._gfx.get(uuid), gfx
        total = value(vram["vram_total"]) if vram else None
        used = value(vram["vram_used"]) if vram else None
        gfx_pct = value(activity["gfx_activity"]) if activity else None
        watts = None
        if power:
            watts = value(power["current_socket_power"]) or value(power["average_socket_power"])
        gpu = GpuSample(
            index=index, uuid=uuid, name=name,
            memory_total_bytes=None if total is None else int(total * MIB),
            memory_used_bytes=None if used is None else int(used * MIB),
            utilization_ratio=None if gfx_pct is None else gfx_pct / 100,
            temperature_celsius=temp, power_watts=watts,
            processes_listed=listed is not None,
            busy_pids=(busy(previous, gfx) if gfx is not None and self._process_utilization
                       and not self._engine_blind else None),
            pci_bus_id=pci, vendor=VENDOR, driver_version=driver,
            not_holding=tuple(not_holding))
        return gpu, holders

    def _identity(self, index: int, uuid: str, handle: Any, errors: list[tuple[str, str]]
                  ) -> tuple[str | None, str | None, str | None]:
        """The GPU's model, PCI address and driver version: read once per initialisation
        (again on the next read where a call failed)."""
        known = self._identities.get(uuid)
        if known is not None:
            return known
        failed: list[tuple[str, str]] = []

        def get(fn: Callable[..., T]) -> T | None:
            return self._field(index, fn.__name__, failed, lambda: self._call(
                "amdsmi_device", fn, handle, stage="amdsmi_device"))

        asic = get(self._smi.amdsmi_get_gpu_asic_info)
        pci = get(self._smi.amdsmi_get_gpu_device_bdf)
        info = get(self._smi.amdsmi_get_gpu_driver_info)
        name = asic.get("market_name") if isinstance(asic, dict) else None
        driver = info.get("driver_version") if isinstance(info, dict) else None
        found = (None if name == NA else name, pci if isinstance(pci, str) else None,
                 None if driver == NA else driver)
        errors.extend(failed)
        if not failed:
            self._identities[uuid] = found
        return found

    def _temperature(self, handle: Any) -> float | None:
        """The edge sensor, else the hotspot (MI300 has no edge sensor)."""
        smi = self._smi
        metric = smi.AmdSmiTemperatureMetric.CURRENT
        for sensor in (smi.AmdSmiTemperatureType.EDGE, smi.AmdSmiTemperatureType.HOTSPOT):
            try:
                return float(self._call("amdsmi_device", smi.amdsmi_get_temp_metric, handle,
                                        sensor, metric, stage="amdsmi_device"))
            except smi.AmdSmiException as err:
                if code_of(err) not in UNSUPPORTED:
                    raise
        return None

    def _processes(self, index: int, handle: Any,
                   errors: list[tuple[str, str]]) -> list[dict[str, Any]] | None:
        """The process list; None on error, since half a list misleads."""
        try:
            return list(self._call("amdsmi_processes", self._smi.amdsmi_get_gpu_process_list,
                                   handle, stage="amdsmi_processes"))
        except self._smi.AmdSmiException as err:
            if code_of(err) in GPU_GONE:
                raise GpuGone(f"GPU {index}: processes: {words(err)}") from None
            hint = (" (other users' processes need root)" if code_of(err) == NO_PERM else "")
            errors.append(("amdsmi_processes", f"GPU {index}: {words(err)}{hint}"))
            return None

    # -- reset -------------------------------------------------------------------------

    def reset(self, uuid: str) -> None:
        """amdsmi_reset_gpu on the GPU of `uuid`, as this reader last read it; refused when
        the library lists, on any GPU it read (a reset may take the GPU's whole XGMI hive),
        a process that /proc shows now and that may hold a GPU (Listing.blocking): a last
        check, after the caller's own on a fresh read."""
        with LOCK:
            handle = self._handles.get(uuid) if self._initialised else None
            if handle is None:
                raise ResetError(f"no AMD GPU {uuid} in the last reading", refused=True)
            try:
                pids = [int(e["pid"]) for other in self._handles.values() for e in self._call(
                    "amdsmi_processes", self._smi.amdsmi_get_gpu_process_list, other,
                    stage="amdsmi_processes")]
                live = self._listing.blocking(pids)
            except (self._smi.AmdSmiException, LibraryGone, ProcUnreadable) as err:
                raise ResetError(f"cannot list the GPUs' processes: {err}", refused=True
                                 ) from None
            if live:
                raise ResetError(f"AMD SMI lists live pid(s) {live} on its GPUs", refused=True)
            try:
                self._call("amdsmi_device", self._smi.amdsmi_reset_gpu, handle,
                           stage="amdsmi_device")
            except (self._smi.AmdSmiException, LibraryGone) as err:
                text = err.message if isinstance(err, LibraryGone) else words(err)
                raise ResetError(f"amdsmi_reset_gpu failed: {text}", refused=False) from None
            log.warning("GPU %s reset through amdsmi_reset_gpu", uuid)
