"""The remediator as it runs: `python -m gpuguard.remediator` under waitress, real HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, descendants_of, stat_fields, wait_for
from tests.support.remediator_harness import (
    HOST,
    RETRY_LOOP,
    TOKEN,
    Orphan,
    alert,
    payload,
    spawn_orphan,
    write_config,
)
from tests.support.servers import REPO, ServerProcess, child_env, find, parse_samples

AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Remediator:
    """One running `python -m gpuguard.remediator`, restartable on the same config and state."""

    def __init__(self, config: Path, token: Path, env: dict[str, str]) -> None:
        self.config, self.token, self.env = config, token, env
        self.server: ServerProcess | None = None

    def start(self) -> Remediator:
        self.server = ServerProcess("gpuguard.remediator", [
            "--allow-pid-namespace", "--config", str(self.config), "--token-file", str(self.token),
            "--hostname", HOST, "--log-level", "DEBUG"], env=self.env)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def post(self, body: Any = None, *, headers: dict[str, str] | None = None,
             data: Any = None) -> requests.Response:
        return requests.post(f"{self.url}/alerts", json=body if data is None else None,
                             data=data, headers=AUTH if headers is None else headers,
                             timeout=10)

    def state(self) -> dict[str, Any]:
        resp = requests.get(f"{self.url}/state", headers=AUTH, timeout=10)
        resp.raise_for_status()
        return resp.json()

    def idle(self) -> bool:
        state = self.state()
        return state["in_flight"] is None and not state["pending"]


@pytest.fixture
def remediator(tmp_path: Path, fake_gpu: FakeGpuWorld,
               fake_nvml_lib: Path) -> Iterator[Callable[..., Remediator]]:
    made: list[Remediator] = []

    def make(**remediate: Any) -> Remediator:
        token = tmp_path / "token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
        env.pop("GPUGUARD_TOKEN_FILE", None)
        made.append(Remediator(write_config(tmp_path, **remediate), token, env))
        return made[-1].start()

    yield make
    for r in made:
        r.stop()


def audit(tmp_path: Path, orphan: Orphan) -> list[dict[str, Any]]:
    """This tree's final records so far. The remediator may be appending while the tests
    poll: a last line without its newline is still being written, read on the next look."""
    path = tmp_path / "audit.jsonl"
    if not path.exists():
        return []
    *complete, _being_written = path.read_text().split("\n")
    records = [json.loads(line) for line in complete]
    return [r for r in records if r["key"]["root_pid"] == orphan.root and r["phase"] == "final"]


def test_retry_loop_supervisor_is_reaped_without_respawn(
        remediator: Callable[..., Remediator], trees: Trees, fake_gpu: FakeGpuWorld,
        tmp_path: Path) -> None:
    server = remediator()
    orphan = spawn_orphan(trees, fake_gpu, RETRY_LOOP)
    session = int(stat_fields(orphan.root)["sid"])  # type: ignore[index,arg-type]
    pidfile = orphan.tree.dir / "holder"

    started = time.monotonic()
    resp = server.post(payload(orphan.alert()))
    answered = time.monotonic() - started
    assert resp.status_code == 200 and resp.json()["accounts"][0]["status"] == "accepted"
    wait_for(orphan.none_alive, timeout=10, interval=0.001, what="the retry loop to be reaped")
    gone = time.monotonic() - started
    print(f"\nretry-loop reap: answered in {answered * 1000:.1f} ms, "
          f"all members gone {gone * 1000:.1f} ms after the POST")

    (record,) = wait_for(lambda: audit(tmp_path, orphan), what="the audit record")
    assert (record["outcome"], record["kill_path"]) == ("reaped", "pidfd")
    assert {m["comm"] for m in record["tree"]["members"]} == {"bash", "python"}
    assert record["survivors"] == []

    # No respawn: nothing of that session comes back and the pid file is not rewritten.
    before = pidfile.read_text()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        back = [p for p in descendants_of(os.getpid())
                if (f := stat_fields(p)) and f["sid"] == session and alive(p)]
        assert not back, f"respawned: {back}"
        assert pidfile.read_text() == before
        time.sleep(0.02)


def test_same_alert_twice_concurrently_and_after_a_restart_reaps_once(
        remediator: Callable[..., Remediator], trees: Trees, fake_gpu: FakeGpuWorld,
        tmp_path: Path) -> None:
    server = remediator()
    orphan = spawn_orphan(trees, fake_gpu)
    body = payload(orphan.alert())
    barrier = threading.Barrier(2)
    answers: list[dict[str, Any]] = []

    def deliver() -> None:
        barrier.wait()
        resp = server.post(body)
        assert resp.status_code == 200
        answers.extend(resp.json()["accounts"])

    threads = [threading.Thread(target=deliver) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(a["status"] for a in answers) == ["accepted", "duplicate"]
    wait_for(orphan.none_alive, what="the reap")
    wait_for(server.idle, what="the worker to finish")

    server.stop()
    server.start()
    # The same alert again, and as an HA peer would send it (new fingerprint, same tree).
    for again in (body, payload(orphan.alert())):
        resp = server.post(again)
        assert [a["status"] for a in resp.json()["accounts"]] == ["duplicate"]
    assert server.idle()
    records = audit(tmp_path, orphan)
    assert len(records) == 1 and records[0]["decision"]["action"] == "reap"
    reaps = sum(1 for s in records[0]["signals"] if s["signal"] == "SIGTERM")
    assert reaps == 2  # one SIGTERM per member, once


def test_bad_input_is_refused_and_nothing_is_killed(
        remediator: Callable[..., Remediator], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    server = remediator()
    orphan = spawn_orphan(trees, fake_gpu)
    good = payload(orphan.alert())

    def labels_not_strings() -> dict[str, Any]:
        body = payload(orphan.alert())
        body["alerts"][0]["labels"]["root_pid"] = orphan.root
        return body

    many = payload(*[orphan.alert() for _ in range(1001)])
    cases: list[tuple[str, requests.Response, int, str]] = [
        ("no token", server.post(good, headers={}), 401, "bearer token"),
        ("wrong token", server.post(good, headers={"Authorization": "Bearer nope"}), 401,
         "bearer token"),
        ("basic auth", server.post(good, headers={"Authorization": f"Basic {TOKEN}"}), 401,
         "bearer token"),
        ("2 MiB", server.post(data=b"{" + b" " * (2 * 2**20) + b"}",
                              headers={**AUTH, "Content-Type": "application/json"}), 413,
         "limit"),
        ("2 MiB chunked", server.post(data=iter([b"[" + b" " * 2**20] * 2),
                                      headers={**AUTH, "Content-Type": "application/json"}),
         413, "limit"),
        ("not json type", server.post(data=b"hello", headers={**AUTH,
                                                              "Content-Type": "text/plain"}),
         415, "Content-Type"),
        ("not json body", server.post(data=b"{hello", headers={
            **AUTH, "Content-Type": "application/json"}), 400, "not valid JSON"),
        ("wrong shape", server.post({"version": "4", "alerts": "all of them"}), 400,
         "alerts: must be a list"),
        ("labels not strings", server.post(labels_not_strings()), 400,
         "alerts[0].labels.root_pid: must be a string"),
        ("huge alert list", server.post(many), 400, "at most 1000"),
    ]
    for name, resp, status, words in cases:
        assert resp.status_code == status, (name, resp.status_code, resp.text)
        assert words in resp.json()["error"], (name, resp.text)
    assert orphan.all_alive()
    assert requests.get(f"{server.url}/healthz", timeout=5).status_code == 200
    samples = parse_samples(requests.get(f"{server.url}/metrics", timeout=5).text)
    rejected = {labels["cause"]: value for labels, value in
                find(samples, "gpuguard_remediator_rejected_requests_total")}
    assert rejected == {"unauthorized": 3, "too_large": 2, "not_json": 1, "malformed": 4,
                        "state_unwritable": 0}
    assert server.state()["pending"] == [] and server.idle()
    # Still serving, and still careful: a good delivery in dry-run terms is accepted.
    resp = server.post(payload(alert(orphan.root, orphan.root_start, hostname="elsewhere")))
    assert resp.json()["accounts"][0]["reason"] == "other-host"


def run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = env if env is not None else child_env()
    env.pop("GPUGUARD_TOKEN_FILE", None) if env is not None else None
    # Each test is about one refusal; the PID-namespace one has its own (test_kill_safety).
    return subprocess.run([sys.executable, "-m", "gpuguard.remediator", "--allow-pid-namespace",
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(("remediate", "key", "problem"), [
    ("{mode: enforce, kill_everything: true}", "remediate.kill_everything", "unknown key"),
    ("{term_timeout_seconds: soon}", "remediate.term_timeout_seconds", "must be a number"),
    ("{mode: yes-please}", "remediate.mode", "must be one of"),
    # Issue 54: Prometheus pull needs Alertmanager for the confirmation, and one pull only.
    ("{prometheus: {url: 'https://p:9090'}}", "remediate.prometheus",
     "needs remediate.alertmanager"),
    ("{alertmanager: {url: 'http://a', pull: true}, prometheus: {url: 'https://p:9090'}}",
     "remediate.prometheus", "it and remediate.alertmanager.pull: true both poll"),
])
def test_config_errors_exit_with_one_line(tmp_path: Path, remediate: str, key: str,
                                          problem: str) -> None:
    config = tmp_path / "bad.yml"
    config.write_text(f"remediate: {remediate}\n")
    done = run_cli(["--config", str(config), "--insecure-no-auth"])
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"gpuguard-remediator: config error: {config}: {key}: {problem}")


def test_an_unusable_prometheus_password_file_refuses_to_start(tmp_path: Path) -> None:
    """Checked once at start, like Alertmanager's token: a poll would only ever fail."""
    config = tmp_path / "gpuguard.yml"
    config.write_text("remediate:\n  alertmanager: {url: 'http://127.0.0.1:9'}\n"
                      "  prometheus: {url: 'https://127.0.0.1:9', basic_auth: "
                      f"{{username: u, password_file: '{tmp_path / 'missing'}'}}}}\n"
                      f"  state_dir: '{tmp_path / 'state'}'\n"
                      f"  audit_log: '{tmp_path / 'audit.jsonl'}'\n")
    done = run_cli(["--config", str(config), "--insecure-no-auth"])
    assert done.returncode == 2, done.stderr
    assert "remediate.prometheus.basic_auth.password_file: token file" in done.stderr


