"""WDDM per-process GPU memory (issue 30): the counter instance names, their sums, which
adapter a GPU is, and the holders NVML cannot size given WDDM's figure. The C/G/C+G marks
come from NVML's two process lists, merged per pid (gpuguard/gpu/nvml/reader.py).

The counters themselves (pdh.dll) cannot exist on Linux: reading them here is the
"absent" path (None, one warning); the Wine tier reads the real PDH.
"""

from __future__ import annotations

import ctypes
import logging
from types import SimpleNamespace

import pytest

from gpuguard.engine.scan.accounting import balance
from gpuguard.gpu.nvml import _merge_holders
from gpuguard.gpu.reading import GpuReading, GpuSample
from gpuguard.host.windows import jobs, wddm
from gpuguard.host.windows.wddm import (
    Instance,
    WddmCounters,
    WddmUsage,
    attribute,
    gpu_luids,
    parse_instance,
    usage_of,
)
from gpuguard.orphans.process import Holder


def format_luid(luid: int) -> str:
    """A LUID as the counters spell it, `0x00000000_0x0000D1A5`: the names tests give
    the counter instances (gpuguard itself only parses them)."""
    return f"0x{luid >> 32:08X}_0x{luid & 0xFFFFFFFF:08X}"

MiB = 2**20
GPU0, GPU1 = "GPU-aaaa", "GPU-bbbb"
NVIDIA, INTEL = 0x0000D1A5, 0x00010C4E  # two adapters' LUIDs (low parts)


def gpu(uuid: str = GPU0, index: int = 0, used: int | None = 4096 * MiB) -> GpuSample:
    return GpuSample(index, uuid, "NVIDIA RTX", 8192 * MiB, used, 0.1, 50.0, 30.0)


def reading(*holders: Holder, gpus: tuple[GpuSample, ...] = (gpu(),)) -> GpuReading:
    return GpuReading(True, "560.94", gpus, holders, ())


def name(pid: int, luid: int, phys: int = 0, eng: str = "") -> str:
    return f"pid_{pid}_luid_{format_luid(luid)}_phys_{phys}{eng}"


# -- instance names -----------------------------------------------------------------------

def test_an_instance_name_gives_pid_and_luid() -> None:
    assert parse_instance("pid_1234_luid_0x00000000_0x0000D1A5_phys_0") == Instance(
        1234, 0xD1A5, 0)
    assert parse_instance("pid_8_luid_0x00000001_0x0000d1a5_phys_1_eng_3_engtype_3D") == (
        Instance(8, (1 << 32) | 0xD1A5, 1))


@pytest.mark.parametrize("other", [
    "_Total", "", "pid_x_luid_0x0_0x1_phys_0", "pid_12_luid_0x00000000_phys_0",
    "luid_0x00000000_0x0000D1A5_phys_0", "pid_12_luid_0x00000000_0x0000D1A5_phys_0x",
    "pid_12_luid_0x00000000_0x0000D1A5_physical_0",
    # numbers no parser should take: past int()'s digit limit, another script's digits
    "pid_" + "9" * 5000 + "_luid_0x00000000_0x0000D1A5_phys_0",
    "pid_\u0663_luid_0x00000000_0x0000D1A5_phys_0",
    "pid_12_luid_0x00000000_0x0000D1A5_phys_" + "1" * 5000,
])
def test_other_shapes_name_nobody(other: str) -> None:
    assert parse_instance(other) is None


def test_luids_are_spelled_as_the_counters_spell_them() -> None:
    assert format_luid((1 << 32) | 0xD1A5) == "0x00000001_0x0000D1A5"
    named = parse_instance(f"pid_7_luid_{format_luid((1 << 32) | 0xD1A5)}_phys_0")
    assert named is not None and named.luid == (1 << 32) | 0xD1A5


