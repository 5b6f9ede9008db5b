"""What this build is: version, source revision and Python, for `--version` and
gpuguard_build_info (as node_exporter's `--version` and `node_exporter_build_info`)."""

from __future__ import annotations

import functools
import importlib
import platform
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

#: The version a build that cannot tell which it is reports (gpuguard_build_info).
UNKNOWN_VERSION = "unknown"


#: Where the build wrote which build it is: setuptools-scm's version_file (pyproject.toml's
#: [tool.setuptools_scm]), in the sdist and the wheel; never committed.
BUILT = "gpuguard._version"


@functools.cache
def _built() -> tuple[str | None, str | None]:
    """(version, commit) as the build wrote them, or (None, None) where no build ran (a
    bare checkout on PYTHONPATH)."""
    try:
        module = importlib.import_module(BUILT)
    except ImportError:
        return None, None
    version = getattr(module, "version", None)
    return (version if isinstance(version, str) and version else None,
            _commit(getattr(module, "node", None)))


def _commit(node: object) -> str | None:
    """setuptools-scm's node for git is "g" and the commit's hash: the hash."""
    if not isinstance(node, str) or not node:
        return None
    if node.startswith("g") and len(node) > 1 and all(c in HEX for c in node[1:]):
        return node[1:]
    return node


HEX = frozenset("0123456789abcdef")


@functools.cache
def version() -> str:
    """The version the build derived from git (a tag vX.Y.Z: X.Y.Z; any other commit a
    dev version naming it); the installed metadata's where no version file was written."""
    built, _ = _built()
    if built is not None:
        return built
    from importlib import metadata  # a build wrote no version file: rare, and costly to map

    try:
        return metadata.version("gpuguard")
    except metadata.PackageNotFoundError:  # run from a checkout, never built or installed
        return "0+unknown"


@functools.cache
def revision() -> str:
    """The full hash of the source commit. Run from a git checkout (an editable install,
    PYTHONPATH), the checkout's HEAD now, which may have moved since `pip install -e`
    wrote the version; anywhere else (a wheel, an sdist's build) the commit the build
    was made from; "unknown" when neither says."""
    checkout = Path(__file__).resolve().parents[2]  # above gpuguard/base/
    if (checkout / ".git").exists():  # a checkout (a worktree's .git is a file)
        live = _git_head(checkout)
        if live is not None:
            return live
    _, built = _built()
    return built or UNKNOWN_VERSION


def _git_head(where: Path) -> str | None:
    import subprocess  # a checkout only

    try:
        out = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    head = out.stdout.strip()
    return head if out.returncode == 0 and head else None


def python_version() -> str:
    return platform.python_version()


def version_text(program: str) -> str:
    """`PROGRAM --version`, in node_exporter's layout."""
    return (f"{program}, version {version()} (revision: {revision()})\n"
            f"  python version:   {python_version()} ({platform.python_implementation()})\n"
            f"  platform:         {platform.system().lower()}/{platform.machine()}\n")


class BuildInfoCollector(Collector):
    """gpuguard_build_info{version, revision, python_version} 1."""

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self.collect())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "gpuguard_build_info", "A metric with a constant 1 labelled by the version, "
            "source revision and Python version gpuguard runs on.",
            labels=["version", "revision", "python_version"])
        family.add_metric([version(), revision(), python_version()], 1)
        yield family
