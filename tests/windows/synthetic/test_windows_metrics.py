"""A Windows scan through the exporter: the Scanner over a recorded Windows process table
(what psutil would read there) and real pynvml over the fake libnvidia-ml listing
Windows pids, rendered by exporter/metrics.py like any other Snapshot."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, generate_latest

from gpuguard.base.counters import Counters
from gpuguard.config.classify import default_rules
from gpuguard.engine.scan.scanner import Scanner
from gpuguard.exporter.metrics import GpuguardCollector
from gpuguard.gpu.nvml import Nvml
from gpuguard.gpu.source import GpuSource
from gpuguard.gpu.vendors import gpu_source
from gpuguard.host.platform.linux import BACKEND as LINUX_BACKEND
from gpuguard.host.procfs import ProcessView
from gpuguard.host.windows.platform import BACKEND as WINDOWS_BACKEND
from gpuguard.host.windows.tree import WinProc, encode_create_time
from gpuguard.host.windows.wddm import WddmMemory, WddmUsage, usage_of
from tests.support.fakenvml import FakeGpuWorld

GIB = 1 << 30
ALICE = "WIN-A\\alice"
#: train.py's creation, as psutil gives it, and its one encoding.
CREATED = 1_733_000_003.2504
ROOT_START = encode_create_time(CREATED)


def windows_table() -> dict[int, WinProc]:
    """cmd.exe (6000) is gone: train.py (7004) is an orphan root, its worker holds the GPU;
    a notebook under a live explorer holds one too."""
    def row(pid: int, ppid: int, created: float, name: str, *args: str) -> WinProc:
        return WinProc(pid, ppid, encode_create_time(created), (f"C:\\bin\\{name}", *args),
                       name, ALICE, 1)

    return {r.pid: r for r in (
        WinProc(4, 0, encode_create_time(1_733_000_000.0), (), "System",
                "NT AUTHORITY\\SYSTEM", 0),
        row(3000, 2900, 1_733_000_001.0, "explorer.exe"),
        row(3100, 3000, 1_733_000_001.5, "python.exe", "-m", "jupyter", "lab"),
        row(7004, 6000, CREATED, "python.exe", "train.py"),
        row(7008, 7004, CREATED + 0.05, "python.exe", "-c", "worker"),
        row(7012, 7004, CREATED + 0.06, "conhost.exe"),
    )}


def make(table: Mapping[int, WinProc],
         nvml: GpuSource | None = None) -> tuple[Scanner, CollectorRegistry]:
    counters = Counters()
    scanner = Scanner(rules=default_rules(WINDOWS_BACKEND.defaults),
                      nvml=nvml if nvml is not None else Nvml(counters=counters),
                      counters=counters, table=lambda: table,
                      host_pids=True)  # as Windows' platform says: no PID namespaces
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="win-a"))
    return scanner, registry


def test_a_windows_orphan_renders_with_its_integer_root_start_time(
        fake_gpu: FakeGpuWorld) -> None:
    fake_gpu.add_process(0, 7008, None)  # WDDM: NVML cannot size the process
    fake_gpu.add_process(0, 3100, None)
    scanner, registry = make(windows_table())
    snap = scanner.scan_once()
    (orphan,) = [t for t in snap.trees if t.verdict == "orphan"]
    assert (orphan.root_pid, orphan.reason, orphan.root_start_time) == (
        7004, "parent-gone", 1_733_000_003_250)
    labels = {"root_pid": "7004", "root_start_time": "1733000003250", "comm": "python.exe",
              "user": ALICE, "reason": "parent-gone"}
    assert registry.get_sample_value("gpuguard_orphan_tree_age_seconds", labels) == 0
    assert registry.get_sample_value("gpuguard_orphan_tree_processes", labels) == 3
    assert registry.get_sample_value("gpuguard_orphan_tree_memory_bytes", labels) == 0
    assert registry.get_sample_value("gpuguard_orphan_trees") == 1
    # The holders are listed though NVML could not size them (no memory series for them).
    text = generate_latest(registry).decode()
    assert 'gpuguard_gpu_process_info{comm="python.exe",container_id="",pid="7008",' \
           'pod_uid="",reason="parent-gone",root_pid="7004",start_time="1733000003300",' \
           'user="WIN-A\\\\alice",verdict="orphan"} 1.0' in text
    assert 'pid="3100"' in text and 'reason="protect-pattern"' in text
    assert 'gpuguard_gpu_process_memory_bytes{' not in text
    assert registry.get_sample_value("gpuguard_scan_errors_total", {"stage": "procfs"}) == 0


class FakeCounters:
    """What PDH's `\\GPU Process Memory(*)\\Dedicated Usage` would read on Windows (which
    cannot exist here): 3 GiB for the worker on one adapter."""

    def read(self) -> WddmUsage | None:
        return usage_of([("pid_7008_luid_0x00000000_0x0000D1A5_phys_0", 3 * GIB)])

    def close(self) -> None:
        pass


def test_wddm_sizes_what_nvml_could_not(fake_gpu: FakeGpuWorld) -> None:
    """Windows' scan reads NVML through the GPU seam with the Windows back-end's WDDM hook:
    the holders NVML lists without a size get WDDM's, and the orphan tree's memory
    follows."""
    fake_gpu.add_process(0, 7008, None)
    table = windows_table()
    windows = dataclasses.replace(
        WINDOWS_BACKEND, process_gpu_memory=lambda: WddmMemory(wddm=FakeCounters()))  # type: ignore[arg-type]
    scanner, registry = make(table, nvml=gpu_source(windows, Counters()))
    scanner.scan_once()
    labels = {"root_pid": "7004", "root_start_time": str(ROOT_START), "comm": "python.exe",
              "user": ALICE, "reason": "parent-gone"}
    assert registry.get_sample_value("gpuguard_orphan_tree_memory_bytes", labels) == 3 * GIB
    uuid = fake_gpu.gpus[0].uuid
    assert registry.get_sample_value(
        "gpuguard_gpu_process_memory_bytes",
        {"gpu": "0", "UUID": uuid, "Hostname": "win-a", "vendor": "nvidia",
         "pid": "7008"}) == 3 * GIB


def test_a_holder_missing_from_the_table_exited_since_and_is_no_scan_error(
        fake_gpu: FakeGpuWorld) -> None:
    """Windows has no PID namespaces: the table shows every pid NVML reports, and a listed
    holder missing from it exited since (issue 50: it was a `procfs` stage error)."""
    fake_gpu.add_process(0, 9999, GIB)
    scanner, registry = make(windows_table())
    (tree,) = scanner.scan_once().trees
    assert (tree.verdict, tree.reason) == ("unknown", "not-visible")
    assert registry.get_sample_value("gpuguard_scan_errors_total", {"stage": "procfs"}) == 0
    uuid = fake_gpu.gpus[0].uuid
    assert registry.get_sample_value("gpuguard_gpu_unseen_processes",
                                     {"gpu": "0", "UUID": uuid, "Hostname": "win-a",
                                      "vendor": "nvidia"}) == 1


def test_without_a_table_the_scanner_reads_proc_as_before(fake_gpu: FakeGpuWorld) -> None:
    """The Linux path: a pid NVML lists that /proc does not have is not-visible there too,
    in /proc's words."""
    fake_gpu.add_process(0, 2**22 + 7, GIB)
    counters = Counters()
    scanner = Scanner(rules=default_rules(LINUX_BACKEND.defaults), nvml=Nvml(counters=counters),
                      view=ProcessView(counters=counters), counters=counters)
    (tree,) = scanner.scan_once().trees
    assert (tree.verdict, tree.reason) == ("unknown", "not-visible")
    assert "/proc" in tree.evidence.detail
