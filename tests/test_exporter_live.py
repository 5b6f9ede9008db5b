"""The exporter as a real process over real trees and real pynvml on the fake library."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from gpuguard.exporter.procfs import in_host_pid_namespace
from tests.fakenvml import NVML_ERROR_DRIVER_NOT_LOADED, FakeGpuWorld
from tests.proctree import CHAIN, Trees, wait_for
from tests.servers import REPO, Exporter, child_env, find

GIB = 2**30

# bash (session leader) -> sh -> python holder; sh writes its pid to DIR/sh.
# The same, with the session leader kept alive after sh exits.
CHAIN_LEADER_STAYS = (
    "sh -c '{holder} --pidfile {dir}/worker & echo $$ > {dir}/sh; wait' & sleep 3600 & wait"
)


@pytest.fixture
def exporter_for(fake_gpu: FakeGpuWorld, fake_nvml_lib):
    started: list[Exporter] = []

    def start(*args: str, scan_interval: float = 0.2) -> Exporter:
        env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
        exp = Exporter(env=env, args=args, scan_interval=scan_interval)
        started.append(exp)
        return exp

    yield start
    for exp in started:
        exp.stop()


#: The exporter runs while the launcher is SIGKILLed: its process-event listener sees
#: that, except in a child PID namespace (CI's), where it stays off (host pids).
KILLED = "launcher-killed" if in_host_pid_namespace() else "session-ended"

def process_info(exp: Exporter, pid: int, **want: str):
    """Poll until gpuguard_gpu_process_info{pid} has the wanted labels; return them."""

    def probe():
        rows = find(exp.scrape(), "gpuguard_gpu_process_info", pid=str(pid))
        return rows[0][0] if rows and want.items() <= rows[0][0].items() else None

    return wait_for(probe, timeout=10, what=f"process_info for {pid} with {want}")


def orphan_age(exp: Exporter, root: int) -> float | None:
    rows = find(exp.scrape(), "gpuguard_orphan_tree_age_seconds", root_pid=str(root))
    return rows[0][1] if rows else None


def test_session_ended_orphan_ages_and_disappears(trees: Trees, fake_gpu: FakeGpuWorld,
                                                  exporter_for) -> None:
    tree = trees.spawn(CHAIN)
    worker, sh = tree.pid("worker"), tree.pid("sh")
    fake_gpu.add_process(0, worker, 3 * GIB)
    exp = exporter_for()
    process_info(exp, worker, verdict="normal")

    tree.kill_launcher()
    labels = process_info(exp, worker, verdict="orphan", reason=KILLED, root_pid=str(sh))
    assert labels["comm"] == "python3" or labels["comm"].startswith("python")
    first = wait_for(lambda: orphan_age(exp, sh), what="orphan age series")
    samples = exp.scrape()
    (tree_labels, memory), = find(samples, "gpuguard_orphan_tree_memory_bytes")
    assert tree_labels["root_pid"] == str(sh) and tree_labels["reason"] == KILLED
    assert tree_labels["comm"] == "sh" and memory == 3 * GIB
    (_, procs), = find(samples, "gpuguard_orphan_tree_processes", root_pid=str(sh))
    assert procs == 2  # sh and the python worker
    assert find(samples, "gpuguard_orphan_trees")[0][1] == 1
    wait_for(lambda: (orphan_age(exp, sh) or 0) > first + 0.3, what="age to grow")

    tree.kill(worker)
    tree.kill(sh)
    fake_gpu.remove_process(worker)
    wait_for(lambda: orphan_age(exp, sh) is None, what="orphan series to disappear")
    assert find(exp.scrape(), "gpuguard_orphan_trees")[0][1] == 0


def test_parent_exited_orphan_roots_at_the_adopted_process(trees: Trees, fake_gpu: FakeGpuWorld,
                                                           exporter_for) -> None:
    tree = trees.spawn(CHAIN_LEADER_STAYS)
    worker, sh = tree.pid("worker"), tree.pid("sh")
    fake_gpu.add_process(0, worker, GIB)
    exp = exporter_for()
    tree.kill(sh)  # the intermediate parent dies; the session leader (bash) lives on
    process_info(exp, worker, verdict="orphan", reason="parent-exited", root_pid=str(worker))
    assert wait_for(lambda: orphan_age(exp, worker) is not None, what="age series")


@pytest.mark.parametrize(
    ("script", "verdict", "reasons"),
    [
        ("setsid {holder} --pidfile {dir}/worker & wait", "normal", {"detached", "attached"}),
        ("nohup {holder} --pidfile {dir}/worker >/dev/null 2>&1 & wait",
         "protected", {"ignores-sighup"}),
        ("{holder} --pidfile {dir}/worker jupyter-kernel & wait", "protected", {"protect-pattern"}),
    ],
    ids=["setsid-detached", "nohup", "protect-pattern"],
)
def test_launcher_gone_but_not_an_orphan(trees: Trees, fake_gpu: FakeGpuWorld, exporter_for,
                                         script: str, verdict: str, reasons: set[str]) -> None:
    tree = trees.spawn(script)
    worker = tree.pid("worker")
    fake_gpu.add_process(0, worker, GIB)
    tree.kill_launcher()
    exp = exporter_for()
    labels = process_info(exp, worker, verdict=verdict)
    assert labels["reason"] in reasons
    # The verdict must hold over several more scans, never flipping to orphan.
    scans = find(exp.scrape(), "gpuguard_scans_total")[0][1]
    wait_for(lambda: find(exp.scrape(), "gpuguard_scans_total")[0][1] >= scans + 3,
             what="three more scans")
    assert process_info(exp, worker)["verdict"] == verdict
    assert orphan_age(exp, worker) is None
    assert find(exp.scrape(), "gpuguard_orphan_trees")[0][1] == 0


def test_healthy_tree_is_normal(trees: Trees, fake_gpu: FakeGpuWorld, exporter_for) -> None:
    tree = trees.spawn("{holder} --pidfile {dir}/worker & wait")
    worker = tree.pid("worker")
    fake_gpu.add_process(0, worker, GIB)
    exp = exporter_for()
    labels = process_info(exp, worker, verdict="normal", reason="attached")
    assert labels["root_pid"] != str(worker)
    samples = exp.scrape()
    assert find(samples, "gpuguard_gpu_process_memory_bytes", pid=str(worker))[0][1] == GIB
    assert find(samples, "gpuguard_orphan_trees")[0][1] == 0


def test_gpu_gauges_and_info(fake_gpu: FakeGpuWorld, exporter_for) -> None:
    fake_gpu.update_gpu(0, memory_used=5 * GIB, util_gpu=75, temp=61, power_mw=250_500)
    exp = exporter_for("--hostname", "gpu-node-7")
    samples = wait_for(lambda: (s := exp.scrape()) and find(s, "gpuguard_gpu_info") and s,
                       what="first scan")
    uuid = fake_gpu.gpus[0].uuid
    assert find(samples, "gpuguard_gpu_memory_bytes", gpu="0", uuid=uuid)[0][1] == 80 * GIB
    assert find(samples, "gpuguard_gpu_memory_used_bytes", gpu="0")[0][1] == 5 * GIB
    assert find(samples, "gpuguard_gpu_utilization_ratio", gpu="0")[0][1] == pytest.approx(0.75)
    assert find(samples, "gpuguard_gpu_temperature_celsius", gpu="0")[0][1] == 61
    assert find(samples, "gpuguard_gpu_power_watts", gpu="0")[0][1] == pytest.approx(250.5)
    info, = find(samples, "gpuguard_gpu_info")
    assert info[0]["driver_version"] == "550.54.15" and info[0]["name"] == "NVIDIA Fake H100"
    host, = find(samples, "gpuguard_host_info")
    assert host[0]["hostname"] == "gpu-node-7"
    assert find(samples, "gpuguard_nvml_up")[0][1] == 1
    assert requests.get(f"{exp.url}/healthz", timeout=5).status_code == 200


def test_no_driver_then_driver_appears(fake_gpu: FakeGpuWorld, exporter_for) -> None:
    fake_gpu.set_init_error(NVML_ERROR_DRIVER_NOT_LOADED)
    exp = exporter_for()
    wait_for(lambda: find(exp.scrape(), "gpuguard_nvml_up") == [({}, 0.0)], what="nvml_up 0")
    wait_for(lambda: find(exp.scrape(), "gpuguard_scan_errors_total", stage="nvml_init")[0][1] >= 2,
             what="init errors counted")
    assert requests.get(f"{exp.url}/healthz", timeout=5).status_code == 200
    warnings = [line for line in exp.stderr_lines if "WARNING gpuguard.exporter.nvml" in line]
    assert len(warnings) == 1, warnings  # one clear warning, not one per scan
    fake_gpu.set_init_error(None)
    wait_for(lambda: find(exp.scrape(), "gpuguard_nvml_up") == [({}, 1.0)], what="driver pickup")
    assert find(exp.scrape(), "gpuguard_gpu_info")


def test_lost_gpu_and_missing_holder_are_counted_not_fatal(trees: Trees, fake_gpu: FakeGpuWorld,
                                                           exporter_for) -> None:
    fake_gpu.add_gpu(1)
    tree = trees.spawn("{holder} --pidfile {dir}/worker & wait")
    worker = tree.pid("worker")
    fake_gpu.add_process(0, worker, GIB)
    fake_gpu.add_process(0, 4_000_000, GIB)  # above pid_max: never a real process
    fake_gpu.set_gpu_lost(1)
    exp = exporter_for()

    def errors(stage: str) -> float:
        rows = find(exp.scrape(), "gpuguard_scan_errors_total", stage=stage)
        return rows[0][1] if rows else 0

    wait_for(lambda: errors("nvml_device") >= 1, what="GPU-lost error counted")
    wait_for(lambda: errors("procfs") >= 1, what="missing holder counted")
    samples = exp.scrape()
    assert [lbl["gpu"] for lbl, _ in find(samples, "gpuguard_gpu_info")] == ["0"]
    assert find(samples, "gpuguard_nvml_up")[0][1] == 1
    assert process_info(exp, 4_000_000)["verdict"] == "unknown"
    assert process_info(exp, worker)["verdict"] == "normal"
    fake_gpu.set_gpu_lost(1, False)
    wait_for(lambda: len(find(exp.scrape(), "gpuguard_gpu_info")) == 2, what="GPU 1 back")


def test_metrics_answer_while_a_scan_is_slow(fake_gpu: FakeGpuWorld, exporter_for) -> None:
    exp = exporter_for(scan_interval=0.05)
    wait_for(lambda: find(exp.scrape(), "gpuguard_gpu_info"), what="first scan")
    fake_gpu.set_delay_ms(400)  # each NVML call now sleeps: a scan takes seconds
    wait_for(lambda: find(exp.scrape(), "gpuguard_scan_duration_seconds")[0][1] > 1.0,
             timeout=30, what="a slow scan to complete")
    worst = 0.0
    for _ in range(20):
        began = time.perf_counter()
        exp.scrape(timeout=2)
        worst = max(worst, time.perf_counter() - began)
    assert worst < 0.5, f"a scrape waited {worst:.3f}s for the scan"


def test_concurrent_scrapes_see_complete_snapshots(trees: Trees, fake_gpu: FakeGpuWorld,
                                                   exporter_for) -> None:
    exp = exporter_for(scan_interval=0.01)
    wait_for(lambda: find(exp.scrape(), "gpuguard_gpu_info"), what="first scan")
    failures: list[str] = []

    def hammer() -> None:
        for _ in range(30):
            samples = exp.scrape()
            if len(find(samples, "gpuguard_gpu_info")) != 1:
                failures.append("missing gpu_info")

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ("classify:\n  protectt: [x]\n", "classify.protectt: unknown key"),
        ("classify:\n  protect: ['(']\n", "classify.protect[0]: bad regex"),
        ("classify:\n  max_depth: deep\n", "classify.max_depth: must be an integer"),
        ("classify: [\n", "invalid YAML"),
        ("remediate:\n  mode: yolo\n", "remediate.mode: must be one of dry-run, enforce"),
    ],
)
def test_bad_config_exits_with_one_line(tmp_path, config: str, needle: str) -> None:
    path = tmp_path / "gpuguard.yml"
    path.write_text(config)
    proc = subprocess.run([sys.executable, "-m", "gpuguard.exporter", "--config", str(path),
                           "--listen", "127.0.0.1:0"], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(path) in lines[0] and needle in lines[0]


def test_missing_config_file_is_named(tmp_path) -> None:
    missing = tmp_path / "nope.yml"
    proc = subprocess.run([sys.executable, "-m", "gpuguard.exporter", "--config", str(missing)],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    expected = f"gpuguard-exporter: config error: {missing}: (file): no such file"
    assert proc.stderr.strip() == expected


def test_a_normal_start_logs_no_error(fake_gpu: FakeGpuWorld, exporter_for) -> None:
    exp = exporter_for()
    wait_for(lambda: find(exp.scrape(), "gpuguard_scans_total", ), what="a scan")
    wait_for(lambda: any("serving /metrics" in line for line in exp.stderr_lines),
             what="the start-up line")
    text = "".join(exp.stderr_lines)
    assert "Traceback" not in text and "Logging error" not in text, text


def test_sigterm_stops_the_exporter(fake_gpu: FakeGpuWorld, exporter_for) -> None:
    exp = exporter_for()
    exp.proc.send_signal(signal.SIGTERM)
    assert exp.proc.wait(timeout=10) == 0
