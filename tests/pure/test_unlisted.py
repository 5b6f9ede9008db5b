"""Which GPU a device file names, when the search runs, and the pids NVML lists that
/proc lacks: gpuguard/engine/scan/unlisted.py's pure rules on synthetic input."""

from __future__ import annotations

import os

from gpuguard.engine.scan.accounting import GpuBalance
from gpuguard.engine.scan.unlisted import (
    UNLISTED_KIND,
    gpu_of,
    search_holders,
    unattributed_gpus,
)
from gpuguard.gpu.reading import GpuSample
from gpuguard.orphans.process import Holder


def gpu(index: int) -> GpuSample:
    return GpuSample(index, f"GPU-{index}", None, None, None, None, None, None)


def test_a_node_names_the_gpu_whose_minor_number_it_has() -> None:
    gpus = [gpu(0), gpu(1), gpu(2)]
    minors = {"GPU-0": 1, "GPU-1": 0}  # GPU 2's driver would not say
    assert gpu_of(os.makedev(195, 0), gpus, minors) == gpus[1]  # NVML's minor, not its index
    assert gpu_of(os.makedev(195, 1), gpus, minors) == gpus[0]
    assert gpu_of(os.makedev(195, 2), gpus, minors) is None
    assert gpu_of(os.makedev(195, 255), gpus, minors) is None  # nvidiactl: no one GPU's
    assert gpu_of(os.makedev(511, 0), gpus, minors) is None  # another driver's device 0
    assert gpu_of(os.makedev(195 + 4096, 0), gpus, minors) is None  # major's high bits
    assert gpu_of(None, gpus, minors) is None  # a plain file: reported without a GPU
    assert gpu_of(os.makedev(195, 300), gpus, {"GPU-0": 300}) == gpus[0]  # minor's high bits


def test_the_search_runs_only_above_a_known_threshold() -> None:
    def b(index: int, unattributed: int | None) -> GpuBalance:
        return GpuBalance(index, f"GPU-{index}", 10, 0, 0, unattributed,
                          None if unattributed is not None else "why")

    balances = [b(0, 100), b(1, 101), b(2, None)]
    assert [g.index for g in unattributed_gpus(balances, 100)] == [1]
    assert unattributed_gpus([b(0, 0), b(1, None)], 0) == ()


def test_found_pids_nvml_lists_are_not_unlisted() -> None:
    gpus = [gpu(0)]
    found = {30: "/dev/nvidia0", 10: "/srv/file", 20: "/dev/nvidia0"}
    rdevs: dict[str, int | None] = {"/dev/nvidia0": os.makedev(195, 0), "/srv/file": None}
    listed = [Holder(20, "GPU-0", 0, 5, "C")]
    assert search_holders(found, listed, rdevs, gpus, {"GPU-0": 0}) == (
        Holder(10, "", -1, None, UNLISTED_KIND), Holder(30, "GPU-0", 0, None, UNLISTED_KIND))


def test_node_check_is_not_clean_when_the_scan_failed_past_nvml() -> None:
    """A scan whose accounting or search raised has empty accounting: reading that as
    "nothing unattributed" would pass a node whose GPUs it never finished looking at."""
    from gpuguard.console.node_check import remaining
    from gpuguard.engine.scan.scanner import Snapshot
    from gpuguard.gpu.reading import GpuReading

    reading = GpuReading(True, "550.54.15", (), (), ())
    assert remaining(Snapshot(0.0, 0.0, reading, ()), 0)["why"] == []
    failed = Snapshot(0.0, 0.0, reading, (), errors=(("scan", "OSError: boom"),))
    assert remaining(failed, 0)["why"] == ["scan-failed: OSError: boom"]
