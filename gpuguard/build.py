"""What this build is: version, source revision and Python, for `--version` and
gpuguard_build_info (as node_exporter's `--version` and `node_exporter_build_info`)."""

from __future__ import annotations

import functools
import platform
import subprocess
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

UNKNOWN = "unknown"


@functools.cache
def version() -> str:
    """The installed distribution's version (one place: pyproject.toml)."""
    try:
        return metadata.version("gpuguard")
    except metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0+unknown"


@functools.cache
def revision() -> str:
    """The source commit: REVISION shipped beside this module when the build wrote one,
    else the checkout's HEAD (an editable install), else "unknown"."""
    here = Path(__file__).resolve().parent
    shipped = here / "REVISION"
    if shipped.is_file():
        return shipped.read_text().strip() or UNKNOWN
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else UNKNOWN


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
