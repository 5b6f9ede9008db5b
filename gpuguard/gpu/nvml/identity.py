"""Each GPU's model, device node and PCI address: read on the first scan that sees its
UUID, kept until the library is dropped, so labels that never change cost nothing per
scan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml

from gpuguard.gpu.nvml.failures import Call, field
from gpuguard.gpu.reading import GpuIdentity


class GpuIdentities:
    """GpuIdentity by UUID, each field read until it settles (read, or NOT_SUPPORTED)."""

    def __init__(self, call: Call) -> None:
        self._call = call
        #: Per UUID, dropped with the library: a GPU moved to another slot is only seen
        #: after a driver reload.
        self._known: dict[str, GpuIdentity] = {}

    def clear(self) -> None:
        """Forget every GPU: the library was dropped (a driver that comes back may differ)."""
        self._known.clear()

    def of(self, index: int, uuid: str, handle: Any,
           errors: list[tuple[str, str]]) -> GpuIdentity:
        """Model, device node and PCI address: NVML calls on the first scan that sees this
        GPU only. Each field falls back alone: a failed read leaves that label empty (and
        is tried again next scan), never the GPU unreported."""
        known = self._known.get(uuid)
        if known is not None and not known.unsettled:
            return known
        values: dict[str, str | None] = {} if known is None else {
            "name": known.name, "minor": known.device, "pci": known.pci_bus_id}
        reads: dict[str, Callable[[], Any]] = {
            "name": lambda: self._call("nvml_device", pynvml.nvmlDeviceGetName, handle),
            "minor": lambda: device_node(
                self._call("nvml_device", pynvml.nvmlDeviceGetMinorNumber, handle)),
            "pci": lambda: bus_id(
                self._call("nvml_device", pynvml.nvmlDeviceGetPciInfo, handle).busId),
        }
        unsettled: set[str] = set()
        for what, read in reads.items():
            if known is not None and what not in known.unsettled:
                continue
            before = len(errors)
            values[what] = field(index, what, errors, read)
            if len(errors) > before:
                unsettled.add(what)
        identity = GpuIdentity(name=values["name"], device=values["minor"],
                               pci_bus_id=values["pci"], unsettled=frozenset(unsettled))
        self._known[uuid] = identity
        return identity


def device_node(minor: int) -> str:
    """/dev/nvidiaN's name, as dcgm-exporter's `device` label spells it."""
    return f"nvidia{int(minor)}"


def bus_id(raw: bytes | str) -> str | None:
    """nvmlPciInfo_t.busId ("00000000:3B:00.0", the form dcgm-exporter labels with)."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    return text.strip("\x00 ") or None
