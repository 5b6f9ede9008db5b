"""gpuguard.gpu.nvml (the GPU seam's NVML vendor) over the real pynvml and the fake
libnvidia-ml.so.1."""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from gpuguard.base.counters import Counters
from gpuguard.engine.scan.accounting import WHY_V1_MEMORY, balance
from gpuguard.gpu.nvml import Nvml
from gpuguard.gpu.reading import GpuSample
from gpuguard.orphans.process import Holder
from tests.support.fakenvml import FakeGpuWorld, default_uuid

pytest_plugins = ["tests.support.fakenvml.plugin"]

GiB = 2**30


@pytest.fixture
def counters() -> Counters:
    return Counters()


@pytest.fixture
def nvml(fake_gpu: FakeGpuWorld, counters: Counters) -> Iterator[Nvml]:
    reader = Nvml(counters=counters)
    yield reader
    reader.close()


def test_two_gpus_report_every_gauge(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.add_gpu(
        0, memory_total=80 * GiB, memory_used=3 * GiB, util_gpu=42, temp=61, power_mw=250_500
    )
    fake_gpu.add_gpu(
        1,
        uuid="GPU-11111111-2222-3333-4444-555555555555",
        name="NVIDIA Fake A100 80GB PCIe",
        memory_total=40 * GiB,
        memory_used=0,
        util_gpu=0,
        temp=35,
        power_mw=60_000,
        minor=3,  # /dev/nvidia3: probe order need not follow the index
        pci=(1, 0x3B, 0),
    )
    fake_gpu.set_driver_version("560.35.03")

    reading = nvml.read()

    assert reading.up
    assert reading.errors == ()
    assert reading.driver_version == "560.35.03"
    assert reading.gpus == (
        # No sample on either GPU: NVML says nobody used an SM (busy_pids empty, not None).
        GpuSample(0, default_uuid(0), "NVIDIA Fake H100", 80 * GiB, 3 * GiB, 0.42, 61.0, 250.5,
                  busy_pids=frozenset(), device="nvidia0", pci_bus_id="00000000:01:00.0"),
        GpuSample(
            1,
            "GPU-11111111-2222-3333-4444-555555555555",
            "NVIDIA Fake A100 80GB PCIe",
            40 * GiB,
            0,
            0.0,
            35.0,
            60.0,
            busy_pids=frozenset(),
            device="nvidia3",
            pci_bus_id="00000001:3B:00.0",  # the driver's busId: dcgm-exporter's pci_bus_id
        ),
    )
    assert reading.holders == ()


def test_holders_compute_graphics_and_merged(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.add_gpu(1)
    fake_gpu.add_process(0, 100, 5 * GiB, "C")
    fake_gpu.add_process(0, 200, 64 * 2**20, "G")
    fake_gpu.add_process(0, 300, 2 * GiB, "C")
    fake_gpu.add_process(0, 300, 1 * GiB, "G")
    fake_gpu.add_process(1, 100, 7 * GiB, "C")  # same pid on another GPU: its own holder

    holders = nvml.read().holders

    assert sorted(holders, key=lambda h: (h.gpu_index, h.pid)) == [
        Holder(100, default_uuid(0), 0, 5 * GiB, "C"),
        Holder(200, default_uuid(0), 0, 64 * 2**20, "G"),
        Holder(300, default_uuid(0), 0, 2 * GiB, "C+G"),
        Holder(100, default_uuid(1), 1, 7 * GiB, "C"),
    ]


def test_unavailable_used_memory_is_none(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.add_process(0, 100, None, "C")
    fake_gpu.add_process(0, 200, None, "C")
    fake_gpu.add_process(0, 200, 4096, "G")  # a known figure beside "na" is not the figure

    holders = {h.pid: h for h in nvml.read().holders}

    assert holders[100].used_bytes is None
    assert holders[200].used_bytes is None
    assert holders[200].kind == "C+G"


def test_a_pid_listed_twice_sums_unless_one_entry_is_unavailable(
    fake_gpu: FakeGpuWorld, nvml: Nvml
) -> None:
    """MIG lists a pid once per instance it runs in: separate memory, so the entries
    add up; one entry the driver cannot size makes the pid's usage unknown, and the
    GPU's unattributed memory with it (2 GiB of 10 used is not "8 GiB held by nobody")."""
    fake_gpu.update_gpu(0, memory_used=10 * GiB)
    fake_gpu.add_gpu(1, memory_used=10 * GiB)
    fake_gpu.add_process(0, 100, 2 * GiB, "C")
    fake_gpu.add_process(0, 100, None, "C")
    fake_gpu.add_process(1, 100, 2 * GiB, "C")
    fake_gpu.add_process(1, 100, 3 * GiB, "C")

    reading = nvml.read()

    assert sorted(reading.holders, key=lambda h: h.gpu_index) == [
        Holder(100, default_uuid(0), 0, None, "C"),
        Holder(100, default_uuid(1), 1, 5 * GiB, "C"),
    ]
    unknown, known = balance(reading.gpus, reading.holders)
    assert (unknown.unattributed_bytes, unknown.why_unknown) == (
        None, "usage of pid 100 unavailable")
    assert (known.processes_bytes, known.unattributed_bytes) == (5 * GiB, 5 * GiB)


def test_many_processes_survive_the_two_pass_protocol(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    for pid in range(1000, 1300):
        fake_gpu.add_process(0, pid, pid)

    holders = nvml.read().holders

    assert [h.pid for h in holders] == list(range(1000, 1300))
    assert all(h.used_bytes == h.pid for h in holders)


def test_lost_gpu_is_skipped_and_others_still_report(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.add_gpu(1)
    fake_gpu.add_gpu(2)
    fake_gpu.add_process(0, 100, GiB)
    fake_gpu.add_process(1, 200, GiB)
    fake_gpu.set_gpu_lost(1)

    reading = nvml.read()

    assert reading.up
    assert [g.index for g in reading.gpus] == [0, 2]
    assert [h.pid for h in reading.holders] == [100]
    assert reading.errors == (("nvml_device", "GPU 1: GPU is lost"),)


def test_gpu_lost_during_a_field_read_skips_that_gpu(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.add_gpu(1)
    fake_gpu.set_field_error(1, "power", pynvml.NVML_ERROR_GPU_IS_LOST)

    reading = nvml.read()

    assert [g.index for g in reading.gpus] == [0]
    assert reading.errors == (("nvml_device", "GPU 1: GPU is lost"),)


def test_init_failure_reports_down_then_driver_appears(
    fake_gpu: FakeGpuWorld, nvml: Nvml, caplog: pytest.LogCaptureFixture
) -> None:
    fake_gpu.set_init_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    caplog.set_level(logging.WARNING, logger="gpuguard.host.nvml")

    for _ in range(3):
        reading = nvml.read()
        assert not reading.up
        assert reading.errors == (("nvml_init", "Driver Not Loaded"),)
        assert reading.gpus == () and reading.holders == ()
        assert reading.driver_version is None
    assert len([r for r in caplog.records if r.name == "gpuguard.host.nvml"]) == 1

    fake_gpu.set_init_error(None)
    reading = nvml.read()
    assert reading.up
    assert [g.index for g in reading.gpus] == [0]
    assert reading.errors == ()


def test_missing_state_file_means_no_driver(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.remove_file()
    assert nvml.read().errors == (("nvml_init", "Driver Not Loaded"),)
    fake_gpu.save()
    assert nvml.read().up


def test_driver_lost_at_runtime_marks_down_and_reinitialises(
    fake_gpu: FakeGpuWorld, nvml: Nvml, counters: Counters
) -> None:
    assert nvml.read().up
    fake_gpu.set_runtime_error(pynvml.NVML_ERROR_UNINITIALIZED)

    reading = nvml.read()
    assert not reading.up
    assert reading.errors == (("nvml_device", "device count: Uninitialized"),)

    fake_gpu.set_runtime_error(None)
    before = counters.snapshot()["nvml_init"].calls
    assert nvml.read().up
    # init + driver version again: the library was initialised afresh
    assert counters.snapshot()["nvml_init"].calls == before + 2


def test_driver_unloaded_mid_scan_is_down(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    assert nvml.read().up
    fake_gpu.set_field_error(0, "compute", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    reading = nvml.read()

    assert not reading.up
    assert reading.errors == (("nvml_processes", "GPU 0: Driver Not Loaded"),)


def test_not_supported_field_is_none_and_not_an_error(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.update_gpu(0, temp=55, power_mw=123_000)
    fake_gpu.set_not_supported(0, "temperature")

    reading = nvml.read()

    (gpu,) = reading.gpus
    assert gpu.temperature_celsius is None
    assert gpu.power_watts == 123.0
    assert gpu.memory_total_bytes == 80 * GiB
    assert gpu.utilization_ratio == 0.0
    assert gpu.name == "NVIDIA Fake H100"
    assert reading.errors == ()


def test_other_field_error_is_none_with_an_error(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.set_field_error(0, "power", pynvml.NVML_ERROR_UNKNOWN)
    fake_gpu.set_not_supported(0, "memory")

    reading = nvml.read()

    (gpu,) = reading.gpus
    assert gpu.power_watts is None
    assert gpu.memory_total_bytes is None and gpu.memory_used_bytes is None
    assert gpu.temperature_celsius == 40.0
    assert reading.errors == (("nvml_device", "GPU 0: power: Unknown Error"),)


def test_driver_without_memory_v2_falls_back_and_says_so(fake_gpu: FakeGpuWorld,
                                                         nvml: Nvml) -> None:
    """_v1's "used" includes the driver's reserved memory, which no process holds: the
    reading says so, and unattributed memory is unknown rather than reserved + leak."""
    fake_gpu.update_gpu(0, memory_used=5 * GiB, memory_reserved=GiB)
    fake_gpu.add_process(0, 100, 5 * GiB)
    (v2,) = nvml.read().gpus
    assert (v2.memory_used_bytes, v2.used_excludes_reserved) == (5 * GiB, True)
    assert balance([v2], [Holder(100, v2.uuid, 0, 5 * GiB, "C")])[0].unattributed_bytes == 0

    fake_gpu.set_missing("nvmlDeviceGetMemoryInfo_v2")
    older = Nvml(counters=Counters())
    try:
        reading = older.read()
    finally:
        older.close()

    (v1,) = reading.gpus
    assert (v1.memory_used_bytes, v1.used_excludes_reserved) == (6 * GiB, False)
    assert reading.errors == ()
    (b,) = balance(reading.gpus, reading.holders)
    assert (b.used_bytes, b.unattributed_bytes, b.why_unknown) == (6 * GiB, None, WHY_V1_MEMORY)


def test_process_list_error_skips_that_gpus_holders(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.add_gpu(1)
    fake_gpu.add_process(0, 100, GiB)
    fake_gpu.add_process(0, 101, GiB, "G")
    fake_gpu.add_process(1, 200, GiB)
    fake_gpu.set_field_error(0, "graphics", pynvml.NVML_ERROR_NO_PERMISSION)

    reading = nvml.read()

    assert reading.up
    assert [g.index for g in reading.gpus] == [0, 1]
    assert [h.pid for h in reading.holders] == [200]
    assert reading.errors == (("nvml_processes", "GPU 0: Insufficient Permissions"),)


def test_counters_count_every_call_per_callsite(
    fake_gpu: FakeGpuWorld, nvml: Nvml, counters: Counters
) -> None:
    fake_gpu.add_gpu(1)

    nvml.read()
    first = counters.snapshot()
    # init + driver version; count + 2 x (handle, uuid, name, minor, pci, memory, util,
    # temp, power, recovery action, MIG mode); 2 x (compute, graphics, per-process
    # utilization: one call per GPU)
    assert first["nvml_init"].calls == 2
    assert first["nvml_device"].calls == 1 + 2 * 11
    assert first["nvml_processes"].calls == 2 * 3
    assert all(c.proc_reads == 0 for c in first.values())
    assert all(c.calls == 0 for name, c in first.items() if not name.startswith("nvml_"))

    nvml.read()
    second = counters.snapshot()
    assert second["nvml_init"].calls == 2  # initialised once
    # name, minor and pci are read once per GPU, and a recovery action the driver cannot
    # give (the fake's default) is not asked again: the second pass is count + 2 x
    # (handle, uuid, memory, util, temp, power, MIG mode: asked on every read)
    assert second["nvml_device"].calls == 23 + 1 + 2 * 7
    assert second["nvml_processes"].calls == 2 * 6

    nvml.close()
    assert counters.snapshot()["nvml_init"].calls == 3  # nvmlShutdown


def test_identity_fields_fall_back_alone_and_failed_ones_are_read_again(
    fake_gpu: FakeGpuWorld, nvml: Nvml, counters: Counters
) -> None:
    fake_gpu.set_field_error(0, "minor", pynvml.NVML_ERROR_NO_PERMISSION)
    fake_gpu.set_not_supported(0, "pci")

    gpu, = nvml.read().gpus
    # The failed read empties its own label only; NOT_SUPPORTED is no error.
    assert (gpu.name, gpu.device, gpu.pci_bus_id) == ("NVIDIA Fake H100", None, None)
    assert gpu.memory_total_bytes == 80 * GiB
    assert nvml.read().gpus[0].device is None
    before = counters.snapshot()["nvml_device"].calls

    fake_gpu.set_field_error(0, "minor", None)
    fake_gpu.set_not_supported(0, "pci", False)
    gpu, = nvml.read().gpus
    # Only the failed field is asked again (count, handle, uuid, minor, 4 gauges, MIG
    # mode): the name was read and NOT_SUPPORTED stands while the driver stays loaded.
    assert counters.snapshot()["nvml_device"].calls - before == 1 + 2 + 1 + 4 + 1
    assert (gpu.name, gpu.device, gpu.pci_bus_id) == ("NVIDIA Fake H100", "nvidia0", None)
    before = counters.snapshot()["nvml_device"].calls
    nvml.read()
    assert counters.snapshot()["nvml_device"].calls - before == 1 + 2 + 4 + 1


def test_failed_identity_read_is_reported_not_the_scan(
    fake_gpu: FakeGpuWorld, nvml: Nvml
) -> None:
    fake_gpu.set_field_error(0, "pci", 999)

    reading = nvml.read()

    assert reading.up and [g.index for g in reading.gpus] == [0]
    assert reading.errors == (("nvml_device", "GPU 0: pci: Unknown Error"),)
    assert reading.gpus[0].device == "nvidia0"


def test_identity_is_read_again_after_the_driver_comes_back(
    fake_gpu: FakeGpuWorld, nvml: Nvml
) -> None:
    assert nvml.read().gpus[0].pci_bus_id == "00000000:01:00.0"
    fake_gpu.set_runtime_error(pynvml.NVML_ERROR_UNINITIALIZED)
    assert not nvml.read().up
    fake_gpu.set_runtime_error(None)
    fake_gpu.update_gpu(0, pci=(0, 0x9D, 0), minor=5)  # moved while the driver was away

    gpu, = nvml.read().gpus

    assert (gpu.device, gpu.pci_bus_id) == ("nvidia5", "00000000:9D:00.0")


def test_state_change_between_reads_is_visible(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.add_process(0, 100, GiB)
    first = nvml.read()
    assert [h.pid for h in first.holders] == [100]

    fake_gpu.remove_process(100)
    fake_gpu.add_process(0, 200, 2 * GiB, "G")
    fake_gpu.update_gpu(0, memory_used=2 * GiB, temp=77)
    fake_gpu.add_gpu(1)

    second = nvml.read()
    assert [(h.pid, h.kind) for h in second.holders] == [(200, "G")]
    assert second.gpus[0].memory_used_bytes == 2 * GiB
    assert second.gpus[0].temperature_celsius == 77.0
    assert len(second.gpus) == 2


def test_reads_from_several_threads_are_serialised(
    fake_gpu: FakeGpuWorld, counters: Counters, nvml_max_in_flight: Callable[[], int]
) -> None:
    """No two NVML calls overlap: the fake's own mutex does not count, its probe spans
    each whole call (the injected delay included), so only our lock keeps it at 1."""
    fake_gpu.add_process(0, 100, GiB)
    fake_gpu.set_delay_ms(1)
    readers = [Nvml(counters=counters) for _ in range(4)]
    results: list[bool] = []

    def work(reader: Nvml) -> None:
        for _ in range(3):
            reading = reader.read()
            results.append(reading.up and [h.pid for h in reading.holders] == [100])

    threads = [threading.Thread(target=work, args=(r,)) for r in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for r in readers:
        r.close()
    assert results == [True] * 12
    assert nvml_max_in_flight() == 1, f"{nvml_max_in_flight()} NVML calls ran at once"


def test_fake_rejects_a_wrong_memory_struct_version(fake_gpu: FakeGpuWorld) -> None:
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError) as info:
            pynvml.nvmlDeviceGetMemoryInfo(handle, version=0x01000028)
        assert info.value.value == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        assert pynvml.nvmlDeviceGetMemoryInfo(handle).total == 80 * GiB  # v1 struct
        assert pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 40
    finally:
        pynvml.nvmlShutdown()


def test_fake_loads_in_a_subprocess_via_ld_library_path(
    fake_gpu: FakeGpuWorld, fake_nvml_lib: Path
) -> None:
    fake_gpu.set_driver_version("999.1.2")
    code = "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlSystemGetDriverVersion())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=fake_gpu.subprocess_env(fake_nvml_lib),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "999.1.2"


def test_pynvml_uses_the_preloaded_fake(fake_nvml_lib: Path) -> None:
    lib = ctypes.CDLL(str(fake_nvml_lib / "libnvidia-ml.so.1"))
    pynvml._LoadNvmlLibrary()
    assert pynvml.nvmlLib._handle == lib._handle


# -- per-process utilization (nvmlDeviceGetProcessesUtilizationInfo, else the legacy call) --

NVML_ERROR_UNKNOWN = 999
NEW, LEGACY = "processes_utilization", "process_utilization"


def now_us() -> int:
    return time.time_ns() // 1000


def use_calls(counters: Counters) -> int:
    """nvml_processes calls so far: per GPU and read, compute + graphics + utilization."""
    return counters.snapshot()["nvml_processes"].calls


def test_busy_pids_are_those_with_any_use_since_the_last_read(
        fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    """SM, memory controller (copies), encoder or decoder above 0 is use: a job busy only
    copying or on NVENC/NVDEC read idle when only SM use counted (issue 47)."""
    for pid in range(4001, 4008):
        fake_gpu.add_process(0, pid, GiB)
    fake_gpu.set_busy(0, 4001)
    fake_gpu.add_sample(0, 4002, now_us() - 1_000_000, sm_util=30)
    fake_gpu.add_sample(0, 4003, now_us() - 1_000_000, sm_util=0, mem_util=95)
    fake_gpu.add_sample(0, 4004, now_us() - 1_000_000, sm_util=0, enc_util=40)
    fake_gpu.add_sample(0, 4005, now_us() - 1_000_000, sm_util=0, dec_util=40)
    fake_gpu.add_sample(0, 4006, now_us() - 1_000_000, sm_util=0)  # a sample, all zero
    # 4007: no sample at all

    (gpu,) = nvml.read().gpus
    assert gpu.busy_pids == frozenset({4001, 4002, 4003, 4004, 4005})
    # The fixed sample is not newer than the last read's newest: not seen again; the busy
    # process gives a fresh sample at every read.
    (gpu,) = nvml.read().gpus
    assert gpu.busy_pids == frozenset({4001})
    fake_gpu.set_idle(0, 4001)
    (gpu,) = nvml.read().gpus
    assert gpu.busy_pids == frozenset()


def test_the_legacy_call_counts_encoder_and_decoder_use_too(
        fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.set_missing("nvmlDeviceGetProcessesUtilizationInfo")
    fake_gpu.add_process(0, 4001, GiB)
    fake_gpu.add_process(0, 4002, GiB)
    fake_gpu.set_busy(0, 4001, sm_util=0, mem_util=0, dec_util=70)
    fake_gpu.set_busy(0, 4002, sm_util=0, mem_util=0, enc_util=70)
    assert nvml.read().gpus[0].busy_pids == frozenset({4001, 4002})


class SteppedClocks:
    """A wall clock and a boot clock the test moves, the fake driver's clock on the same
    wall: time passing moves both, a step (NTP, a restored VM) the wall clock alone."""

    def __init__(self, world: FakeGpuWorld) -> None:
        self.world = world
        self.now = time.time()
        self.since_boot = 1000.0
        world.set_clock(self.now)

    def wall(self) -> float:
        return self.now

    def boot(self) -> float:
        return self.since_boot

    def elapse(self, seconds: float) -> None:
        self.now += seconds
        self.since_boot += seconds
        self.world.set_clock(self.now)

    def step(self, seconds: float) -> None:
        self.now += seconds
        self.world.set_clock(self.now)


@pytest.fixture
def clocks(fake_gpu: FakeGpuWorld) -> SteppedClocks:
    return SteppedClocks(fake_gpu)


@pytest.fixture
def stepped_nvml(clocks: SteppedClocks, counters: Counters) -> Iterator[Nvml]:
    reader = Nvml(counters=counters, wall=clocks.wall, boot=clocks.boot)
    yield reader
    reader.close()


@pytest.mark.parametrize("legacy", [False, True], ids=["info", "legacy"])
def test_a_wall_clock_step_back_reads_unknown_never_idle_then_busy_again(
        fake_gpu: FakeGpuWorld, clocks: SteppedClocks, stepped_nvml: Nvml,
        counters: Counters, legacy: bool) -> None:
    """Issue 47: after NTP steps the clock back an hour, every sample NVML takes is older
    than the mark (the newest read), so NVML answers NOT_FOUND: that must not read as "no
    use". The read that sees the step says nothing (no call), and the next asks from the
    new wall time, so a holder at 100% SM reads busy again."""
    if legacy:
        fake_gpu.set_missing("nvmlDeviceGetProcessesUtilizationInfo")
    fake_gpu.add_process(0, 4001, GiB)
    fake_gpu.set_busy(0, 4001, sm_util=100, mem_util=0)
    assert stepped_nvml.read().gpus[0].busy_pids == frozenset({4001})
    clocks.elapse(1)
    assert stepped_nvml.read().gpus[0].busy_pids == frozenset({4001})
    clocks.step(-3600)
    before = use_calls(counters)
    assert stepped_nvml.read().gpus[0].busy_pids is None
    assert use_calls(counters) - before == 2  # compute, graphics: NVML not asked
    for _ in range(3):
        clocks.elapse(1)
        assert stepped_nvml.read().gpus[0].busy_pids == frozenset({4001})
    fake_gpu.set_idle(0, 4001)
    clocks.elapse(1)
    assert stepped_nvml.read().gpus[0].busy_pids == frozenset()  # idle reads idle again


def test_a_step_forward_reads_unknown_once_and_slew_is_no_step(
        fake_gpu: FakeGpuWorld, clocks: SteppedClocks, stepped_nvml: Nvml) -> None:
    fake_gpu.add_process(0, 4001, GiB)
    assert stepped_nvml.read().gpus[0].busy_pids == frozenset()
    clocks.step(+600)
    assert stepped_nvml.read().gpus[0].busy_pids is None
    clocks.elapse(15)
    clocks.step(0.01)  # NTP slewing: far under the tolerance
    assert stepped_nvml.read().gpus[0].busy_pids == frozenset()


def test_a_step_during_the_call_reads_unknown(fake_gpu: FakeGpuWorld,
                                             clocks: SteppedClocks, counters: Counters) -> None:
    """The wall clock read before the call and after it disagree with the boot clock:
    what NVML answered in between is from either side of the step."""
    readings: list[float] = []

    def wall() -> float:  # steps back an hour between the first read's two readings
        readings.append(clocks.now)
        if len(readings) == 2:
            clocks.step(-3600)
        return clocks.now

    reader = Nvml(counters=counters, wall=wall, boot=clocks.boot)
    try:
        fake_gpu.add_process(0, 4001, GiB)
        assert reader.read().gpus[0].busy_pids is None
        fake_gpu.set_busy(0, 4001)
        clocks.elapse(1)
        assert reader.read().gpus[0].busy_pids == frozenset({4001})
    finally:
        reader.close()


def test_a_sample_stamped_ahead_of_the_wall_clock_counts_until_the_clock_passes_it(
        fake_gpu: FakeGpuWorld, clocks: SteppedClocks, stepped_nvml: Nvml) -> None:
    """A mark never moves past the wall time of its read: a sample from ahead of it (taken
    before a step back) would otherwise hide every sample stamped before it."""
    fake_gpu.add_process(0, 4001, GiB)
    fake_gpu.add_process(0, 4002, GiB)
    fake_gpu.add_sample(0, 4001, int((clocks.now + 10) * 1e6), sm_util=50)
    assert stepped_nvml.read().gpus[0].busy_pids == frozenset({4001})
    fake_gpu.add_sample(0, 4002, int((clocks.now + 1) * 1e6), sm_util=50)
    clocks.elapse(2)
    assert stepped_nvml.read().gpus[0].busy_pids == frozenset({4001, 4002})
    clocks.elapse(10)  # past both: asked again this once, then never
    assert stepped_nvml.read().gpus[0].busy_pids == frozenset({4001})
    clocks.elapse(1)
    assert stepped_nvml.read().gpus[0].busy_pids == frozenset()


def test_one_call_per_gpu_per_read(fake_gpu: FakeGpuWorld, nvml: Nvml,
                                   counters: Counters) -> None:
    fake_gpu.add_gpu(1)
    nvml.read()
    nvml.read()
    assert use_calls(counters) == 2 * 2 * 3  # two reads, two GPUs, compute+graphics+use


def test_legacy_call_not_found_reads_as_idle(fake_gpu: FakeGpuWorld, nvml: Nvml,
                                             counters: Counters) -> None:
    """A driver before R550 lacks the new call: the legacy one answers, NOT_FOUND (no
    sample at all) meaning nobody used an SM, and the new call is not asked again."""
    fake_gpu.set_missing("nvmlDeviceGetProcessesUtilizationInfo")
    fake_gpu.add_process(0, 4001, GiB)
    (gpu,) = nvml.read().gpus
    assert gpu.busy_pids == frozenset()
    assert use_calls(counters) == 2 + 2  # the new call refused, then the legacy one
    fake_gpu.set_busy(0, 4001)
    (gpu,) = nvml.read().gpus
    assert gpu.busy_pids == frozenset({4001})
    assert use_calls(counters) == 4 + 3  # only the legacy call now


def test_not_supported_is_cached_per_device(fake_gpu: FakeGpuWorld, nvml: Nvml,
                                            counters: Counters) -> None:
    """GPU 0 refuses the new call (NOT_SUPPORTED): it falls back to the legacy one for
    good; GPU 1 keeps the new one."""
    fake_gpu.add_gpu(1)
    fake_gpu.set_not_supported(0, NEW)
    fake_gpu.set_not_supported(1, LEGACY)  # never asked: GPU 1 answers the new call
    fake_gpu.add_process(0, 4001, GiB)
    fake_gpu.add_process(1, 4002, GiB)
    fake_gpu.set_busy(0, 4001)
    fake_gpu.set_busy(1, 4002)
    first = nvml.read().gpus
    assert [g.busy_pids for g in first] == [frozenset({4001}), frozenset({4002})]
    assert use_calls(counters) == 2 * 2 + 3  # GPU 0 tried twice, GPU 1 once
    second = nvml.read().gpus
    assert [g.busy_pids for g in second] == [frozenset({4001}), frozenset({4002})]
    assert use_calls(counters) == 7 + 2 * 3


def test_a_struct_version_the_driver_does_not_know_falls_back(
        fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.set_field_error(0, NEW, 25)  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    fake_gpu.add_process(0, 4001, GiB)
    fake_gpu.set_busy(0, 4001)
    assert nvml.read().gpus[0].busy_pids == frozenset({4001})


def test_not_supported_by_both_calls_reads_absent_never_idle(
        fake_gpu: FakeGpuWorld, nvml: Nvml, counters: Counters) -> None:
    fake_gpu.set_not_supported(0, NEW)
    fake_gpu.set_not_supported(0, LEGACY)
    fake_gpu.add_process(0, 4001, GiB)
    reading = nvml.read()
    assert reading.gpus[0].busy_pids is None
    assert reading.errors == ()  # not a scan error: the GPU simply cannot say
    before = use_calls(counters)
    assert nvml.read().gpus[0].busy_pids is None
    assert use_calls(counters) - before == 2  # neither call asked again


def test_an_error_reads_absent_and_is_asked_again(fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.set_field_error(0, NEW, NVML_ERROR_UNKNOWN)
    fake_gpu.add_process(0, 4001, GiB)
    reading = nvml.read()
    assert reading.gpus[0].busy_pids is None
    assert reading.errors == ()
    fake_gpu.set_field_error(0, NEW, None)
    assert nvml.read().gpus[0].busy_pids == frozenset()


def test_asked_without_process_utilization_nothing_is_called(
        fake_gpu: FakeGpuWorld, counters: Counters) -> None:
    reader = Nvml(counters=counters, process_utilization=False)
    try:
        assert reader.read().gpus[0].busy_pids is None
        assert use_calls(counters) == 2
    finally:
        reader.close()


# -- MIG: no per-process samples, whatever the utilization calls answer ------------------


def test_a_gpu_in_mig_mode_reads_absent_never_idle(fake_gpu: FakeGpuWorld, nvml: Nvml,
                                                   counters: Counters) -> None:
    """The fake's utilization calls answer NOT_FOUND under MIG as without it, which reads
    as "nobody used an SM": gpuguard must not lean on a driver refusing them there, or a
    busy job on a MIG instance would read idle and `require_idle_seconds` reap it."""
    fake_gpu.add_process(0, 4001, GiB)
    assert nvml.read().gpus[0].busy_pids == frozenset()  # MIG off: NOT_FOUND is idle
    fake_gpu.update_gpu(0, mig=(1, 1))
    before = use_calls(counters)
    assert nvml.read().gpus[0].busy_pids is None
    assert use_calls(counters) - before == 2  # compute, graphics: no utilization call
    fake_gpu.update_gpu(0, mig=(0, 1))  # enabling, pending a reset: still not per process
    assert nvml.read().gpus[0].busy_pids is None
    fake_gpu.update_gpu(0, mig=(0, 0))  # asked on every read: off again, samples count
    assert nvml.read().gpus[0].busy_pids == frozenset()


def test_a_mig_mode_nvml_cannot_give_reads_absent_and_one_it_does_not_have_is_not_asked(
        fake_gpu: FakeGpuWorld, nvml: Nvml, counters: Counters) -> None:
    fake_gpu.add_process(0, 4001, GiB)
    fake_gpu.set_field_error(0, "mig", NVML_ERROR_UNKNOWN)
    reading = nvml.read()
    assert reading.gpus[0].busy_pids is None and reading.errors == ()
    fake_gpu.set_field_error(0, "mig", None)
    fake_gpu.set_not_supported(0, "mig")  # a GPU without MIG (a V100, an RTX)
    assert nvml.read().gpus[0].busy_pids == frozenset()
    before = counters.snapshot()["nvml_device"].calls
    nvml.read()
    assert counters.snapshot()["nvml_device"].calls - before == 1 + 2 + 4  # no MIG call
    fake_gpu.set_not_supported(0, "mig", False)
    fake_gpu.set_missing("nvmlDeviceGetMigMode")  # a driver before MIG: the same
    other = Nvml(counters=Counters())
    try:
        assert other.read().gpus[0].busy_pids == frozenset()
    finally:
        other.close()


# NVML's recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, through nvmlDeviceGetFieldValues)

#: nvml.h's nvmlDeviceGpuRecoveryAction_t, as GpuSample.recovery_action names each.
RECOVERY_NAMES = {0: "none", 1: "gpu-reset", 2: "node-reboot", 3: "drain-p2p",
                  4: "drain-and-reset", 5: "recover-imex-domain", 6: "bus-reset",
                  7: "system-reboot"}


def test_each_recovery_action_the_driver_reports_is_named(fake_gpu: FakeGpuWorld,
                                                          nvml: Nvml) -> None:
    fake_gpu.add_gpu(1)
    fake_gpu.set_recovery_action(1, 0)
    for code, name in RECOVERY_NAMES.items():
        fake_gpu.set_recovery_action(0, code)
        reading = nvml.read()
        assert [g.recovery_action for g in reading.gpus] == [name, "none"], code
        assert reading.errors == ()
    # A code this gpuguard does not know (a newer driver's) is still not "none".
    fake_gpu.set_recovery_action(0, 42)
    assert nvml.read().gpus[0].recovery_action == "unknown-42"


def test_the_names_follow_the_installed_pynvml() -> None:
    """The codes are nvml.h's; the installed bindings spell each as NVIDIA does."""
    assert pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION == 230
    for code, name in RECOVERY_NAMES.items():
        constant = "NVML_GPU_RECOVERY_ACTION_" + name.upper().replace("-", "_")
        assert getattr(pynvml, constant, code) == code, constant


def test_a_recovery_action_the_driver_cannot_give_is_absent_for_good(
        fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    """NOT_SUPPORTED (a driver older than the field): absent, never "none", no error, and
    not asked again while the driver stays loaded; a driver that comes back is asked."""
    fake_gpu.add_gpu(1)
    fake_gpu.set_recovery_action(1, 1)
    reading = nvml.read()
    assert [g.recovery_action for g in reading.gpus] == [None, "gpu-reset"]
    assert reading.errors == ()
    fake_gpu.set_recovery_action(0, 2)
    assert [g.recovery_action for g in nvml.read().gpus] == [None, "gpu-reset"]
    nvml.close()
    assert [g.recovery_action for g in nvml.read().gpus] == ["node-reboot", "gpu-reset"]


def test_a_driver_without_field_values_has_no_recovery_action(fake_gpu: FakeGpuWorld,
                                                             nvml: Nvml) -> None:
    fake_gpu.set_recovery_action(0, 1)
    fake_gpu.set_missing("nvmlDeviceGetFieldValues")
    reading = nvml.read()
    assert reading.gpus[0].recovery_action is None
    assert reading.errors == ()
    assert reading.gpus[0].memory_total_bytes == 80 * GiB


def test_a_failed_recovery_read_is_absent_this_scan_and_read_again(
        fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.set_recovery_action(0, 4)
    fake_gpu.set_field_error(0, "recovery", pynvml.NVML_ERROR_UNKNOWN)
    reading = nvml.read()
    assert reading.gpus[0].recovery_action is None
    assert reading.gpus[0].power_watts == 100.0
    assert reading.errors == (("nvml_device", "GPU 0: recovery action: Unknown Error"),)
    fake_gpu.set_field_error(0, "recovery", None)
    reading = nvml.read()
    assert reading.gpus[0].recovery_action == "drain-and-reset"
    assert reading.errors == ()


def test_a_gpu_lost_while_its_recovery_action_is_read_is_skipped(
        fake_gpu: FakeGpuWorld, nvml: Nvml) -> None:
    fake_gpu.add_gpu(1)
    fake_gpu.set_recovery_action(1, 1)
    fake_gpu.set_field_error(1, "recovery", pynvml.NVML_ERROR_GPU_IS_LOST)
    reading = nvml.read()
    assert [g.index for g in reading.gpus] == [0]
    assert reading.errors == (("nvml_device", "GPU 1: GPU is lost"),)
