"""Under --log.format json every line either daemon writes is JSON, on stdout and stderr
alike (issue 38): the `listening on` line supervisors wait for included, and a start-up
failure's one line too."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import requests

from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import wait_for
from tests.support.remediator_harness import TOKEN, write_config
from tests.support.servers import REPO, Exporter, ServerProcess, child_env


def records(lines: list[str], stream: str) -> list[dict]:
    """Every line parsed as one JSON object (the assertion names the first that is not)."""
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"not JSON on {stream}: {line!r}") from None
        assert isinstance(record, dict) and {"time", "level", "msg"} <= record.keys(), line
        out.append(record)
    return out


def live_through_a_day(daemon: ServerProcess, config: Path) -> tuple[list[dict], list[dict]]:
    """Start (done), a scrape, a reload by POST /-/reload and one by SIGHUP, a stop; then
    (stdout's records, stderr's)."""
    assert requests.get(f"{daemon.url}/metrics", timeout=10).status_code == 200
    assert requests.post(f"{daemon.url}/-/reload", timeout=30).status_code == 200
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: sum("configuration reloaded" in line for line in daemon.stderr_lines) == 2,
             timeout=20, what="the second reload")
    daemon.stop()
    assert daemon.proc.returncode == 0 and daemon.drained()
    return (records(daemon.stdout_lines, "stdout"), records(daemon.stderr_lines, "stderr"))


def test_exporter_writes_only_json(fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
                                   tmp_path: Path) -> None:
    config = tmp_path / "gpuguard.yml"
    config.write_text("classify:\n  protect: [jupyter]\n")
    exp = Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()),
                   args=["--config", str(config), "--log.format", "json",
                         "--web.enable-lifecycle"])
    out, err = live_through_a_day(exp, config)
    assert [r["msg"] for r in out] == [f"listening on 127.0.0.1:{exp.port}"]
    assert out[0]["level"] == "info" and out[0]["time"].endswith("Z")
    messages = [r["msg"] for r in err]
    assert any(m.startswith("serving /metrics on http://127.0.0.1:") for m in messages)
    assert any(m.startswith("signal 15: shutting down") for m in messages), messages


def test_remediator_writes_only_json(fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
                                     tmp_path: Path) -> None:
    config = write_config(tmp_path, mode="dry-run")
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    rem = ServerProcess("gpuguard.remediator", [
        "--config", str(config), "--token-file", str(token), "--allow-pid-namespace",
        "--log.format", "json", "--web.enable-lifecycle"],
        env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()))
    # An alert without the token: refused (401), which the remediator counts.
    assert requests.post(f"{rem.url}/alerts", json={}, timeout=10).status_code == 401
    out, err = live_through_a_day(rem, config)
    assert [r["msg"] for r in out] == [f"listening on 127.0.0.1:{rem.port}"]
    messages = [r["msg"] for r in err]
    assert any(m.startswith("mode dry-run, host ") for m in messages), messages
    assert any(m.startswith("signal 15: shutting down") for m in messages), messages


def test_a_start_up_failure_is_one_json_line(tmp_path: Path) -> None:
    for module, argv in (
            ("gpuguard.exporter", ["--config", str(tmp_path / "missing.yml")]),
            ("gpuguard.remediator", ["--config", str(write_config(tmp_path))])):  # no token
        done = subprocess.run([sys.executable, "-m", module, "--log.format", "json",
                               "--listen", "127.0.0.1:0", *argv], cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stdout == "", (module, done.stdout)
        (record,) = records(done.stderr.splitlines(), "stderr")
        program = module.replace(".", "-")
        assert record["level"] == "error" and record["msg"].startswith(f"{program}: "), record
