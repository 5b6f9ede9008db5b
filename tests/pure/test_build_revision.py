"""`--version`'s revision in a checkout is the checkout's HEAD now (gpuguard/base/build.py),
whatever commit an earlier install wrote into the version file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: The clone's package, not an editable install's (whose finder comes before PYTHONPATH).
LOAD_FROM_PYTHONPATH = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if not "
                        "type(f).__module__.startswith('__editable__')]; import gpuguard; ")


@pytest.mark.skipif(not (REPO / ".git").exists() or shutil.which("git") is None,
                    reason="needs a git checkout")
def test_a_checkout_reports_its_own_head(tmp_path: Path) -> None:
    """A checkout with no version file (never built) still names its commit: the module looks
    for the checkout's .git above the package folder, wherever in the package it lies (it
    moved from gpuguard/ to gpuguard/base/, and looked one folder too low)."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "gpuguard", clone / "gpuguard", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "_version.py"))
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t.invalid"]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "a checkout"]):
        subprocess.run(git + step, check=True, timeout=60, capture_output=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True, timeout=30).stdout.strip()
    assert not (clone / "gpuguard" / "_version.py").exists()
    done = subprocess.run([sys.executable, "-c", LOAD_FROM_PYTHONPATH
                           + "from gpuguard.base import build; print(gpuguard.__file__); "
                           "print(build.revision())"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(clone)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    where, revision = done.stdout.split()
    assert Path(where).is_relative_to(clone), where
    assert revision == head
