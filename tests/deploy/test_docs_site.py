"""The documentation site (mkdocs.yml, docs/): `mkdocs build --strict` passes, a broken
link fails it, and the pages outside the site (README, SECURITY, CONTRIBUTING) point at
pages and anchors that exist; the README's samples are the generator's.

Skips where mkdocs and mkdocs-material are not installed (`pip install -e '.[docs]'`),
except under CI=true, where that is a failure.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_alerting_config import EXPORTER_METRICS, REMEDIATOR_METRICS
from tests.support.ci import require
from tests.support.docs_samples import BEGIN, END, EXCERPT_FAMILIES
from tests.support.servers import REPO

DOCS = REPO / "docs"
ASSETS = DOCS / "assets"
#: The pages other parts of the project own or link to: the nav must hold them.
NAV_PAGES = ("install.md", "mcp.md", "windows.md", "design.md", "runbooks/index.md")
#: Pages read on GitHub, outside the site: their relative links are checked here.
OUTSIDE = ("README.md", "SECURITY.md", "CONTRIBUTING.md")


def mkdocs_build(config: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
         "-d", str(site)],
        cwd=cwd, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(site.parent)})


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require(importlib.util.find_spec("mkdocs") and importlib.util.find_spec("material"),
            "mkdocs and mkdocs-material are not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site") / "site"
    built = mkdocs_build(REPO / "mkdocs.yml", out, REPO)
    assert built.returncode == 0, built.stderr[-4000:]
    return out


def page_html(site: Path, page: str) -> Path:
    """Where mkdocs writes docs/PAGE (use_directory_urls): x.md -> x/index.html."""
    stem = page.removesuffix(".md")
    if stem == "index" or stem.endswith("/index"):
        return site / stem.removesuffix("index") / "index.html"
    return site / stem / "index.html"


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    assert (site / "index.html").is_file()
    config = (REPO / "mkdocs.yml").read_text()
    for page in NAV_PAGES:
        assert re.search(rf":\s*{re.escape(page)}\s*$|-\s*{re.escape(page)}\s*$", config,
                         re.MULTILINE), f"{page} is not in mkdocs.yml's nav"
        assert page_html(site, page).is_file(), page
    for option in ("omitted_files", "absolute_links", "unrecognized_links", "anchors"):
        assert re.search(rf"^\s+{option}: warn$", config, re.MULTILINE), option
    # Included, not copied: the samples and the changelog are in the pages that show them.
    assert "gpuguard_orphan_tree_age_seconds" in page_html(site, "metrics.md").read_text()
    assert "Upgrade notes" in page_html(site, "changelog.md").read_text()
    assert 'class="mermaid"' in page_html(site, "index.md").read_text()


def test_a_broken_anchor_fails_the_strict_build(site: Path, tmp_path: Path) -> None:
    """The validation options are what make the build above mean something."""
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copy(REPO / "CHANGELOG.md", copy / "CHANGELOG.md")
    shutil.copytree(DOCS, copy / "docs")
    page = copy / "docs" / "faq.md"
    page.write_text(page.read_text() + "\n[gone](orphans.md#no-such-heading)\n")
    built = mkdocs_build(copy / "mkdocs.yml", tmp_path / "site", copy)
    assert built.returncode != 0
    assert "no-such-heading" in built.stderr


@pytest.mark.parametrize("name", OUTSIDE)
def test_pages_outside_the_site_link_to_what_exists(site: Path, name: str) -> None:
    text = (REPO / name).read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, name
    for target in links:
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        assert (REPO / path).exists(), (name, target)
        if anchor and path.startswith("docs/") and path.endswith(".md"):
            html = page_html(site, path.removeprefix("docs/")).read_text()
            assert f'id="{anchor}"' in html, (name, target)


def test_the_readme_is_a_front_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "```mermaid" in readme and "make demo" in readme and "make run" in readme
    assert "](docs/assets/gpuguard-status.svg)" in readme
    assert "| everyday action | verdict (reason), listener on | measured by |" in readme
    assert re.search(r"0\.x, beta", readme) and re.search(r"0\.x, beta",
                                                        (REPO / "CHANGELOG.md").read_text())


def test_the_samples_are_the_generators_and_name_documented_metrics() -> None:
    """`python -m tests.support.docs_samples` wrote the excerpt the README shows; every
    family in it, and every metric the alerts may use, has a row in docs/metrics.md."""
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index(BEGIN) + len(BEGIN):readme.index(END)]
    excerpt = (ASSETS / "metrics-excerpt.txt").read_text()
    assert block == f"\n```text\n{excerpt}```\n"
    families = [f.name for f in text_string_to_metric_families(excerpt)]
    assert families == [name.removesuffix("_total") for name in EXCERPT_FAMILIES]
    documented = set(re.findall(r"`(gpuguard_\w+)`", (DOCS / "metrics.md").read_text()))
    assert set(EXCERPT_FAMILIES) <= documented
    assert EXPORTER_METRICS | REMEDIATOR_METRICS <= documented
    assert 'verdict="orphan"' in excerpt and 'reason="launcher-killed"' in excerpt
    svg = (ASSETS / "gpuguard-status.svg").read_text()
    assert svg.startswith("<svg") and "orphan" in svg and "protected" in svg
    for sample in ("gpuguard-status.txt", "gpuguard-explain.txt", "gpuguard-reap.txt",
                   "make-demo.txt"):
        assert (ASSETS / sample).read_text().startswith("$ "), sample
