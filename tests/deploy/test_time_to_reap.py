"""The time to reap that README.md and docs/alerting.md state is the one the shipped
defaults give (issue 50): each wait read from where it is set (the rule, the example
Alertmanager route, the `remediate:` defaults, the exporter's flag, Prometheus's own
defaults), added up, and compared with the numbers the docs print. A default that moves
without the docs fails here."""

from __future__ import annotations

import re

import yaml

from gpuguard.config.remediate import AlertmanagerConfig, Remediate
from gpuguard.exporter.cli import build_parser
from tests.support.servers import REPO

#: Prometheus's own defaults for scrape_interval and evaluation_interval (its
#: configuration docs); deploy/prometheus-scrape.yml sets neither.
PROMETHEUS_SCRAPE_INTERVAL = PROMETHEUS_EVALUATION_INTERVAL = 60


def seconds(duration: str) -> int:
    """A Prometheus/Alertmanager duration of one unit: 10s, 1m, 4h."""
    number, unit = re.fullmatch(r"(\d+)([smh])", duration).groups()  # type: ignore[union-attr]
    return int(number) * {"s": 1, "m": 60, "h": 3600}[unit]


def shipped() -> dict[str, int]:
    rules = yaml.safe_load((REPO / "alerts/rules.yml").read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"]
               if r.get("alert") == "GPUOrphanTree"]
    threshold = re.search(r"gpuguard_orphan_tree_age_seconds\{[^}]*\} > (\d+)", rule["expr"])
    assert threshold is not None
    config = yaml.safe_load((REPO / "alerts/alertmanager.yml").read_text())
    (route,) = [r for r in config["route"]["routes"] if r["receiver"] == "gpuguard-remediator"]
    scrape = yaml.safe_load((REPO / "deploy/prometheus-scrape.yml").read_text())
    assert "global" not in scrape and all(
        "scrape_interval" not in job for job in scrape["scrape_configs"])
    defaults = Remediate()
    return {
        "scan": int(build_parser().get_default("scan_interval")),
        "threshold": int(threshold.group(1)),
        "lag": PROMETHEUS_SCRAPE_INTERVAL + PROMETHEUS_EVALUATION_INTERVAL,
        "for": seconds(rule["for"]),
        "group_wait": seconds(route["group_wait"]),
        "min_age": int(defaults.min_age_seconds),
        "redelivery": max(seconds(route["group_interval"]), seconds(route["repeat_interval"])),
        "term": int(defaults.term_timeout_seconds),
        "pull": int(AlertmanagerConfig(url=("http://am",)).pull_interval_seconds),
    }


def test_the_docs_state_the_time_to_reap_the_defaults_give() -> None:
    d = shipped()
    least = d["threshold"] + d["for"] + d["group_wait"] + d["min_age"]
    most = (d["scan"] + d["threshold"] + d["lag"] + d["for"] + d["group_wait"] + d["min_age"]
            + d["redelivery"] + d["term"])
    alerting = (REPO / "docs/alerting.md").read_text()
    readme = (REPO / "README.md").read_text()
    assert f"| **total** | | **{least} to {most} (about 11 to 14.5 minutes)** |" in alerting
    assert f"({least} to {most} s;" in readme and "**11 to 14.5 minutes**" in readme
    assert 11 * 60 <= least and most <= 14.5 * 60  # the minutes printed round the seconds
    assert f"the delivery wait is gone ({least} to {most - d['redelivery']} s)" in alerting
    for row in (f"| `--scan-interval {d['scan']}` | 0 to {d['scan']} |",
                f"| `gpuguard_orphan_tree_age_seconds > {d['threshold']}` | {d['threshold']} |",
                f"| 0 to {d['lag']} |",
                f"| `for: {d['for'] // 60}m` | {d['for']} |",
                f"| `group_wait: {d['group_wait']}s` | {d['group_wait']} |",
                f"| {d['min_age']} | {d['min_age']} | `remediate.min_age_seconds`",
                f"| 0 to {d['redelivery']} |",
                f"| {d['term']} | 0 to {d['term']} |",
                f"`pull_interval_seconds` ({d['pull']})"):
        assert row in alerting, row
