"""`gpuguard assets`: the shipped rules and dashboard, listed, printed and written out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpuguard import assets
from tests.support.servers import REPO, child_env


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuguard.console", "assets", *args],
                          cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=60)


def test_every_rule_and_dashboard_file_is_an_asset() -> None:
    """A new file under alerts/, grafana/, mixin/ or deploy/systemd/ that is not shipped
    fails here, not in the field."""
    on_disk = {str(p.relative_to(REPO)) for top in ("alerts", "grafana", "mixin",
                                                    "deploy/systemd")
               for p in (REPO / top).rglob("*") if p.is_file()
               and p.name != "__init__.py" and "__pycache__" not in p.parts}
    assert on_disk == set(assets.ASSETS)


def test_list_print_and_write(tmp_path: Path) -> None:
    listed = run()
    assert listed.returncode == 0 and listed.stdout.split() == list(assets.ASSETS)
    printed = run("--print", "alerts/rules.yml")
    assert printed.returncode == 0
    assert printed.stdout == (REPO / "alerts/rules.yml").read_text()
    done = run(str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    for name in assets.ASSETS:
        assert (tmp_path / "out" / name).read_bytes() == (REPO / name).read_bytes()
    again = run(str(tmp_path / "out"))
    assert again.returncode == 0 and f"0 written, {len(assets.ASSETS)} already up to date" \
        in again.stdout


def test_an_edited_file_is_not_overwritten_without_force(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run(str(out)).returncode == 0
    edited = out / "alerts/rules.yml"
    edited.write_text("# my local edits\n")
    refused = run(str(out))
    assert refused.returncode == 2 and not refused.stdout
    assert refused.stderr.count("\n") == 1 and str(edited) in refused.stderr
    assert edited.read_text() == "# my local edits\n"  # nothing lost
    forced = run(str(out), "--force")
    assert forced.returncode == 0 and f"wrote {edited}" in forced.stdout
    assert edited.read_bytes() == (REPO / "alerts/rules.yml").read_bytes()


def test_diff_shows_what_an_upgrade_would_change_and_writes_nothing(tmp_path: Path) -> None:
    """After an upgrade: `--diff DIR` prints a unified diff per file that differs from
    this version's (a missing one against /dev/null), exits 1, and writes nothing; once
    they agree, exit 0 and no diff."""
    out = tmp_path / "out"
    assert run(str(out)).returncode == 0
    same = run(str(out), "--diff")
    assert (same.returncode, same.stdout) == (0, ""), same.stderr
    assert f"0 of {len(assets.ASSETS)} differ under {out}" in same.stderr
    rules = out / "alerts/rules.yml"
    shipped = rules.read_text()
    edited = shipped.replace("for: 1m", "for: 2m", 1)
    assert edited != shipped
    rules.write_text(edited)
    (out / "deploy/systemd/gpuguard.yml").unlink()
    shown = run(str(out), "--diff")
    assert shown.returncode == 1, shown.stderr
    assert f"--- {rules}\n+++ alerts/rules.yml (gpuguard " in shown.stdout
    assert "\n-    for: 2m\n+    for: 1m\n" in shown.stdout
    assert "--- /dev/null\n+++ deploy/systemd/gpuguard.yml (gpuguard " in shown.stdout
    assert f"2 of {len(assets.ASSETS)} differ under {out} (1 missing)" in shown.stderr
    assert rules.read_text() == edited and not (out / "deploy/systemd/gpuguard.yml").exists()
    # The refusal without --force points at it.
    refused = run(str(out))
    assert refused.returncode == 2 and "see how with --diff" in refused.stderr
    for bad in (("--diff",), (str(out), "--diff", "--force")):
        wrong = run(*bad)
        assert wrong.returncode == 2 and "--diff needs DIR" in wrong.stderr


def test_unknown_name_and_blocked_path_are_one_line_errors(tmp_path: Path) -> None:
    unknown = run("--print", "alerts/nope.yml")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
    assert "no asset 'alerts/nope.yml'" in unknown.stderr
    (tmp_path / "out" / "alerts" / "rules.yml").mkdir(parents=True)
    blocked = run(str(tmp_path / "out"), "--force")
    assert blocked.returncode == 2 and "is not a file" in blocked.stderr


def test_rules_written_for_a_fleet_name_its_runbooks_and_jobs(tmp_path: Path) -> None:
    import yaml

    base = "https://docs.example.com/gpuguard/runbooks"
    done = run(str(tmp_path), "--runbook-url-base", base + "/", "--job", "gpu-exporter")
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "alerts" / "rules.yml").read_text()
    rules = [r for g in yaml.safe_load(text)["groups"] for r in g["rules"]]
    assert all(r["annotations"]["runbook_url"] == f"{base}/{r['alert'].lower()}" for r in rules)
    assert 'job="gpuguard"' not in text and 'job="gpu-exporter"' in text
    assert 'job="gpu-exporter-remediator"' in text
    printed = run("--print", "alerts/rules.yml", "--job", "gpu-exporter")
    assert printed.returncode == 0 and 'job="gpu-exporter"' in printed.stdout
    bad = run(str(tmp_path / "other"), "--runbook-url-base", "docs/runbooks")
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1
    assert not (tmp_path / "other").exists()
