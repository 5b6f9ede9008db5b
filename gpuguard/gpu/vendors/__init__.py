"""The GPU source of this host, chosen apart from the operating system: every back-end
(BACKENDS) that is switched on or, left to itself, finds its library or devices, read as
one (combined.py), each completed where the OS counts per-process GPU memory itself
(Platform.process_gpu_memory: Windows' WDDM). A new vendor is a package beside
gpuguard/gpu/nvml/ and a Backend here (CONTRIBUTING.md, How to add a GPU vendor)."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from gpuguard.base.counters import Counters
from gpuguard.gpu.amdsmi import KFD, AmdSmiSource, amdsmi_privileges, amdsmi_probe
from gpuguard.gpu.os_memory import OsSized
from gpuguard.gpu.source import Clock, GpuSource, GpuSourceFactory
from gpuguard.gpu.vendors.combined import Combined
from gpuguard.host.backend import Platform

log = logging.getLogger("gpuguard.gpu")

#: The vendor read when none is named (the NVML back-end's vendor).
NVIDIA = "nvidia"


@dataclass(frozen=True)
class Backend:
    """One way of reading GPUs. `name` is its collector's (`--collector.NAME`, the
    `backend` label); `probe` says why it cannot run on this host (None: it can), cheaply
    and without side effects; `source` makes its GpuSource; `drivers` are the kernel DRM
    drivers whose GPUs it reads (so the DRM back-end leaves them to it); `privileges`
    says what this process lacks to see every user's GPU use through it (one line each;
    `gpuguard config check` prints them); `beside`, for a back-end that could read other
    back-ends' GPUs too (DRM), its source given the drivers the other active back-ends
    read, which it leaves to them; `probe_beside`, for such a back-end, its probe given
    those drivers (it does not run where every GPU it finds is theirs)."""

    name: str
    probe: Callable[[], str | None]
    source: GpuSourceFactory
    drivers: frozenset[str] = frozenset()
    privileges: Callable[[], list[str]] = list
    beside: Callable[[frozenset[str]], GpuSourceFactory] | None = None
    probe_beside: Callable[[frozenset[str]], str | None] | None = None

    def factory(self, others: frozenset[str]) -> GpuSourceFactory:
        """The source to run beside back-ends that read `others`' GPUs."""
        return self.source if self.beside is None else self.beside(others)

    def check(self, others: frozenset[str]) -> str | None:
        """Why it cannot run beside back-ends that read `others`' GPUs (None: it can)."""
        return self.probe() if self.probe_beside is None else self.probe_beside(others)


def _nvml(counters: Counters, *, process_utilization: bool = True, wall: Clock | None = None,
          boot: Clock | None = None) -> GpuSource:
    from gpuguard.gpu.nvml import Nvml  # pynvml loads with the first source, not before

    clocks = {name: clock for name, clock in (("wall", wall), ("boot", boot))
              if clock is not None}
    return Nvml(counters=counters, process_utilization=process_utilization, **clocks)


def _nvml_probe() -> str | None:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as exc:
        return f"libnvidia-ml.so.1 cannot be loaded ({exc})"
    return None


NVML = Backend("nvml", _nvml_probe, _nvml, frozenset({"nvidia"}))


def _drm(counters: Counters, *, process_utilization: bool = True, wall: Clock | None = None,
         boot: Clock | None = None, skip_drivers: frozenset[str] = frozenset()) -> GpuSource:
    from gpuguard.gpu.drm import Drm

    return Drm(counters, process_utilization=process_utilization, wall=wall, boot=boot,
               skip_drivers=skip_drivers)


def _drm_probe(others: frozenset[str] = frozenset()) -> str | None:
    from gpuguard.gpu.drm import probe

    return probe(others=others)


def _drm_privileges() -> list[str]:
    from gpuguard.gpu.drm import privileges

    return privileges()


#: Last: it reads whatever DRM driver no other active back-end reads (amdgpu's GPUs when
#: AMD SMI does not run, Intel's always), and does not run where every render node is
#: theirs (an NVIDIA host, whose BMC's display chip has none).
DRM = Backend("drm", _drm_probe, _drm, privileges=_drm_privileges,
              beside=lambda others: partial(_drm, skip_drivers=others),
              probe_beside=_drm_probe)

#: AMD's GPUs through AMD SMI (gpuguard/gpu/amdsmi/: the wrapper loads on a source's read).
AMDSMI = Backend("amdsmi", amdsmi_probe, AmdSmiSource, frozenset({"amdgpu"}),
                 privileges=amdsmi_privileges)

#: The device every ROCm compute client holds open (`gpuguard reset` looks for it too).
KFD_DEVICE = KFD

