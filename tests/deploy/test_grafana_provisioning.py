"""The Grafana provisioning files meet an existing Grafana without taking anything over.

Issue 50: the example data source said `isDefault: true`, and an existing Grafana with a
default data source of its own refuses a second one ("Only one datasource per
organization can be marked as default"); its name and uid (`Prometheus`, `prometheus`)
are the ones an existing Grafana most likely has, and provisioning takes over (edits,
and locks against editing) a data source of the same name. The file is for a fresh
Grafana only, and says so; the dashboard picks any Prometheus data source through its
`datasource` variable.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DATASOURCES = REPO / "grafana" / "provisioning" / "datasources" / "prometheus.yml"


def test_the_example_data_source_claims_no_default_and_no_common_name() -> None:
    doc = yaml.safe_load(DATASOURCES.read_text())
    (source,) = doc["datasources"]
    assert source["type"] == "prometheus"
    assert source.get("isDefault", False) is False  # was true: a second default
    assert source["name"].lower() != "prometheus" and "gpuguard" in source["name"].lower()
    assert "gpuguard" in source["uid"]
    assert "fresh Grafana only" in DATASOURCES.read_text()


def test_the_dashboard_names_no_data_source_of_its_own() -> None:
    """Whatever Prometheus data source a Grafana has: chosen by the variable, never by
    the example file's uid."""
    text = (REPO / "grafana" / "dashboard.json").read_text()
    dashboard = json.loads(text)
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    assert '"uid": "prometheus"' not in text
