"""The Collector in-process: a fresh CollectorRegistry per test, read with get_sample_value."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, generate_latest

from gpuguard.base import build
from gpuguard.base.counters import Counters
from gpuguard.config.accounting import Quotas
from gpuguard.engine.scan.scanner import Scanner, user_name
from gpuguard.exporter.metrics import GpuguardCollector
from gpuguard.gpu.nvml import Nvml
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.process import Holder
from gpuguard.orphans.rules_config import Rules
from tests.support.fakenvml import FakeGpuWorld, default_uuid
from tests.support.proctree import Trees, wait_for

GIB = 2**30


def make(clock=None, boot_clock=None) -> tuple[Scanner, CollectorRegistry]:
    """A scanner; a given `clock` drives the boot clock too, unless `boot_clock` is given."""
    counters = Counters()
    kwargs = {"clock": clock, "boot_clock": boot_clock or clock} if clock else {}
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters),
                      view=ProcessView(counters=counters), counters=counters, **kwargs)
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="node-1"))
    return scanner, registry


def test_before_the_first_scan_only_host_and_counters(fake_gpu: FakeGpuWorld) -> None:
    _, registry = make()
    assert registry.get_sample_value("gpuguard_host_info",
                                     {"hostname": "node-1", "version": build.version()}) == 1
    assert registry.get_sample_value("gpuguard_scans_total") == 0
    assert registry.get_sample_value("gpuguard_nvml_up") is None


def test_a_wall_clock_step_does_not_age_an_orphan(trees: Trees,
                                                  fake_gpu: FakeGpuWorld) -> None:
    """Ages count on the boot clock: NTP stepping the wall clock a day ahead must not make
    a tree look a day old (its alert would fire at once)."""
    tree = trees.spawn("sh -c '{holder} --pidfile {dir}/w & echo $$ > {dir}/sh; wait' & wait")
    fake_gpu.add_process(0, tree.pid("w"), GIB)
    tree.pid("sh")
    tree.kill_launcher()
    wall, boot = [1000.0], [50.0]
    scanner, _ = make(clock=lambda: wall[0], boot_clock=lambda: boot[0])
    scanner.scan_once()
    wall[0] += 86400.0
    boot[0] += 2.0
    (info,) = scanner.scan_once().orphans.values()
    assert info.age_seconds == 2.0
    assert info.first_seen == wall[0] - 2.0


def test_orphan_age_counts_from_first_sighting_and_labels_are_bounded(
        trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    tree = trees.spawn("sh -c '{holder} --pidfile {dir}/w & echo $$ > {dir}/sh; wait' & wait")
    worker, sh = tree.pid("w"), tree.pid("sh")
    fake_gpu.add_process(0, worker, 2 * GIB)
    now = [1000.0]
    scanner, registry = make(clock=lambda: now[0])
    scanner.scan_once()
    tree.kill_launcher()
    now[0] = 1010.0
    snap = scanner.scan_once()  # first scan that sees it orphaned: age 0
    root = next(t.root for t in snap.trees if t.verdict == "orphan")
    labels = {"root_pid": str(sh), "root_start_time": str(root.start_time), "comm": "sh",
              "user": user_name(os.getuid()), "reason": "session-ended"}
    assert registry.get_sample_value("gpuguard_orphan_tree_age_seconds", labels) == 0
    now[0] = 1042.5
    scanner.scan_once()
    assert registry.get_sample_value("gpuguard_orphan_tree_age_seconds", labels) == 32.5
    assert registry.get_sample_value("gpuguard_orphan_tree_memory_bytes", labels) == 2 * GIB
    assert registry.get_sample_value("gpuguard_last_scan_timestamp_seconds") == 1042.5
    assert registry.get_sample_value("gpuguard_scans_total") == 3
    # No label carries a command line: the holder's argv includes its pid file path.
    text = generate_latest(registry).decode()
    assert "--pidfile" not in text and str(tree.dir) not in text
    assert undocumented(text) == []


def meaningless(name: str, doc: str) -> bool:
    """Help text that says nothing: empty, a single word, or the metric's own name."""
    words = doc.strip().rstrip(".").split()
    return len(words) < 2 or doc.strip() in (name, name.removesuffix("_total"))


