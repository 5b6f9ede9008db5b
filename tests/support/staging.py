"""gpuguard, runnable by an identity that cannot reach the checkout.

Tests that run gpuguard as another uid, or as uid 0 without a DAC capability (as the systemd
units and the Kubernetes containers do), must not depend on where the checkout and this
environment's packages sit: a clone under /root, or any folder other uids may not enter,
would make them fail for a reason that has nothing to do with what they test. `stage`
copies gpuguard and its run-time dependencies into a world-readable folder; `staged_python`
finds an interpreter the restricted identity can run with that copy importable.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from packaging.requirements import Requirement

from tests.support.proctree import HOLDER
from tests.support.servers import REPO


def runtime_distributions(name: str = "gpuguard") -> set[str]:
    """gpuguard's run-time dependencies, transitively (no extras): what the daemons import."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower()
        if key in seen:
            continue
        seen.add(key)
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen - {name}


def stage(root: Path) -> dict[str, str]:
    """Copy gpuguard and its run-time dependencies under root, readable by any uid; return
    the environment (PYTHONPATH) that imports them from there. tests/support/holder.py is copied
    to root/src/holder.py (see `staged_holder`)."""
    shutil.copytree(REPO / "gpuguard", root / "src" / "gpuguard", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__"))
    # The stand-in GPU worker, for jobs that run as another uid (stdlib only).
    shutil.copy2(HOLDER, root / "src" / HOLDER.name)
    site = root / "site"
    for name in runtime_distributions():
        dist = importlib.metadata.distribution(name)
        for file in dist.files or ():
            source = Path(str(dist.locate_file(file)))
            if "__pycache__" in file.parts or not source.is_file():
                continue
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    for path in (root / "src", site):
        for folder, _dirs, files in os.walk(path):
            os.chmod(folder, 0o755)
            for f in files:
                os.chmod(os.path.join(folder, f), 0o644 if not f.endswith(".so") else 0o755)
    return {"PYTHONPATH": f"{root / 'src'}:{site}", "PYTHONDONTWRITEBYTECODE": "1"}


def staged_holder(root: Path) -> Path:
    """tests/support/holder.py as `stage(root)` copied it: runnable by a uid that cannot reach the
    checkout."""
    return root / "src" / HOLDER.name


def interpreters() -> Iterator[str]:
    """This test's own Python first; else the system's (an interpreter under /root, such
    as pyenv's, is out of a restricted identity's reach). Same minor version: the staged
    packages' compiled parts are built for it."""
    yield sys.executable
    system = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}",
                          path="/usr/bin:/bin")
    if system and os.path.realpath(system) != os.path.realpath(sys.executable):
        yield system


def staged_python(identity: Sequence[str], env: dict[str, str],
                  modules: str = "gpuguard.exporter.cli, gpuguard.remediator.cli"
                  ) -> tuple[str | None, list[str]]:
    """The first interpreter that `identity` (a setpriv command line) can run, from /, with
    `modules` importable under `env`; and, when none can, why each one failed."""
    tried: list[str] = []
    for python in interpreters():
        # Through env: Python is not setpriv's own exec, as behind the tests' loaders.
        probe = subprocess.run([*identity, "env", python, "-c", f"import {modules}"],
                               env=env, cwd="/", capture_output=True, text=True, timeout=60,
                               check=False)
        if probe.returncode == 0:
            return python, tried
        tried.append(f"{python}: {probe.stderr.strip().splitlines()[-1:]}")
    return None, tried