def test_usage_sums_per_pid_and_adapter() -> None:
    usage = usage_of([
        (name(10, NVIDIA, 0), 100 * MiB), (name(10, NVIDIA, 1), 20 * MiB),
        (name(10, INTEL), 5 * MiB), (name(11, NVIDIA), 0),
        ("_Total", 999 * MiB), (name(12, NVIDIA), -1),
    ])
    assert usage.by_pid_luid == {(10, NVIDIA): 120 * MiB, (10, INTEL): 5 * MiB,
                                 (11, NVIDIA): 0}
    assert usage.per_pid() == {10: 125 * MiB, 11: 0}
    assert usage.luids() == {NVIDIA, INTEL}


# -- which adapter a GPU is -------------------------------------------------------------------

def test_a_gpu_is_the_one_adapter_all_its_holders_use() -> None:
    # 10 and 20 also have instances on the Intel adapter (a window drawn there); only
    # NVIDIA's is shared by every holder NVML lists on GPU0.
    usage = usage_of([(name(10, NVIDIA), 100 * MiB), (name(10, INTEL), 0),
                      (name(20, NVIDIA), 1 * MiB), (name(20, INTEL), 9 * MiB),
                      (name(30, NVIDIA), 5 * MiB), (name(40, INTEL), 5 * MiB)])
    holders = [Holder(pid, GPU0, 0, None, "C") for pid in (10, 20, 30)]
    assert gpu_luids(reading(*holders).holders, usage) == {GPU0: NVIDIA}


def test_two_gpus_each_on_an_adapter_of_their_own() -> None:
    other = 0x0000E0F0
    nvml = reading(Holder(10, GPU0, 0, None, "C"), Holder(11, GPU1, 1, None, "C"),
                   Holder(12, GPU1, 1, None, "C"), gpus=(gpu(), gpu(GPU1, 1)))
    usage = usage_of([(name(10, NVIDIA), 1), (name(11, other), 1), (name(11, INTEL), 1),
                      (name(12, other), 1)])
    assert gpu_luids(nvml.holders, usage) == {GPU0: NVIDIA, GPU1: other}
    # Without 12's instance, 11 alone cannot say which of its two adapters GPU1 is.
    alone = usage_of([(name(10, NVIDIA), 1), (name(11, other), 1), (name(11, INTEL), 1)])
    assert gpu_luids(nvml.holders, alone) == {GPU0: NVIDIA}


def test_a_gpu_is_never_matched_on_a_guess() -> None:
    both = usage_of([(name(10, NVIDIA), 100 * MiB), (name(10, INTEL), 1 * MiB)])
    assert gpu_luids(reading(Holder(10, GPU0, 0, None, "G")).holders, both) == {}  # two adapters
    one = usage_of([(name(10, NVIDIA), 100 * MiB)])
    shared = reading(Holder(10, GPU0, 0, None, "C"), Holder(10, GPU1, 1, None, "C"),
                     gpus=(gpu(), gpu(GPU1, 1)))
    assert gpu_luids(shared.holders, one) == {}  # one adapter cannot be two GPUs
    assert gpu_luids(reading(Holder(10, GPU0, 0, None, "C")).holders, usage_of([])) == {}
    assert gpu_luids(reading().holders, one) == {}  # no holder: nothing says which GPU it is


# -- holders NVML cannot size ----------------------------------------------------------------

def test_wddm_sizes_the_holders_nvml_cannot_and_unattributed_memory_follows() -> None:
    nvml = reading(Holder(10, GPU0, 0, None, "C"), Holder(20, GPU0, 0, None, "C+G"),
                   Holder(30, GPU0, 0, 512 * MiB, "C"))
    usage = usage_of([(name(10, NVIDIA), 1024 * MiB), (name(20, NVIDIA), 256 * MiB),
                      (name(30, NVIDIA), 1 * MiB), (name(20, INTEL), 64 * MiB)])
    (before,) = balance(nvml.gpus, nvml.holders)
    assert (before.unattributed_bytes, before.why_unknown) == (
        None, "usage of pid 10 unavailable")
    after = attribute(nvml.holders, usage)
    assert [(h.pid, h.used_bytes, h.kind) for h in after] == [
        (10, 1024 * MiB, "C"), (20, 256 * MiB, "C+G"), (30, 512 * MiB, "C")]  # NVML's stands
    (known,) = balance(nvml.gpus, after)
    # 4096 MiB used; NVML or WDDM account for 1792 of it; the Intel adapter's 64 are not
    # this GPU's.
    assert (known.processes_bytes, known.unattributed_bytes) == (1792 * MiB, 2304 * MiB)


