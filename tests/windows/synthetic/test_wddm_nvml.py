"""WddmNvml over the real pynvml and the fake libnvidia-ml.so.1 set up as WDDM reports:
every process listed, none sized ("not available"). The PDH counters cannot exist on
Linux, so a recorded WDDM reading stands in for them (the Wine tier reads real PDH)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpuguard.exporter.accounting import balance
from gpuguard.host.counters import Counters
from gpuguard.host.windows.wddm import WddmNvml, WddmUsage, usage_of
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
def nvml(fake_gpu: FakeGpuWorld, wddm: Recorded) -> Iterator[WddmNvml]:
    reader = WddmNvml(counters=Counters(), wddm=wddm)  # type: ignore[arg-type]
    yield reader
    reader.close()


def test_wddm_sizes_what_nvml_lists_unsized(fake_gpu: FakeGpuWorld, nvml: WddmNvml,
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


def test_without_counters_the_sizes_stay_absent(fake_gpu: FakeGpuWorld, nvml: WddmNvml,
                                                wddm: Recorded) -> None:
    wddm.usage = None
    fake_gpu.update_gpu(0, memory_used=3000 * MiB)
    fake_gpu.add_process(0, 100, None, "C")

    reading = nvml.read()

    assert [(h.pid, h.used_bytes) for h in reading.holders] == [(100, None)]
    (gpu,) = balance(reading.gpus, reading.holders)
    assert (gpu.unattributed_bytes, gpu.why_unknown) == (None, "usage of pid 100 unavailable")


def test_counters_are_not_read_when_nvml_sizes_everything(fake_gpu: FakeGpuWorld,
                                                          nvml: WddmNvml,
                                                          wddm: Recorded) -> None:
    fake_gpu.add_process(0, 100, 5 * MiB, "C")  # TCC mode, or Linux: NVML's own figure
    assert [h.used_bytes for h in nvml.read().holders] == [5 * MiB]
    assert wddm.reads == 0
