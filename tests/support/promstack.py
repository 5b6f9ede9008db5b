"""Real Prometheus and Alertmanager on 127.0.0.1 for end-to-end tests and the demo.

Durations are the only thing changed from alerts/rules.yml (test-sized `for:`,
`keep_firing_for:` and age thresholds); the expressions, labels and annotations are the
shipped ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.support.proctree import wait_for
from tests.support.servers import Exporter, ServerProcess

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "rules.yml"

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")


def missing_binaries() -> str | None:
    """Why the e2e stack cannot run here, or None."""
    if PROMETHEUS is None or ALERTMANAGER is None:
        return ("prometheus/alertmanager binaries not found: "
                "apt-get install prometheus prometheus-alertmanager")
    return None


def require_binaries() -> None:
    """Skip without Prometheus and Alertmanager; under CI (which installs them), fail."""
    why = missing_binaries()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the real Prometheus/Alertmanager are required under CI: {why}")
        pytest.skip(why)


def free_port() -> int:
    """A port the kernel says is free now (bind port 0), for binaries that need a number."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rules_with_durations(*, for_seconds: int = 1, orphan_age_seconds: int = 1,
                         keep_firing_seconds: int | None = 1) -> str:
    """alerts/rules.yml with only its durations shortened; `keep_firing_seconds` None
    keeps the shipped `keep_firing_for` (a reaped tree's alert then resolves minutes
    later, which the loop tests do not wait for)."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = f"{for_seconds}s"
            if "keep_firing_for" in rule and keep_firing_seconds is not None:
                rule["keep_firing_for"] = f"{keep_firing_seconds}s"
            if rule.get("alert") == "GPUOrphanTree":
                rule["expr"] = re.sub(r"(gpuguard_orphan_tree_age_seconds(?:\{[^}]*\})?\s*>\s*)\d+",
                                      rf"\g<1>{orphan_age_seconds}", rule["expr"])
    return yaml.safe_dump(doc, sort_keys=False)


class _Proc:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=log.parent)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


class Alertmanager(_Proc):
    def __init__(self, workdir: Path, config: dict[str, Any], *, port: int | None = None) -> None:
        """`port`: a port picked earlier (the remediator's config names it), or a free one."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.config = workdir, config
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = workdir / "alertmanager.yml"
        cfg.write_text(yaml.safe_dump(config, sort_keys=False))
        assert ALERTMANAGER is not None
        super().__init__([
            ALERTMANAGER, f"--config.file={cfg}", f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=",
            "--log.level=info",
        ], workdir / "alertmanager.log")
        wait_for(self._ready, timeout=30, what=f"alertmanager ready ({self.log_path})")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"alertmanager exited: {self.log_tail()}")
        try:
            return requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def alerts(self, **filters: str) -> list[dict]:
        resp = requests.get(f"{self.url}/api/v2/alerts", timeout=5)
        resp.raise_for_status()
        return [a for a in resp.json()
                if all(a["labels"].get(k) == v for k, v in filters.items())]

    def silence(self, matchers: dict[str, str], *, minutes: int = 30) -> str:
        from datetime import datetime, timedelta

        now = datetime.now(timezone.utc)
        body = {
            "matchers": [{"name": k, "value": v, "isRegex": False, "isEqual": True}
                         for k, v in matchers.items()],
            "startsAt": now.isoformat(),
            "endsAt": (now + timedelta(minutes=minutes)).isoformat(),
            "createdBy": "gpuguard-e2e",
            "comment": "on-call is looking at this tree",
        }
        resp = requests.post(f"{self.url}/api/v2/silences", json=body, timeout=5)
        resp.raise_for_status()
        return resp.json()["silenceID"]

    def post_alert(self, labels: dict[str, str], *, minutes: int = 30) -> None:
        """An alert straight into Alertmanager, as another Prometheus rule would send it."""
        from datetime import datetime, timedelta

        now = datetime.now(timezone.utc)
        body = [{"labels": labels, "startsAt": now.isoformat(),
                 "endsAt": (now + timedelta(minutes=minutes)).isoformat()}]
        requests.post(f"{self.url}/api/v2/alerts", json=body, timeout=5).raise_for_status()

    def restarted(self) -> Alertmanager:
        """The same Alertmanager (config, storage, port) started again after stop()."""
        return Alertmanager(self.workdir, self.config, port=self.port)


