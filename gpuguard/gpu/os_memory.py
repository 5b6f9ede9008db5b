"""A vendor's reading completed by the operating system's own count of each process's GPU
memory: under Windows' WDDM, NVML lists the processes on a GPU but cannot size them,
while Windows counts every process's memory on every adapter (whatever its vendor). The
OS seam supplies that count (Platform.process_gpu_memory); this source applies it."""

from __future__ import annotations

import dataclasses

from gpuguard.gpu.reading import GpuReading
from gpuguard.gpu.source import GpuSource
from gpuguard.host.backend import ProcessGpuMemory


class OsSized:
    """`source`'s reading, with `memory`'s figure for every holder the vendor could not
    size (used_bytes None). A reading that is down, or sizes every holder, is returned as
    read, and the OS's count is not read at all. A GpuSource."""

    def __init__(self, source: GpuSource, memory: ProcessGpuMemory) -> None:
        self.source = source
        self.memory = memory

    def read(self) -> GpuReading:
        reading = self.source.read()
        if not reading.up or all(h.used_bytes is not None for h in reading.holders):
            return reading
        holders = self.memory.size(reading.holders)
        if holders is reading.holders:
            return reading
        return dataclasses.replace(reading, holders=holders)

    def close(self) -> None:
        self.source.close()
        self.memory.close()
