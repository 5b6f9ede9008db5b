"""grafana/dashboard.json as the tests read it: its panels and their PromQL.

Shared by the static checks (tests/deploy/test_alerting_config.py) and the end-to-end
test that runs every panel query against a live Prometheus (tests/e2e/test_e2e.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "dashboard.json"


def walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included, depth first."""
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


def load_dashboard() -> dict[str, Any]:
    with DASHBOARD.open(encoding="utf-8") as fh:
        doc: dict[str, Any] = json.load(fh)
    return doc


def dashboard_exprs() -> list[str]:
    """Every panel target's PromQL, with the `instance` variable set to match everything."""
    exprs = []
    for panel in walk_panels(load_dashboard()["panels"]):
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            if expr.strip():
                exprs.append(expr.replace("${instance}", ".*").replace("$instance", ".*"))
    return exprs