class Prometheus(_Proc):
    def __init__(self, workdir: Path, *, targets: Mapping[str, str | list[str]],
                 rules_text: str, alertmanager_url: str | None,
                 scrape: Mapping[str, Any] | None = None,
                 web_config: str | None = None,
                 client: Mapping[str, Any] | None = None, port: int | None = None) -> None:
        """`targets`: each job's target, or its targets (several hosts' exporters).
        `scrape`: keys added to every scrape job (scheme, tls_config, basic_auth).
        `web_config`: Prometheus's own --web.config.file (TLS: its URL is https), which
        the test's own requests meet with `client` (requests' verify, auth).
        `port`: one picked earlier (the remediator's config names it), or a free one."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.targets, self.rules_text = workdir, targets, rules_text
        self.alertmanager_url, self.scrape = alertmanager_url, scrape
        self.web_config, self.client = web_config, client
        self.port = port if port is not None else free_port()
        scheme = "http" if web_config is None else "https"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self._client = dict(client or {})
        (workdir / "rules.yml").write_text(rules_text)
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "scrape_timeout": "900ms"},
            "rule_files": [str(workdir / "rules.yml")],
            "scrape_configs": [
                {"job_name": job, "static_configs": [
                    {"targets": [target] if isinstance(target, str) else list(target)}],
                 **(scrape or {})}
                for job, target in targets.items()
            ],
        }
        if alertmanager_url:
            config["alerting"] = {"alertmanagers": [
                {"static_configs": [{"targets": [alertmanager_url.split("//", 1)[1]]}]}]}
        cfg = workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config, sort_keys=False))
        assert PROMETHEUS is not None
        super().__init__([
            PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=info",
            "--rules.alert.resend-delay=1s",  # a restarted Alertmanager hears at once
            *([f"--web.config.file={web_config}"] if web_config else []),
        ], workdir / "prometheus.log")
        wait_for(self._ready, timeout=30, what=f"prometheus ready ({self.log_path})")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.log_tail()}")
        try:
            return requests.get(f"{self.url}/-/ready", timeout=1,
                                **self._client).status_code == 200
        except requests.RequestException:
            return False

    def restarted(self) -> Prometheus:
        """The same Prometheus (config, TSDB, port) started again after stop()."""
        return Prometheus(self.workdir, targets=self.targets, rules_text=self.rules_text,
                          alertmanager_url=self.alertmanager_url, scrape=self.scrape,
                          web_config=self.web_config, client=self.client, port=self.port)

    def query(self, expr: str) -> list[dict]:
        resp = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5,
                            **self._client)
        body = resp.json()
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def firing(self, alertname: str, **labels: str) -> list[dict]:
        resp = requests.get(f"{self.url}/api/v1/alerts", timeout=5)
        return [a for a in resp.json()["data"]["alerts"]
                if a["labels"].get("alertname") == alertname and a["state"] == "firing"
                and all(a["labels"].get(k) == v for k, v in labels.items())]


class WebhookRecorder:
    """A webhook receiver that keeps every notification Alertmanager sends it."""

    def __init__(self) -> None:
        self.payloads: list[dict] = []
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                with recorder._lock:
                    recorder.payloads.append(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self, predicate: Callable[[dict], bool] = lambda a: True) -> list[dict]:
        with self._lock:
            return [a for p in self.payloads for a in p.get("alerts", []) if predicate(a)]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass(frozen=True)
class LoopTls:
    """Both daemons behind `web_config`; Prometheus and Alertmanager trust `ca_file` and
    present `cert_file`/`key_file`; Prometheus scrapes as `username`/`password_file`."""

    web_config: str
    ca_file: str
    cert_file: str
    key_file: str
    username: str
    password_file: str

    def tls_config(self) -> dict[str, str]:
        return {"ca_file": self.ca_file, "cert_file": self.cert_file, "key_file": self.key_file}


def shipped_alertmanager_config(*, remediator_url: str | None, recorder_url: str,
                                token_file: Path, repeat_interval: str | None = None,
                                tls: LoopTls | None = None) -> dict:
    """alerts/alertmanager.yml with local URLs, the token path and 1 s group timings.

    `remediator_url=None`: the remediator's receiver has no webhook (pull mode: it asks).
    `repeat_interval`: the remediator route's, shortened like the other timings.
    """
    config = yaml.safe_load((REPO / "alerts" / "alertmanager.yml").read_text())

    def shorten(route: dict) -> None:
        for key in ("group_wait", "group_interval"):
            if key in route:
                route[key] = "1s"
        for child in route.get("routes", []):
            shorten(child)

    config["route"].update(group_wait="1s", group_interval="1s")
    shorten(config["route"])
    for route in config["route"]["routes"]:
        if route["receiver"] == "gpuguard-remediator" and repeat_interval is not None:
            route["repeat_interval"] = repeat_interval
    for receiver in config["receivers"]:
        if receiver["name"] == "gpuguard-remediator" and remediator_url is None:
            receiver.pop("webhook_configs")
        for hook in receiver.get("webhook_configs", []):
            if receiver["name"] == "gpuguard-remediator":
                hook["url"] = f"{remediator_url}/alerts"
                hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
                if tls is not None:
                    hook["http_config"]["tls_config"] = tls.tls_config()
            else:
                hook["url"] = recorder_url
    return config


@dataclass
class Loop:
    """exporter -> Prometheus -> Alertmanager -> remediator, all on 127.0.0.1."""

    exporter: Exporter
    remediator: ServerProcess
    recorder: WebhookRecorder
    alertmanager: Alertmanager
    prometheus: Prometheus
    audit_log: Path
    started: list = field(default_factory=list)

    def stop(self) -> None:
        for thing in reversed(self.started):
            thing.stop()


def start_loop(base: Path, env: Mapping[str, str], *, hostname: str, scan_interval: float,
               for_seconds: int, orphan_age_seconds: int, term_timeout_seconds: float,
               before_prometheus: Callable[[Alertmanager], None] = lambda am: None,
               remediate: Mapping[str, Any] | None = None, confirm: bool = False,
               pull: bool = False, prometheus_pull: bool = False,
               repeat_interval: str | None = None,
               inhibit_rules: list[dict[str, Any]] | None = None,
               tls: LoopTls | None = None,
               exporter_config: Mapping[str, Any] | None = None) -> Loop:
    """Start the whole loop with the remediator in enforce mode; stop what started on error.

    `before_prometheus` runs once Alertmanager is up and before any alert can fire
    (on-call's silences go there). `remediate` overrides keys of the remediator's
    policy; `confirm` gives it `remediate.alertmanager` (kill-time confirmation),
    `pull` also makes it poll (and removes the webhook from Alertmanager's config);
    `prometheus_pull` makes it poll Prometheus instead (remediate.prometheus), Alertmanager
    confirming each reap, again without the webhook.
    `exporter_config`: sections (quotas:, audit:) added to the one config file, which the
    exporter reads too.
    """
    started: list = []
    try:
        token = base / "token"
        token.write_text("loop-secret-token\n")
        token.chmod(0o600)
        audit_log = base / "audit.jsonl"
        config = base / "gpuguard.yml"
        am_port, prom_port = free_port(), free_port()
        policy: dict[str, Any] = {
            "mode": "enforce", "min_age_seconds": 0,
            "term_timeout_seconds": term_timeout_seconds,
            # The trees' launchers die before the daemons start: with their listener on
            # (the host PID namespace) that reads launcher-unrecorded, which the default
            # policy does not reap. These tests are about the alerting loop: allow it.
            "reasons": ["launcher-killed", "session-ended", "launcher-unrecorded"],
            # The planted trees belong to whoever runs this, root under CI.
            "users": {"allow": ["*"], "deny": []}, "allow_root_owned": True,
            "state_dir": str(base / "state"), "audit_log": str(audit_log),
        }
        if confirm or pull or prometheus_pull:
            policy["alertmanager"] = {"url": f"http://127.0.0.1:{am_port}", "pull": pull,
                                      "pull_interval_seconds": 1, "timeout_seconds": 2}
        if prometheus_pull:
            policy["prometheus"] = {"url": f"http://127.0.0.1:{prom_port}",
                                    "pull_interval_seconds": 1, "timeout_seconds": 2}
        policy.update(remediate or {})
        config.write_text(yaml.safe_dump({"remediate": policy, **(exporter_config or {})}))
        web = ["--web-config-file", tls.web_config] if tls is not None else []
        exporter = Exporter(env=env, args=["--hostname", hostname, "--config", str(config),
                                           *web], scan_interval=scan_interval)
        started.append(exporter)
        remediator = ServerProcess("gpuguard.remediator", [
            "--config", str(config), "--token-file", str(token), "--hostname", hostname,
            "--allow-pid-namespace", *web], env=env)  # the fake NVML reports our pids
        started.append(remediator)
        if tls is not None:
            remediator.url = remediator.url.replace("http://", "https://")
        recorder = WebhookRecorder()
        started.append(recorder)
        am_config = shipped_alertmanager_config(
            remediator_url=None if pull or prometheus_pull else remediator.url,
            recorder_url=recorder.url,
            token_file=token, repeat_interval=repeat_interval, tls=tls)
        am_config["inhibit_rules"] = am_config.get("inhibit_rules", []) + (inhibit_rules or [])
        alertmanager = Alertmanager(base / "am", am_config, port=am_port)
        started.append(alertmanager)
        before_prometheus(alertmanager)
        prometheus = Prometheus(
            base / "prom",
            targets={"gpuguard": f"127.0.0.1:{exporter.port}",
                     "gpuguard-remediator": f"127.0.0.1:{remediator.port}"},
            rules_text=rules_with_durations(for_seconds=for_seconds,
                                            orphan_age_seconds=orphan_age_seconds),
            alertmanager_url=alertmanager.url,
            scrape=None if tls is None else {
                "scheme": "https", "tls_config": tls.tls_config(),
                "basic_auth": {"username": tls.username, "password_file": tls.password_file}},
            port=prom_port,
        )
        started.append(prometheus)
    except BaseException:
        for thing in reversed(started):
            thing.stop()
        raise
    return Loop(exporter, remediator, recorder, alertmanager, prometheus, audit_log, started)
