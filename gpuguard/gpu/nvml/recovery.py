"""NVML's recovery action: what the driver asks for before a GPU can be used again after an
uncorrectable error (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, read through
nvmlDeviceGetFieldValues). NVML has no reset call; this field is how it says one is needed
(docs/runbooks/gpuguardgpurecoveryaction.md)."""

from __future__ import annotations

from typing import Any

import pynvml

from gpuguard.gpu.nvml.failures import Call, raise_if_gone

#: NVML_FI_DEV_GET_GPU_RECOVERY_ACTION in nvml.h (pynvml names it too, in releases that
#: know it).
FIELD = 230

#: nvml.h's nvmlDeviceGpuRecoveryAction_t, each named as NVIDIA does, in lower case and
#: dashes: the `action` label's values. The codes are the driver's ABI, so they are written
#: here rather than looked up in whichever pynvml is installed.
ACTIONS: dict[int, str] = {
    0: "none",  # the GPU can be used again by a new process
    1: "gpu-reset",  # stop its processes, reset it (`nvidia-smi -r`)
    2: "node-reboot",  # the fault may have left the OS inconsistent
    3: "drain-p2p",  # stop peer-to-peer traffic, then read the field again
    4: "drain-and-reset",  # drain peer-to-peer traffic, then reset
    5: "recover-imex-domain",
    6: "bus-reset",
    7: "system-reboot",
}

#: Answers that mean this GPU's driver will never give the field: older than the field
#: (NOT_SUPPORTED; INVALID_ARGUMENT, for a field id past the driver's own last one: the
#: call is otherwise always well formed), or older than nvmlDeviceGetFieldValues itself.
NEVER = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT,
                   pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})

#: nvmlValueType_t -> the c_nvmlValue_t member that holds it (integer types only).
INTEGER_MEMBERS = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


def action_name(code: int) -> str:
    """The action's name; a code this release does not know is named, never "none"."""
    return ACTIONS.get(code, f"unknown-{code}")


class RecoveryActions:
    """Each GPU's recovery action, one field read per GPU per scan; a GPU whose driver
    cannot give it is not asked again until the library is dropped."""

    def __init__(self, call: Call) -> None:
        self._call = call
        #: GPU uuids whose driver answered NEVER: absent for good, never "none".
        self._never: set[str] = set()

    def clear(self) -> None:
        """Forget every answer: the library was dropped (a driver that comes back may be a
        newer one)."""
        self._never.clear()

    def of(self, index: int, uuid: str, handle: Any,
           errors: list[tuple[str, str]]) -> str | None:
        """The action's name, or None: unsupported (for good), or a failed read (an error,
        read again on the next scan). A lost GPU or driver raises as any field does."""
        if uuid in self._never:
            return None
        try:
            (value,) = self._call("nvml_device", pynvml.nvmlDeviceGetFieldValues, handle,
                                  [FIELD])
            # The call answers SUCCESS when it filled any value; each carries its own code.
            if value.nvmlReturn != pynvml.NVML_SUCCESS:
                raise pynvml.NVMLError(value.nvmlReturn)
        except pynvml.NVMLError as err:
            if err.value in NEVER:
                self._never.add(uuid)
                return None
            raise_if_gone(index, "nvml_device", err)
            errors.append(("nvml_device", f"GPU {index}: recovery action: {err}"))
            return None
        member = INTEGER_MEMBERS.get(value.valueType)
        if member is None:
            errors.append(("nvml_device", f"GPU {index}: recovery action: value type "
                                          f"{value.valueType}, not an integer"))
            return None
        return action_name(int(getattr(value.value, member)))
