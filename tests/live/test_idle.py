"""The idle clocks the exporter builds from NVML's per-process utilization, over real
processes and the fake libnvidia-ml.so.1: gpuguard_gpu_process_idle_seconds,
gpuguard_orphan_tree_idle_seconds and gpuguard_user_gpu_idle_memory_bytes. The NVML
calls themselves are tested in test_nvml.py."""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry

from gpuguard.base.counters import Counters
from gpuguard.config.accounting import IdleAccounting
from gpuguard.engine.scan.scanner import Scanner, user_name
from gpuguard.exporter.metrics import GpuguardCollector
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.rules_config import Rules
from tests.support.fakenvml import FakeGpuWorld, default_uuid
from tests.support.proctree import Trees

pytest_plugins = ["tests.support.fakenvml.plugin"]

GIB = 2**30
NVML_ERROR_UNKNOWN = 999
NEW, LEGACY = "processes_utilization", "process_utilization"

#: GPU 0's per-GPU labels, as the collector below (hostname "node-1") writes them.
GPU0 = {"gpu": "0", "UUID": default_uuid(0), "Hostname": "node-1", "vendor": "nvidia"}


def make(boot: list[float], wall: list[float] | None = None,
         **kwargs: object) -> tuple[Scanner, CollectorRegistry]:
    """A scanner on the boot clock `boot[0]`; with `wall`, its NVML reader's wall clock is
    `wall[0]` (and its boot clock `boot[0]`), else the real clocks."""
    counters = Counters()
    # interval: the scans these tests make are the scanner's every scan, however far
    # apart on `boot` (a longer gap than 3 intervals is a stall, which restarts the clocks).
    kwargs.setdefault("interval", 60.0)
    nvml = (Nvml(counters=counters) if wall is None else
            Nvml(counters=counters, wall=lambda: wall[0], boot=lambda: boot[0]))
    scanner = Scanner(rules=Rules(), nvml=nvml,
                      view=ProcessView(counters=counters), counters=counters,
                      boot_clock=lambda: boot[0], **kwargs)  # type: ignore[arg-type]
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="node-1"))
    return scanner, registry


