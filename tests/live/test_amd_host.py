"""A host with AMD GPUs: the real exporter (as a process, choosing its back-ends itself) and
the remediator over the fake libamd_smi.so and real process trees, with and without NVML."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuguard.base.counters import Counters
from gpuguard.config import load_config
from gpuguard.gpu.amdsmi import AmdSmiSource
from gpuguard.remediator.app import create_app
from gpuguard.remediator.service import build_remediator
from tests.live.test_exporter_live import KILLED, process_info
from tests.support.fakeamdsmi import FakeAmdWorld
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import CHAIN, Trees, alive, wait_for
from tests.support.remediator_harness import HOST, TOKEN, payload, spawn_orphan, write_config
from tests.support.servers import Exporter, child_env, find

GIB = 2**30


@pytest.fixture
def amd_exporter(fake_amd: FakeAmdWorld, fake_amdsmi_lib: Path
                 ) -> Iterator[Callable[..., Exporter]]:
    """Start the exporter on a host whose only GPU library is the fake AMD SMI (no
    libnvidia-ml.so.1 on its loader path), or with `env` given, on that one."""
    started: list[Exporter] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Exporter:
        env = env if env is not None else fake_amd.subprocess_env(fake_amdsmi_lib, child_env())
        exp = Exporter(env=env, args=args, scan_interval=0.2)
        started.append(exp)
        return exp

    yield start
    for exp in started:
        exp.stop()


def dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not alive(proc.pid)
    return proc.pid


def test_amd_gauges_and_per_process_vram_on_metrics_with_no_nvml(
        trees: Trees, fake_amd: FakeAmdWorld, amd_exporter) -> None:
    worker = trees.spawn(CHAIN).pid("worker")
    fake_amd.update_gpu(0, vram_used_mib=6 * 1024, gfx_activity=25)
    fake_amd.add_process(0, worker, 4 * GIB, gfx_ns=123)
    exp = amd_exporter()
    gpu = {"gpu": "0", "UUID": fake_amd.gpus[0].uuid, "vendor": "amd"}
    rows = wait_for(lambda: find(exp.scrape(), "gpuguard_gpu_process_memory_bytes",
                                 pid=str(worker)), what="the AMD holder's series")
    assert rows[0][0].items() >= gpu.items() and rows[0][1] == 4 * GIB
    samples = exp.scrape()
    assert find(samples, "gpuguard_gpu_memory_used_bytes", **gpu)[0][1] == 6 * GIB
    assert find(samples, "gpuguard_gpu_memory_bytes", **gpu)[0][1] == 192 * GIB
    assert find(samples, "gpuguard_gpu_utilization_ratio", **gpu)[0][1] == 0.25
    (info, _), = find(samples, "gpuguard_gpu_info", **gpu)
    assert (info["modelName"], info["pci_bus_id"], info["driver_version"]) == (
        "AMD Instinct MI300X", "0000:10:00.0", "6.10.5")
    assert find(samples, "gpuguard_gpu_backend_up", backend="amdsmi")[0][1] == 1
    assert find(samples, "gpuguard_gpu_backend_up", backend="nvml") == []
    (off, _), = find(samples, "gpuguard_gpu_backend_disabled", backend="nvml")
    assert "libnvidia-ml.so.1" in off["reason"]
    assert find(samples, "gpuguard_gpu_memory_unattributed_bytes", **gpu)[0][1] == 2 * GIB
    process_info(exp, worker, verdict="normal")


def test_an_orphan_tree_holding_amd_vram_reads_launcher_killed(
        trees: Trees, fake_amd: FakeAmdWorld, amd_exporter) -> None:
    tree = trees.spawn(CHAIN)
    worker, sh = tree.pid("worker"), tree.pid("sh")
    fake_amd.add_process(0, worker, 3 * GIB)
    exp = amd_exporter()
    process_info(exp, worker, verdict="normal")
    tree.kill_launcher()
    process_info(exp, worker, verdict="orphan", reason=KILLED, root_pid=str(sh))
    rows = wait_for(lambda: find(exp.scrape(), "gpuguard_orphan_tree_memory_bytes",
                                 root_pid=str(sh)), what="the orphan tree's memory series")
    assert rows[0][1] == 3 * GIB


def test_a_dead_pid_in_amds_list_is_no_holder_on_metrics(
        trees: Trees, fake_amd: FakeAmdWorld, amd_exporter) -> None:
    worker = trees.spawn(CHAIN).pid("worker")
    gone = dead_pid()
    fake_amd.update_gpu(0, vram_used_mib=4 * 1024)
    fake_amd.add_process(0, worker, GIB)
    fake_amd.add_process(0, gone, 3 * GIB, name="ghost")
    exp = amd_exporter()
    gpu = {"UUID": fake_amd.gpus[0].uuid, "vendor": "amd"}
    wait_for(lambda: find(exp.scrape(), "gpuguard_gpu_process_memory_bytes", pid=str(worker)),
             what="the live holder's series")
    samples = exp.scrape()
    assert find(samples, "gpuguard_gpu_process_memory_bytes", pid=str(gone)) == []
    assert find(samples, "gpuguard_gpu_process_info", pid=str(gone)) == []
    assert find(samples, "gpuguard_gpu_unseen_processes", **gpu)[0][1] == 1
    assert find(samples, "gpuguard_gpu_unseen_process_memory_bytes", **gpu)[0][1] == 3 * GIB
    assert find(samples, "gpuguard_gpu_memory_unattributed_bytes", **gpu)[0][1] == 3 * GIB
    assert not [s for s in samples if s[0] == "gpuguard_scan_errors_total" and dict(s[1]).get(
        "stage") == "procfs" and samples[s]]


def test_a_host_with_nvidia_and_amd_gpus_shows_both_vendors(
        trees: Trees, fake_amd: FakeAmdWorld, fake_amdsmi_lib: Path, fake_gpu: FakeGpuWorld,
        fake_nvml_lib: Path, amd_exporter) -> None:
    nv_worker = trees.spawn(CHAIN).pid("worker")
    amd_worker = trees.spawn(CHAIN).pid("worker")
    fake_gpu.add_process(0, nv_worker, 5 * GIB)
    fake_amd.add_process(0, amd_worker, 7 * GIB)
    env = fake_gpu.subprocess_env(fake_nvml_lib,
                                  fake_amd.subprocess_env(fake_amdsmi_lib, child_env()))
    exp = amd_exporter(env=env)
    for pid in (nv_worker, amd_worker):
        process_info(exp, pid, verdict="normal")
    samples = exp.scrape()
    vendors = {labels["vendor"]: labels["UUID"]
               for labels, _ in find(samples, "gpuguard_gpu_info")}
    assert vendors == {"nvidia": fake_gpu.gpus[0].uuid, "amd": fake_amd.gpus[0].uuid}
    assert {labels["backend"]: v for labels, v in find(samples, "gpuguard_gpu_backend_up")} \
        == {"nvml": 1, "amdsmi": 1}
    mem = {labels["vendor"]: v for labels, v in find(
        samples, "gpuguard_gpu_process_memory_bytes")}
    assert mem == {"nvidia": 5 * GIB, "amd": 7 * GIB}


def test_the_remediator_reaps_an_orphan_holding_amd_vram_on_an_alert(
        tmp_path: Path, trees: Trees, fake_amd: FakeAmdWorld) -> None:
    config = load_config(write_config(tmp_path))
    counters = Counters()
    source = AmdSmiSource(counters)
    service = build_remediator(config, hostname=HOST, nvml=source, counters=counters)
    client = create_app(service, token=lambda: TOKEN.encode()).test_client()
    service.start()
    try:
        orphan = spawn_orphan(trees, fake_amd)  # type: ignore[arg-type]  # the same add_process
        resp = client.post("/alerts", json=payload(orphan.alert()),
                           headers={"Authorization": f"Bearer {TOKEN}"})
        assert resp.status_code == 200
        wait_for(orphan.none_alive, what="the AMD orphan tree to be reaped")
        assert service.wait_idle(10)
        (record,) = [r for r in service.audit.records() if r["phase"] == "final"]
        assert (record["decision"]["action"], record["outcome"]) == ("reap", "reaped")
        assert record["tree"]["gpu_bytes"] == 2 * GIB
        assert {m["pid"] for m in record["tree"]["members"]} == {orphan.root, orphan.holder}
    finally:
        service.stop()
        source.close()
