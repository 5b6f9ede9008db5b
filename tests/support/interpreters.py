"""The other Pythons gpuguard supports (3.10, 3.12, 3.13), found where the CI image keeps them:
pyenv's builds, whether or not pyenv itself is on PATH; then pythonX.Y on PATH. Found the
same way as .ci/run's find_python."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

#: The Pythons pyproject.toml's classifiers name besides CI's own 3.11: .ci/run runs the
#: pure and live tests on 3.10 and 3.13; tests/deploy/test_wheel.py installs the wheel on
#: each (3.12 is the container image's, deploy/Dockerfile).
OTHER_PYTHONS = ("3.10", "3.12", "3.13")


def _pyenv_roots() -> list[Path]:
    roots = []
    if shutil.which("pyenv"):
        done = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30,
                              check=False)
        if done.returncode == 0 and done.stdout.strip():
            roots.append(Path(done.stdout.strip()))
    if os.environ.get("PYENV_ROOT"):
        roots.append(Path(os.environ["PYENV_ROOT"]))
    roots.append(Path("/root/.pyenv"))
    return roots


def _is(python: Path, version: str) -> bool:
    """Whether python runs, is `version` and can make a venv with pip (ensurepip)."""
    try:
        done = subprocess.run(
            [str(python), "-c", "import sys, ensurepip; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return False
    return done.returncode == 0 and done.stdout.strip() == version


def _patch(folder: Path) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else -1 for part in folder.name.split("."))


def find_python(version: str) -> Path | None:
    """The newest interpreter of `version` ("3.10") found, or None."""
    for root in _pyenv_roots():
        for folder in sorted((root / "versions").glob(f"{version}.*"), key=_patch,
                             reverse=True):
            if _is(folder / "bin" / "python3", version):
                return folder / "bin" / "python3"
    on_path = shutil.which(f"python{version}")
    if on_path and _is(Path(on_path), version):
        return Path(on_path)
    return None
