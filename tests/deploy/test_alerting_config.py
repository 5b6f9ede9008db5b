"""Alerting rules, Alertmanager example and Grafana dashboard: static checks.

promtool/amtool checks need Debian's `prometheus` and `prometheus-alertmanager`
packages; without them these tests skip, except under CI=true where they fail.
The pure-Python checks always run. The dashboard's queries come from
tests/support/dashboard.py, shared with the e2e test that runs them against Prometheus.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.dashboard import dashboard_exprs, load_dashboard, walk_panels

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "rules.yml"
RULES_TEST = REPO / "alerts" / "rules.test.yml"
ALERTMANAGER = REPO / "alerts" / "alertmanager.yml"
#: The one-receiver example for Alertmanager 0.31+, whose webhook URL is a template.
ROUTED = REPO / "alerts" / "alertmanager-routed.yml"
ROUTED_URL = "https://{{ .CommonLabels.hostname }}:9878/alerts"

RUNBOOKS = REPO / "docs" / "runbooks"
REMEDIATOR_RECEIVER = "gpuguard-remediator"
PAGER_RECEIVER = "pager"
TEAM_RECEIVER = "team"
#: kube-prometheus's severities; `info` is held back by its InfoInhibitor.
SEVERITIES = frozenset({"critical", "warning", "info"})
#: Each rule's severity (docs/alerting.md): was page -> critical, ticket -> warning.
EXPECTED_SEVERITY = {
    "GPUOrphanTree": "warning",  # never info: an inhibited GPUOrphanTree is never reaped
    "GPUGuardExporterDown": "critical",
    "GPUGuardExporterAbsent": "critical",
    "GPUGuardNVMLDown": "critical",
    "GPUGuardGPUBackendDown": "critical",
    "GPUGuardScanStale": "critical",
    "GPUGuardScanErrors": "warning",
    "GPUGuardScanSlow": "warning",
    "GPUGuardConfigReloadFailed": "warning",
    "GPUGuardLauncherEvidenceEvicted": "warning",
    "GPUGuardRemediatorDown": "warning",
    # warning like RemediatorDown: a fleet that only reports has no remediator at all
    "GPUGuardRemediatorAbsent": "warning",
    "GPUGuardRemediatorRejecting": "warning",
    "GPUGuardReapFailed": "critical",
    "GPUGuardAuditLogFailing": "critical",
    "GPUGuardRemediatorStuck": "critical",
    "GPUGuardRecoveryWaiting": "critical",
    "GPUGuardAlertmanagerUnreachable": "warning",
    "GPUUserOverQuota": "warning",
    "GPUIdleHolder": "warning",  # for people: never remediate="true"
    "GPUSuspectProcess": "critical",
    "GPUSuspectProcessSustained": "warning",
    "GPUMemoryUnattributed": "warning",
    # critical: the GPU's driver asks for a reset or a reboot before it can be used again
    "GPUGuardGPURecoveryAction": "critical",
    "GPUGuardProcessEventsDown": "warning",
}

# docs/design.md, Contracts (the exporter's metrics) + the remediator's metrics + `up`.
EXPORTER_METRICS = frozenset(
    {
        "gpuguard_gpu_info",
        "gpuguard_gpu_memory_bytes",
        "gpuguard_gpu_memory_used_bytes",
        "gpuguard_gpu_utilization_ratio",
        "gpuguard_gpu_temperature_celsius",
        "gpuguard_gpu_power_watts",
        "gpuguard_gpu_process_memory_bytes",
        "gpuguard_gpu_process_info",
        "gpuguard_orphan_tree_age_seconds",
        "gpuguard_orphan_tree_memory_bytes",
        "gpuguard_orphan_tree_processes",
        "gpuguard_orphan_trees",
        "gpuguard_scan_duration_seconds",
        "gpuguard_last_scan_timestamp_seconds",
        "gpuguard_scans_total",
        "gpuguard_scan_errors_total",
        "gpuguard_inspector_calls_total",
        "gpuguard_inspector_seconds_total",
        "gpuguard_inspector_proc_reads_total",
        "gpuguard_nvml_up",
        "gpuguard_gpu_backend_up",
        "gpuguard_host_info",
        # accounting (issue 15): for people, never for the remediator
        "gpuguard_user_gpu_memory_bytes",
        "gpuguard_user_gpu_memory_quota_bytes",
        "gpuguard_suspect_process_info",
        "gpuguard_gpu_memory_unattributed_bytes",
        # idle holders (issue 40)
        "gpuguard_gpu_process_idle_seconds",
        "gpuguard_orphan_tree_idle_seconds",
        "gpuguard_user_gpu_idle_memory_bytes",
        # memory NVML puts no live name to (issue 40)
        "gpuguard_gpu_unseen_process_memory_bytes",
        # what a GPU's driver asks for before it can be used again (issue 52)
        "gpuguard_gpu_recovery_action",
    }
)
REMEDIATOR_METRICS = frozenset(
    {
        "gpuguard_remediator_decisions_total",
        "gpuguard_remediator_rejected_requests_total",
        "gpuguard_remediator_reaped_processes_total",
        "gpuguard_remediator_reclaimed_bytes_total",
        "gpuguard_remediator_reap_failures_total",
        "gpuguard_remediator_audit_write_failures_total",
        "gpuguard_remediator_audit_ok",
        "gpuguard_remediator_alertmanager_requests_total",
        "gpuguard_remediator_queue_depth",
        "gpuguard_remediator_info",
        "gpuguard_remediator_worker_stuck",
        "gpuguard_remediator_alertmanager_poller_stalled",
        "gpuguard_remediator_recovery_waiting",
    }
)
# Both daemons export the reload gauge (gpuguard/base/reload.py) and the process-event
# listener's families (gpuguard/engine/reading_metrics.py event_metrics).
DAEMON_METRICS = frozenset({"gpuguard_config_last_reload_successful",
                            "gpuguard_process_events_up",
                            "gpuguard_process_events_evicted_total",
                            "gpuguard_process_events_watched_pids"})
CONTRACT_METRICS = EXPORTER_METRICS | REMEDIATOR_METRICS | DAEMON_METRICS | {"up"}


# --------------------------------------------------------------------------- helpers


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} not installed: apt-get install {package}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )


def _load_yaml(path: Path):
    with path.open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def alert_rules() -> list[dict]:
    """Every alerting rule in alerts/rules.yml."""
    return [
        rule for group in _load_yaml(RULES)["groups"] for rule in group["rules"] if "alert" in rule
    ]


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
    }
)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (strings, matchers, ranges, groupings stripped)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("{}", text)
    text = _RANGE.sub("[]", text)
    text = _GROUPING.sub(" ", text)
    return {m for m in _IDENTIFIER.findall(text) if m.lower() not in _KEYWORDS}


# --------------------------------------------------------------------------- promtool


def test_promtool_check_rules_lint():
    promtool = _tool("promtool", "prometheus")
    result = _run(promtool, "check", "rules", "--lint=all", "--lint-fatal", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_unit_tests():
    promtool = _tool("promtool", "prometheus")
    result = _run(promtool, "test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_exprs_parse(tmp_path):
    """Every panel query is valid PromQL (checked by promtool as recording rules)."""
    promtool = _tool("promtool", "prometheus")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{i}", "expr": expr}
                    for i, expr in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules), encoding="utf-8")
    result = _run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- amtool


def test_amtool_check_config():
    amtool = _tool("amtool", "prometheus-alertmanager")
    result = _run(amtool, "check-config", str(ALERTMANAGER))
    assert result.returncode == 0, result.stdout + result.stderr


def _amtool_templates_webhook_urls(amtool: str) -> bool:
    """Whether this amtool is 0.31+ (prometheus/alertmanager#4798 templates webhook URLs)."""
    found = re.search(r"version (\d+)\.(\d+)", _run(amtool, "--version").stdout
                      + _run(amtool, "--version").stderr)
    return found is not None and (int(found[1]), int(found[2])) >= (0, 31)


def _remediator_parts(config: dict) -> tuple[dict, dict]:
    (route,) = [r for r in config["route"]["routes"] if r["receiver"] == REMEDIATOR_RECEIVER]
    (receiver,) = [r for r in config["receivers"] if r["name"] == REMEDIATOR_RECEIVER]
    return route, receiver


def test_routed_example_differs_only_in_the_remediators_route_and_receiver():
    """Issue 54: the one-receiver recipe is alertmanager.yml but for its remediator route
    (a hostname matcher that admits a DNS name only) and receiver (the templated URL,
    https with a private CA, one token)."""
    plain, routed = _load_yaml(ALERTMANAGER), _load_yaml(ROUTED)
    plain_route, _ = _remediator_parts(plain)
    route, receiver = _remediator_parts(routed)
    assert route["group_by"] == ["alertname", "hostname", "root_pid", "root_start_time"]
    assert route["matchers"] == [*plain_route["matchers"],
                                 'hostname=~"[A-Za-z0-9][A-Za-z0-9.-]*"']
    (hook,) = receiver["webhook_configs"]
    assert hook["url"] == ROUTED_URL
    assert hook["http_config"]["tls_config"]["ca_file"]  # never the system's CAs
    assert hook["http_config"]["authorization"]["credentials_file"]
    for config in (plain, routed):  # the rest is the same document
        config["route"]["routes"] = [r for r in config["route"]["routes"]
                                     if r["receiver"] != REMEDIATOR_RECEIVER]
        config["receivers"] = [r for r in config["receivers"]
                               if r["name"] != REMEDIATOR_RECEIVER]
    assert plain == routed


def test_amtool_checks_the_routed_example(tmp_path: Path):
    """amtool 0.31+ checks the file as shipped; an older one (Debian's 0.25) refuses the
    template in a URL, so it checks the file with the URL filled in for one node, and
    routes a node's orphan alert (and no forged hostname) to the remediator."""
    amtool = _tool("amtool", "prometheus-alertmanager")
    if _amtool_templates_webhook_urls(amtool):
        result = _run(amtool, "check-config", str(ROUTED))
        assert result.returncode == 0, result.stdout + result.stderr
    text = ROUTED.read_text()
    assert text.count(ROUTED_URL) == 1
    filled = tmp_path / "alertmanager-routed.yml"
    filled.write_text(text.replace(ROUTED_URL, "https://gpu-node-1:9878/alerts"))
    result = _run(amtool, "check-config", str(filled))
    assert result.returncode == 0, result.stdout + result.stderr
    for hostname, receivers in (("gpu-node-1", {REMEDIATOR_RECEIVER, TEAM_RECEIVER}),
                                ("gpu-node-1.example.org", {REMEDIATOR_RECEIVER, TEAM_RECEIVER}),
                                ("x@evil.example/", {TEAM_RECEIVER})):
        labels = {**_orphan_alert_labels(), "hostname": hostname}
        args = [amtool, "config", "routes", "test", f"--config.file={filled}"]
        got = _run(*args, *(f"{k}={v}" for k, v in sorted(labels.items())))
        assert set(got.stdout.strip().splitlines()[-1].split(",")) == receivers, got.stdout


def _route(amtool: str, labels: dict[str, str], verify: str | None = None):
    args = [amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}"]
    if verify is not None:
        args.append(f"--verify.receivers={verify}")
    args += [f"{k}={v}" for k, v in sorted(labels.items())]
    result = _run(*args)
    receivers = (
        set(result.stdout.strip().splitlines()[-1].split(",")) if result.stdout.strip() else set()
    )
    return result, receivers


def _orphan_alert_labels() -> dict[str, str]:
    (rule,) = [r for r in alert_rules() if r["alert"] == "GPUOrphanTree"]
    return {
        "alertname": "GPUOrphanTree",
        **{k: str(v) for k, v in rule["labels"].items()},
        "hostname": "gpu-node-1",
        "instance": "gpu-node-1:9877",
        "job": "gpuguard",
        "root_pid": "4242",
        "root_start_time": "123456",
        "comm": "python",
        "user": "alice",
        "reason": "session-ended",
    }


def test_orphan_alert_routes_to_remediator_and_people():
    amtool = _tool("amtool", "prometheus-alertmanager")
    result, receivers = _route(amtool, _orphan_alert_labels())
    assert result.returncode == 0, result.stdout + result.stderr
    assert REMEDIATOR_RECEIVER in receivers
    assert len(receivers) >= 2, f"people are not notified (continue: true?): {receivers}"
    # amtool's own verification, exit 1 on a mismatch
    result, _ = _route(amtool, _orphan_alert_labels(), verify=",".join(sorted(receivers)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_remediator_verify_receivers_matches_exactly():
    """amtool --verify.receivers=gpuguard-remediator on the orphan alert: the list must match
    in full, and people get it too, so verifying the remediator alone must fail."""
    amtool = _tool("amtool", "prometheus-alertmanager")
    result, _ = _route(amtool, _orphan_alert_labels(), verify=REMEDIATOR_RECEIVER)
    assert result.returncode != 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "rule", [r for r in alert_rules() if r["alert"] != "GPUOrphanTree"], ids=lambda r: r["alert"]
)
def test_health_alerts_never_reach_remediator(rule):
    amtool = _tool("amtool", "prometheus-alertmanager")
    labels = {
        "alertname": rule["alert"],
        **{k: str(v) for k, v in rule["labels"].items()},
        "instance": "gpu-node-1:9877",
        "job": "gpuguard",
        # even with tree labels present, only GPUOrphanTree may reach the remediator
        "hostname": "gpu-node-1",
        "root_pid": "4242",
        "root_start_time": "123456",
    }
    result, receivers = _route(amtool, labels)
    assert result.returncode == 0, result.stdout + result.stderr
    assert REMEDIATOR_RECEIVER not in receivers
    expected = PAGER_RECEIVER if rule["labels"]["severity"] == "critical" else TEAM_RECEIVER
    result, _ = _route(amtool, labels, verify=expected)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("severity,receiver", [("critical", PAGER_RECEIVER),
                                               ("warning", TEAM_RECEIVER),
                                               ("info", TEAM_RECEIVER)])
def test_severities_route_as_kube_prometheus_does(severity, receiver):
    """critical reaches the pager (alone), warning and info the team receiver (alone)."""
    amtool = _tool("amtool", "prometheus-alertmanager")
    labels = {"alertname": "SomeAlert", "severity": severity, "instance": "gpu-node-1:9877"}
    result, receivers = _route(amtool, labels, verify=receiver)
    assert result.returncode == 0, result.stdout + result.stderr
    assert receivers == {receiver}


@pytest.mark.parametrize(
    "labels",
    [
        {"alertname": "GPUOrphanTree", "severity": "warning", "hostname": "gpu-node-1"},
        {"alertname": "GPUOrphanTree", "remediate": "false", "hostname": "gpu-node-1"},
        {"alertname": "SomethingElse", "remediate": "true", "hostname": "gpu-node-1"},
    ],
    ids=["no-remediate-label", "remediate-false", "other-alertname"],
)
def test_remediator_needs_alertname_and_remediate_label(labels):
    amtool = _tool("amtool", "prometheus-alertmanager")
    result, receivers = _route(amtool, labels)
    assert result.returncode == 0, result.stdout + result.stderr
    assert REMEDIATOR_RECEIVER not in receivers


def test_alertmanager_remediator_receiver_shape():
    config = _load_yaml(ALERTMANAGER)
    (receiver,) = [r for r in config["receivers"] if r["name"] == REMEDIATOR_RECEIVER]
    (webhook,) = receiver["webhook_configs"]
    assert webhook["url"] == "http://127.0.0.1:9878/alerts"
    assert webhook["send_resolved"] is True
    assert webhook["max_alerts"] == 0
    assert webhook["http_config"]["authorization"] == {
        "type": "Bearer",
        "credentials_file": "/etc/gpuguard/token",
    }
    (route,) = [r for r in config["route"]["routes"] if r["receiver"] == REMEDIATOR_RECEIVER]
    assert route["group_by"] == ["alertname", "hostname", "root_pid", "root_start_time"]
    assert route["continue"] is True


# --------------------------------------------------------------------------- rules (pure Python)


def test_every_rule_has_severity_and_annotations():
    rules = alert_rules()
    assert rules
    for rule in rules:
        assert rule["labels"].get("severity"), rule["alert"]
        for key in ("summary", "description"):
            assert str(rule.get("annotations", {}).get(key, "")).strip(), (rule["alert"], key)


def test_severities_are_kube_prometheus_severities():
    assert {rule["alert"]: rule["labels"]["severity"] for rule in alert_rules()} \
        == EXPECTED_SEVERITY
    assert set(EXPECTED_SEVERITY.values()) <= SEVERITIES


def test_shipped_rules_carry_no_runbook_url():
    """No default URL that points at nothing: `gpuguard assets` adds the user's own."""
    for rule in alert_rules():
        assert "runbook_url" not in rule["annotations"], rule["alert"]
    for path in (RULES, RULES_TEST):
        assert not re.search(r"^\s*runbook_url:", path.read_text(), re.MULTILINE), path


def test_every_rule_has_its_runbook_page():
    index = (RUNBOOKS / "index.md").read_text()
    alerting = (REPO / "docs" / "alerting.md").read_text()
    for rule in alert_rules():
        name = rule["alert"]
        page = RUNBOOKS / f"{name.lower()}.md"
        assert page.is_file(), f"no runbook page {page.relative_to(REPO)}"
        text = page.read_text()
        assert text.startswith(f"# {name}\n"), page
        assert f"Severity `{rule['labels']['severity']}`" in text, page
        assert f"]({name.lower()}.md)" in index, name
        assert f"](runbooks/{name.lower()}.md)" in alerting, name
    pages = {p.stem for p in RUNBOOKS.glob("*.md")} - {"index"}
    assert pages == {rule["alert"].lower() for rule in alert_rules()}


def heading_anchors(page: Path) -> set[str]:
    """The ids MkDocs gives a page's headings (toc's slugify: code marks and punctuation
    dropped, spaces and hyphens joined into one hyphen)."""
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h.replace("`", "")).strip().lower())
            for h in re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)}


