"""AMD's GPUs through AMD SMI (the PyPI `amdsmi` wrapper over libamd_smi.so), and the only
package that imports `amdsmi`: one pass becomes a GpuReading (gpuguard/gpu/reading.py), as
gpuguard/gpu/nvml/ does for NVIDIA's, with the same fallbacks: a figure the GPU does not
give is None, a lost GPU is skipped with an error, a dead library reads `up` False and is
initialised again on the next read.

Unlike NVML's, AMD SMI's process list is checked against /proc before a pid is a holder
(pids.py). By concept: `library` (where the wrapper finds libamd_smi.so, the probe, the
privileges it wants), `pids` (pure: which listed pids are holders, who used a GPU),
`kfd` (whether a listed pid's process has /dev/kfd open),
`reader` (AmdSmi: the pass and the reset), `source` (AmdSmiSource: the reader once the
wrapper loads). Importing this package imports no wrapper: the probe imports it only once
the library is found (library.py says why), the reader on a source's first good read."""

from __future__ import annotations

from gpuguard.gpu.amdsmi.kfd import KFD
from gpuguard.gpu.amdsmi.library import privileges as amdsmi_privileges
from gpuguard.gpu.amdsmi.library import probe as amdsmi_probe
from gpuguard.gpu.amdsmi.source import AmdSmiSource

__all__ = ["KFD", "AmdSmiSource", "amdsmi_privileges", "amdsmi_probe"]
