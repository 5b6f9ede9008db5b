"""The monitoring mixin (mixin/, docs/mixin.md): one jsonnet source for the shipped rules,
recording rules and dashboard.

- The checked-in alerts/rules.yml, alerts/joins.yml and grafana/dashboard.json are the
  mixin rendered with its default _config (`make mixin` rewrites them).
- A _config of one's own (other selectors, a runbook pattern, other thresholds and
  durations) reaches every selector, threshold and link: nothing of the defaults is
  left, and the result passes promtool's lint and the unit tests adapted to the jobs.
- `gpuguard assets` without the jsonnet package writes the defaults, and says in one
  line that a rendering option needs the `mixin` extra.

promtool checks skip without Debian's `prometheus` package, except under CI=true.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard import assets, monitoring_mixin
from tests.support.ci import require
from tests.support.dashboard import walk_panels
from tests.support.servers import child_env

REPO = Path(__file__).resolve().parents[2]
MIXIN = REPO / "mixin"
OTHER_JOBS = {"exporterSelector": 'job="node-gpuguard"', "remediatorSelector": 'job="node-reaper"',
              "runbookURLPattern": "https://wiki.example.org/gpu/%s/page"}
# Series names of exporter / remediator metrics in a query (recording rules excluded).
METRIC = re.compile(r"(?<![\w:])(gpuguard_[a-z_]+|up|DCGM_FI_DEV_FB_USED)\b(?!\s*\()(\{[^}]*\})?")


def _render(config: dict[str, Any] | None = None) -> dict[str, str]:
    rendered = monitoring_mixin.render(config, folder=MIXIN)
    return {name: data.decode("utf-8") for name, data in rendered.files.items()}


def _alerts(text: str) -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(text)["groups"] for r in g["rules"] if "alert" in r]


def _queries(rendered: dict[str, str]) -> list[str]:
    """Every PromQL query in the rules, recording rules and dashboard (with its variables)."""
    out = [r["expr"] for name in (monitoring_mixin.RULES, monitoring_mixin.RECORDING_RULES)
           for g in yaml.safe_load(rendered[name])["groups"] for r in g["rules"]]
    dashboard = json.loads(rendered[monitoring_mixin.DASHBOARD])
    out += [t["expr"] for p in walk_panels(dashboard["panels"]) for t in p.get("targets", [])]
    out += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return out


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    require(promtool, "promtool not installed: apt-get install prometheus")
    assert promtool is not None
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_checked_in_files_are_the_default_rendering() -> None:
    """CI fails here when someone edits a rendered file instead of mixin/ (or forgets
    `make mixin` after editing mixin/)."""
    rendered = monitoring_mixin.render(folder=MIXIN).files
    assert set(rendered) == set(monitoring_mixin.RENDERED)
    for name, data in rendered.items():
        assert (REPO / name).read_bytes() == data, f"{name} differs from mixin/: run make mixin"
    assert monitoring_mixin.main(["--repo", str(REPO), "--check"]) == 0


def test_check_mode_names_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copytree(MIXIN, tmp_path / "mixin")
    for name in monitoring_mixin.RENDERED:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / monitoring_mixin.RULES).write_text("groups: []\n")
    assert monitoring_mixin.main(["--repo", str(tmp_path), "--check"]) == 1
    assert "alerts/rules.yml" in capsys.readouterr().out
    assert monitoring_mixin.main(["--repo", str(tmp_path)]) == 0
    assert monitoring_mixin.main(["--repo", str(tmp_path), "--check"]) == 0


def test_the_shipped_mixin_is_the_checkout_s() -> None:
    """The wheel's gpuguard/mixin is a link to mixin/: one source, also for assets."""
    assert monitoring_mixin.render().files == monitoring_mixin.render(folder=MIXIN).files
    for name in monitoring_mixin.SOURCES:
        assert assets.read(name) == (REPO / name).read_bytes()
    assert {str(p.relative_to(REPO)) for p in MIXIN.rglob("*") if p.is_file()} \
        == set(monitoring_mixin.SOURCES)


