"""What a GPU vendor's library gives gpuguard (`GpuSource`): one pass over its GPUs as a
GpuReading, and its release. The exporter's scanner, the remediator's inspection and
watches, a reap's re-check and the console hold a GpuSource and never name a vendor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gpuguard.base.counters import Counters
from gpuguard.gpu.reading import GpuReading


class GpuSource(Protocol):
    """One vendor's GPUs, read in passes; safe to call from several threads.

    read(): every GPU's gauges and identity, the processes holding memory on each (with
    their size where the library gives it: None where not, never 0), and per GPU the pids
    busy since the previous read where the library can say (the idle clocks). A failure
    is never raised: a field becomes None, a GPU is skipped with an error, a dead library
    reads `up` False; the next read tries again. close(): release the library (a later
    read opens it again)."""

    def read(self) -> GpuReading: ...

    def close(self) -> None: ...


class Resettable(Protocol):
    """A source whose library can reset one of its GPUs (AMD SMI's amdsmi_reset_gpu; NVML
    has no such call). reset(uuid) resets the GPU of that uuid now, or raises ResetError
    (refused or failed); whether anyone still holds the GPU is the caller's question,
    asked of a fresh read (gpuguard/console/reset/), and the source's own last check."""

    def reset(self, uuid: str) -> None: ...


class ResetError(Exception):
    """A GPU reset that did not happen: `refused` (nothing was asked of the driver: no such
    GPU, no reset call, a process listed on it) or failed (the driver's call failed)."""

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.message = message
        self.refused = refused


#: A clock, in seconds.
Clock = Callable[[], float]


class GpuSourceFactory(Protocol):
    """A vendor's source, counting its calls on `counters`; process_utilization False:
    one that never asks who used a GPU (busy_pids None), for readers that keep no idle
    clock (each such call answers only the samples since that reader's previous one).
    `wall` and `boot` (None: the real ones): the clock the library dates its samples by and
    one no step moves, whose offset moving voids the sample mark (orphans/idleness.py)."""

    def __call__(self, counters: Counters, *, process_utilization: bool = True,
                 wall: Clock | None = None, boot: Clock | None = None) -> GpuSource: ...
