"""The AMD back-end's GpuSource as gpu/vendors/ makes it: AmdSmi (reader.py) once the
wrapper loads, and until then a reading that is down and says why, trying again on every
read (a back-end switched on by --collector.amdsmi runs even where the probe fails, and
ROCm installed later is picked up as NVML's driver is)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.gpu.amdsmi.kfd import KFD
from gpuguard.gpu.amdsmi.library import probe
from gpuguard.gpu.reading import GpuReading
from gpuguard.gpu.source import ResetError

if TYPE_CHECKING:
    from gpuguard.gpu.amdsmi.reader import AmdSmi


class AmdSmiSource:
    """AmdSmi, made at the first read whose probe passes."""

    def __init__(self, counters: Counters = COUNTERS, *, process_utilization: bool = True,
                 wall: Callable[[], float] | None = None,
                 boot: Callable[[], float] | None = None, kfd_path: str = KFD) -> None:
        self._counters = counters
        self._kfd_path = kfd_path
        self._process_utilization = process_utilization
        self._wall, self._boot = wall, boot
        self._reader: AmdSmi | None = None

    def _loaded(self) -> AmdSmi | str:
        """The reader, or why there is none yet."""
        if self._reader is None:
            problem = probe()
            if problem is not None:
                return problem
            from gpuguard.gpu.amdsmi.reader import AmdSmi  # binds the wrapper: only now

            self._reader = AmdSmi(self._counters, process_utilization=self._process_utilization,
                                  wall=self._wall, boot=self._boot,
                                  kfd_path=self._kfd_path)
        return self._reader

    def read(self) -> GpuReading:
        reader = self._loaded()
        if isinstance(reader, str):
            return GpuReading(False, None, (), (), (("amdsmi_init", reader),))
        return reader.read()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    def reset(self, uuid: str) -> None:
        reader = self._loaded()
        if isinstance(reader, str):
            raise ResetError(reader, refused=True)
        reader.reset(uuid)
