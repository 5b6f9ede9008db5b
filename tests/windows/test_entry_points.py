"""gpuguard's three programs start on Windows: nothing POSIX-only runs at import."""

from __future__ import annotations

import pytest

from tests.support.wine import WinePrefix

PROGRAMS = {
    "gpuguard": "gpuguard",
    "gpuguard.exporter": "gpuguard-exporter",
    "gpuguard.remediator": "gpuguard-remediator",
}


@pytest.mark.parametrize("module", sorted(PROGRAMS))
def test_version_runs_on_windows(wine: WinePrefix, module: str) -> None:
    done = wine.python("-m", module, "--version")
    assert done.returncode == 0, f"python -m {module} --version: {done.stderr}"
    first = done.stdout.splitlines()[0]
    assert first.startswith(f"{PROGRAMS[module]}, version "), done.stdout
    assert "windows/AMD64" in done.stdout, done.stdout  # the Windows CPython, not Linux's


def test_package_imports_without_reading_the_parent(wine: WinePrefix) -> None:
    """`import gpuguard` reads no parent pid on Windows (os.getppid() aborts a Python
    >= 3.12 under Wine): the launcher's early read is Linux's alone."""
    done = wine.python("-c", "import os, gpuguard; "
                             "print(gpuguard.PARENT_AT_START, gpuguard.PARENT_READ_BY)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0"], done.stdout
