"""Hardening (issue 11): configs that mean one thing, regexes that cannot hang a scan,
servers that keep serving under abuse, a bounded intake, safe files, honest status codes."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from gpuguard.base.validation import ConfigError
from gpuguard.config import parse_config
from gpuguard.engine.state.ledger import FILE_NAME
from gpuguard.orphans.rules_config import Rules
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, wait_for
from tests.support.remediator_harness import (
    HOST,
    TOKEN,
    Harness,
    alert,
    payload,
    spawn_orphan,
    write_config,
)
from tests.support.servers import REPO, Exporter, ServerProcess, child_env, find

AUTH = {"Authorization": f"Bearer {TOKEN}"}


# -- 1. one file, one reading ----------------------------------------------------------


@pytest.mark.parametrize(("text", "key", "lines"), [
    ("remediate: {mode: dry-run, alerts: [GPUOrphanTree], mode: enforce}\n",
     "remediate.mode", "lines 1 and 1"),
    ("remediate:\n  mode: dry-run\nclassify:\n  max_depth: 3\nremediate:\n  mode: enforce\n",
     "remediate", "lines 1 and 5"),
    ("remediate:\n  users:\n    allow: [a]\n    allow: ['*']\n", "remediate.users.allow",
     "lines 3 and 4"),
])
def test_a_key_given_twice_is_an_error_naming_both_lines(text: str, key: str,
                                                         lines: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="g.yml")
    assert err.value.key == key and lines in err.value.problem


# -- 3, 4. protect patterns: one by one, linear time --------------------------------------


def test_protect_patterns_are_compiled_one_by_one() -> None:
    # Joined into one regex, (x) shifted the group numbers of (a)\1; named groups clashed;
    # a global (?i) in the middle crashed both daemons.
    rules = parse_config("classify: {protect: ['(x)', '(?i)FOO', '(?P<n>bar)', "
                         "'(?P<n>baz)']}\n").classify
    assert rules.protects("xyz") and rules.protects("foo") and rules.protects("a baz job")
    with pytest.raises(ConfigError) as err:
        parse_config("classify: {protect: ['(x)', '(a)\\1']}\n", source="g.yml")
    assert err.value.key == "classify.protect[1]" and "back-references" in err.value.problem


def test_a_hostile_command_line_cannot_stall_a_match() -> None:
    rules = Rules(protect=("(a+)+$",))
    started = time.perf_counter()
    assert not rules.protects("a" * 100_000 + "!")
    assert time.perf_counter() - started < 0.5


def test_the_exporter_scans_in_time_with_a_hostile_process_on_the_host(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """Any user can name a process so that a backtracking protect pattern never returns."""
    tree = trees.spawn("{holder} --pidfile {dir}/worker " + "a" * 4000 + "! & wait")
    fake_gpu.add_process(0, tree.pid("worker"), 2**30)
    config = tmp_path / "gpuguard.yml"
    config.write_text("classify: {protect: ['(a+)+$', jupyter]}\n")
    exporter = Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()),
                        args=["--config", str(config)], scan_interval=0.2)
    try:
        durations: list[float] = []

        def scanned() -> bool:
            samples = exporter.scrape(timeout=1.0)
            durations.extend(v for _, v in find(samples, "gpuguard_scan_duration_seconds"))
            return bool(find(samples, "gpuguard_gpu_process_info"))

        wait_for(scanned, timeout=10, what="a scan with the hostile holder")
        assert max(durations) < 0.5, durations
        print(f"\nscan with the hostile process present: {max(durations) * 1000:.1f} ms")
        health = requests.get(f"{exporter.url}/healthz", timeout=1.0)
        assert health.status_code == 200
    finally:
        exporter.stop()


# -- 5. slow and half-open clients --------------------------------------------------------


def dry_run_remediator(tmp_path: Path, env: dict[str, str]) -> ServerProcess:
    """`python -m gpuguard.remediator` in dry-run with a token file, on 127.0.0.1."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    return ServerProcess("gpuguard.remediator", [
        "--config", str(write_config(tmp_path, mode="dry-run")), "--token-file", str(token),
        "--hostname", HOST, "--allow-pid-namespace"], env=env)


def half_open(port: int, count: int) -> list[socket.socket]:
    """Connections that say half a request and then nothing."""
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    return socks