def undocumented(text: str) -> list[str]:
    """Families in an exposition whose `# HELP name text` line is missing or meaningless.

    generate_latest writes a `# HELP` line for every family, empty documentation or not,
    so the line's presence proves nothing: its text is what is checked.
    """
    helps: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            _, _, name, *doc = line.split(" ", 3)
            helps[name] = doc[0] if doc else ""
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert types, "no families in the exposition"
    return [name for name in types if meaningless(name, helps.get(name, ""))]


def test_every_family_the_collector_can_yield_is_documented(fake_gpu: FakeGpuWorld) -> None:
    """describe() lists every family, those of an empty scan included."""
    scanner, _ = make()
    families = list(GpuguardCollector(scanner, hostname="n").describe())
    assert len(families) > 20
    assert [f.name for f in families if meaningless(f.name, f.documentation)] == []


def test_a_tree_that_stops_being_orphan_restarts_its_clock(
        trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    tree = trees.spawn("sh -c '{holder} --pidfile {dir}/w & echo $$ > {dir}/sh; wait' & wait")
    worker, sh = tree.pid("w"), tree.pid("sh")
    fake_gpu.add_process(0, worker, GIB)
    tree.kill_launcher()
    now = [0.0]
    scanner, registry = make(clock=lambda: now[0])
    scanner.scan_once()
    fake_gpu.remove_process(worker)  # the tree released the GPU
    now[0] = 50.0
    scanner.scan_once()
    assert registry.get_sample_value("gpuguard_orphan_trees") == 0
    fake_gpu.add_process(0, worker, GIB)
    now[0] = 60.0
    snap = scanner.scan_once()
    (info,) = snap.orphans.values()
    assert info.first_seen == 60.0 and info.age_seconds == 0
    assert sh in {t.root_pid for t in snap.trees}


class _Exploding:
    def read(self):
        raise RuntimeError("driver wedged")


def test_an_unexpected_nvml_failure_is_counted_and_scanning_goes_on() -> None:
    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=_Exploding(), counters=counters,  # type: ignore[arg-type]
                      view=ProcessView(counters=counters))
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="n"))
    scanner.scan_once()
    scanner.scan_once()
    assert registry.get_sample_value("gpuguard_scan_errors_total", {"stage": "scan"}) == 2
    assert registry.get_sample_value("gpuguard_nvml_up") == 0
    assert registry.get_sample_value("gpuguard_scans_total") == 2


def call(app, path: str) -> tuple[str, bytes]:
    got: list[str] = []
    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": "GET", "QUERY_STRING": ""},
                        lambda status, headers: got.append(status)))
    return got[0], body


def test_healthz_follows_the_scan_thread(fake_gpu: FakeGpuWorld) -> None:
    from gpuguard.exporter.cli import make_app

    scanner, registry = make()
    app = make_app(scanner, registry)
    scanner.scan_once()
    status, body = call(app, "/healthz")
    assert status.startswith("503") and body == b"scan-thread-stopped\n"  # never started
    scanner.interval = 0.05
    scanner.start()
    try:
        status, body = call(app, "/healthz")
        assert status.startswith("200") and body == b"ok\n"  # a code: nothing else
    finally:
        scanner.stop()
    assert call(app, "/healthz")[0].startswith("503")
    assert call(app, "/nope")[0].startswith("404")
    assert b"gpuguard_host_info" in call(app, "/metrics")[1]


class ReadingOf:
    """NVML's answer for a synthetic table (the one thing here that needs a GPU)."""

    def __init__(self, *holders: Holder) -> None:
        self.reading = GpuReading(True, "550", (), holders, ())

    def read(self) -> GpuReading:
        return self.reading