def test_idle_seconds_grow_for_an_idle_holder_and_stay_near_zero_for_a_busy_one(
        trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    idle_tree = trees.spawn("{holder} --pidfile {dir}/w")
    busy_tree = trees.spawn("{holder} --pidfile {dir}/w")
    idler, worker = idle_tree.pid("w"), busy_tree.pid("w")
    fake_gpu.add_process(0, idler, 2 * GIB)
    fake_gpu.add_process(0, worker, 3 * GIB)
    fake_gpu.set_busy(0, worker)
    boot = [100.0]
    scanner, registry = make(boot, accounting=IdleAccounting(idle_after_seconds=60))

    def idle_of(pid: int) -> float | None:
        return registry.get_sample_value("gpuguard_gpu_process_idle_seconds",
                                         {**GPU0, "pid": str(pid)})

    scanner.scan_once()
    assert idle_of(idler) == 0.0 and idle_of(worker) == 0.0
    for step in (30.0, 60.0, 90.0):
        boot[0] = 100.0 + step
        scanner.scan_once()
        assert idle_of(idler) == step
        assert idle_of(worker) == 0.0
    # The user's idle memory: the idle holder's 2 GiB (idle 90 s >= 60 s), not the busy one's.
    user = user_name(os.getuid())
    assert registry.get_sample_value("gpuguard_user_gpu_memory_bytes", {"user": user}) == 5 * GIB
    assert registry.get_sample_value("gpuguard_user_gpu_idle_memory_bytes",
                                     {"user": user}) == 2 * GIB
    # Work again: the clock restarts at that scan.
    fake_gpu.set_busy(0, idler)
    boot[0] = 200.0
    scanner.scan_once()
    fake_gpu.set_idle(0, idler)
    boot[0] = 210.0
    scanner.scan_once()
    assert idle_of(idler) == 10.0


def test_unknown_utilization_leaves_idle_series_absent(trees: Trees,
                                                       fake_gpu: FakeGpuWorld) -> None:
    tree = trees.spawn("{holder} --pidfile {dir}/w")
    pid = tree.pid("w")
    fake_gpu.add_process(0, pid, GIB)
    fake_gpu.set_not_supported(0, NEW)
    fake_gpu.set_not_supported(0, LEGACY)
    boot = [100.0]
    scanner, registry = make(boot, accounting=IdleAccounting(idle_after_seconds=0))
    scanner.scan_once()
    boot[0] = 500.0
    scanner.scan_once()
    assert registry.get_sample_value("gpuguard_gpu_process_memory_bytes",
                                     {**GPU0, "pid": str(pid)}) == GIB
    assert registry.get_sample_value("gpuguard_gpu_process_idle_seconds",
                                     {**GPU0, "pid": str(pid)}) is None
    assert registry.get_sample_value("gpuguard_user_gpu_idle_memory_bytes",
                                     {"user": user_name(os.getuid())}) == 0


def test_orphan_tree_idle_is_its_least_idle_holder(trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    tree = trees.spawn("sh -c '{holder} --pidfile {dir}/a & {holder} --pidfile {dir}/b & "
                       "echo $$ > {dir}/sh; wait' & wait")
    a, b, sh = tree.pid("a"), tree.pid("b"), tree.pid("sh")
    fake_gpu.add_process(0, a, GIB)
    fake_gpu.add_process(0, b, GIB)
    tree.kill_launcher()
    boot = [100.0]
    scanner, registry = make(boot)
    scanner.scan_once()
    boot[0] = 150.0
    fake_gpu.set_busy(0, b)
    snap = scanner.scan_once()
    fake_gpu.set_idle(0, b)
    boot[0] = 170.0
    snap = scanner.scan_once()
    root = next(t.root for t in snap.trees if t.verdict == "orphan")
    assert root is not None and root.pid == sh
    labels = {"root_pid": str(sh), "root_start_time": str(root.start_time), "comm": "sh",
              "user": user_name(os.getuid()), "reason": "session-ended"}
    assert registry.get_sample_value("gpuguard_orphan_tree_idle_seconds", labels) == 20.0
    # One holder's utilization unknown: the tree's idleness is too.
    fake_gpu.set_not_supported(0, NEW)
    fake_gpu.set_not_supported(0, LEGACY)
    scanner.nvml.close()  # a fresh init re-probes the calls
    scanner.scan_once()
    assert registry.get_sample_value("gpuguard_orphan_tree_idle_seconds", labels) is None
    assert registry.get_sample_value("gpuguard_orphan_tree_age_seconds", labels) is not None


def test_a_scan_after_a_stall_restarts_the_idle_clock(trees: Trees,
                                                      fake_gpu: FakeGpuWorld) -> None:
    """Scans more than three intervals apart (the exporter stopped, a VM paused): what
    the holder did meanwhile is not known, so its idle time counts from the new scan."""
    tree = trees.spawn("{holder} --pidfile {dir}/w")
    holder = tree.pid("w")
    fake_gpu.add_process(0, holder, 2 * GIB)
    boot = [100.0]
    scanner, registry = make(boot, interval=5.0)

    def idle() -> float | None:
        return registry.get_sample_value("gpuguard_gpu_process_idle_seconds",
                                         {**GPU0, "pid": str(holder)})

    for t in (100.0, 105.0, 110.0):
        boot[0] = t
        scanner.scan_once()
    assert idle() == 10.0
    boot[0] = 3710.0  # an hour without a scan
    scanner.scan_once()
    assert idle() == 0.0
    boot[0] = 3715.0
    scanner.scan_once()
    assert idle() == 5.0


def test_a_wall_clock_step_leaves_idle_series_absent_then_restarts_them(
        trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """Issue 47 at the exporter: NTP steps the clock back an hour. NVML's new samples are
    all older than the mark, so a holder at 100% SM read "no use" and its idle time grew
    from then on. The scan that sees the step leaves every idle series absent (unknown,
    never idle), and the clocks count again from the next scan."""
    busy_tree = trees.spawn("{holder} --pidfile {dir}/w")
    idle_tree = trees.spawn("{holder} --pidfile {dir}/w")
    worker, idler = busy_tree.pid("w"), idle_tree.pid("w")
    fake_gpu.add_process(0, worker, GIB)
    fake_gpu.add_process(0, idler, GIB)
    fake_gpu.set_busy(0, worker, sm_util=100, mem_util=0)
    boot, wall = [100.0], [time.time()]
    fake_gpu.set_clock(wall[0])
    scanner, registry = make(boot, wall)

    def scan_after(seconds: float) -> tuple[float | None, float | None]:
        boot[0] += seconds
        wall[0] += seconds
        fake_gpu.set_clock(wall[0])
        scanner.scan_once()
        return tuple(registry.get_sample_value(  # type: ignore[return-value]
            "gpuguard_gpu_process_idle_seconds",
            {**GPU0, "pid": str(pid)}) for pid in (worker, idler))

    assert scan_after(0) == (0.0, 0.0)
    assert scan_after(30) == (0.0, 30.0)
    wall[0] -= 3600
    assert scan_after(30) == (None, None)
    assert [scan_after(30) for _ in range(3)] == [(0.0, 0.0), (0.0, 30.0), (0.0, 60.0)]
