"""How NVML fails, sorted by what it costs a reading: the whole library (down, initialised
again on the next read), one GPU (skipped), or one field (None, with an error or not).
Also the lock every NVML call in the process is made under, and how a call is counted."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import pynvml

T = TypeVar("T")

#: The logger every module of this package writes to: the name operators filter on, kept
#: from when the package lived at gpuguard/host/nvml/ (a log line is part of the contract).
LOGGER = "gpuguard.host.nvml"

#: Serialises every NVML call in the process: the scanner thread and the
#: remediator's worker both read NVML, and one read must see one driver state.
NVML_LOCK = threading.Lock()

#: Return codes that mean the library as a whole is unusable: report down, re-init next read.
DRIVER_GONE = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    }
)

#: Return codes that mean one GPU is unusable: skip it, keep reporting the others.
DEVICE_GONE = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED})


class DriverGone(Exception):
    """The library is unusable; the whole reading is down."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message


class DeviceGone(Exception):
    """One GPU is unusable; skip it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Call(Protocol):
    """Nvml._call: one NVML call, counted under its callsite (its cost shows at /metrics)."""

    def __call__(self, callsite: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...


def raise_if_gone(index: int, stage: str, err: pynvml.NVMLError) -> None:
    """DriverGone or DeviceGone for an error that costs the library or this GPU."""
    if err.value in DRIVER_GONE:
        raise DriverGone(stage, f"GPU {index}: {err}") from None
    if err.value in DEVICE_GONE:
        raise DeviceGone(f"GPU {index}: {err}") from None


def field(index: int, what: str, errors: list[tuple[str, str]], get: Callable[[], T]) -> T | None:
    """One gauge: None when unsupported or the driver lacks the call (no error), or
    failing (with an error)."""
    try:
        return get()
    except pynvml.NVMLError as err:
        if err.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            return None
        raise_if_gone(index, "nvml_device", err)
        errors.append(("nvml_device", f"GPU {index}: {what}: {err}"))
        return None
