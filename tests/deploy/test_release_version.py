"""The version scheme the build uses (build_backend/gpuguard_release.py): CHANGELOG.md's
newest release, the commits since, and tags that must agree. tests/deploy/test_wheel.py
builds wheels from clones with and without tags; these are the rules on their own, and
this repository's CHANGELOG and tags held to them."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from packaging.version import Version

from tests.support.servers import REPO


def load() -> ModuleType:
    """The build backend's module, as the build imports it (from build_backend/)."""
    spec = importlib.util.spec_from_file_location(
        "gpuguard_release", REPO / "build_backend/gpuguard_release.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


release = load()


def test_the_newest_heading_is_the_release_and_unreleased_is_not_one() -> None:
    text = ("# Changelog\n\n## [Unreleased]\n\n- a fix\n\n## [1.4.0] - 2027-01-02\n\n"
            "## [1.3.9] - 2026-12-30\n")
    assert release.newest_release(text) == ("1.4.0", "## [1.4.0] - 2027-01-02")
    with pytest.raises(release.ReleaseError, match="no release heading"):
        release.newest_release("# Changelog\n\n## [Unreleased]\n\n## [1.4] - 2027-01-02\n")


@pytest.mark.parametrize(("distance", "dirty", "public", "local"), [
    (0, False, "0.2.0", ""),  # the commit that wrote the heading (or a tag that agrees)
    (5, False, "0.2.0.post1.dev5", "+gabc1234"),
    (0, True, "0.2.0.post1.dev0", "+gabc1234.d20270102"),  # edits on top of the release
    (None, False, "0.2.0.post1.dev0", "+gabc1234"),  # shallow: never the bare release
])
def test_versions_after_a_release_sort_after_it_and_before_the_next(
        distance: int | None, dirty: bool, public: str, local: str) -> None:
    assert release.public_version("0.2.0", distance, dirty) == public
    assert release.local_part(distance, dirty, "gabc1234", "20270102") == local
    built = Version(public + local)
    assert Version("0.2.0") <= built < Version("0.2.1") and built.release == (0, 2, 0)
    assert Version("0.2.0.post1.dev5") < Version("0.2.0.post1.dev6")


def test_a_tag_must_agree_with_the_changelog() -> None:
    release.check_tags("0.2.0", ["v0.2.0", "not-a-release"], "v0.2.0")
    release.check_tags("0.2.0", [], "v0.1.0")  # an older release's tag, further back
    with pytest.raises(release.ReleaseError, match="tag v0.3.0 is on the commit built"):
        release.check_tags("0.2.0", ["v0.3.0"], "v0.3.0")
    with pytest.raises(release.ReleaseError, match="tag v0.2.1 is newer than"):
        release.check_tags("0.2.0", [], "v0.2.1")
    with pytest.raises(release.ReleaseError, match="tag v0.10.0 is newer"):
        release.check_tags("0.9.0", [], "v0.10.0")  # numbers, not strings


def test_this_repositorys_tags_are_releases_its_changelog_records() -> None:
    """Every release tag this clone has (there may be none: tags need not travel) names a
    section of CHANGELOG.md; the newest heading is a release the build can name."""
    changelog = (REPO / "CHANGELOG.md").read_text()
    newest, _ = release.newest_release(changelog)
    recorded = set(re.findall(r"^## \[(\d+\.\d+\.\d+)\] - ", changelog, re.MULTILINE))
    assert newest in recorded
    tags = subprocess.run(["git", "-C", str(REPO), "tag", "--list", "v[0-9]*"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.split()
    for tag in tags:
        assert tag[1:] in recorded, f"tag {tag} names no CHANGELOG.md section"
        assert Version(tag[1:]) <= Version(newest)


def test_the_build_uses_this_scheme() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'build-backend = "gpuguard_release"' in pyproject
    assert 'backend-path = ["build_backend"]' in pyproject
    assert 'version_scheme = "gpuguard_release:version_scheme"' in pyproject
    assert 'local_scheme = "gpuguard_release:local_scheme"' in pyproject
    assert Path(release.__file__).parent.name == "build_backend"
