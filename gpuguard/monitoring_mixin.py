"""The monitoring mixin (mixin/, docs/mixin.md) rendered into the files Prometheus and
Grafana read: alerts/rules.yml, alerts/joins.yml (recording rules) and
grafana/dashboard.json.

One source for the shipped defaults and for `gpuguard assets --job ...`: the files in the
checkout and the wheel are this module's rendering with the default _config (a test
renders again and compares), and a rendering with other settings changes every selector,
threshold and link the mixin draws from its _config, nothing else. Needs the `jsonnet`
package (the `mixin` extra); without it only the pre-rendered defaults exist.

`python -m gpuguard.monitoring_mixin` rewrites the checked-in files (`make mixin`);
`--check` exits 1 when one differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

import yaml

RULES = "alerts/rules.yml"
RECORDING_RULES = "alerts/joins.yml"
DASHBOARD = "grafana/dashboard.json"
#: What the mixin renders, by the path of each file in the source tree.
RENDERED: tuple[str, ...] = (RULES, RECORDING_RULES, DASHBOARD)
#: The mixin's own files, by their path in the source tree (shipped with the wheel).
SOURCES: tuple[str, ...] = (
    "mixin/mixin.libsonnet",
    "mixin/config.libsonnet",
    "mixin/alerts/alerts.libsonnet",
    "mixin/rules/rules.libsonnet",
    "mixin/dashboards/dashboards.libsonnet",
    "mixin/jsonnetfile.json",
)
EXTRA_HINT = "the jsonnet package (gpuguard[mixin]): pip install 'jsonnet>=0.20'"

_RULES_HEADER = """\
# gpuguard alerting rules (Prometheus 2.42+), rendered from gpuguard's monitoring mixin
# (mixin/; docs/mixin.md) with exporterSelector {exporter} and
# remediatorSelector {remediator}. Do not edit by hand: change mixin/ and
# run `make mixin`, or render your own with `gpuguard assets` or jsonnet.
#
# GPUOrphanTree is the only rule that may lead to a reap: it carries remediate="true" and
# Alertmanager routes exactly that (alertname + label) to the remediator, which re-checks
# the tree locally and applies its policy. Every other rule is for people. Runbooks:
# docs/runbooks/<alertname-lowercase>.md; {runbooks}.
"""
_RECORDING_HEADER = """\
# gpuguard recording rules for the joins people ask for (Prometheus 2.42+), rendered from
# gpuguard's monitoring mixin (mixin/; docs/mixin.md) with exporterSelector {exporter}.
# Do not edit by hand: change mixin/ and run `make mixin`. gpuguard's series carry
# dcgm-exporter's UUID and modelName, so these join dcgm-exporter's series on UUID, also
# where the exporter runs with --no-collector.gpu (docs/metrics.md).
"""
#: Field order in the rendered rules (jsonnet sorts fields; people read them in this order).
_ORDER = ("name", "interval", "alert", "record", "expr", "for", "keep_firing_for", "labels",
          "annotations", "rules", "severity", "summary", "description", "runbook_url")


class MixinUnavailable(Exception):
    """The jsonnet package is not installed: only the pre-rendered defaults exist."""


@dataclass(frozen=True)
class Rendered:
    """The mixin's three outputs as the bytes of the files they are written to."""

    files: Mapping[str, bytes]


def available() -> bool:
    try:
        import _jsonnet  # noqa: F401
    except ImportError:
        return False
    return True


def _evaluate(folder: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    try:
        import _jsonnet
    except ImportError:
        raise MixinUnavailable(f"rendering the mixin needs {EXTRA_HINT}") from None
    snippet = ("local mixin = (import 'mixin.libsonnet') + "
               "{ _config+:: std.parseJson(std.extVar('config')) };\n"
               "{ alerts: mixin.prometheusAlerts, rules: mixin.prometheusRules,\n"
               "  dashboards: mixin.grafanaDashboards, config: mixin._config }")
    try:
        out = _jsonnet.evaluate_snippet("gpuguard-mixin", snippet, jpathdir=[str(folder)],
                                        ext_vars={"config": json.dumps(dict(config))})
    except RuntimeError as exc:
        raise ValueError(f"mixin: {str(exc).strip()}") from None
    result: dict[str, Any] = json.loads(out)
    return result


def _ordered(node: Any) -> Any:
    if isinstance(node, dict):
        known = [k for k in _ORDER if k in node]
        return {k: _ordered(node[k]) for k in known + sorted(set(node) - set(known))}
    if isinstance(node, list):
        return [_ordered(v) for v in node]
    return node


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (queries) as literal blocks, long ones as folded blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else (">" if len(value) > 80 else None)
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def rules_yaml(doc: Any, header: str) -> str:
    """One rules file: the header, then the groups in YAML that reads back as doc."""
    body = yaml.dump(_ordered(doc), Dumper=_Dumper, sort_keys=False, width=88,
                     allow_unicode=True, indent=2)
    if yaml.safe_load(body) != doc:  # the dumper's block styles must not change a string
        raise ValueError("mixin: the rules did not survive YAML as rendered")
    return header + body


def render(config: Mapping[str, Any] | None = None, *, folder: Path | None = None) -> Rendered:
    """The rules, recording rules and dashboard from the mixin in folder (default: the one
    shipped in this package) with config merged over its _config. MixinUnavailable
    without the jsonnet package; ValueError when jsonnet refuses the mixin or config."""
    if folder is None:
        with as_file(files("gpuguard").joinpath("mixin")) as shipped:
            return render(config, folder=Path(shipped))
    out = _evaluate(folder, config or {})
    cfg = out["config"]
    runbooks = ("as rendered, no rule carries a runbook_url" if not cfg["runbookURLPattern"]
                else f"runbook_url: {cfg['runbookURLPattern'] % '<alertname-lowercase>'}")
    dashboards = out["dashboards"]
    if list(dashboards) != ["gpuguard.json"]:
        raise ValueError(f"mixin: expected one dashboard gpuguard.json, got {list(dashboards)}")
    return Rendered({
        RULES: rules_yaml(out["alerts"], _RULES_HEADER.format(
            exporter=cfg["exporterSelector"], remediator=cfg["remediatorSelector"],
            runbooks=runbooks)).encode("utf-8"),
        RECORDING_RULES: rules_yaml(out["rules"], _RECORDING_HEADER.format(
            exporter=cfg["exporterSelector"])).encode("utf-8"),
        DASHBOARD: (json.dumps(dashboards["gpuguard.json"], indent=2, ensure_ascii=False)
                    + "\n").encode("utf-8"),
    })


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuguard.monitoring_mixin",
                                     description="Render mixin/ into the checked-in files.")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a checked-in file differs")
    args = parser.parse_args(argv)
    rendered = render(folder=args.repo / "mixin")
    stale = []
    for name, data in rendered.files.items():
        path = args.repo / name
        if path.is_file() and path.read_bytes() == data:
            continue
        stale.append(name)
        if not args.check:
            path.write_bytes(data)
    for name in stale:
        print(f"{'differs from the mixin' if args.check else 'wrote'}: {name}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