def test_bad_regex_in_classify_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "bad.yml"
    config.write_text("classify: {protect: ['jupyter', '(unclosed']}\n")
    done = run_cli(["--config", str(config), "--insecure-no-auth"])
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2
    assert line.startswith(f"gpuguard-remediator: config error: {config}: classify.protect[1]: "
                           "bad regex")


def test_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    done = run_cli(["--config", str(config)])
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and "refusing to start without a bearer token" in line
    done = run_cli(["--config", str(config), "--insecure-no-auth", "--listen", "0.0.0.0:0"])
    assert done.returncode == 2 and "loopback" in done.stderr
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    done = run_cli(["--config", str(config), "--token-file", str(empty)])
    assert done.returncode == 2 and "empty" in done.stderr


def test_token_file_from_the_environment(tmp_path: Path, fake_gpu: FakeGpuWorld,
                                         fake_nvml_lib: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env(GPUGUARD_TOKEN_FILE=str(token)))
    server = ServerProcess("gpuguard.remediator", ["--config", str(write_config(tmp_path)),
                                          "--hostname", HOST, "--allow-pid-namespace"], env=env)
    try:
        assert requests.get(f"{server.url}/state", timeout=5).status_code == 401
        assert requests.get(f"{server.url}/state", headers=AUTH, timeout=5).status_code == 200
    finally:
        server.stop()