def test_each_holder_shows_its_own_verdict_in_process_info() -> None:
    """Two jobs under one root (an sshd listener's logins, say) keep their own verdicts."""
    from tests.support.proctable import SyntheticView, holder, init, leader, proc

    view = SyntheticView([
        init(),
        leader(50, ppid=1, comm="sshd", cgroup="/system.slice/ssh.service"),
        proc(60, ppid=50, sid=50, comm="python", sighup_ignored=True),
        proc(70, ppid=50, sid=50, comm="python", cgroup="/system.slice/ssh.service"),
    ])
    scanner = Scanner(rules=Rules(), nvml=ReadingOf(holder(60), holder(70)),  # type: ignore[arg-type]
                      view=view, counters=Counters())  # type: ignore[arg-type]
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="node-1"))
    (tree,) = scanner.scan_once().trees
    assert tree.verdict == "protected"  # the safest of both, for the tree

    def info(pid: str) -> tuple[str, str]:
        for metric in registry.collect():
            for sample in metric.samples:
                if sample.name == "gpuguard_gpu_process_info" and sample.labels["pid"] == pid:
                    return sample.labels["verdict"], sample.labels["reason"]
        raise AssertionError(pid)

    assert info("60") == ("protected", "ignores-sighup")
    assert info("70") == ("normal", "managed")


def test_a_name_filtered_scrape_finds_the_collectors_families(fake_gpu: FakeGpuWorld) -> None:
    """/metrics?name[]=... asks describe() which collector has which family."""
    scanner, registry = make()
    scanner.scan_once()
    only = registry.restricted_registry(["gpuguard_host_info", "gpuguard_nvml_up"])
    names = {s.name for metric in only.collect() for s in metric.samples}
    assert names == {"gpuguard_host_info", "gpuguard_nvml_up"}


def samples_of(registry: CollectorRegistry, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(s.labels), s.value) for metric in registry.collect() for s in metric.samples
            if s.name == name]


def test_accounting_series_in_a_fake_world(trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """GPU 0 has 1 GiB reserved by the driver; a process on GPU 1 cannot be sized."""
    me = user_name(os.getuid())
    fake_gpu.update_gpu(0, memory_used=10 * GIB, memory_reserved=GIB)
    fake_gpu.add_gpu(1, memory_used=6 * GIB)
    a, b, c = (trees.spawn("{holder} --pidfile {dir}/worker & wait").pid("worker")
               for _ in range(3))
    fake_gpu.add_process(0, a, 4 * GIB)
    fake_gpu.add_process(1, a, 2 * GIB)
    fake_gpu.add_process(0, b, 3 * GIB)
    fake_gpu.add_process(1, c, None)  # NVML_VALUE_NOT_AVAILABLE
    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters), counters=counters,
                      view=ProcessView(counters=counters),
                      quotas=Quotas(users=((me, 5 * GIB),)))
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="node-1"))
    scanner.scan_once()

    # Used memory is _v2's (without the reserved GiB): 10 GiB used, 7 GiB held by processes.
    gpu0 = {"gpu": "0", "UUID": fake_gpu.gpus[0].uuid, "Hostname": "node-1", "vendor": "nvidia"}
    assert registry.get_sample_value("gpuguard_gpu_memory_used_bytes", gpu0) == 10 * GIB
    assert samples_of(registry, "gpuguard_gpu_memory_unattributed_bytes") == [
        (gpu0, 3 * GIB)]  # GPU 1: absent, not 0
    # Every holding of the user's processes, both GPUs; the unsized one counts 0.
    assert registry.get_sample_value("gpuguard_user_gpu_memory_bytes", {"user": me}) == 9 * GIB
    assert registry.get_sample_value("gpuguard_user_gpu_memory_quota_bytes",
                                     {"user": me}) == 5 * GIB
    info = [labels for labels, _ in samples_of(registry, "gpuguard_gpu_process_info")]
    assert sorted(int(labels["pid"]) for labels in info) == sorted([a, b, c])
    assert all(labels["container_id"] == "" and labels["pod_uid"] == "" for labels in info)
    assert samples_of(registry, "gpuguard_suspect_process_info") == []

    fake_gpu.remove_process(c)  # now every process on GPU 1 is sized: 6 - 2 GiB unattributed
    scanner.scan_once()
    assert registry.get_sample_value("gpuguard_gpu_memory_unattributed_bytes", {
        "gpu": "1", "UUID": fake_gpu.gpus[1].uuid, "Hostname": "node-1",
        "vendor": "nvidia"}) == 4 * GIB


