"""Windows' GPU source (the GPU seam's NVML, sized by the Windows back-end's WDDM hook)
over the real pynvml and the fake libnvidia-ml.so.1 set up as WDDM reports: every
process listed, none sized ("not available"). The PDH counters cannot exist on
Linux, so a recorded WDDM reading stands in for them (the Wine tier reads real PDH)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pynvml
import pytest

from gpuguard.base.counters import Counters
from gpuguard.engine.scan.accounting import balance
from gpuguard.gpu.nvml import Nvml
from gpuguard.gpu.os_memory import OsSized
from gpuguard.gpu.source import GpuSource
from gpuguard.gpu.vendors import gpu_source
from gpuguard.gpu.vendors.combined import Combined
from gpuguard.host.platform.linux import BACKEND as LINUX_BACKEND
from gpuguard.host.windows.platform import BACKEND as WINDOWS_BACKEND
from gpuguard.host.windows.wddm import WddmMemory, WddmUsage, usage_of
from tests.support.fakenvml import FakeGpuWorld, default_uuid
from tests.windows.synthetic.test_wddm import format_luid

pytest_plugins = ["tests.support.fakenvml.plugin"]

MiB = 2**20
LUID = 0x0000D1A5


class Recorded:
    """A WDDM reading recorded from a Windows host (instance names as PDH gives them)."""

    def __init__(self, usage: WddmUsage | None) -> None:
        self.usage = usage
        self.reads = 0
        self.closed = False

    def read(self) -> WddmUsage | None:
        self.reads += 1
        return self.usage

    def close(self) -> None:
        self.closed = True


def instance(pid: int) -> str:
    return f"pid_{pid}_luid_{format_luid(LUID)}_phys_0"


@pytest.fixture
def wddm() -> Recorded:
    return Recorded(usage_of([(instance(100), 900 * MiB), (instance(200), 100 * MiB)]))


@pytest.fixture
def nvml(fake_gpu: FakeGpuWorld, wddm: Recorded) -> Iterator[GpuSource]:
    """The Windows back-end's GPU source, its WDDM counters the recorded ones."""
    windows = dataclasses.replace(
        WINDOWS_BACKEND, process_gpu_memory=lambda: WddmMemory(wddm=wddm))  # type: ignore[arg-type]
    reader = gpu_source(windows, Counters())
    yield reader
    reader.close()


def test_wddm_sizes_what_nvml_lists_unsized(fake_gpu: FakeGpuWorld, nvml: GpuSource,
                                            wddm: Recorded) -> None:
    fake_gpu.update_gpu(0, memory_used=3000 * MiB)
    fake_gpu.add_process(0, 100, None, "C")
    fake_gpu.add_process(0, 200, None, "G")
    fake_gpu.add_process(0, 200, None, "C")

    reading = nvml.read()

    assert sorted((h.pid, h.kind, h.used_bytes) for h in reading.holders) == [
        (100, "C", 900 * MiB), (200, "C+G", 100 * MiB)]
    (gpu,) = balance(reading.gpus, reading.holders)
    assert (gpu.uuid, gpu.processes_bytes, gpu.unattributed_bytes) == (
        default_uuid(0), 1000 * MiB, 2000 * MiB)
    assert wddm.reads == 1
    nvml.close()
    assert wddm.closed


def test_without_counters_the_sizes_stay_absent(fake_gpu: FakeGpuWorld, nvml: GpuSource,
                                                wddm: Recorded) -> None:
    wddm.usage = None
    fake_gpu.update_gpu(0, memory_used=3000 * MiB)
    fake_gpu.add_process(0, 100, None, "C")

    reading = nvml.read()

    assert [(h.pid, h.used_bytes) for h in reading.holders] == [(100, None)]
    (gpu,) = balance(reading.gpus, reading.holders)
    assert (gpu.unattributed_bytes, gpu.why_unknown) == (None, "usage of pid 100 unavailable")


def test_counters_are_not_read_when_nvml_sizes_everything(fake_gpu: FakeGpuWorld,
                                                          nvml: GpuSource,
                                                          wddm: Recorded) -> None:
    fake_gpu.add_process(0, 100, 5 * MiB, "C")  # TCC mode, or Linux: NVML's own figure
    assert [h.used_bytes for h in nvml.read().holders] == [5 * MiB]
    assert wddm.reads == 0


def test_a_reading_that_is_down_is_returned_as_read(fake_gpu: FakeGpuWorld, nvml: GpuSource,
                                                    wddm: Recorded) -> None:
    fake_gpu.set_init_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    reading = nvml.read()
    assert not reading.up and reading.holders == ()
    assert wddm.reads == 0


def test_the_vendor_is_chosen_apart_from_the_os(fake_gpu: FakeGpuWorld) -> None:
    """NVML on both; only Windows' back-end adds its per-process memory (WDDM)."""
    linux = gpu_source(LINUX_BACKEND, Counters())
    windows = gpu_source(WINDOWS_BACKEND, Counters())
    try:
        assert isinstance(linux, Combined) and isinstance(windows, Combined)
        ((name, nvml),) = linux.parts
        assert name == "nvml" and type(nvml) is Nvml
        ((name, sized),) = windows.parts
        assert name == "nvml" and isinstance(sized, OsSized) and type(sized.source) is Nvml
        assert isinstance(sized.memory, WddmMemory)
    finally:
        linux.close()
        windows.close()
