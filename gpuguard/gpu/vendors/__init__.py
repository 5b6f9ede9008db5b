"""The GPU source of this host, chosen apart from the operating system: a vendor's library
(VENDORS), completed where the OS counts per-process GPU memory itself
(Platform.process_gpu_memory: Windows' WDDM). NVML is the one vendor today; a second one
is a package beside gpuguard/gpu/nvml/ and an entry here (CONTRIBUTING.md, How to add a
GPU vendor)."""

from __future__ import annotations

from gpuguard.base.counters import Counters
from gpuguard.gpu.os_memory import OsSized
from gpuguard.gpu.source import Clock, GpuSource, GpuSourceFactory
from gpuguard.host.backend import Platform

#: The vendor read when none is named.
NVIDIA = "nvidia"


def _nvml(counters: Counters, *, process_utilization: bool = True, wall: Clock | None = None,
          boot: Clock | None = None) -> GpuSource:
    from gpuguard.gpu.nvml import Nvml  # pynvml loads with the first source, not before

    clocks = {name: clock for name, clock in (("wall", wall), ("boot", boot))
              if clock is not None}
    return Nvml(counters=counters, process_utilization=process_utilization, **clocks)


#: Each vendor's source, by name.
VENDORS: dict[str, GpuSourceFactory] = {NVIDIA: _nvml}


def vendor_source(counters: Counters, *, process_utilization: bool = True,
                  wall: Clock | None = None, boot: Clock | None = None,
                  vendor: str = NVIDIA) -> GpuSource:
    """`vendor`'s own reading, nothing added by the OS (GpuSourceFactory says what the
    arguments are): the readers that have never had the OS's sizes read it (the
    remediator's idle watch, which needs only who used a GPU, on its own clocks;
    `gpuguard explain` and `check`)."""
    return VENDORS[vendor](counters, process_utilization=process_utilization, wall=wall,
                           boot=boot)


def gpu_source(platform: Platform, counters: Counters, *, process_utilization: bool = True,
               vendor: str = NVIDIA) -> GpuSource:
    """`vendor`'s source on `platform`: sized by the OS where the vendor cannot size a
    holder and the platform counts it (Windows); process_utilization: GpuSourceFactory."""
    source = vendor_source(counters, process_utilization=process_utilization, vendor=vendor)
    if platform.process_gpu_memory is None:
        return source
    return OsSized(source, platform.process_gpu_memory())