def test_no_quota_no_quota_series(trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    worker = trees.spawn("{holder} --pidfile {dir}/worker & wait").pid("worker")
    fake_gpu.add_process(0, worker, GIB)
    scanner, registry = make()
    scanner.scan_once()
    assert samples_of(registry, "gpuguard_user_gpu_memory_bytes") == [
        ({"user": user_name(os.getuid())}, GIB)]
    assert samples_of(registry, "gpuguard_user_gpu_memory_quota_bytes") == []


def test_a_gpu_whose_process_list_fails_has_no_unattributed_figure(
        fake_gpu: FakeGpuWorld) -> None:
    fake_gpu.update_gpu(0, memory_used=5 * GIB)
    fake_gpu.set_field_error(0, "compute", 999)
    scanner, registry = make()
    scanner.scan_once()
    assert samples_of(registry, "gpuguard_gpu_memory_unattributed_bytes") == []
    fake_gpu.set_field_error(0, "compute", None)
    scanner.scan_once()
    assert samples_of(registry, "gpuguard_gpu_memory_unattributed_bytes")[0][1] == 5 * GIB


def test_a_pid_listed_twice_with_one_unsized_entry_leaves_no_unattributed_figure(
        trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """The review's MIG case: entries (2 GiB, not available) for one pid on a GPU with
    10 GiB used must not read as "8 GiB held by nobody" (a false GPUMemoryUnattributed)."""
    worker = trees.spawn("{holder} --pidfile {dir}/worker & wait").pid("worker")
    fake_gpu.update_gpu(0, memory_used=10 * GIB)
    fake_gpu.add_process(0, worker, 2 * GIB)
    fake_gpu.add_process(0, worker, None)
    scanner, registry = make()
    scanner.scan_once()
    assert samples_of(registry, "gpuguard_gpu_memory_unattributed_bytes") == []
    assert samples_of(registry, "gpuguard_gpu_process_memory_bytes") == []  # unknown, not 2 GiB
    fake_gpu.remove_process(worker)
    fake_gpu.add_process(0, worker, 2 * GIB)
    fake_gpu.add_process(0, worker, 3 * GIB)  # both sized: they add up
    scanner.scan_once()
    assert samples_of(registry, "gpuguard_gpu_memory_unattributed_bytes")[0][1] == 5 * GIB


def test_a_driver_without_memory_v2_has_no_unattributed_figure(trees: Trees,
                                                               fake_gpu: FakeGpuWorld) -> None:
    """_v1's used memory includes the driver's reserved memory, which no process holds:
    the series is absent there, not reserved memory passed off as unattributed."""
    worker = trees.spawn("{holder} --pidfile {dir}/worker & wait").pid("worker")
    fake_gpu.update_gpu(0, memory_used=4 * GIB, memory_reserved=GIB)
    fake_gpu.add_process(0, worker, 4 * GIB)
    fake_gpu.set_missing("nvmlDeviceGetMemoryInfo_v2")
    scanner, registry = make()
    scanner.scan_once()
    assert samples_of(registry, "gpuguard_gpu_memory_used_bytes")[0][1] == 5 * GIB  # with it
    assert samples_of(registry, "gpuguard_gpu_memory_unattributed_bytes") == []


def test_the_exposition_passes_promtool_check_metrics(trees: Trees,
                                                      fake_gpu: FakeGpuWorld) -> None:
    """Every family, the accounting ones with samples, linted by Prometheus's own tool."""
    import subprocess

    from tests.support.promstack import PROMTOOL, require_binaries

    require_binaries()
    assert PROMTOOL is not None
    me = user_name(os.getuid())
    tree = trees.spawn("sh -c '{holder} --pidfile {dir}/w & echo $$ > {dir}/sh; wait' & wait")
    suspect = trees.spawn("exec -a xmrig {holder} --pidfile {dir}/worker & wait")
    fake_gpu.update_gpu(0, memory_used=8 * GIB)
    fake_gpu.set_recovery_action(0, 1)
    fake_gpu.add_process(0, tree.pid("w"), 2 * GIB)
    fake_gpu.add_process(0, suspect.pid("worker"), GIB)
    tree.pid("sh")
    tree.kill_launcher()
    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters), counters=counters,
                      view=ProcessView(counters=counters), quotas=Quotas(users=((me, GIB),)))
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="node-1"))
    scanner.scan_once()
    text = generate_latest(registry).decode()
    for name in ("gpuguard_user_gpu_memory_bytes{", "gpuguard_user_gpu_memory_quota_bytes{",
                 "gpuguard_suspect_process_info{", "gpuguard_gpu_memory_unattributed_bytes{",
                 "gpuguard_orphan_tree_age_seconds{", "gpuguard_gpu_recovery_action{"):
        assert name in text, name
    lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60, check=False)
    # One warning is on purpose: gpuguard_gpu_info's modelName is dcgm-exporter's name for
    # the model, so the two join and read alike (docs/metrics.md, Labels); dcgm's names win
    # over the lint's snake_case. Anything else the lint says fails.
    warnings = [line for line in (lint.stdout + lint.stderr).splitlines() if line.strip()]
    assert warnings == ["gpuguard_gpu_info label names should be written in 'snake_case' "
                        "not 'camelCase'"], lint.stdout + lint.stderr
    assert undocumented(text) == []


