"""Several GPU back-ends read as one source (a host with NVIDIA and AMD cards): one reading
whose GPUs, holders and errors are every back-end's, and which fails closed when any of
them could not read (a holder on its GPUs could change a tree's verdict)."""

from __future__ import annotations

import dataclasses
import logging

from gpuguard.gpu.reading import BackendState, GpuReading
from gpuguard.gpu.source import GpuSource, ResetError

log = logging.getLogger("gpuguard.gpu")

#: What to do instead, for a back-end whose library has no reset call.
NO_RESET = {"nvml": "NVML has no reset call; see docs/runbooks/gpuguardgpurecoveryaction.md "
                    "(`nvidia-smi -r` and its preconditions)"}


def _detail(reading: GpuReading) -> str | None:
    if reading.up:
        return None
    return "; ".join(message for _, message in reading.errors) or "down"


class Combined:
    """The back-ends `parts` ((collector name, source), in the chooser's order) as one
    GpuSource. The reading is `up` when any back-end is; one that is down while another is
    up adds an error naming it, so a reap's check reads the whole as incomplete. Each GPU
    keeps its back-end's driver version. With one part, that part's reading as read, with
    its BackendState and the GPUs' driver version added."""

    def __init__(self, parts: list[tuple[str, GpuSource]]) -> None:
        self.parts = parts
        #: Which part listed each GPU (by uuid) in the last reading: reset() asks it.
        self._lister: dict[str, tuple[str, GpuSource]] = {}

    def read(self) -> GpuReading:
        readings = [(name, self._read_one(name, source)) for name, source in self.parts]
        parts = dict(self.parts)
        self._lister = {g.uuid: (name, parts[name]) for name, r in readings for g in r.gpus}
        states = tuple(BackendState(name, r.up, _detail(r)) for name, r in readings)
        gpus = tuple(g if g.driver_version is not None or r.driver_version is None
                     else dataclasses.replace(g, driver_version=r.driver_version)
                     for _, r in readings for g in r.gpus)
        if len(readings) == 1:
            return dataclasses.replace(readings[0][1], gpus=gpus, backends=states)
        if not readings:
            return GpuReading(False, None, (), (), (("backends", "no GPU back-end is active"),),
                              backends=())
        up = any(r.up for _, r in readings)
        errors: list[tuple[str, str]] = []
        for name, r in readings:
            # The stage stays the back-end's own (gpuguard_scan_errors_total{stage}); the
            # message says whose it is.
            errors.extend((stage, f"{name}: {message}") for stage, message in r.errors)
            if up and not r.up and not r.errors:
                errors.append((name, f"the {name} back-end is down"))
        driver = next((r.driver_version for _, r in readings if r.up and r.driver_version),
                      None)
        return GpuReading(up=up, driver_version=driver, gpus=gpus,
                          holders=tuple(h for _, r in readings for h in r.holders),
                          errors=tuple(errors), backends=states)

    @staticmethod
    def _read_one(name: str, source: GpuSource) -> GpuReading:
        try:
            return source.read()
        except Exception as exc:  # a source never raises; one that does is down, not fatal
            log.warning("%s back-end: read failed: %s: %s", name, type(exc).__name__, exc)
            return GpuReading(False, None, (), (), (("read", f"{type(exc).__name__}: {exc}"),))

    def reset_refusal(self, uuid: str) -> str | None:
        """Why reset(uuid) would be refused before any call (None: it would be tried)."""
        name, source = self._lister.get(uuid, (None, None))
        if name is None:
            return f"no GPU {uuid} in the last reading"
        if getattr(source, "reset", None) is None:
            return NO_RESET.get(name, f"the {name} back-end has no reset call")
        return None

    def reset(self, uuid: str) -> None:
        """Reset the GPU `uuid` through the back-end that listed it in the last reading
        (gpu/source.py, Resettable); ResetError where none did or it has no reset call."""
        refused = self.reset_refusal(uuid)
        if refused is not None:
            raise ResetError(refused, refused=True)
        getattr(self._lister[uuid][1], "reset")(uuid)  # noqa: B009 (checked just above)

    def close(self) -> None:
        for _, source in self.parts:
            source.close()
