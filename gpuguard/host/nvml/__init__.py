"""The only package that imports pynvml: one pass over NVML becomes an NvmlReading.

NVML fails in pieces on real hosts: the driver is not loaded yet, one GPU falls
off the bus, a consumer card does not report power. A scan must report what it
can and say what failed, so every call has a fallback: a field becomes None, a
lost GPU is skipped, and only a dead library marks the whole reading down (and
is initialised again on the next read, so a driver that appears later is used).

By concept: `reading` (what a pass gives), `failures` (what a failure costs, the one
lock), `reader` (Nvml: the library's lifetime and the pass), `identity` (each GPU's
labels, read once), `utilization` (who used a GPU since the last read, for the idle
clocks). Every module logs as `gpuguard.host.nvml`.
"""

from __future__ import annotations

from gpuguard.host.nvml.reader import Nvml, merge_holders
from gpuguard.host.nvml.reading import GpuIdentity, GpuSample, NvmlReading
from gpuguard.host.nvml.utilization import USE_INFO, USE_LEGACY

#: The name tests and older callers know merge_holders by.
_merge_holders = merge_holders

__all__ = ["USE_INFO", "USE_LEGACY", "GpuIdentity", "GpuSample", "Nvml", "NvmlReading",
           "merge_holders"]
