"""NVIDIA's GPUs through NVML, the GPU seam's one vendor today (gpuguard/gpu/source.py,
GpuSource), and the only package that imports pynvml: one pass over NVML becomes a
GpuReading (gpuguard/gpu/reading.py). Only the GPU seam imports this package; everything
else asks gpuguard/gpu/vendors/__init__.py for a GpuSource.

NVML fails in pieces on real hosts: the driver is not loaded yet, one GPU falls
off the bus, a consumer card does not report power. A scan must report what it
can and say what failed, so every call has a fallback: a field becomes None, a
lost GPU is skipped, and only a dead library marks the whole reading down (and
is initialised again on the next read, so a driver that appears later is used).

By concept: `failures` (what a failure costs, the one lock), `reader` (Nvml: the
library's lifetime and the pass), `identity` (each GPU's labels, read once),
`utilization` (who used a GPU since the last read, for the idle clocks). Every module
logs as `gpuguard.host.nvml` (LOGGER): the name operators filter on, kept from when this
package lived under host/.
"""

from __future__ import annotations

from gpuguard.gpu.nvml.reader import Nvml, merge_holders
from gpuguard.gpu.nvml.utilization import USE_INFO, USE_LEGACY

#: The name tests and older callers know merge_holders by.
_merge_holders = merge_holders

__all__ = ["USE_INFO", "USE_LEGACY", "Nvml", "merge_holders"]