def test_ready_waits_for_the_first_scan_and_ends_with_the_scan_thread(
        fake_gpu: FakeGpuWorld) -> None:
    """/-/ready stayed 200 after the scan thread stopped, while /metrics showed the last
    scan for ever (only /-/healthy said so)."""
    from typing import Any, cast

    from gpuguard.exporter.cli import exporter_lifecycle

    scanner, _registry = make()
    ready = exporter_lifecycle(scanner, cast(Any, None), False).ready
    assert ready() == (False, "gpuguard-exporter is not ready: the first scan is not done.")
    scanner.interval = 0.05
    scanner.start()
    try:
        wait_for(lambda: scanner.latest is not None, what="the first scan")
        assert ready() == (True, "gpuguard-exporter is Ready.")
    finally:
        scanner.stop()
    assert ready() == (False, "gpuguard-exporter is not ready: the scan thread stopped.")


def test_process_events_up_is_absent_without_a_listener(fake_gpu: FakeGpuWorld) -> None:
    """A platform without a process-event listener (Windows: events=None) has no such
    gauge, rather than a 0 that GPUGuardProcessEventsDown would page for on every host."""
    _, registry = make()
    assert registry.get_sample_value("gpuguard_process_events_total", {"kind": "exit"}) == 0
    assert registry.get_sample_value("gpuguard_process_events_up") is None


def test_the_recovery_action_nvml_reports_is_one_series_per_gpu(
        fake_gpu: FakeGpuWorld) -> None:
    """Each action the fake driver reports shows as the series' `action` label, one series
    per GPU; a GPU whose driver cannot say (NOT_SUPPORTED) has none, never "none"."""
    fake_gpu.add_gpu(1)
    fake_gpu.add_gpu(2)
    fake_gpu.set_recovery_action(1, 0)
    scanner, registry = make()
    gpu = {"Hostname": "node-1", "vendor": "nvidia"}
    for code, action in ((1, "gpu-reset"), (2, "node-reboot"), (3, "drain-p2p"),
                         (4, "drain-and-reset"), (0, "none")):
        fake_gpu.set_recovery_action(0, code)
        scanner.scan_once()
        assert samples_of(registry, "gpuguard_gpu_recovery_action") == [
            ({"gpu": "0", "UUID": default_uuid(0), **gpu, "action": action}, 1.0),
            ({"gpu": "1", "UUID": default_uuid(1), **gpu, "action": "none"}, 1.0),
        ], action  # GPU 2: NOT_SUPPORTED, no series


def test_the_recovery_action_stays_without_the_gpu_collector(fake_gpu: FakeGpuWorld) -> None:
    """--no-collector.gpu drops the gauges dcgm-exporter also exports, not the one an alert
    (GPUGuardGPURecoveryAction) reads."""
    fake_gpu.set_recovery_action(0, 2)
    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters),
                      view=ProcessView(counters=counters), counters=counters)
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="node-1", gpu=False))
    scanner.scan_once()
    assert samples_of(registry, "gpuguard_gpu_memory_bytes") == []
    assert [labels["action"] for labels, _ in
            samples_of(registry, "gpuguard_gpu_recovery_action")] == ["node-reboot"]
