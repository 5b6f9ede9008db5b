"""A fake libnvidia-ml.so.1 and the world it reports, for tests without a GPU.

`build_library` compiles fakenvml.c; `FakeGpuWorld` writes the state file the
library re-reads on every NVML call (path in env var FAKE_NVML_STATE), so a
test changes GPUs, processes and failures while the code under test runs. The
state-file format is documented at the top of fakenvml.c.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("fakenvml.c")
LIBRARY_NAME = "libnvidia-ml.so.1"
STATE_ENV = "FAKE_NVML_STATE"

#: Per-device calls that `set_field_error` / `set_not_supported` can break.
FIELDS: tuple[str, ...] = (
    "name",
    "uuid",
    "memory",
    "utilization",
    "temperature",
    "power",
    "compute",
    "graphics",
    "process_utilization",  # nvmlDeviceGetProcessUtilization (the legacy call)
    "processes_utilization",  # nvmlDeviceGetProcessesUtilizationInfo (R550's)
    "minor",
    "pci",
    "mig",  # nvmlDeviceGetMigMode
    "recovery",  # the recovery action's own nvmlReturn in nvmlDeviceGetFieldValues
)

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_GPU_IS_LOST = 15

#: Calls `set_missing` can take away (the ones gpuguard falls back from).
MISSABLE: tuple[str, ...] = ("nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetTemperatureV",
                             "nvmlDeviceGetProcessesUtilizationInfo",
                             "nvmlDeviceGetMinorNumber", "nvmlDeviceGetMigMode",
                             "nvmlDeviceGetFieldValues")


class FakeNvmlBuildError(RuntimeError):
    """The fake library could not be compiled (no gcc, or a compile error)."""


def build_library(dest_dir: Path) -> Path:
    """Compile fakenvml.c into dest_dir/libnvidia-ml.so.1 and return its path."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise FakeNvmlBuildError("gcc not found on PATH: cannot build the fake libnvidia-ml.so.1")
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / LIBRARY_NAME
    cmd = [
        gcc, "-shared", "-fPIC", "-O2", "-Wall", f"-Wl,-soname,{LIBRARY_NAME}",
        "-o", str(out), str(SOURCE), "-lpthread",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise FakeNvmlBuildError(
            f"building the fake NVML failed ({' '.join(cmd)}):\n{proc.stderr.strip()}"
        )
    return out


@dataclass
class FakeGpu:
    """One fake GPU, as NVML will report it."""

    index: int
    uuid: str
    name: str = "NVIDIA Fake H100"
    memory_total: int = 80 * 2**30
    memory_used: int = 0
    util_gpu: int = 0
    util_mem: int = 0
    temp: int = 40
    power_mw: int = 100_000
    memory_reserved: int = 0  # the driver's own: outside _v2's used, inside _v1's
    #: /dev/nvidiaN's N (nvmlDeviceGetMinorNumber); None: the index, as on most hosts.
    minor: int | None = None
    #: PCI (domain, bus, device) for nvmlDeviceGetPciInfo; None: (0, index + 1, 0).
    pci: tuple[int, int, int] | None = None
    lost: bool = False
    field_errors: dict[str, int] = field(default_factory=dict)
    #: MIG mode (current, pending), 1 enabled; the utilization calls answer regardless.
    mig: tuple[int, int] = (0, 0)
    #: NVML_FI_DEV_GET_GPU_RECOVERY_ACTION's value (0 none, 1 GPU reset, 2 node reboot, 3
    #: drain P2P, 4 drain and reset, ...); None: the field answers NOT_SUPPORTED, as a
    #: driver older than the field does.
    recovery_action: int | None = None


@dataclass(frozen=True)
class FakeProcess:
    """One process holding a context on a fake GPU; used_bytes None means "na"."""

    gpu_index: int
    pid: int
    used_bytes: int | None
    kind: str  # "C" or "G"


@dataclass(frozen=True)
class FakeSample:
    """One per-process utilization sample; timestamp_us None: taken afresh at every call
    (a process that keeps its GPU busy)."""

    gpu_index: int
    pid: int
    timestamp_us: int | None
    sm_util: int
    mem_util: int = 0
    enc_util: int = 0
    dec_util: int = 0

    @property
    def use(self) -> str:
        """SM MEM [ENC DEC] as the state file writes them (the older form when both are 0)."""
        tail = f" {self.enc_util} {self.dec_util}" if self.enc_util or self.dec_util else ""
        return f"{self.sm_util} {self.mem_util}{tail}"


class FakeGpuWorld:
    """The GPUs, processes and failures the fake library reports.

    Every mutator saves the file at once (atomically), so the next NVML call in
    any thread or subprocess sees the change.
    """

    def __init__(self, path: Path, *, driver_version: str = "550.54.15") -> None:
        self.path = Path(path)
        self.driver_version = driver_version
        self.gpus: dict[int, FakeGpu] = {}
        self.processes: list[FakeProcess] = []
        self.init_error: int | None = None
        self.runtime_error: int | None = None
        self.delay_ms = 0
        self.missing: set[str] = set()
        self.samples: list[FakeSample] = []
        #: The driver's wall clock, seconds since the epoch (None: the real one).
        self.clock: float | None = None
        self.save()

    # GPUs

    def add_gpu(
        self,
        index: int,
        *,
        uuid: str | None = None,
        name: str = "NVIDIA Fake H100",
        memory_total: int = 80 * 2**30,
        memory_used: int = 0,
        util_gpu: int = 0,
        util_mem: int = 0,
        temp: int = 40,
        power_mw: int = 100_000,
        memory_reserved: int = 0,
        minor: int | None = None,
        pci: tuple[int, int, int] | None = None,
    ) -> FakeGpu:
        """Add (or replace) GPU `index`; the default uuid is derived from the index."""
        gpu = FakeGpu(
            index=index,
            uuid=uuid or default_uuid(index),
            name=name,
            memory_total=memory_total,
            memory_used=memory_used,
            util_gpu=util_gpu,
            util_mem=util_mem,
            temp=temp,
            power_mw=power_mw,
            memory_reserved=memory_reserved,
            minor=minor,
            pci=pci,
        )
        self.gpus[index] = gpu
        self.save()
        return gpu

    def update_gpu(self, index: int, **changes: Any) -> FakeGpu:
        """Change some fields of GPU `index` (e.g. memory_used=..., temp=...)."""
        gpu = dataclasses.replace(self.gpus[index], **changes)
        self.gpus[index] = gpu
        self.save()
        return gpu

    def remove_gpu(self, index: int) -> None:
        """Remove GPU `index` and its processes."""
        self.gpus.pop(index, None)
        self.processes = [p for p in self.processes if p.gpu_index != index]
        self.save()

    def set_gpu_lost(self, index: int, lost: bool = True) -> None:
        """Every call on GPU `index`, its handle included, answers GPU_IS_LOST (15)."""
        self.gpus[index].lost = lost
        self.save()

    def set_field_error(self, index: int, field_name: str, code: int | None) -> None:
        """One call (see FIELDS) on GPU `index` answers NVML return `code`; None clears."""
        if field_name not in FIELDS:
            raise ValueError(f"unknown field {field_name!r}; expected one of {FIELDS}")
        errors = self.gpus[index].field_errors
        if code is None:
            errors.pop(field_name, None)
        else:
            errors[field_name] = code
        self.save()

    def set_recovery_action(self, index: int, action: int | None) -> None:
        """GPU `index`'s recovery action (nvmlDeviceGpuRecoveryAction_t); None: the field
        answers NOT_SUPPORTED (the default)."""
        self.update_gpu(index, recovery_action=action)

    def set_not_supported(self, index: int, field_name: str, on: bool = True) -> None:
        """One call on GPU `index` answers NOT_SUPPORTED (3), or works again."""
        self.set_field_error(index, field_name, NVML_ERROR_NOT_SUPPORTED if on else None)

    # Processes

    def add_process(
        self, gpu_index: int, pid: int, used_bytes: int | None, kind: str = "C"
    ) -> FakeProcess:
        """Add a process holding `used_bytes` (None: not available) on a GPU."""
        if kind not in ("C", "G"):
            raise ValueError(f"kind must be 'C' or 'G', not {kind!r}")
        proc = FakeProcess(gpu_index, pid, used_bytes, kind)
        self.processes.append(proc)
        self.save()
        return proc

    def remove_process(self, pid: int, gpu_index: int | None = None) -> None:
        """Remove every entry of `pid` (on one GPU if gpu_index is given)."""
        self.processes = [
            p
            for p in self.processes
            if not (p.pid == pid and (gpu_index is None or p.gpu_index == gpu_index))
        ]
        self.save()

    # Per-process utilization

    def set_busy(self, gpu_index: int, pid: int, sm_util: int = 80, mem_util: int = 20, *,
                 enc_util: int = 0, dec_util: int = 0) -> None:
        """`pid` keeps GPU `gpu_index` busy: every utilization call sees a fresh sample
        (stamped with the driver's clock, `set_clock`)."""
        self.set_idle(gpu_index, pid, save=False)
        self.samples.append(FakeSample(gpu_index, pid, None, sm_util, mem_util, enc_util,
                                       dec_util))
        self.save()

    def set_idle(self, gpu_index: int, pid: int, *, save: bool = True) -> None:
        """`pid` stops using GPU `gpu_index`: no more fresh samples (fixed ones stay)."""
        self.samples = [s for s in self.samples if not (
            s.gpu_index == gpu_index and s.pid == pid and s.timestamp_us is None)]
        if save:
            self.save()

    def add_sample(self, gpu_index: int, pid: int, timestamp_us: int, sm_util: int,
                   mem_util: int = 0, *, enc_util: int = 0, dec_util: int = 0) -> FakeSample:
        """One sample taken at `timestamp_us` (microseconds since the epoch)."""
        sample = FakeSample(gpu_index, pid, timestamp_us, sm_util, mem_util, enc_util,
                            dec_util)
        self.samples.append(sample)
        self.save()
        return sample

    def set_clock(self, seconds: float | None) -> None:
        """The driver's wall clock reads `seconds` (since the epoch) until set again: busy
        samples are stamped with it, so a test steps the clock NVML stamps with (as NTP
        stepping a fast clock back does). None: the real CLOCK_REALTIME."""
        self.clock = seconds
        self.save()

    # Library-wide behaviour

    def set_init_error(self, code: int | None) -> None:
        """nvmlInit answers `code` (e.g. 9 DRIVER_NOT_LOADED); None lets it succeed."""
        self.init_error = code
        self.save()

    def set_runtime_error(self, code: int | None) -> None:
        """Every call but init/shutdown answers `code` (e.g. 1 UNINITIALIZED); None clears."""
        self.runtime_error = code
        self.save()

    def set_delay_ms(self, ms: int) -> None:
        """Every NVML call sleeps `ms` milliseconds, to slow a scan down."""
        self.delay_ms = ms
        self.save()

    def set_missing(self, function: str, missing: bool = True) -> None:
        """`function` (see MISSABLE) answers FUNCTION_NOT_FOUND (13), as pynvml does for
        a symbol an older driver lacks; missing=False puts it back."""
        if function not in MISSABLE:
            raise ValueError(f"unknown function {function!r}; expected one of {MISSABLE}")
        if missing:
            self.missing.add(function)
        else:
            self.missing.discard(function)
        self.save()

    def set_driver_version(self, version: str) -> None:
        self.driver_version = version
        self.save()

    def remove_file(self) -> None:
        """Delete the state file: the driver is gone (DRIVER_NOT_LOADED) until save()."""
        self.path.unlink(missing_ok=True)

    def subprocess_env(
        self, lib_dir: Path, base: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """Environment for a child process that should load the fake library."""
        env = dict(os.environ if base is None else base)
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{lib_dir}:{old}" if old else str(lib_dir)
        env[STATE_ENV] = str(self.path)
        return env

    # File

    def render(self) -> str:
        """The state file's text (format: see fakenvml.c)."""
        lines = [f"driver {self.driver_version}"]
        if self.init_error is not None:
            lines.append(f"init_error {self.init_error}")
        if self.runtime_error is not None:
            lines.append(f"runtime_error {self.runtime_error}")
        if self.delay_ms:
            lines.append(f"delay_ms {int(self.delay_ms)}")
        if self.clock is not None:
            lines.append(f"clock_us {round(self.clock * 1_000_000)}")
        for function in sorted(self.missing):
            lines.append(f"missing {function}")
        for g in sorted(self.gpus.values(), key=lambda g: g.index):
            if any(c.isspace() for c in g.uuid) or "\n" in g.name:
                raise ValueError(f"GPU {g.index}: uuid has spaces or name has a newline")
            lines.append(
                f"gpu {g.index} {g.uuid} {g.memory_total} {g.memory_used} {g.util_gpu}"
                f" {g.util_mem} {g.temp} {g.power_mw} {g.name}"
            )
            if g.memory_reserved:
                lines.append(f"reserved {g.index} {g.memory_reserved}")
            if g.minor is not None:
                lines.append(f"minor {g.index} {g.minor}")
            if g.pci is not None:
                lines.append(f"pci {g.index} {g.pci[0]:x} {g.pci[1]:x} {g.pci[2]:x}")
            if g.mig != (0, 0):
                lines.append(f"mig {g.index} {g.mig[0]} {g.mig[1]}")
            if g.recovery_action is not None:
                lines.append(f"recovery {g.index} {g.recovery_action}")
            if g.lost:
                lines.append(f"lost {g.index}")
            for name, code in sorted(g.field_errors.items()):
                lines.append(f"error {g.index} {name} {code}")
        for p in self.processes:
            used = "na" if p.used_bytes is None else str(p.used_bytes)
            lines.append(f"proc {p.gpu_index} {p.kind} {p.pid} {used}")
        for s in self.samples:
            if s.timestamp_us is None:
                lines.append(f"busy {s.gpu_index} {s.pid} {s.use}")
            else:
                lines.append(f"sample {s.gpu_index} {s.pid} {s.timestamp_us} {s.use}")
        return "\n".join(lines) + "\n"

    def save(self) -> None:
        """Write the state file atomically: readers see the old or the new world."""
        text = self.render()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def pci_bus_id(gpu: FakeGpu) -> str:
    """The busId the fake answers for `gpu`, as the driver formats it (8-digit domain)."""
    domain, bus, device = gpu.pci if gpu.pci is not None else (0, gpu.index + 1, 0)
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def default_uuid(index: int) -> str:
    """A stable, UUID-shaped id for fake GPU `index`."""
    return f"GPU-fa4e0000-0000-4000-8000-{index:012d}"
