"""Write the two Kubernetes manifests derived from files kept elsewhere in the repository.

    python deploy/kubernetes/generate.py           # rewrite both files
    python deploy/kubernetes/generate.py --check   # exit 1 if either is stale (CI)

prometheusrule.yaml carries alerts/rules.yml's groups and grafana-dashboard-configmap.yaml
carries grafana/dashboard.json. Why generated and checked in: `kubectl apply -k` needs the
files as they are, and a hand-kept copy drifts from the rules that `promtool test rules`
checks. Both sources are embedded as text (comments, block scalars and formatting kept),
then parsed back: what the manifest means must equal the source, or generation fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
COMMAND = "python deploy/kubernetes/generate.py"
NAMESPACE = "gpuguard"
LABELS = "    app.kubernetes.io/name: gpuguard\n    app.kubernetes.io/part-of: gpuguard\n"
RULE_NOTE = """\
# The Prometheus Operator loads it only where the Prometheus object's ruleSelector
# matches these labels (kube-prometheus-stack's default wants its `release:` label:
# add it with kustomize `labels:` or set ruleSelectorNilUsesHelmValues=false).
"""
DASHBOARD_NOTE = """\
# Grafana's dashboard sidecar (kube-prometheus-stack, the grafana chart with
# sidecar.dashboards.enabled) loads ConfigMaps labelled grafana_dashboard: "1", from its
# own namespace only unless sidecar.dashboards.searchNamespace is ALL or names this one.
"""


@dataclass(frozen=True)
class Output:
    """One generated manifest: where it goes, what it is made from, and its text."""

    path: Path
    source: str
    text: str


class GenerateError(Exception):
    """A source the manifests cannot be made from, phrased for one line of output."""


def _indent(text: str, by: int) -> str:
    """Indent every non-empty line: YAML's meaning is unchanged, empty lines stay empty."""
    pad = " " * by
    return "".join(pad + line if line.strip() else "\n"
                   for line in text.splitlines(keepends=True))


def _header(source: str) -> str:
    return (f"# Generated from {source} by {COMMAND}: do not edit by hand.\n"
            f"# After changing {source}, run `{COMMAND}` "
            "(tests/deploy/test_kubernetes.py checks it).\n")


def prometheus_rule(rules_text: str, source: str = "alerts/rules.yml") -> str:
    """A monitoring.coreos.com/v1 PrometheusRule whose spec.groups are the file's groups."""
    rules = yaml.safe_load(rules_text)
    if not isinstance(rules, dict) or set(rules) != {"groups"}:
        raise GenerateError(f"{source}: (top level): expected exactly one key, groups")
    lines = rules_text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("groups:")), None)
    if start is None:
        raise GenerateError(f"{source}: groups: must start a line at column 0")
    body = "".join(lines[start:])
    text = (_header(source)
            + RULE_NOTE
            + "apiVersion: monitoring.coreos.com/v1\n"
            + "kind: PrometheusRule\n"
            + "metadata:\n"
            + "  name: gpuguard\n"
            + f"  namespace: {NAMESPACE}\n"
            + "  labels:\n" + LABELS
            + "spec:\n"
            + _indent(body, 2))
    if yaml.safe_load(text)["spec"]["groups"] != rules["groups"]:
        raise GenerateError(f"{source}: groups: changed meaning when embedded; "
                            "keep groups: as the last top-level key")
    return text


def dashboard_configmap(dashboard_text: str, source: str = "grafana/dashboard.json") -> str:
    """A ConfigMap carrying the dashboard for Grafana's sidecar (label grafana_dashboard)."""
    try:
        json.loads(dashboard_text)
    except ValueError as exc:
        raise GenerateError(f"{source}: (file): not JSON: {exc}") from None
    if not dashboard_text.endswith("\n") or dashboard_text.startswith((" ", "\n")):
        raise GenerateError(f"{source}: (file): must start with '{{' and end with a newline")
    text = (_header(source)
            + DASHBOARD_NOTE
            + "apiVersion: v1\n"
            + "kind: ConfigMap\n"
            + "metadata:\n"
            + "  name: gpuguard-grafana-dashboard\n"
            + f"  namespace: {NAMESPACE}\n"
            + "  labels:\n" + LABELS
            + "    grafana_dashboard: \"1\"\n"
            + "data:\n"
            + "  gpuguard.json: |\n"
            + _indent(dashboard_text, 4))
    if yaml.safe_load(text)["data"]["gpuguard.json"] != dashboard_text:
        raise GenerateError(f"{source}: (file): changed when embedded as a YAML block scalar")
    return text


def outputs(root: Path = ROOT) -> list[Output]:
    """Both manifests, rendered from the sources under `root` (a repository checkout)."""
    rules, dashboard = "alerts/rules.yml", "grafana/dashboard.json"
    out = root / "deploy" / "kubernetes"
    return [
        Output(out / "prometheusrule.yaml", rules,
               prometheus_rule((root / rules).read_text(encoding="utf-8"), rules)),
        Output(out / "grafana-dashboard-configmap.yaml", dashboard,
               dashboard_configmap((root / dashboard).read_text(encoding="utf-8"), dashboard)),
    ]


def stale(root: Path = ROOT) -> list[Output]:
    """The manifests whose checked-in text differs from a fresh generation."""
    found = []
    for output in outputs(root):
        try:
            current = output.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            current = None
        if current != output.text:
            found.append(output)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a checked-in file differs")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.check:
            found = stale(args.root)
            for output in found:
                print(f"{output.path.relative_to(args.root)} is stale: {output.source} changed "
                      f"since it was generated; run `{COMMAND}`", file=sys.stderr)
            return 1 if found else 0
        for output in outputs(args.root):
            output.path.write_text(output.text, encoding="utf-8")
            print(f"wrote {output.path.relative_to(args.root)} from {output.source}")
    except (GenerateError, OSError) as exc:
        print(f"generate.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
