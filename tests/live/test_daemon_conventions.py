"""Both daemons behave like Prometheus exporters (issue 27): node_exporter's flag
spellings, --version, logfmt/JSON logs in UTC, a landing page, build info and process
self-metrics, and SIGHUP reloads instead of killing."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import wait_for
from tests.support.servers import REPO, Exporter, child_env, find, parse_samples

VERSION_LINE = re.compile(r"^(\S+), version \S+ \(revision: \S+\)$")


@pytest.mark.parametrize("module,program", [
    ("gpuguard.exporter", "gpuguard-exporter"), ("gpuguard.remediator", "gpuguard-remediator"),
    ("gpuguard", "gpuguard")])
def test_version_names_the_program_revision_and_python(module: str, program: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "--version"], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    first, *rest = done.stdout.splitlines()
    assert VERSION_LINE.match(first) and first.startswith(program + ", "), first
    assert any(line.split() == ["python", "version:", sys.version.split()[0], "(CPython)"]
               for line in rest), done.stdout


@pytest.fixture
def exporter(fake_gpu: FakeGpuWorld, fake_nvml_lib, tmp_path: Path):
    config = tmp_path / "gpuguard.yml"
    config.write_text("classify:\n  protect: [jupyter]\n")
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    exp = Exporter(env=env, args=["--config", str(config), "--log.format", "json",
                                  "--web.telemetry-path", "/custom"])
    exp.config = config  # type: ignore[attr-defined]
    yield exp
    exp.stop()


def scrape(exp: Exporter) -> dict:
    resp = requests.get(f"{exp.url}/custom", timeout=5)
    resp.raise_for_status()
    return parse_samples(resp.text)


def reload_gauges(exp: Exporter) -> tuple[float, float]:
    samples = scrape(exp)
    (ok,) = find(samples, "gpuguard_config_last_reload_successful")
    (when,) = find(samples, "gpuguard_config_last_reload_success_timestamp_seconds")
    return ok[1], when[1]


def test_landing_page_telemetry_path_and_self_metrics(exporter: Exporter) -> None:
    landing = requests.get(exporter.url + "/", timeout=5)
    assert landing.status_code == 200 and "text/html" in landing.headers["Content-Type"]
    assert 'href="/custom"' in landing.text and "gpuguard-exporter" in landing.text
    assert requests.get(exporter.url + "/metrics", timeout=5).status_code == 404
    samples = scrape(exporter)
    (build,) = find(samples, "gpuguard_build_info")
    assert build[0]["python_version"] == sys.version.split()[0] and build[0]["version"]
    assert find(samples, "process_resident_memory_bytes")[0][1] > 0
    assert find(samples, "process_start_time_seconds")


def test_json_logs_carry_utc_times(exporter: Exporter) -> None:
    line = wait_for(lambda: next((ln for ln in exporter.stderr_lines if "serving" in ln), None),
                    timeout=10, what="the serving log line")
    record = json.loads(line)
    assert record["level"] == "info" and record["time"].endswith("Z")
    assert record["msg"].startswith("serving /custom on http://127.0.0.1:"), record


def test_sighup_reloads_and_a_broken_config_is_refused_not_fatal(exporter: Exporter) -> None:
    ok, started = reload_gauges(exporter)
    assert ok == 1
    exporter.config.write_text("classify:\n  protect: [jupyter, tensorboard]\n")  # type: ignore[attr-defined]
    exporter.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: reload_gauges(exporter)[1] > started, timeout=10,
             what="the reload's timestamp to move")
    assert exporter.proc.poll() is None and reload_gauges(exporter)[0] == 1
    exporter.config.write_text("classify:\n  protect: [\n")  # type: ignore[attr-defined]
    exporter.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: reload_gauges(exporter)[0] == 0, timeout=10, what="a refused reload")
    assert exporter.proc.poll() is None

    def refused() -> list[str]:  # read from the pipe by a thread of ours (servers.py)
        return [ln for ln in exporter.stderr_lines if "reload failed" in ln]

    wait_for(refused, what="the refused reload's line")
    (line,) = refused()
    assert json.loads(line)["level"] == "error"


def test_old_flag_spellings_still_work(fake_gpu: FakeGpuWorld, fake_nvml_lib) -> None:
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    exp = Exporter(env=env, args=["--log-level", "WARNING"])  # Exporter passes --listen
    try:
        assert requests.get(exp.url + "/metrics", timeout=5).status_code == 200
    finally:
        exp.stop()


def test_remediator_sighup_keeps_serving_and_refuses_a_changed_policy(
        fake_gpu: FakeGpuWorld, fake_nvml_lib, tmp_path: Path) -> None:
    from tests.support.servers import ServerProcess

    config = tmp_path / "gpuguard.yml"
    policy = (f"remediate:\n  mode: dry-run\n  state_dir: {tmp_path / 'state'}\n"
              f"  audit_log: {tmp_path / 'audit.jsonl'}\n")
    config.write_text(policy)
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    rem = ServerProcess("gpuguard.remediator", [
        "--config", str(config), "--token-file", str(token), "--allow-pid-namespace",
        "--log.format", "logfmt"], env=env)
    try:
        def gauges() -> tuple[float, float]:
            samples = parse_samples(requests.get(rem.url + "/metrics", timeout=5).text)
            return (find(samples, "gpuguard_config_last_reload_successful")[0][1],
                    find(samples, "gpuguard_config_last_reload_success_timestamp_seconds")[0][1])

        landing = requests.get(rem.url + "/", timeout=5)
        assert landing.status_code == 200 and 'href="/metrics"' in landing.text
        samples = parse_samples(requests.get(rem.url + "/metrics", timeout=5).text)
        assert find(samples, "gpuguard_build_info") and find(samples, "process_cpu_seconds_total")
        ok, started = gauges()
        rem.proc.send_signal(signal.SIGHUP)  # unchanged: a successful reload
        wait_for(lambda: gauges()[1] > started, timeout=10, what="an unchanged reload")
        # An edit of the exporter's sections in the shared file is no change here.
        _, before = gauges()
        config.write_text(policy + "quotas:\n  users:\n    alice: 1073741824\n")
        rem.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: gauges()[1] > before, timeout=10, what="a reload past a quotas edit")
        assert gauges()[0] == 1
        config.write_text(policy.replace("dry-run", "enforce"))
        rem.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: gauges()[0] == 0, timeout=10, what="a refused policy change")
        assert rem.proc.poll() is None
        assert requests.get(rem.url + "/healthz", timeout=5).status_code == 200

        def refused() -> list[str]:  # read from the pipe by a thread of ours (servers.py)
            return [ln for ln in rem.stderr_lines if "reload refused" in ln]

        wait_for(refused, what="the refused reload's line")
        (line,) = refused()
        assert line.startswith("time=") and "level=error" in line
    finally:
        rem.stop()


def start_exporter(fake_gpu: FakeGpuWorld, fake_nvml_lib, *args: str) -> Exporter:
    return Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()), args=list(args))


def first_scan(exp: Exporter) -> dict:
    return wait_for(lambda: (s := exp.scrape()) and find(s, "gpuguard_scans_total") and s,
                    what="a scan")


def test_series_join_dcgm_exporter_on_uuid(fake_gpu: FakeGpuWorld,
                                                      fake_nvml_lib) -> None:
    import os

    fake_gpu.add_process(gpu_index=0, pid=os.getpid(), used_bytes=2**30)
    exp = start_exporter(fake_gpu, fake_nvml_lib)
    try:
        samples = wait_for(lambda: (s := exp.scrape())
                           and find(s, "gpuguard_gpu_process_memory_bytes") and s,
                           what="the holder's memory")
        uuid = fake_gpu.gpus[0].uuid
        (info,) = find(samples, "gpuguard_gpu_info")
        assert info[0]["UUID"] == uuid and "uuid" not in info[0]
        assert info[0]["modelName"] == "NVIDIA Fake H100" and "name" not in info[0]
        for name in ("gpuguard_gpu_memory_bytes", "gpuguard_gpu_process_memory_bytes"):
            assert find(samples, name, UUID=uuid), name
    finally:
        exp.stop()


@pytest.mark.parametrize("switch,gone,kept", [
    ("--no-collector.gpu", ["gpuguard_gpu_info", "gpuguard_gpu_memory_bytes"],
     ["gpuguard_gpu_process_memory_bytes", "gpuguard_gpu_process_info", "gpuguard_nvml_up"]),
    ("--no-collector.processes",
     ["gpuguard_gpu_process_memory_bytes", "gpuguard_gpu_process_info"],
     ["gpuguard_gpu_info", "gpuguard_gpu_memory_bytes", "gpuguard_nvml_up"]),
])
def test_collector_switches(fake_gpu: FakeGpuWorld, fake_nvml_lib, switch: str,
                            gone: list[str], kept: list[str]) -> None:
    import os

    fake_gpu.add_process(gpu_index=0, pid=os.getpid(), used_bytes=2**30)
    on = start_exporter(fake_gpu, fake_nvml_lib)
    off = start_exporter(fake_gpu, fake_nvml_lib, switch)
    try:
        wait_for(lambda: find(on.scrape(), "gpuguard_gpu_process_info"), what="a full scan")
        first_scan(off)
        wait_for(lambda: find(off.scrape(), "gpuguard_scans_total")[0][1] >= 2,
                 what="a second scan")
        samples = off.scrape()
        for name in gone:
            assert not find(samples, name), name
        for name in kept:
            assert find(samples, name), name
        assert find(samples, "gpuguard_scan_duration_seconds")
    finally:
        on.stop()
        off.stop()


def test_a_sighup_before_the_daemon_serves_is_kept_for_the_reloader() -> None:
    """systemd's ExecReload= may signal a daemon still starting: the hangup is noted
    (not the default action, which would end it) and reloads once a reloader exists."""
    import logging
    import os

    from gpuguard.base.reload import EarlyHangups, Reloader

    previous = signal.getsignal(signal.SIGHUP)
    calls: list[int] = []
    try:
        early = EarlyHangups()
        os.kill(os.getpid(), signal.SIGHUP)
        wait_for(lambda: early.pending, timeout=5, what="the hangup to be noted")
        reloader = Reloader("probe", lambda: calls.append(1), log=logging.getLogger("probe"))
        early.hand_to(reloader)
        wait_for(lambda: calls == [1], timeout=5, what="the held-back reload")
        os.kill(os.getpid(), signal.SIGHUP)
        wait_for(lambda: calls == [1, 1], timeout=5, what="a reload on the next hangup")
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_the_web_configs_rate_limit_answers_429_but_not_to_probes(
        fake_gpu: FakeGpuWorld, fake_nvml_lib, tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text('rate_limit:\n  interval: "1h"\n  burst: 2\n')
    exp = start_exporter(fake_gpu, fake_nvml_lib, "--web.config.file", str(web))
    try:
        codes = [requests.get(exp.url + "/metrics", timeout=5).status_code for _ in range(4)]
        assert codes == [200, 200, 429, 429]
        assert requests.get(exp.url + "/healthz", timeout=5).status_code == 200
    finally:
        exp.stop()