def test_runbook_pages_link_to_what_exists():
    """Relative links from docs/runbooks/ resolve inside docs/ (the pages are published on
    their own, so nothing outside it) and their anchors name a heading of the target."""
    docs = (REPO / "docs").resolve()
    for page in RUNBOOKS.glob("*.md"):
        for target in re.findall(r"\]\(([^)]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page.resolve()
            assert resolved.exists() and resolved.is_relative_to(docs), (page.name, target)
            if anchor:
                assert anchor in heading_anchors(resolved), (page.name, target)


def test_only_the_orphan_rule_can_remediate():
    for rule in alert_rules():
        labels = rule["labels"]
        if rule["alert"] == "GPUOrphanTree":
            assert labels == {"severity": "warning", "remediate": "true"}
            assert rule["for"] == "1m"
        else:
            assert "remediate" not in labels, rule["alert"]
            assert labels["severity"] in SEVERITIES, rule["alert"]


def test_rules_use_contract_metrics_only():
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= CONTRACT_METRICS, (rule["alert"], names - CONTRACT_METRICS)
        in_templates = set(re.findall(r"\bgpuguard_\w+", json.dumps(rule["annotations"])))
        assert in_templates <= CONTRACT_METRICS, (rule["alert"], in_templates - CONTRACT_METRICS)


def test_every_rule_has_a_firing_unit_test():
    tested = {
        case["alertname"]
        for test in _load_yaml(RULES_TEST)["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    missing = {rule["alert"] for rule in alert_rules()} - tested
    assert not missing, f"rules without a firing test in rules.test.yml: {sorted(missing)}"


def test_every_unit_test_group_sets_interval():
    for test in _load_yaml(RULES_TEST)["tests"]:
        assert "interval" in test, test.get("name")  # promtool 2.42 has no default


# --------------------------------------------------------------------------- dashboard


def test_metric_names_extractor():
    expr = (
        'sum by (instance) (rate(foo_total{a="b", c=~"$x"}[5m])) / on (instance) '
        'group_left (hostname) bar_info * 1e3 + label_replace(baz, "n", "$1", "i", "(.*)") '
        "and time() - qux offset 5m"
    )
    assert metric_names(expr) == {"foo_total", "bar_info", "baz", "qux"}


def test_dashboard_identity_and_variables():
    dashboard = load_dashboard()
    assert dashboard["uid"] == "gpuguard"
    assert dashboard["title"] == "gpuguard"
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["datasource"]
    assert datasource["type"] == "datasource"
    assert datasource["query"] == "prometheus"
    instance = variables["instance"]
    assert instance["type"] == "query"
    query = instance["query"]
    query = query["query"] if isinstance(query, dict) else query
    assert query == 'label_values(gpuguard_host_info{job="gpuguard"}, instance)'
    assert instance["multi"] is True
    assert instance["includeAll"] is True


def test_every_panel_has_a_query_on_the_selected_datasource():
    panels = [p for p in walk_panels(load_dashboard()["panels"]) if p.get("type") != "row"]
    assert panels
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        targets = panel.get("targets", [])
        assert any(t.get("expr", "").strip() for t in targets), panel["title"]
        for target in targets:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])


def test_dashboard_exprs_use_contract_metrics_only():
    exprs = dashboard_exprs()
    assert exprs
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        assert names <= CONTRACT_METRICS, (expr, names - CONTRACT_METRICS)
        # runnable as-is against Prometheus: no Grafana variable left ($1 is label_replace's)
        assert not re.search(r"\$(?!\d)", expr), expr
        assert "$instance" not in expr


def test_dashboard_covers_the_contract():
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    expected = (EXPORTER_METRICS - {"gpuguard_gpu_info"}) | {
        "gpuguard_remediator_decisions_total",
        "gpuguard_remediator_reclaimed_bytes_total",
    }
    assert expected <= used, sorted(expected - used)


def test_host_label_is_hostname_in_one_spelling() -> None:
    """The alert contract's host name is `hostname`, joined from gpuguard_host_info, and
    the remediator's required alert label: deployed routes and silences match on it, and
    dcgm-exporter itself renamed its `Hostname` to `hostname` (NVIDIA/dcgm-exporter#655).
    gpuguard's per-GPU series also carry dcgm-exporter's older `Hostname` (for older
    dcgm-exporters' joins); the rules name it only to drop it, so no alert carries both
    spellings (alerts/rules.test.yml feeds it in and expects it gone), the joins never use
    it, and the dashboard names it only to hide it from its process table, where
    `instance` says the host (docs/metrics.md, Labels)."""
    from gpuguard.engine.decision.policy import REQUIRED_LABELS

    assert "hostname" in REQUIRED_LABELS
    rules = RULES.read_text()
    assert "group_left (hostname)" in rules
    assert rules.count("Hostname") == rules.count("max without (Hostname) (") == 3
    assert "Hostname" not in (REPO / "alerts" / "joins.yml").read_text()
    dashboard = (REPO / "grafana" / "dashboard.json").read_text()
    assert dashboard.count("Hostname") == dashboard.count('"Hostname": true') == 1


# ------------------------------------------------------ the fleet recipe (docs/fleet.md)

FLEET_ALERTMANAGER = REPO / "docs" / "assets" / "alertmanager-fleet.yml"


def _fleet_receivers(amtool: str, **labels: str) -> set[str]:
    result = _run(amtool, "config", "routes", "test", f"--config.file={FLEET_ALERTMANAGER}",
                  *[f"{k}={v}" for k, v in sorted(labels.items())])
    assert result.returncode == 0, result.stdout + result.stderr
    return set(result.stdout.strip().splitlines()[-1].split(","))


def test_fleet_recipe_is_valid_and_tells_the_trees_owner():
    """The Alertmanager recipe docs/fleet.md shows passes amtool; a GPUOrphanTree alert
    reaches its owner (route on `user`) and people, root's only people; nothing routes to
    a remediator (pull mode); the owner hears the firing (before the reap) and the
    resolution (after it)."""
    amtool = _tool("amtool", "prometheus-alertmanager")
    result = _run(amtool, "check-config", str(FLEET_ALERTMANAGER))
    assert result.returncode == 0, result.stdout + result.stderr
    orphan = {k: v for k, v in _orphan_alert_labels().items() if k != "remediate"}
    orphan["remediate"] = "true"
    assert _fleet_receivers(amtool, **orphan) == {"tree-owner", "team"}
    assert _fleet_receivers(amtool, **{**orphan, "user": "root"}) == {"team"}
    assert _fleet_receivers(amtool, **{**orphan, "user": "1001"}) == {"team"}  # no name
    assert _fleet_receivers(amtool, alertname="GPUGuardExporterDown",
                            severity="critical", instance="n1:9877") == {"pager"}
    config = yaml.safe_load(FLEET_ALERTMANAGER.read_text())
    (owner_route,) = [r for r in config["route"]["routes"] if r["receiver"] == "tree-owner"]
    assert "user" in owner_route["group_by"] and owner_route["continue"] is True
    (owner,) = [r for r in config["receivers"] if r["name"] == "tree-owner"]
    (mail,) = owner["email_configs"]
    assert "{{ .GroupLabels.user }}" in mail["to"] and mail["send_resolved"] is True
    assert all("webhook_configs" not in r or "9878" not in str(r) for r in config["receivers"])
    assert FLEET_ALERTMANAGER.name in (REPO / "docs" / "fleet.md").read_text()
