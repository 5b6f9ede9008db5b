"""The exporter as a real process over real trees and real pynvml on the fake library."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from gpuguard.host.procfs import in_host_pid_namespace
from tests.live.test_accounting import ID as CONTAINER_ID
from tests.live.test_accounting import LIVE_CGROUPS
from tests.live.test_accounting import UID as POD_UID
from tests.support.fakenvml import NVML_ERROR_DRIVER_NOT_LOADED, FakeGpuWorld
from tests.support.proctree import CHAIN, HOLDER, Trees, stat_fields, wait_for
from tests.support.servers import REPO, Exporter, child_env, find

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
    assert find(samples, "gpuguard_gpu_memory_bytes", gpu="0", UUID=uuid)[0][1] == 80 * GIB
    # dcgm-exporter's label names, one spelling each: no lowercase uuid, modelName not name.
    for name in ("gpuguard_gpu_memory_bytes", "gpuguard_gpu_info"):
        (labels, _), = find(samples, name, gpu="0")
        assert "uuid" not in labels and "name" not in labels, (name, labels)
    assert find(samples, "gpuguard_gpu_memory_used_bytes", gpu="0")[0][1] == 5 * GIB
    assert find(samples, "gpuguard_gpu_utilization_ratio", gpu="0")[0][1] == pytest.approx(0.75)
    assert find(samples, "gpuguard_gpu_temperature_celsius", gpu="0")[0][1] == 61
    assert find(samples, "gpuguard_gpu_power_watts", gpu="0")[0][1] == pytest.approx(250.5)
    info, = find(samples, "gpuguard_gpu_info")
    assert info[0]["driver_version"] == "550.54.15" and info[0]["modelName"] == "NVIDIA Fake H100"
    # dcgm-exporter's device and pci_bus_id, on the info series only: a gauge joins them
    # on UUID, so no per-sample bytes are spent on labels that never change.
    assert (info[0]["device"], info[0]["pci_bus_id"]) == ("nvidia0", "00000000:01:00.0")
    for name in ("gpuguard_gpu_memory_bytes", "gpuguard_gpu_process_memory_bytes"):
        for labels, _ in find(samples, name):
            assert not {"device", "pci_bus_id"} & set(labels), (name, labels)
    host, = find(samples, "gpuguard_host_info")
    assert host[0]["hostname"] == "gpu-node-7"
    # The host name as the alert contract spells it, `hostname`, on gpuguard_host_info alone;
    # as dcgm-exporter before its rename spelled it, `Hostname`, on every series that names
    # a GPU (older dcgm-exporters' joins use it), and on no other (docs/metrics.md, Labels).
    assert [n for (n, labels) in samples if "hostname" in dict(labels)] == ["gpuguard_host_info"]
    per_gpu = {n for (n, labels) in samples if "UUID" in dict(labels)}
    assert {"gpuguard_gpu_info", "gpuguard_gpu_memory_bytes", "gpuguard_gpu_memory_used_bytes",
            "gpuguard_gpu_utilization_ratio", "gpuguard_gpu_temperature_celsius",
            "gpuguard_gpu_power_watts"} <= per_gpu
    assert {n for (n, labels) in samples if dict(labels).get("Hostname") == "gpu-node-7"} == \
        per_gpu
    assert [n for (n, labels) in samples if "Hostname" in dict(labels)
            and dict(labels)["Hostname"] != "gpu-node-7"] == []
    assert find(samples, "gpuguard_nvml_up")[0][1] == 1
    assert requests.get(f"{exp.url}/healthz", timeout=5).status_code == 200


def test_no_driver_then_driver_appears(fake_gpu: FakeGpuWorld, exporter_for) -> None:
    fake_gpu.set_init_error(NVML_ERROR_DRIVER_NOT_LOADED)
    exp = exporter_for()
    wait_for(lambda: find(exp.scrape(), "gpuguard_nvml_up") == [({}, 0.0)], what="nvml_up 0")
    wait_for(lambda: find(exp.scrape(), "gpuguard_scan_errors_total", stage="nvml_init")[0][1] >= 2,
             what="init errors counted")
    assert requests.get(f"{exp.url}/healthz", timeout=5).status_code == 200

    def nvml_warnings() -> list[str]:
        return [line for line in exp.stderr_lines if "level=warn logger=gpuguard.host.nvml" in line]

    # Logged before the first scan was published, but read from the pipe by a thread of
    # ours (servers.py) that may not have got to it yet.
    wait_for(nvml_warnings, what="the NVML warning on the exporter's stderr")
    warnings = nvml_warnings()
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
    wait_for(lambda: find(exp.scrape(), "gpuguard_gpu_unseen_processes", gpu="0")[0][1] == 1,
             what="missing holder counted")
    # In the host's PID namespace a listed pid /proc lacks exited since: no scan error
    # (issue 50); in a child one (CI), it may be one /proc cannot show: a procfs error.
    assert (errors("procfs") >= 1) is (in_host_pid_namespace() is not True)
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


# -- accounting: quotas, suspects, unattributed memory, containers --------------------------


def write_config(tmp_path, text: str) -> str:
    path = tmp_path / "gpuguard.yml"
    path.write_text(text)
    return str(path)


def series(exp: Exporter, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    return find(exp.scrape(), name, **labels)


def test_miners_by_command_line_and_by_comm_are_suspects(trees: Trees, fake_gpu: FakeGpuWorld,
                                                         exporter_for) -> None:
    """Real GPU holders: one started with argv[0] "xmrig" (`exec -a`), one whose
    executable is a link named t-rex (the kernel takes comm from the file name), one
    given a mining pool's URL; and two honest ones whose arguments merely contain a
    miner's name (a T-Rex model's directory, a xmrig_detector script)."""
    renamed = trees.spawn("exec -a xmrig {holder} --pidfile {dir}/worker & wait").pid("worker")
    t_rex = trees.spawn(f"ln -s {shlex.quote(sys.executable)} {{dir}}/t-rex && "
                        f"{{dir}}/t-rex {shlex.quote(str(HOLDER))} --pidfile {{dir}}/worker "
                        "& wait").pid("worker")
    pool = trees.spawn("exec -a ./miner {holder} --pidfile {dir}/worker "
                       "stratum+tcp://pool:3333 & wait").pid("worker")
    honest = trees.spawn("{holder} --pidfile {dir}/worker & wait").pid("worker")
    model = trees.spawn("{holder} --pidfile {dir}/worker /home/alice/T-Rex/demo.py "
                        "tools/xmrig_detector.py & wait").pid("worker")
    for pid in (renamed, t_rex, pool, honest, model):
        fake_gpu.add_process(0, pid, GIB)
    exp = exporter_for()
    by_cmdline = wait_for(lambda: series(exp, "gpuguard_suspect_process_info", pid=str(renamed)),
                          what="the xmrig suspect")
    (labels, _), = by_cmdline
    assert labels["why"] == "cmdline-pattern" and labels["comm"].startswith("python")
    assert labels["start_time"] == str(stat_fields(renamed)["start_time"])
    (labels, _), = wait_for(lambda: series(exp, "gpuguard_suspect_process_info",
                                           pid=str(t_rex)), what="the t-rex suspect")
    assert (labels["why"], labels["comm"]) == ("comm-pattern", "t-rex")
    (labels, _), = wait_for(lambda: series(exp, "gpuguard_suspect_process_info",
                                           pid=str(pool)), what="the stratum suspect")
    assert labels["why"] == "cmdline-pattern"
    assert series(exp, "gpuguard_suspect_process_info", pid=str(honest)) == []
    assert series(exp, "gpuguard_suspect_process_info", pid=str(model)) == []
    # A suspect is reported, never reaped: its own verdict is untouched.
    assert process_info(exp, renamed)["verdict"] == "normal"


def test_sustained_utilization_makes_the_sole_holder_a_suspect(
        trees: Trees, fake_gpu: FakeGpuWorld, exporter_for, tmp_path) -> None:
    config = write_config(tmp_path, "audit:\n  suspect_patterns: []\n"
                          "  sustained_utilization: {ratio: 0.9, for_seconds: 1}\n")
    fake_gpu.update_gpu(0, util_gpu=99)
    busy = trees.spawn("{holder} --pidfile {dir}/worker & wait").pid("worker")
    fake_gpu.add_process(0, busy, GIB)
    exp = exporter_for("--config", config, scan_interval=0.1)
    (labels, _), = wait_for(lambda: series(exp, "gpuguard_suspect_process_info", pid=str(busy)),
                            what="the sustained-utilization suspect")
    assert labels["why"] == "sustained-utilization"
    other = trees.spawn("{holder} --pidfile {dir}/worker & wait").pid("worker")
    fake_gpu.add_process(0, other, GIB)  # two holders: the GPU's load is no one's alone
    wait_for(lambda: not series(exp, "gpuguard_suspect_process_info"),
             what="the suspect to clear with a second holder")


def test_quota_and_unattributed_memory_live(trees: Trees, fake_gpu: FakeGpuWorld,
                                            exporter_for, tmp_path) -> None:
    from gpuguard.engine.scan.scanner import user_name

    me = user_name(os.getuid())
    config = write_config(tmp_path, 'quotas:\n  users: {"*": 1GiB}\n')
    # "*" is not root's (containers run as uid 0: root sums every pod on a node).
    quota = None if os.getuid() == 0 else GIB
    fake_gpu.update_gpu(0, memory_used=5 * GIB, memory_reserved=2 * GIB)
    worker = trees.spawn("{holder} --pidfile {dir}/worker & wait").pid("worker")
    fake_gpu.add_process(0, worker, 3 * GIB)
    exp = exporter_for("--config", config)
    wait_for(lambda: series(exp, "gpuguard_user_gpu_memory_bytes", user=me), what="user memory")
    samples = exp.scrape()
    assert find(samples, "gpuguard_user_gpu_memory_bytes", user=me)[0][1] == 3 * GIB
    assert [v for _, v in find(samples, "gpuguard_user_gpu_memory_quota_bytes", user=me)] == (
        [] if quota is None else [quota])
    # 5 GiB used without the 2 GiB reserved: 2 GiB no listed process accounts for.
    assert find(samples, "gpuguard_gpu_memory_unattributed_bytes", gpu="0")[0][1] == 2 * GIB
    fake_gpu.add_process(0, 4_000_001, None)  # a holder whose usage the driver cannot give
    wait_for(lambda: not series(exp, "gpuguard_gpu_memory_unattributed_bytes"),
             what="unattributed memory to become absent (not zero)")


def _writable_cgroup_root() -> Path | None:
    """A cgroup hierarchy this process may create groups in (cgroup v2 first), or None."""
    roots: list[Path] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype = fields[fields.index("-") + 1]
        if fstype == "cgroup2":
            roots.insert(0, Path(fields[4]))
        elif fstype == "cgroup":
            roots.append(Path(fields[4]))
    for root in roots:
        probe = root / f"gpuguard-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError:
            continue
        return root
    return None


@pytest.fixture
def cgroup_at():
    """Make a real cgroup at a path a runtime would use; move processes into it. At
    teardown its processes go back to the hierarchy's root and the groups are removed."""
    root = _writable_cgroup_root()
    if root is None:
        pytest.skip("no writable cgroup hierarchy here (needs root and a writable cgroupfs)")
    made: list[Path] = []

    def make(relative: str, *pids: int) -> str:
        path = root
        for part in relative.strip("/").split("/"):
            path = path / part
            if not path.exists():
                path.mkdir()
                made.append(path)
        for pid in pids:
            (path / "cgroup.procs").write_text(str(pid))
        return relative

    yield make
    for path in reversed(made):
        for pid in (path / "cgroup.procs").read_text().split():
            try:
                (root / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # exited meanwhile
        path.rmdir()


@pytest.mark.parametrize("relative", LIVE_CGROUPS.values(), ids=LIVE_CGROUPS.keys())
def test_a_holder_in_a_pod_cgroup_carries_container_and_pod(
        trees: Trees, fake_gpu: FakeGpuWorld, exporter_for, cgroup_at, relative: str) -> None:
    worker = trees.spawn("{holder} --pidfile {dir}/worker & wait").pid("worker")
    outside = trees.spawn("{holder} --pidfile {dir}/worker & wait").pid("worker")
    cgroup_at(relative, worker)
    assert CONTAINER_ID in Path(f"/proc/{worker}/cgroup").read_text()
    for pid in (worker, outside):
        fake_gpu.add_process(0, pid, GIB)
    exp = exporter_for()
    labels = process_info(exp, worker, container_id=CONTAINER_ID, pod_uid=POD_UID)
    assert labels["verdict"] == "normal"  # a kubepods cgroup is managed (rule 5)
    assert process_info(exp, outside)["pod_uid"] != POD_UID  # the runner's own, if any