#: Every back-end, in the order their GPUs are listed.
BACKENDS: tuple[Backend, ...] = (NVML, AMDSMI, DRM)

#: Which back-ends to run, by name: True on, False off, absent or None: on where its probe
#: finds it (NVML also where no other back-end runs, so a host whose driver is not loaded
#: yet reads NVML down and picks it up later, as before there were others).
Selection = Mapping[str, "bool | None"]


#: The reasons already logged (choose() runs once per reader: the scan, each watch).
_said: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Choice:
    """The back-ends that run, and why each other one does not (name, reason)."""

    active: tuple[Backend, ...]
    inactive: tuple[tuple[str, str], ...]


def choose(selection: Selection | None = None, *,
           backends: tuple[Backend, ...] | None = None) -> Choice:
    """The back-ends `selection` asks for: a named one runs even if its probe fails (it
    then reads down, which the metrics and alerts show), an unnamed one where its probe
    passes, given the drivers the back-ends before it that run read (Backend.check: the
    DRM back-end comes last). Each one that does not run is logged once, at info, with its
    reason."""
    selection = selection or {}
    backends = BACKENDS if backends is None else backends
    active: list[Backend] = []
    inactive: list[tuple[str, str]] = []
    auto_nvml_missing: str | None = None
    nvml = NVML
    for backend in backends:
        wanted = selection.get(backend.name)
        if wanted is False:
            inactive.append((backend.name, f"switched off (--no-collector.{backend.name})"))
            continue
        problem = None if wanted else backend.check(
            frozenset(d for other in active for d in other.drivers))
        if problem is None:
            active.append(backend)
        elif backend.name == NVML.name:
            auto_nvml_missing = problem
            nvml = backend
        else:
            inactive.append((backend.name, problem))
    if auto_nvml_missing is not None:
        if active:
            inactive.insert(0, (nvml.name, auto_nvml_missing))
        else:
            active.insert(0, nvml)  # no GPU library at all: NVML reads down until it appears
    for name, reason in inactive:
        if (name, reason) not in _said:  # once per process, not per reader that chooses
            _said.add((name, reason))
            log.info("GPU back-end %s not used: %s", name, reason)
    return Choice(tuple(sorted(active, key=backends.index)), tuple(inactive))


def _sources(choice: Choice, counters: Counters, *, process_utilization: bool,
             wall: Clock | None, boot: Clock | None) -> list[tuple[str, GpuSource]]:
    """Each active back-end's source, made beside the others (Backend.beside)."""
    def others(backend: Backend) -> frozenset[str]:
        return frozenset(d for o in choice.active if o is not backend for d in o.drivers)

    return [(b.name, b.factory(others(b))(counters, process_utilization=process_utilization,
                                          wall=wall, boot=boot)) for b in choice.active]


def privilege_warnings(backends: tuple[Backend, ...] | None = None) -> list[str]:
    """`gpuguard config check`'s lines: what this process lacks, per back-end that would
    run on this host (its probe passes), "NAME: LINE". A back-end is probed only when it
    has something to say (NVML never, so the check loads no vendor library)."""
    out = []
    for backend in BACKENDS if backends is None else backends:
        lines = backend.privileges()
        if lines and backend.probe() is None:
            out += [f"{backend.name}: {line}" for line in lines]
    return out


def vendor_source(counters: Counters, *, process_utilization: bool = True,
                  wall: Clock | None = None, boot: Clock | None = None,
                  choice: Choice | None = None) -> GpuSource:
    """Every active back-end's own reading, nothing added by the OS (GpuSourceFactory says
    what the arguments are): the readers that have never had the OS's sizes read it (the
    remediator's idle watch, which needs only who used a GPU, on its own clocks;
    `gpuguard explain` and `check`). `choice`: None, the back-ends choose() finds."""
    choice = choice if choice is not None else choose()
    return Combined(_sources(choice, counters, process_utilization=process_utilization,
                             wall=wall, boot=boot))


def gpu_source(platform: Platform, counters: Counters, *, process_utilization: bool = True,
               choice: Choice | None = None) -> GpuSource:
    """The active back-ends' source on `platform`: each sized by the OS where it cannot size
    a holder and the platform counts it (Windows); process_utilization: GpuSourceFactory."""
    choice = choice if choice is not None else choose()
    parts = _sources(choice, counters, process_utilization=process_utilization, wall=None,
                     boot=None)
    if platform.process_gpu_memory is not None:
        parts = [(name, OsSized(source, platform.process_gpu_memory()))
                 for name, source in parts]
    return Combined(parts)
