"""Rendering the shipped rules for a site: runbook URLs on the user's own pages, job names.

The shipped rules carry no runbook_url (a default would point at nothing) and select the
jobs gpuguard and gpuguard-remediator; gpuguard.assets renders a copy with both set, from
the monitoring mixin (tests/deploy/test_mixin.py checks the mixin itself), and rewrites
the unit tests to match. promtool checks skip without Debian's `prometheus` package,
except under CI=true.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuguard import assets
from tests.support.ci import require

REPO = Path(__file__).resolve().parents[2]
RULES_TEXT = (REPO / "alerts" / "rules.yml").read_text(encoding="utf-8")
RULES_TEST_TEXT = (REPO / "alerts" / "rules.test.yml").read_text(encoding="utf-8")
BASE = "https://runbooks.example.com/gpuguard"
JOB = "gpu-exporters"
SELECTOR = re.compile(r'job="([^"]*)"')


def _alerts(text: str) -> list[dict]:
    return [rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"]
            if "alert" in rule]


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    require(promtool, "promtool not installed: apt-get install prometheus")
    assert promtool is not None
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def _rendered(**settings: str | None) -> tuple[str, str]:
    return (assets.render("alerts/rules.yml", **settings).decode("utf-8"),
            assets.render("alerts/rules.test.yml", **settings).decode("utf-8"))


def _render_rules(**settings: str | None) -> str:
    return _rendered(**settings)[0]


def _jobs_back(node, job: str, remediator_job: str):
    """node with the rendered job names swapped back for the shipped ones."""
    if isinstance(node, dict):
        return {k: _jobs_back(v, job, remediator_job) for k, v in node.items()}
    if isinstance(node, list):
        return [_jobs_back(v, job, remediator_job) for v in node]
    if isinstance(node, str):
        return node.replace(f'job="{remediator_job}"', 'job="gpuguard-remediator"') \
            .replace(f'job="{job}"', 'job="gpuguard"')
    return node


def test_shipped_rules_have_no_runbook_url_and_select_the_shipped_jobs() -> None:
    for rule in _alerts(RULES_TEXT):
        assert "runbook_url" not in rule["annotations"], rule["alert"]
    assert set(SELECTOR.findall(RULES_TEXT)) == {"gpuguard", "gpuguard-remediator"}


def test_without_settings_the_text_is_unchanged() -> None:
    assert _rendered() == (RULES_TEXT, RULES_TEST_TEXT)
    assert assets.render("alerts/rules.yml") == assets.read("alerts/rules.yml")


@pytest.mark.parametrize("base", [BASE, BASE + "/", BASE + "//"])
def test_every_alert_gets_its_runbook_page_url(base: str) -> None:
    rendered = _render_rules(runbook_url_base=base)
    alerts = _alerts(rendered)
    assert [a["alert"] for a in alerts] == [a["alert"] for a in _alerts(RULES_TEXT)]
    for rule in alerts:
        url = rule["annotations"]["runbook_url"]
        assert url == BASE + "/" + rule["alert"].lower()
        page = url.removeprefix(BASE + "/")
        assert (REPO / "docs" / "runbooks" / f"{page}.md").is_file(), url


def test_a_percent_in_the_base_reaches_the_url_verbatim() -> None:
    base = "https://wiki.example.com/GPU%20runbooks"
    rule = _alerts(_render_rules(runbook_url_base=base))[0]
    assert rule["annotations"]["runbook_url"] == f"{base}/{rule['alert'].lower()}"


def test_rendering_changes_the_job_selectors_and_runbooks_and_nothing_else() -> None:
    rendered = _render_rules(runbook_url_base=BASE, job=JOB)
    assert set(SELECTOR.findall(rendered)) == {JOB, f"{JOB}-remediator"}
    assert rendered.count(f'job="{JOB}-remediator"') == RULES_TEXT.count(
        'job="gpuguard-remediator"')
    # Undo exactly what was asked: the shipped rules come back.
    doc = yaml.safe_load(rendered)
    for rule in (r for g in doc["groups"] for r in g["rules"]):
        assert rule["annotations"].pop("runbook_url").startswith(BASE + "/")
    assert _jobs_back(doc, JOB, f"{JOB}-remediator") == yaml.safe_load(RULES_TEXT)


@pytest.mark.parametrize("remediator_job", [None, "node-reaper"])
def test_the_header_names_the_rendered_jobs(remediator_job: str | None) -> None:
    """Issue 38 item 7: the old rewrite left the header saying job gpuguard."""
    rendered = _render_rules(job="node-gpuguard", remediator_job=remediator_job)
    remediators = remediator_job or "node-gpuguard-remediator"
    header = rendered.split("groups:", 1)[0]
    assert 'job="node-gpuguard"' in header and f'job="{remediators}"' in header
    assert 'job="gpuguard"' not in rendered
    assert not re.search(r"(?<![\w-])gpuguard-remediator", rendered)


@pytest.mark.parametrize("job,remediator_job,exporters,remediators", [
    (JOB, None, JOB, f"{JOB}-remediator"),
    (JOB, "reaper", JOB, "reaper"),
    (None, "reaper", "gpuguard", "reaper"),
])
def test_remediator_job_defaults_to_job_remediator(job, remediator_job, exporters,
                                                   remediators) -> None:
    rendered = _render_rules(job=job, remediator_job=remediator_job)
    assert set(SELECTOR.findall(rendered)) == {exporters, remediators}
    exprs = {r["alert"]: r["expr"] for r in _alerts(rendered)}
    assert exprs["GPUGuardExporterDown"] == f'up{{job="{exporters}"}} == 0'
    assert exprs["GPUGuardRemediatorDown"] == f'up{{job="{remediators}"}} == 0'
    assert exprs["GPUGuardRemediatorAbsent"] == f'absent(up{{job="{remediators}"}})'


@pytest.mark.parametrize("job", [JOB, "gpu exporters", "1234", "true", "gpu #1"])
def test_rendered_rules_pass_promtool_with_their_unit_tests(tmp_path: Path, job: str) -> None:
    rules, tests = _rendered(runbook_url_base=BASE, job=job)
    (tmp_path / "rules.yml").write_text(rules)
    (tmp_path / "rules.test.yml").write_text(tests)
    checked = _promtool("check", "rules", "--lint=all", "--lint-fatal", "rules.yml",
                        cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(_alerts(RULES_TEXT))} rules found" in checked.stdout
    tested = _promtool("test", "rules", "rules.test.yml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


@pytest.mark.parametrize("base", [
    "", "runbooks.example.com/gpuguard", "/docs/runbooks", "ftp://example.com/runbooks",
    "https://", "https:///runbooks", "https://example.com/run books",
    "https://example.com/runbooks?page=", "https://example.com/runbooks#",
    "https://example.com/{{ $labels.cluster }}", 'https://example.com/"x"',
])
def test_a_base_that_is_not_an_absolute_http_url_is_refused(base: str) -> None:
    with pytest.raises(ValueError, match="runbook URL base"):
        _render_rules(runbook_url_base=base)


@pytest.mark.parametrize("bad", ["", 'gpu"guard', "gpu\\guard", "gpu\nguard", "gpu\rguard"])
@pytest.mark.parametrize("key", ["job", "remediator_job"])
def test_a_job_name_a_selector_cannot_hold_is_refused(key: str, bad: str) -> None:
    for name in ("alerts/rules.yml", "alerts/rules.test.yml", "grafana/dashboard.json"):
        with pytest.raises(ValueError, match="job"):
            assets.render(name, **{key: bad})


def test_one_job_for_exporters_and_remediators_is_refused() -> None:
    with pytest.raises(ValueError, match="their own jobs"):
        _render_rules(job="gpu", remediator_job="gpu")
    with pytest.raises(ValueError, match="their own jobs"):
        _render_rules(remediator_job="gpuguard")


def test_write_all_writes_the_rendered_pair(tmp_path: Path) -> None:
    written = assets.write_all(tmp_path, runbook_url_base=BASE, job=JOB)
    assert len(written) == len(assets.ASSETS)
    rules, tests = _rendered(runbook_url_base=BASE, job=JOB)
    assert (tmp_path / "alerts/rules.yml").read_text() == rules
    assert (tmp_path / "alerts/rules.test.yml").read_text() == tests
    assert (tmp_path / "alerts/alertmanager.yml").read_bytes() \
        == assets.read("alerts/alertmanager.yml")
    assert assets.write_all(tmp_path, runbook_url_base=BASE, job=JOB) == []
    with pytest.raises(assets.AssetError, match="other content"):
        assets.write_all(tmp_path)  # the shipped rules differ from the rendered ones


def test_write_all_with_a_bad_setting_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        assets.write_all(tmp_path / "out", runbook_url_base="not a url")
    assert not (tmp_path / "out").exists()


def test_the_dcgm_joins_pass_their_promtool_tests(tmp_path: Path) -> None:
    """The recording rules join gpuguard's series with dcgm-exporter's on UUID, and the
    unit test gives them series of both shapes (dcgm-exporter's memory in MiB)."""
    for name in ("alerts/joins.yml", "alerts/joins.test.yml"):
        (tmp_path / Path(name).name).write_bytes(assets.read(name))
    checked = _promtool("check", "rules", "joins.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", "joins.test.yml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    rules = yaml.safe_load(assets.read("alerts/joins.yml"))["groups"][0]["rules"]
    assert rules and not any("label_replace" in rule["expr"] for rule in rules)