def test_a_holder_without_an_instance_stays_absent_never_zero() -> None:
    nvml = reading(Holder(10, GPU0, 0, None, "C"), Holder(11, GPU0, 0, None, "G"))
    after = attribute(nvml.holders, usage_of([(name(10, NVIDIA), 8 * MiB)]))
    assert [h.used_bytes for h in after] == [8 * MiB, None]
    assert balance(nvml.gpus, after)[0].unattributed_bytes is None


def test_no_counters_leave_the_reading_as_it_was() -> None:
    nvml = reading(Holder(10, GPU0, 0, None, "C"))
    assert attribute(nvml.holders, None) is nvml.holders
    assert attribute(nvml.holders, usage_of([])) is nvml.holders  # no adapter known
    # A reading that is down is returned as read, the counters unread: test_wddm_nvml.py.


def test_a_given_mapping_attributes_several_gpus() -> None:
    nvml = reading(Holder(10, GPU0, 0, None, "C"), Holder(10, GPU1, 1, None, "C"),
                   gpus=(gpu(), gpu(GPU1, 1)))
    usage = usage_of([(name(10, NVIDIA), 7 * MiB), (name(10, INTEL), 3 * MiB)])
    after = attribute(nvml.holders, usage, {GPU0: NVIDIA, GPU1: INTEL})
    assert [(h.gpu_uuid, h.used_bytes) for h in after] == [(GPU0, 7 * MiB),
                                                                   (GPU1, 3 * MiB)]


# -- the marks: NVML's compute and graphics lists --------------------------------------------

def proc(pid: int, used: int | None) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, usedGpuMemory=used)


def test_compute_graphics_and_both_are_marked() -> None:
    holders = _merge_holders(0, GPU0, [proc(1, 10), proc(3, 30)], [proc(2, 20), proc(3, 25)])
    assert [(h.pid, h.kind, h.used_bytes) for h in holders] == [
        (1, "C", 10), (3, "C+G", 30), (2, "G", 20)]


def test_under_wddm_the_marks_stand_and_the_sizes_are_unknown() -> None:
    holders = _merge_holders(0, GPU0, [proc(1, None)], [proc(1, None), proc(2, None)])
    assert [(h.pid, h.kind, h.used_bytes) for h in holders] == [(1, "C+G", None),
                                                                (2, "G", None)]


# -- PDH itself ---------------------------------------------------------------------------

def test_pdh_and_job_structures_have_the_windows_x64_layout() -> None:
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        pytest.skip("the layouts checked are the 64-bit ones")
    assert ctypes.sizeof(wddm.PDH_FMT_COUNTERVALUE) == 16
    assert ctypes.sizeof(wddm.PDH_FMT_COUNTERVALUE_ITEM_W) == 24
    assert wddm.PDH_FMT_COUNTERVALUE.value.offset == 8
    assert ctypes.sizeof(jobs.JOBOBJECT_BASIC_LIMIT_INFORMATION) == 64
    assert jobs.JOBOBJECT_BASIC_LIMIT_INFORMATION.LimitFlags.offset == 16
    assert ctypes.sizeof(jobs.IO_COUNTERS) == 48
    assert ctypes.sizeof(jobs.JOBOBJECT_EXTENDED_LIMIT_INFORMATION) == 144


def test_absent_counters_read_none_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Off Windows pdh.dll cannot load: the same path as counters Windows lacks."""
    counters = WddmCounters()
    with caplog.at_level(logging.WARNING, logger=wddm.__name__):
        assert counters.read() is None
        assert counters.read() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "Dedicated Usage" in warnings[0].getMessage()
    counters.close()


def test_wddm_usage_is_plain_data() -> None:
    usage = WddmUsage({(1, NVIDIA): 5})
    assert usage.per_pid() == {1: 5} and usage.luids() == {NVIDIA}