def test_both_servers_keep_answering_with_120_half_open_connections(
        tmp_path: Path, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    exporter = Exporter(env=env)
    remediator = dry_run_remediator(tmp_path, env)
    socks: list[socket.socket] = []
    try:
        socks = half_open(exporter.port, 120) + half_open(remediator.port, 120)
        started = time.monotonic()
        assert requests.get(f"{exporter.url}/metrics", timeout=1.0).status_code == 200
        answer = requests.post(f"{remediator.url}/alerts", json=payload(alert(999999, 1)),
                               headers=AUTH, timeout=1.0)
        assert answer.status_code == 200
        print(f"\nscrape + webhook with 240 half-open connections: "
              f"{(time.monotonic() - started) * 1000:.0f} ms")
    finally:
        for s in socks:
            s.close()
        exporter.stop()
        remediator.stop()


# -- 6, 7, 8. the intake: bounded, per-alert, nothing kept that was not written -------------


def test_the_intake_is_bounded_and_says_so_per_alert(harness: Callable[..., Harness]) -> None:
    h = harness(mode="dry-run", max_pending=3, max_pending_per_user=3)
    h.service.stop()  # nothing drains the queue: what the bound does is all that shows
    answer = h.post(payload(*(alert(3_000_000 + i, 1) for i in range(5))))
    statuses = [(a["status"], a["reason"]) for a in answer.get_json()["accounts"]]
    assert statuses == [("accepted", "queued")] * 3 + [("ignored", "queue-full")] * 2
    assert h.service.queue_depth() == 3
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert 'gpuguard_remediator_decisions_total{action="ignore",reason="queue-full"} 2.0' in (
        metrics)


def test_a_label_that_is_no_sane_integer_spoils_only_its_own_alert(
        harness: Callable[..., Harness]) -> None:
    h = harness(mode="dry-run")
    h.service.stop()
    answer = h.post(payload(alert("9" * 5000, 1), alert(3_100_000, "12" * 30),
                            alert(3_100_001, 1)))
    assert answer.status_code == 200, answer.get_data(as_text=True)
    statuses = [(a["status"], a["reason"]) for a in answer.get_json()["accounts"]]
    assert statuses == [("ignored", "bad-label"), ("ignored", "bad-label"),
                        ("accepted", "queued")]


def test_a_full_state_disk_answers_503_and_keeps_nothing(
        harness: Callable[..., Harness], full_disk: Path) -> None:
    (full_disk / "filler").unlink()
    h = harness(mode="dry-run", state_dir=str(full_disk / "state"))
    h.service.stop()
    filler = os.open(full_disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(filler, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(filler)
    answer = h.post(payload(alert(3_200_000, 1)))
    assert answer.status_code == 503 and "cannot record" in answer.get_json()["error"]
    assert h.service.queue_depth() == 0 and h.service.snapshot()["pending"] == []
    (full_disk / "filler").unlink()
    assert h.post(payload(alert(3_200_000, 1))).get_json()["accounts"][0]["status"] == (
        "accepted")


def test_webhook_latency_while_the_queue_floods(
        tmp_path: Path, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """2 x 1,000 alerts for distinct pids, then single deliveries timed meanwhile."""
    server = dry_run_remediator(tmp_path, fake_gpu.subprocess_env(fake_nvml_lib, child_env()))
    try:
        counts: dict[str, int] = {}
        for batch in range(2):
            flood = payload(*(alert(3_300_000 + batch * 1000 + i, 1) for i in range(1000)))
            answer = requests.post(f"{server.url}/alerts", json=flood, headers=AUTH, timeout=10)
            for status, n in answer.json()["counts"].items():
                counts[status] = counts.get(status, 0) + n
        # remediate.max_pending (256 by default) bounds the queue; the worker drains meanwhile.
        assert counts["ignored"] >= 1000, counts
        state = requests.get(f"{server.url}/state", headers=AUTH, timeout=5).json()
        assert len(state["pending"]) <= 256
        latencies = []
        for i in range(100):
            started = time.perf_counter()
            requests.post(f"{server.url}/alerts", json=payload(alert(3_400_000 + i, 1)),
                          headers=AUTH, timeout=5).raise_for_status()
            latencies.append(time.perf_counter() - started)
        p99 = statistics.quantiles(latencies, n=100)[98]
        print(f"\nwebhook during the flood: p50 {statistics.median(latencies) * 1000:.1f} ms, "
              f"p99 {p99 * 1000:.1f} ms")
        assert p99 < 1.0
        state = tmp_path / "state" / FILE_NAME
        assert state.stat().st_size < 512 * 1024  # bounded by max_pending, not by the flood
    finally:
        server.stop()


# -- 9, 10. files and start-up ---------------------------------------------------------------


def run_remediator(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuguard.remediator", "--allow-pid-namespace",
                           "--insecure-no-auth", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def config_dir(tmp_path: Path) -> Iterator[Path]:
    base = tmp_path / "conf"
    base.mkdir(mode=0o700)
    yield base


@pytest.mark.parametrize("case", ["symlinked-audit-log", "world-writable-state",
                                  "world-writable-audit-dir", "bad-ledger-time"])
def test_unsafe_or_broken_files_stop_start_up_in_one_line(config_dir: Path, case: str) -> None:
    state, logs = config_dir / "state", config_dir / "logs"
    state.mkdir(mode=0o700)
    logs.mkdir(mode=0o700)
    audit = logs / "audit.jsonl"
    if case == "symlinked-audit-log":
        (config_dir / "elsewhere").write_text("")
        audit.symlink_to(config_dir / "elsewhere")
    elif case == "world-writable-state":
        state.chmod(0o777)
    elif case == "world-writable-audit-dir":
        logs.chmod(0o777)
    else:
        (state / FILE_NAME).write_text(json.dumps({
            "version": 2, "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text()
            .strip(), "done": {"h/1/1": {"status": "done", "mode": "enforce", "at": "soon"}}}))
    config = config_dir / "gpuguard.yml"
    config.write_text(json.dumps({"remediate": {"state_dir": str(state),
                                                "audit_log": str(audit)}}))
    done = run_remediator("--config", str(config))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("gpuguard-remediator: ")]
    expected: dict[str, Any] = {"symlinked-audit-log": "audit", "world-writable-state":
                                "writable by group or others", "world-writable-audit-dir":
                                "writable by group or others", "bad-ledger-time": "unusable"}
    assert expected[case] in line, line
    if case == "symlinked-audit-log":
        assert (config_dir / "elsewhere").read_text() == ""


def test_an_unreadable_body_is_400_and_a_wrong_media_type_415(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    h = harness(mode="dry-run")
    spawn_orphan(trees, fake_gpu)
    bad = h.client.post("/alerts", data=b"{nope", headers={**AUTH,
                                                           "Content-Type": "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.get_json()["error"]
    wrong = h.client.post("/alerts", data=b"{}", headers={**AUTH, "Content-Type": "text/plain"})
    assert wrong.status_code == 415


def test_a_request_trickling_in_is_closed_like_an_idle_one() -> None:
    """One header line every 0.3 s would keep waitress's own idle timer young forever."""
    import threading

    from gpuguard.web.serving import create_server

    def app(environ: Any, start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    server = create_server(app, host="127.0.0.1", port=0, ident="test", threads=1,
                           idle_timeout=1)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        s = socket.create_connection(("127.0.0.1", server.effective_port), timeout=5)
        s.sendall(b"GET / HTTP/1.1\r\n")
        started = time.monotonic()
        closed = False
        for i in range(30):  # bounded: 9 s at most
            try:
                s.sendall(f"X-Slow-{i}: 1\r\n".encode())
                time.sleep(0.3)  # the client's own pace is the point of this test
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        closed = True
                        break
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
            except OSError:
                closed = True
                break
        assert closed, "the trickling connection was never closed"
        assert time.monotonic() - started < 5
        s.close()
        fresh = requests.get(f"http://127.0.0.1:{server.effective_port}/", timeout=1)
        assert fresh.text == "ok"
    finally:
        # Close every socket from the loop's own thread: its loop ends when nothing is
        # left to watch (closing them from here would pull them from under its select).
        try:
            server.trigger.pull_trigger(
                lambda: [d.close() for d in list(server._map.values())])
        except OSError:
            # The trigger is gone: its loop saw its pipe closed under it (EBADF, seen twice
            # in whole runs, never alone; the closer is not found yet). Close from here.
            for d in list(server._map.values()):
                d.close()
        thread.join(timeout=5)
        server.task_dispatcher.shutdown()
        assert not thread.is_alive()
