"""Per-process utilization: which pids used a GPU since the previous read, for the idle
clocks (gpuguard/orphans/idleness.py). One reader per clock: each read answers the
samples since this reader's own previous one, from a mark that a wall-clock step resets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pynvml

from gpuguard.gpu.nvml.failures import LOGGER, Call, raise_if_gone
from gpuguard.orphans.idleness import (
    STEP_TOLERANCE_SECONDS,
    SampleMark,
    next_mark,
    rebased_mark,
)

#: The package's one logger name, which operators filter on.
log = logging.getLogger(LOGGER)

#: The per-process utilization calls, first choice first (ProcessUse.busy).
USE_INFO = "nvmlDeviceGetProcessesUtilizationInfo"  # R550 and later: a versioned struct
USE_LEGACY = "nvmlDeviceGetProcessUtilization"
#: Answers that mean this GPU will not give that call: use the next one, for good (a
#: driver that does not know pynvml's struct version is one that cannot give it either).
USE_REFUSED = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                         pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH})


class ProcessUse:
    """Each GPU's utilization calls that still answer, its sample mark and its MIG mode."""

    def __init__(self, call: Call, wall: Callable[[], float], boot: Callable[[], float]) -> None:
        """`wall` is the clock NVML stamps samples with, `boot` one no step moves: their
        offset moving is a wall-clock step (gpuguard/orphans/idleness.py, SampleMark)."""
        self._call = call
        self._wall = wall
        self._boot = boot
        #: Per GPU uuid: the utilization calls it may still answer, first choice first,
        #: and the mark the next read asks from (the newest sample read, never past the
        #: wall time of that read).
        self._use_calls: dict[str, tuple[str, ...]] = {}
        self._marks: dict[str, SampleMark] = {}
        self._step_warned: float | None = None  # the wall-minus-boot offset last warned of
        self._use_warned: set[tuple[str, str, int]] = set()  # (uuid, call, code)
        #: GPUs that cannot be in MIG mode (NOT_SUPPORTED, or the driver lacks the call).
        self._no_mig: set[str] = set()

    def clear(self) -> None:
        """Forget calls, marks and MIG answers: the library was dropped, and a driver that
        comes back may be another one."""
        self._use_calls.clear()
        self._marks.clear()
        self._no_mig.clear()

    def busy(self, index: int, uuid: str, handle: Any) -> frozenset[int] | None:
        """The pids that used this GPU since its previous read; None when NVML cannot say.

        One call per GPU per read: R550's call where the GPU answers it, else the legacy
        one (a NOT_SUPPORTED or missing call is not asked again until NVML is initialised
        anew). NVML keeps samples only for processes that used something, and the legacy
        call answers NOT_FOUND when there are none: that is zero use, not an error, unless
        the wall clock stepped since the mark (then the read says nothing and the mark
        starts again at the new wall time). Errors are logged once per GPU and code and
        leave the answer unknown; they are not scan errors (a reap that does not ask for
        idleness must not be refused).
        """
        calls = self._use_calls.setdefault(uuid, (USE_INFO, USE_LEGACY))
        if not calls:
            return None  # neither call answers on this GPU: the MIG mode changes nothing
        mig = self._mig(index, uuid, handle)
        if mig is not False:  # on, or NVML cannot say: samples would not be per process
            return None
        wall, boot = self._wall(), self._boot()
        mark = self._marks.get(uuid)
        if mark is not None and mark.stepped(wall, boot):
            self._stepped(index, uuid, wall, boot)
            return None
        since = 0 if mark is None else mark.since_us
        while calls:
            fn = getattr(pynvml, calls[0])
            try:
                samples = self._call("nvml_processes", fn, handle, since)
            except pynvml.NVMLError as err:
                if err.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_SUCCESS):
                    samples = []  # no sample newer than `since`: nobody used anything
                elif err.value in USE_REFUSED:
                    calls = self._use_calls[uuid] = calls[1:]
                    continue
                else:
                    raise_if_gone(index, "nvml_processes", err)
                    self._warn_use(index, uuid, calls[0], err.value, str(err))
                    return None
            after_wall, after_boot = self._wall(), self._boot()
            if SampleMark(since, wall - boot).stepped(after_wall, after_boot):
                self._stepped(index, uuid, after_wall, after_boot)  # during the call
                return None
            self._marks[uuid] = next_mark(since, (int(s.timeStamp) for s in samples),
                                          after_wall, after_boot)
            return frozenset(int(s.pid) for s in samples if used(s))
        return None  # neither call: MIG, vGPU, or a GPU too old to sample processes

    def _stepped(self, index: int, uuid: str, wall: float, boot: float) -> None:
        """A wall-clock step: this GPU's read says nothing (its holders' idleness is
        unknown, so their clocks restart) and its mark starts again at the new wall time."""
        self._marks[uuid] = rebased_mark(wall, boot)
        offset = wall - boot
        if (self._step_warned is None
                or abs(offset - self._step_warned) > STEP_TOLERANCE_SECONDS):
            self._step_warned = offset
            log.warning("GPU %d: the wall clock stepped (wall minus boot clock now %.3f s): "
                        "per-process utilization unknown for one read, idle clocks restart",
                        index, offset)

    def _mig(self, index: int, uuid: str, handle: Any) -> bool | None:
        """Whether MIG is on (current or pending mode) on this GPU; None when NVML cannot
        say. Neither utilization call gives per-process samples under MIG, and what one
        would answer there (NOT_FOUND reads as "nobody used the GPU") must not make a busy
        job idle, so the mode is asked on every read rather than left to the driver. A
        GPU or driver without MIG (NOT_SUPPORTED, no such call) is not asked again."""
        if uuid in self._no_mig:
            return False
        try:
            current, pending = self._call("nvml_device", pynvml.nvmlDeviceGetMigMode, handle)
        except pynvml.NVMLError as err:
            if err.value in (pynvml.NVML_ERROR_NOT_SUPPORTED,
                             pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                self._no_mig.add(uuid)
                return False
            raise_if_gone(index, "nvml_device", err)
            self._warn_use(index, uuid, "mig", err.value, f"MIG mode unknown: {err}")
            return None
        on = pynvml.NVML_DEVICE_MIG_ENABLE in (current, pending)
        if on:
            self._warn_use(index, uuid, "mig", -1, "MIG mode: NVML gives no per-process samples")
        return on

    def _warn_use(self, index: int, uuid: str, call: str, code: int, why: str) -> None:
        """Once per GPU, call and `code`: why per-process utilization is unknown there."""
        if (uuid, call, code) not in self._use_warned:
            self._use_warned.add((uuid, call, code))
            log.warning("GPU %d: per-process utilization unavailable: %s", index, why)


def used(sample: Any) -> bool:
    """Whether one utilization sample shows use: SM, memory controller (copies), encoder
    or decoder above 0, and R550's JPEG and optical-flow engines where the struct has
    them. A job busy only copying or on NVENC/NVDEC is not idle."""
    return any(int(getattr(sample, name, 0)) > 0
               for name in ("smUtil", "memUtil", "encUtil", "decUtil", "jpgUtil", "ofaUtil"))
