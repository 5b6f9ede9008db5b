"""Per-callsite cost counters for our own /proc reads and NVML calls.

The whole point of gpuguard is to be cheap on busy hosts, so its own cost is a
metric: every /proc read and NVML call goes through `Counters.track` with a
callsite from a fixed set, which keeps the label set bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Every callsite that may be tracked. A fixed set keeps label cardinality bounded
#: and makes a typo an immediate error instead of a silent new series.
CALLSITES: tuple[str, ...] = (
    "proc_stat",  # /proc/PID/stat: identity, ppid, sid, pgid, state
    "proc_status",  # /proc/PID/status: SigIgn, NSpid
    "proc_cmdline",  # /proc/PID/cmdline: protect patterns
    "proc_cgroup",  # /proc/PID/cgroup: managed-service check
    "proc_environ",  # /proc/PID/environ: GPUGUARD_KEEP marker
    "marks",  # a keep or run registration (gpuguard/host/marks.py): lstat + read, not in /proc
    "proc_fd",  # /proc/PID/cwd and /proc/PID/fd/0: detached-daemon check
    "proc_children",  # /proc/PID/task/TID/children: descendants of an orphan root
    "proc_task_stat",  # /proc/PID/task/TID/stat: the reaper's check that every thread stopped
    "protect_match",  # protect patterns (RE2) on a comm or command line not matched before
    "proc_list",  # the /proc listing of the unlisted-holder search (only with memory unattributed)
    "proc_fd_search",  # /proc/PID/fd listed and its entries stat()ed by that search
    "drm_list",  # the /proc listing of the DRM client search (only where a DRM device is read)
    "drm_fd_search",  # /proc/PID/fd listed and its entries stat()ed by that search, and stat
    "drm_fdinfo",  # /proc/PID/fdinfo/FD of known DRM clients, and their stat (identity)
    "drm_sysfs",  # /dev/dri and /sys reads of the DRM back-end (no /proc read)
    "nvml_init",
    "nvml_device",  # per-GPU gauges: memory, utilization, temperature, power, name, MIG mode
    "nvml_processes",  # running compute/graphics processes; per-process utilization samples
    "amdsmi_init",  # AMD SMI's init and shut-down
    "amdsmi_device",  # per-GPU gauges and identity: VRAM, activity, temperature, power, reset
    "amdsmi_processes",  # amdsmi_get_gpu_process_list
    "amdsmi_kfd",  # /proc/PID/fd of a pid AMD SMI lists listed and stat()ed to find /dev/kfd
)


@dataclass(frozen=True)
class CallsiteCost:
    calls: int
    seconds: float
    proc_reads: int


class Counters:
    """Thread-safe accumulator: calls, seconds and /proc reads per callsite."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = dict.fromkeys(CALLSITES, 0)
        self._seconds = dict.fromkeys(CALLSITES, 0.0)
        self._reads = dict.fromkeys(CALLSITES, 0)

    @contextmanager
    def track(self, callsite: str, *, proc_reads: int = 0) -> Iterator[None]:
        """Count one call at `callsite`, its wall time, and the /proc reads it makes."""
        if callsite not in self._calls:
            raise KeyError(f"unknown callsite {callsite!r}")
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._calls[callsite] += 1
                self._seconds[callsite] += elapsed
                self._reads[callsite] += proc_reads

    def add(self, callsite: str, *, seconds: float, proc_reads: int) -> None:
        """Record one call whose read count is only known once it is done."""
        with self._lock:
            self._calls[callsite] += 1
            self._seconds[callsite] += seconds
            self._reads[callsite] += proc_reads

    def snapshot(self) -> dict[str, CallsiteCost]:
        with self._lock:
            return {
                c: CallsiteCost(self._calls[c], self._seconds[c], self._reads[c])
                for c in CALLSITES
            }

    def proc_reads(self) -> int:
        with self._lock:
            return sum(self._reads.values())


#: The process-wide instance used by procfs.py and nvml/ unless one is injected.
COUNTERS = Counters()
