"""`gpuguard fleet` and MCP's gpu_fleet against the real thing (issue 53): a real
Prometheus scraping two exporters, each its own host (`--hostname`) with its own fake NVML
world and a real orphan tree, one host's remediator, and a real Alertmanager holding a
silence on one tree's alert."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import CHAIN, Trees, stat_fields, wait_for
from tests.support.promstack import (
    Alertmanager,
    Prometheus,
    WebhookRecorder,
    require_binaries,
    rules_with_durations,
    shipped_alertmanager_config,
)
from tests.support.servers import REPO, Exporter, ServerProcess, child_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GIB = 2**30
SILENCED, FIRING = "fleet-node-a", "fleet-node-b"


@dataclass
class Host:
    name: str
    exporter: Exporter
    root: int
    start: int


@dataclass
class Stack:
    hosts: dict[str, Host]
    remediator: ServerProcess
    alertmanager: Alertmanager
    prometheus: Prometheus
    silence_id: str


def plant(tmp_path: Path, trees: Trees, fake_nvml_lib: Path, name: str,
          started: list[Any]) -> tuple[Host, dict[str, str]]:
    """One host: its own fake GPU world, a real tree orphaned in it, its exporter."""
    world = FakeGpuWorld(tmp_path / f"nvml-{name}.txt")
    world.add_gpu(0)
    tree = trees.spawn(CHAIN)
    worker, root = tree.pid("worker"), tree.pid("sh")
    world.add_process(0, worker, 2 * GIB)
    tree.kill_launcher()
    env = world.subprocess_env(fake_nvml_lib, child_env())
    exporter = Exporter(env=env, args=["--hostname", name], scan_interval=0.5)
    started.append(exporter)
    fields = stat_fields(root)
    assert fields is not None
    return Host(name, exporter, root, int(fields["start_time"])), env


@pytest.fixture
def stack(tmp_path: Path, trees: Trees, fake_nvml_lib: Path) -> Iterator[Stack]:
    require_binaries()
    started: list[Any] = []
    try:
        hosts, envs = {}, {}
        for name in (SILENCED, FIRING):
            hosts[name], envs[name] = plant(tmp_path, trees, fake_nvml_lib, name, started)
        token = tmp_path / "token"
        token.write_text("fleet-secret\n")
        token.chmod(0o600)
        config = tmp_path / "gpuguard.yml"
        config.write_text(yaml.safe_dump({"remediate": {
            "mode": "dry-run", "state_dir": str(tmp_path / "state"),
            "audit_log": str(tmp_path / "audit.jsonl")}}))
        remediator = ServerProcess("gpuguard.remediator", [
            "--config", str(config), "--token-file", str(token), "--hostname", SILENCED,
            "--allow-pid-namespace"], env=envs[SILENCED])
        started.append(remediator)
        recorder = WebhookRecorder()
        started.append(recorder)
        alertmanager = Alertmanager(tmp_path / "am", shipped_alertmanager_config(
            remediator_url=None, recorder_url=recorder.url, token_file=token))
        started.append(alertmanager)
        quiet = hosts[SILENCED]
        silence_id = alertmanager.silence({"alertname": "GPUOrphanTree", "hostname": quiet.name,
                                           "root_pid": str(quiet.root),
                                           "root_start_time": str(quiet.start)})
        prometheus = Prometheus(
            tmp_path / "prom",
            targets={"gpuguard": [f"127.0.0.1:{h.exporter.port}" for h in hosts.values()],
                     "gpuguard-remediator": f"127.0.0.1:{remediator.port}"},
            rules_text=rules_with_durations(for_seconds=1, orphan_age_seconds=1),
            alertmanager_url=alertmanager.url)
        started.append(prometheus)
        yield Stack(hosts, remediator, alertmanager, prometheus, silence_id)
    finally:
        for thing in reversed(started):
            thing.stop()


def alerted(stack: Stack) -> bool:
    """Both trees' alerts are in Alertmanager, one silenced, and the remediator's info
    series is in Prometheus: what the fleet view is asked to show."""
    by_host = {a["labels"]["hostname"]: a for a in stack.alertmanager.alerts(
        alertname="GPUOrphanTree")}
    return (by_host.get(SILENCED, {}).get("status", {}).get("silencedBy") == [stack.silence_id]
            and by_host.get(FIRING, {}).get("status", {}).get("state") == "active"
            and bool(stack.prometheus.query("gpuguard_remediator_info")))


def query_requests(prometheus: Prometheus) -> float:
    """Prometheus's own count of the instant queries it answered (read off its /metrics,
    which is no query)."""
    text = requests.get(f"{prometheus.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("prometheus_http_requests_total{")
               and 'handler="/api/v1/query"' in line)


def fleet(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuguard", "fleet", "--prometheus", stack.prometheus.url,
         "--alertmanager", stack.alertmanager.url, *args],
        cwd=REPO, env=child_env(NO_COLOR="1", COLUMNS="200"), capture_output=True,
        text=True, timeout=60, check=False)


def test_both_trees_one_silenced_by_its_author_until_its_end_the_other_firing(
        stack: Stack) -> None:
    wait_for(lambda: alerted(stack), timeout=60, interval=0.2,
             what="both trees' alerts in Alertmanager, one silenced")
    before = query_requests(stack.prometheus)
    run = fleet(stack, "--json")
    assert run.returncode == 0, run.stderr
    asked = query_requests(stack.prometheus) - before
    doc = json.loads(run.stdout)
    assert doc["schema"] == "gpuguard.fleet/v1" and doc["errors"] == []
    assert doc["sources"] == {"prometheus": stack.prometheus.url,
                              "alertmanager": stack.alertmanager.url,
                              "alertmanager_error": None}
    trees = {t["hostname"]: t for t in doc["trees"]}
    assert sorted(trees) == [SILENCED, FIRING]
    me = pwd.getpwuid(os.getuid()).pw_name
    for name, host in stack.hosts.items():
        tree = trees[name]
        assert (tree["root_pid"], tree["root_start_time"], tree["user"], tree["comm"]) == (
            host.root, host.start, me, "sh")
        assert tree["memory_bytes"] == 2 * GIB and tree["processes"] >= 2
        assert tree["age_seconds"] > 0 and tree["reason"]
    quiet, loud = trees[SILENCED], trees[FIRING]
    assert quiet["alert_state"] == "silenced"
    (alert,) = quiet["alerts"]
    assert (alert["alertname"], alert["prometheus"], alert["alertmanager"]) == (
        "GPUOrphanTree", "firing", "suppressed")
    (silence,) = alert["silences"]
    assert (silence["id"], silence["created_by"], silence["comment"], silence["state"]) == (
        stack.silence_id, "gpuguard-e2e", "on-call is looking at this tree", "active")
    assert silence["ends_at"]  # the end the silence was set with (30 minutes on)
    assert loud["alert_state"] == "firing"
    assert [(a["alertname"], a["alertmanager"], a["silences"]) for a in loud["alerts"]] == [
        ("GPUOrphanTree", "active", [])]

    hosts = {h["hostname"]: h for h in doc["hosts"]}
    assert sorted(hosts) == [SILENCED, FIRING]
    assert [(e["up"], e["job"]) for e in hosts[SILENCED]["exporters"]] == [(True, "gpuguard")]
    assert [(r["up"], r["mode"]) for r in hosts[SILENCED]["remediators"]] == [
        (True, "dry-run")]
    assert hosts[FIRING]["remediators"] == [] and hosts[FIRING]["exporters"][0]["up"] is True
    assert hosts[SILENCED]["orphan_trees"] == hosts[FIRING]["orphan_trees"] == 1
    # Bounded: one instant query per family, whatever the number of hosts.
    assert asked == 10, asked

    table = fleet(stack)
    assert table.returncode == 0, table.stderr
    line = next(x for x in table.stdout.splitlines() if x.startswith(SILENCED))
    assert "silenced by gpuguard-e2e until" in line and str(stack.hosts[SILENCED].root) in line
    assert "firing" in next(x for x in table.stdout.splitlines() if x.startswith(FIRING))

    # An exporter that stops answering keeps its host's name, and says it is down.
    stack.hosts[FIRING].exporter.stop()
    wait_for(lambda: any(s["value"][1] == "0" for s in stack.prometheus.query(
        'up{job="gpuguard"}')), timeout=30, what="Prometheus to see the exporter down")
    down = json.loads(fleet(stack, "--json").stdout)
    gone = next(h for h in down["hosts"] if h["hostname"] == FIRING)
    assert [e["up"] for e in gone["exporters"]] == [False]
    assert FIRING not in {t["hostname"] for t in down["trees"]}


def test_gpu_fleet_is_the_same_view(stack: Stack) -> None:
    pytest.importorskip("mcp", reason="the MCP SDK (gpuguard[mcp]) is not installed")
    import anyio
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    wait_for(lambda: alerted(stack), timeout=60, interval=0.2,
             what="both trees' alerts in Alertmanager, one silenced")
    params = StdioServerParameters(
        command=sys.executable, cwd=str(REPO), env=child_env(),
        args=["-m", "gpuguard", "mcp", "--prometheus", stack.prometheus.url,
              "--alertmanager", stack.alertmanager.url])
    got: dict[str, Any] = {}

    async def main() -> None:
        with anyio.fail_after(60):
            async with stdio_client(params) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                got["result"] = await session.call_tool("gpu_fleet", {})

    anyio.run(main)
    result = got["result"]
    assert not result.is_error, result.content
    doc = result.structured_content
    assert doc["schema"] == "gpuguard.fleet/v1"
    states = {t["hostname"]: t["alert_state"] for t in doc["trees"]}
    assert states == {SILENCED: "silenced", FIRING: "firing"}
    silenced = next(t for t in doc["trees"] if t["hostname"] == SILENCED)
    assert silenced["alerts"][0]["silences"][0]["created_by"] == "gpuguard-e2e"


def test_prometheus_behind_tls_and_basic_auth(tmp_path: Path) -> None:
    """The flags a Prometheus behind its own web config needs: a private CA and basic auth
    from a private password file; without the password it is refused (HTTP 401, exit 3),
    and a password over http:// is refused before any request (exit 2)."""
    require_binaries()
    import bcrypt

    from tests.support.certs import make_certs

    certs = make_certs(tmp_path / "certs")
    password = tmp_path / "password"
    password.write_text("fleet-password\n")
    password.chmod(0o600)
    digest = bcrypt.hashpw(b"fleet-password", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": certs.path("server.crt"),
                              "key_file": certs.path("server.key")},
        "basic_auth_users": {"oncall": digest}}))
    prometheus = Prometheus(tmp_path / "prom", targets={}, rules_text="groups: []\n",
                            alertmanager_url=None, web_config=str(web),
                            client={"verify": certs.path("ca.crt"),
                                    "auth": ("oncall", "fleet-password")})
    try:
        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "gpuguard", "fleet", "--json", *args], cwd=REPO,
                env=child_env(), capture_output=True, text=True, timeout=60, check=False)

        ok = run("--prometheus", prometheus.url, "--prometheus-ca-file", certs.path("ca.crt"),
                 "--prometheus-username", "oncall", "--prometheus-password-file", str(password))
        assert ok.returncode == 0, ok.stderr
        doc = json.loads(ok.stdout)
        assert (doc["trees"], doc["hosts"], doc["errors"]) == ([], [], [])

        refused = run("--prometheus", prometheus.url, "--prometheus-ca-file",
                      certs.path("ca.crt"))
        assert refused.returncode == 3 and "HTTP 401" in json.loads(refused.stdout)["errors"][0]
        untrusted = run("--prometheus", prometheus.url, "--prometheus-username", "oncall",
                        "--prometheus-password-file", str(password))
        assert untrusted.returncode == 3 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
        plain = run("--prometheus", prometheus.url.replace("https:", "http:"),
                    "--prometheus-username", "oncall", "--prometheus-password-file",
                    str(password))
        assert plain.returncode == 2 and "in clear" in plain.stderr and plain.stdout == ""
    finally:
        prometheus.stop()