def test_every_query_selects_the_configured_jobs() -> None:
    """Every gpuguard series in every rule and panel carries one of the selectors."""
    rendered = _render(OTHER_JOBS)
    queries = _queries(rendered)
    assert len(queries) > 40
    for query in queries:
        for name, braces in METRIC.findall(query):
            if name == "DCGM_FI_DEV_FB_USED":
                continue
            wanted = (OTHER_JOBS["remediatorSelector"] if name.startswith("gpuguard_remediator_")
                      else OTHER_JOBS["exporterSelector"])
            # Both daemons export these: a rule names each daemon's selector.
            if (name == "gpuguard_config_last_reload_successful"
                    or name.startswith("gpuguard_process_events_")):
                assert braces.startswith("{job="), query
                continue
            if name == "up":
                assert braces.startswith("{job="), query
                continue
            assert braces.startswith("{" + wanted), (name, query)


def test_nothing_of_the_default_jobs_is_left() -> None:
    """Issue 38 item 7: `gpuguard assets --job node-gpuguard` left the dashboard's
    "Exporter up" panel and the rules' header on job gpuguard."""
    rendered = _render(OTHER_JOBS)
    for name, text in rendered.items():
        text = text.replace('\\"', '"')  # the dashboard's JSON escapes the quotes
        assert 'job="node-gpuguard"' in text, name
        assert 'job="gpuguard"' not in text, name
        assert "gpuguard-remediator" not in text, name
    dashboard = json.loads(rendered[monitoring_mixin.DASHBOARD])
    (up,) = [p for p in walk_panels(dashboard["panels"]) if p["title"] == "Exporter up"]
    assert up["targets"][0]["expr"].startswith('up{job="node-gpuguard", ')
    header = rendered[monitoring_mixin.RULES].split("groups:")[0]
    assert 'job="node-gpuguard"' in header and 'job="node-reaper"' in header
    for rule in _alerts(rendered[monitoring_mixin.RULES]):
        assert rule["annotations"]["runbook_url"] == \
            f"https://wiki.example.org/gpu/{rule['alert'].lower()}/page"


def test_the_assets_command_renders_the_dashboard_too(tmp_path: Path) -> None:
    assets.write_all(tmp_path, job="node-gpuguard", remediator_job="node-reaper")
    for name in (*monitoring_mixin.RENDERED, "alerts/rules.test.yml", "alerts/joins.test.yml"):
        text = (tmp_path / name).read_text().replace('\\"', '"')
        assert 'job="node-gpuguard"' in text, name
        assert 'job="gpuguard"' not in text and "job: gpuguard\n" not in text, name
        assert "gpuguard-remediator" not in text, name
    dashboard = json.loads((tmp_path / "grafana/dashboard.json").read_text())
    (up,) = [p for p in walk_panels(dashboard["panels"]) if p["title"] == "Exporter up"]
    assert up["targets"][0]["expr"].startswith('up{job="node-gpuguard", ')


def test_other_thresholds_durations_and_dashboard_settings_reach_the_output() -> None:
    defaults = monitoring_mixin._evaluate(MIXIN, {})["config"]
    config: dict[str, Any] = {}
    for i, key in enumerate(sorted(defaults)):
        if key.endswith(("For", "Window")):
            config[key] = f"{71 + i}m"
        elif key.endswith(("Seconds", "Bytes")):
            config[key] = 7000 + i
    config |= {"dashboardUID": "gpu-uid", "dashboardTags": ["fleet"], "dashboardTitle": "GPUs",
               "datasourceVariable": "prom", "dashboardRateInterval": "3m"}
    rendered = _render(config)
    rules = rendered[monitoring_mixin.RULES]
    for key, value in config.items():
        if key.endswith(("For", "Window", "Seconds", "Bytes")):
            assert str(value) in rules, key
    for rule in _alerts(rules):
        assert rule.get("for", "71m") in {v for v in config.values() if isinstance(v, str)}
    # No default duration or threshold is left in the alerts.
    for default in ("for: 1m", "for: 2m", "for: 5m", "for: 10m", "for: 15m", "[10m]", "[15m]",
                    "> 300", "> 60", "> 1073741824", " 5 minutes", " 10 minutes"):
        assert default not in rules, default
    dashboard = json.loads(rendered[monitoring_mixin.DASHBOARD])
    assert (dashboard["uid"], dashboard["title"], dashboard["tags"]) == \
        ("gpu-uid", "GPUs", ["fleet"])
    text = rendered[monitoring_mixin.DASHBOARD]
    assert "${datasource}" not in text and "${prom}" in text and "[5m]" not in text
    steps = {p["title"]: [s.get("value") for s in
                          p.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {})
                          .get("steps", [])] for p in walk_panels(dashboard["panels"])}
    assert steps["Last scan age"][1] == config["scanStaleThresholdSeconds"]
    assert steps["Scan duration"][1] == config["scanSlowThresholdSeconds"]
    assert steps["Unattributed GPU memory"][1] == config["unattributedMemoryThresholdBytes"]


