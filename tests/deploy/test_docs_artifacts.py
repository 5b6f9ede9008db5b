"""The docs name only artifacts that exist (issue 50). Nothing of gpuguard is published
yet: no PyPI package, no container image in a registry, no jsonnet-bundler release. What
exists is `make dist`'s wheel, sdist and SHA256SUMS, and the Dockerfile you build
yourself; an install line that would fetch anything else fails for every reader who
follows it. These checks read README.md, docs/, the Kubernetes manifests and the
Dockerfile as text, so such a line cannot come back unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.servers import REPO

#: The files a user reads for install steps.
SOURCES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "deploy/Dockerfile",
                  *(REPO / "docs").rglob("*.md"), *(REPO / "deploy/kubernetes").glob("*.yaml")])

#: An installer's command and its arguments, to the end of the line or code span.
INSTALL = re.compile(r"\b(?:pip3?|pipx|uv(?: tool| pip)?|python3? -m pip)\s+install\b([^`\n]*)")
#: A bare requirement on a package named gpuguard (with or without extras): only an index
#: could answer it. A path, a wheel's file name or `.` is something you have.
FROM_AN_INDEX = re.compile(r"""^['"]?gpuguard(?:\[[\w,\s-]*\])?(?:[=<>!~]=?[\w.*]+)?['"]?$""")
#: Published-artifact claims: registries' images, jsonnet-bundler fetching the mixin from
#: a git host, Helm charts, "install(s) from PyPI".
CLAIMS = {
    "a registry's image": re.compile(r"\b(?:ghcr\.io|quay\.io|docker\.io|registry\.hub"
                                     r"\.docker\.com)/[\w./-]*gpuguard", re.IGNORECASE),
    "docker pull": re.compile(r"\b(?:docker|podman|crane|ctr)\s+(?:image\s+)?pull\b[^\n]*"
                              r"gpuguard"),
    "jb install from a git host": re.compile(r"\bjb\s+install\s+\S*(?:github|gitlab)\."),
    "a Helm chart": re.compile(r"\bhelm\s+(?:install|repo\s+add)\b"),
    "installs from PyPI": re.compile(r"\binstall(?:s|ed)?\s+(?:\w+\s+)?from\s+PyPI\b",
                                     re.IGNORECASE),
}


def lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text(encoding="utf-8").splitlines(), start=1))


def where(path: Path, number: int) -> str:
    return f"{path.relative_to(REPO)}:{number}"


def test_the_sources_are_there() -> None:
    names = {str(p.relative_to(REPO)) for p in SOURCES}
    assert {"README.md", "docs/install.md", "docs/mcp.md", "docs/mixin.md",
            "deploy/kubernetes/kustomization.yaml", "deploy/kubernetes/daemonset.yaml"} <= names


@pytest.mark.parametrize("line, published", [
    ("pip install gpuguard", True),
    ("    pip install 'gpuguard[mcp]'", True),
    ("pipx install gpuguard==0.2.0", True),
    ("uv tool install gpuguard", True),
    ("python -m pip install --user 'gpuguard[mixin]'", True),
    ("pip install ./gpuguard-0.2.0-py3-none-any.whl", False),
    ('pip install "$(ls dist/gpuguard-*.whl)[mcp]"', False),
    ("pip install -e '.[docs]'", False),
    ("pip install 'mcp>=2.3,<3' 'anyio>=4'", False),
    ("pip install --user pipx", False),
])
def test_an_install_line_is_caught_when_only_an_index_could_answer_it(
        line: str, published: bool) -> None:
    assert bool(index_requirements(line)) is published


def index_requirements(line: str) -> list[str]:
    found = []
    for match in INSTALL.finditer(line):
        found += [arg for arg in match.group(1).split() if FROM_AN_INDEX.match(arg)]
    return found


def test_no_install_line_fetches_gpuguard_from_an_index() -> None:
    """`pip install gpuguard`, `pipx install 'gpuguard[mcp]'`... : there is no such package
    on PyPI; the docs install `make dist`'s wheel (or a clone) instead."""
    found = [f"{where(path, n)}: {text.strip()}" for path in SOURCES
             for n, text in lines(path) if index_requirements(text)]
    assert found == []


@pytest.mark.parametrize("what", sorted(CLAIMS))
def test_no_published_artifact_is_named(what: str) -> None:
    pattern = CLAIMS[what]
    found = [f"{where(path, n)}: {text.strip()}" for path in SOURCES
             for n, text in lines(path) if pattern.search(text)]
    assert found == [], what


def test_the_manifests_image_is_a_placeholder_the_docs_tell_you_to_replace() -> None:
    images = {m.group(1) for path in (REPO / "deploy/kubernetes").glob("*.yaml")
              for m in re.finditer(r"^\s*(?:-\s*)?(?:image|name): (\S*gpuguard:\S+)$",
                                   path.read_text(), re.MULTILINE)}
    assert images and all(image.startswith("registry.example/") for image in images), images
    assert "registry.example/gpuguard=" in (REPO / "docs/deployment.md").read_text()


def test_the_readme_and_install_page_say_where_the_wheel_comes_from() -> None:
    readme = (REPO / "README.md").read_text()
    install = (REPO / "docs/install.md").read_text()
    assert "make dist" in readme and "dist/gpuguard-" in readme
    assert "nothing is published yet" in readme.lower()
    assert "**Not published yet:**" in install and "SHA256SUMS" in install
    # The extras table lists every extra pyproject.toml defines (test and docs together).
    extras = re.findall(r"^(\w+) = \[", (REPO / "pyproject.toml").read_text().split(
        "[project.optional-dependencies]")[1].split("\n[")[0], re.MULTILINE)
    table = re.findall(r"^\| `(\w+)`(?:, `(\w+)`)? \|", install, re.MULTILINE)
    listed = {name for row in table for name in row if name}
    assert set(extras) <= listed, set(extras) - listed
