"""Per-process GPU memory under WDDM, where NVML cannot size it.

Under the Windows display driver model (every consumer card, and data-centre cards not
switched to TCC) NVML lists the processes on a GPU but gives "not available" for their
memory (pynvml: usedGpuMemory None). Windows itself counts each process's memory on each
adapter: the performance counter `\\GPU Process Memory(*)\\Dedicated Usage`, one
instance per process and adapter, named `pid_1234_luid_0x00000000_0x0000D1A5_phys_0`
(engine counters add `_eng_0_engtype_3D`). It is read here through PDH (pdh.dll over
ctypes, touched only when called: importable on Linux) and summed per (pid, adapter).

An adapter is a LUID, which NVML does not report; a GPU is matched to one only where that
is certain (the one adapter all its holders have memory on), or by a mapping given.
Where the counters are absent (Wine, a stripped-down Windows, a disabled counter) the
figure stays absent (None), never 0, and one warning says so.

The counters are Windows', not a GPU vendor's: WddmMemory is the Windows back-end's
Platform.process_gpu_memory, which the GPU seam applies to any vendor's reading
(gpuguard/gpu/os_memory.py); this module never imports the GPU seam.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuguard.host.windows.winapi import dll
from gpuguard.orphans.process import Holder

log = logging.getLogger(__name__)

#: The counter read, by its English name (PdhAddEnglishCounterW: any display language).
COUNTER_PATH = r"\GPU Process Memory(*)\Dedicated Usage"
PDH_FMT_LARGE = 0x00000400
PDH_MORE_DATA = 0x800007D2
#: PdhCollectQueryData's answer when the wildcard has no instance at all (no process has
#: memory on any adapter): an empty reading, not a failure.
PDH_NO_DATA = 0x800007D5
PDH_CSTATUS_VALID_DATA = 0x00000000
PDH_CSTATUS_NEW_DATA = 0x00000001
#: How often a formatted array is asked again when instances appear between the size
#: query and the read.
MORE_DATA_RETRIES = 4

_INSTANCE = re.compile(  # ASCII digits, bounded: `\d` alone takes any script's, unbounded
    r"^pid_(?P<pid>[0-9]{1,10})_luid_(?P<high>0x[0-9A-Fa-f]{1,8})_(?P<low>0x[0-9A-Fa-f]{1,8})"
    r"_phys_(?P<phys>[0-9]{1,10})(?:_|$)")


@dataclass(frozen=True)
class Instance:
    """What a counter instance name says: whose memory, on which adapter."""

    pid: int
    luid: int  # (HighPart << 32) | LowPart
    phys: int


def parse_instance(name: str) -> Instance | None:
    """`pid_1234_luid_0x00000000_0x0000D1A5_phys_0[_eng_0_engtype_3D]`; None for any other
    shape (the counter's own `_Total`, a format a later Windows may use)."""
    match = _INSTANCE.match(name)
    if match is None:
        return None
    return Instance(int(match["pid"]), (int(match["high"], 16) << 32) | int(match["low"], 16),
                    int(match["phys"]))


@dataclass(frozen=True)
class WddmUsage:
    """Dedicated GPU memory in bytes per (pid, adapter LUID), as read at one moment."""

    by_pid_luid: Mapping[tuple[int, int], int]

    def per_pid(self) -> dict[int, int]:
        """Each process's dedicated memory summed over every adapter."""
        out: dict[int, int] = {}
        for (pid, _luid), used in self.by_pid_luid.items():
            out[pid] = out.get(pid, 0) + used
        return out

    def luids(self) -> frozenset[int]:
        return frozenset(luid for _pid, luid in self.by_pid_luid)


def usage_of(items: Iterable[tuple[str, int]]) -> WddmUsage:
    """Counter instances (name, bytes) summed per (pid, LUID): one process may have
    several instances on one adapter (its physical segments); names of another shape
    and negative values (a counter's error) count for nobody."""
    sums: dict[tuple[int, int], int] = {}
    for name, value in items:
        found = parse_instance(name)
        if found is None or value < 0:
            continue
        key = (found.pid, found.luid)
        sums[key] = sums.get(key, 0) + int(value)
    return WddmUsage(sums)


def gpu_luids(holders: Iterable[Holder], usage: WddmUsage) -> dict[str, int]:
    """The adapter LUID of each GPU `holders` are on, where it is certain: the one adapter
    on which every holder the GPU's library lists on that GPU has an instance (a graphics
    process may also use the integrated GPU; a GPU process has an instance on its own
    adapter; a holder with no instance at all says nothing), and no other GPU's. A GPU
    with no holders, or with several such adapters or none, is not matched: a wrong
    match would hand one adapter's memory to another GPU's processes."""
    on: dict[int, set[int]] = {}
    for pid, luid in usage.by_pid_luid:
        on.setdefault(pid, set()).add(luid)
    candidates: dict[str, set[int]] = {}
    for holder in holders:
        luids = on.get(holder.pid)
        if luids is None:
            continue  # no instance anywhere (no allocation yet): no evidence either way
        found = candidates.get(holder.gpu_uuid)
        candidates[holder.gpu_uuid] = set(luids) if found is None else found & luids
    unique = {uuid: next(iter(c)) for uuid, c in candidates.items() if len(c) == 1}
    taken = list(unique.values())
    return {uuid: luid for uuid, luid in unique.items() if taken.count(luid) == 1}


def attribute(holders: tuple[Holder, ...], usage: WddmUsage | None,
              luids: Mapping[str, int] | None = None) -> tuple[Holder, ...]:
    """`holders` with each one its GPU's library could not size (used_bytes None) given
    its WDDM figure on its GPU's adapter; `luids` (GPU uuid -> LUID) overrides gpu_luids().
    `holders` itself when no adapter is known (no counters, no match).

    A holder the library sized keeps its figure; one with no instance on its adapter, or on a
    GPU whose adapter is not known, stays None. The unattributed memory of a GPU
    (gpuguard/engine/scan/accounting.py: used minus what its holders hold) then follows,
    as on Linux, once every holder of it has a figure.
    """
    if usage is None:
        return holders
    mapping = dict(luids) if luids is not None else gpu_luids(holders, usage)
    if not mapping:
        return holders
    sized = []
    for holder in holders:
        luid = mapping.get(holder.gpu_uuid)
        if holder.used_bytes is None and luid is not None:
            holder = dataclasses.replace(holder,
                                         used_bytes=usage.by_pid_luid.get((holder.pid, luid)))
        sized.append(holder)
    return tuple(sized)


# -- PDH -------------------------------------------------------------------------------


class _Value(ctypes.Union):
    _fields_ = [("longValue", ctypes.c_int32), ("doubleValue", ctypes.c_double),
                ("largeValue", ctypes.c_int64), ("AnsiStringValue", ctypes.c_char_p),
                ("WideStringValue", ctypes.c_wchar_p)]


class PDH_FMT_COUNTERVALUE(ctypes.Structure):  # noqa: N801 (the Windows name)
    _fields_ = [("CStatus", ctypes.c_uint32), ("value", _Value)]


class PDH_FMT_COUNTERVALUE_ITEM_W(ctypes.Structure):  # noqa: N801
    _fields_ = [("szName", ctypes.c_wchar_p), ("FmtValue", PDH_FMT_COUNTERVALUE)]


@functools.cache
def _pdh() -> Any:
    pdh = dll("pdh")
    status, handle, dword = ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32
    pdh.PdhOpenQueryW.restype = status
    pdh.PdhOpenQueryW.argtypes = [ctypes.c_wchar_p, ctypes.c_size_t, ctypes.POINTER(handle)]
    pdh.PdhAddEnglishCounterW.restype = status
    pdh.PdhAddEnglishCounterW.argtypes = [handle, ctypes.c_wchar_p, ctypes.c_size_t,
                                          ctypes.POINTER(handle)]
    pdh.PdhCollectQueryData.restype = status
    pdh.PdhCollectQueryData.argtypes = [handle]
    pdh.PdhGetFormattedCounterArrayW.restype = status
    pdh.PdhGetFormattedCounterArrayW.argtypes = [handle, dword, ctypes.POINTER(dword),
                                                 ctypes.POINTER(dword), ctypes.c_void_p]
    pdh.PdhCloseQuery.restype = status
    pdh.PdhCloseQuery.argtypes = [handle]
    return pdh


class PdhError(OSError):
    """A PDH call answered a status other than success."""

    def __init__(self, call: str, status: int) -> None:
        super().__init__(f"{call} failed with PDH status 0x{status & 0xFFFFFFFF:08X}")
        self.status = status


def _check(call: str, status: int) -> None:
    if status != 0:
        raise PdhError(call, status)


class WddmCounters:
    """The `Dedicated Usage` counters through one PDH query, opened on the first read and
    kept. `read()` is None while they cannot be read, with one warning for the first
    failure (and one info line once they can be read again)."""

    def __init__(self, path: str = COUNTER_PATH) -> None:
        self.path = path
        self._query: Any = None
        self._counter: Any = None
        self._lock = threading.Lock()
        self._warned = False

    def read(self) -> WddmUsage | None:
        with self._lock:
            try:
                if self._counter is None:
                    self._open()
                usage = usage_of(self._collect())
            except OSError as exc:  # PdhError, no pdh.dll (not Windows), a failed load
                self._close()
                if not self._warned:
                    log.warning("WDDM per-process GPU memory (%s) unavailable: %s; GPU "
                                "memory NVML cannot size stays absent", self.path, exc)
                    self._warned = True
                return None
            if self._warned:
                log.info("WDDM per-process GPU memory (%s) readable again", self.path)
                self._warned = False
            return usage

    def close(self) -> None:
        with self._lock:
            self._close()

    def _open(self) -> None:
        pdh = _pdh()
        query, counter = ctypes.c_void_p(), ctypes.c_void_p()
        _check("PdhOpenQueryW", pdh.PdhOpenQueryW(None, 0, ctypes.byref(query)))
        self._query = query
        _check(f"PdhAddEnglishCounterW({self.path})",
               pdh.PdhAddEnglishCounterW(query, self.path, 0, ctypes.byref(counter)))
        self._counter = counter

    def _close(self) -> None:
        if self._query is not None:
            try:
                _pdh().PdhCloseQuery(self._query)
            except OSError:
                pass
        self._query = self._counter = None

    def _collect(self) -> list[tuple[str, int]]:
        """One collection; the counter's instances as (name, bytes), valid ones only."""
        pdh = _pdh()
        collected = pdh.PdhCollectQueryData(self._query)
        if collected == PDH_NO_DATA:
            return []
        _check("PdhCollectQueryData", collected)
        for _ in range(MORE_DATA_RETRIES):
            size, count = ctypes.c_uint32(0), ctypes.c_uint32(0)
            status = pdh.PdhGetFormattedCounterArrayW(self._counter, PDH_FMT_LARGE,
                                                      ctypes.byref(size), ctypes.byref(count),
                                                      None)
            if status == 0 and count.value == 0:
                return []
            if status != PDH_MORE_DATA:
                _check("PdhGetFormattedCounterArrayW", status)
            buffer = (ctypes.c_byte * max(size.value, 1))()
            status = pdh.PdhGetFormattedCounterArrayW(self._counter, PDH_FMT_LARGE,
                                                      ctypes.byref(size), ctypes.byref(count),
                                                      buffer)
            if status == PDH_MORE_DATA:
                continue  # an instance appeared in between: ask for the size again
            _check("PdhGetFormattedCounterArrayW", status)
            items = ctypes.cast(buffer, ctypes.POINTER(PDH_FMT_COUNTERVALUE_ITEM_W))
            return [(items[i].szName or "", int(items[i].FmtValue.value.largeValue))
                    for i in range(count.value)
                    if items[i].FmtValue.CStatus in (PDH_CSTATUS_VALID_DATA,
                                                     PDH_CSTATUS_NEW_DATA)]
        raise PdhError("PdhGetFormattedCounterArrayW (instances kept changing)", PDH_MORE_DATA)


class WddmMemory:
    """WDDM's per-process memory for the holders a GPU's library lists unsized
    (attribute()): the Windows back-end's Platform.process_gpu_memory (a
    gpuguard.host.backend.ProcessGpuMemory). `wddm` and `luids`: the counters read and a
    GPU uuid -> LUID mapping, where given (tests; a host whose adapters are known)."""

    def __init__(self, *, wddm: WddmCounters | None = None,
                 luids: Mapping[str, int] | None = None) -> None:
        self.wddm = wddm if wddm is not None else WddmCounters()
        self.luids = luids

    def size(self, holders: tuple[Holder, ...]) -> tuple[Holder, ...]:
        return attribute(holders, self.wddm.read(), self.luids)

    def close(self) -> None:
        self.wddm.close()