def test_a_rendering_with_other_selectors_passes_promtool(tmp_path: Path) -> None:
    """The unit tests, adapted by renaming the jobs in their input series and expected
    labels (gpuguard.assets.render_rules_test), pass on the other rendering."""
    rendered = _render(OTHER_JOBS)
    for name, text in rendered.items():
        if name.startswith("alerts/"):
            (tmp_path / Path(name).name).write_text(text)
    for name in ("alerts/rules.test.yml", "alerts/joins.test.yml"):
        adapted = assets.render_rules_test(
            (REPO / name).read_text(), job="node-gpuguard", remediator_job="node-reaper",
            runbook_url_base="https://wiki.example.org/gpu")
        # The pattern puts /page after the name, which a base cannot: adapt the URLs too.
        adapted = re.sub(r"(runbook_url: https://wiki\.example\.org/gpu/\S+)", r"\1/page",
                         adapted)
        (tmp_path / Path(name).name).write_text(adapted)
    checked = _promtool("check", "rules", "--lint=all", "--lint-fatal", "rules.yml",
                        "joins.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for tests in ("rules.test.yml", "joins.test.yml"):
        tested = _promtool("test", "rules", tests, cwd=tmp_path)
        assert tested.returncode == 0, tested.stdout + tested.stderr


def test_a_config_jsonnet_refuses_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="mixin"):
        monitoring_mixin.render({"runbookURLPattern": "https://x/%d"}, folder=MIXIN)


_WITHOUT_JSONNET = ("import sys; sys.modules['_jsonnet'] = None\n"
                    "from gpuguard.console.cli import main\n"
                    "sys.exit(main(sys.argv[1:]))")


def _assets_without_jsonnet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _WITHOUT_JSONNET, "assets", *args],
                          cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=60)


def test_without_the_jsonnet_package_the_defaults_are_written(tmp_path: Path) -> None:
    done = _assets_without_jsonnet(str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    for name in assets.ASSETS:
        assert (tmp_path / "out" / name).read_bytes() == (REPO / name).read_bytes()
    units = _assets_without_jsonnet(str(tmp_path / "units"), "--bin-dir", "/usr/local/bin")
    assert units.returncode == 0, units.stderr  # the units need no mixin


@pytest.mark.parametrize("option", [["--job", "node-gpuguard"], ["--remediator-job", "reaper"],
                                    ["--runbook-url-base", "https://wiki.example.org/gpu"]])
def test_without_the_jsonnet_package_a_rendering_option_is_one_clear_line(
        tmp_path: Path, option: list[str]) -> None:
    refused = _assets_without_jsonnet(str(tmp_path / "out"), *option)
    assert refused.returncode == 2 and not refused.stdout
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert "gpuguard[mixin]" in refused.stderr and "jsonnet" in refused.stderr
    assert not (tmp_path / "out").exists()
    printed = _assets_without_jsonnet("--print", "grafana/dashboard.json", *option)
    assert printed.returncode == 2 and "gpuguard[mixin]" in printed.stderr
