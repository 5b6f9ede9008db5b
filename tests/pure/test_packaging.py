"""Every package folder ships: pyproject.toml lists packages by name (the symbolic links
to the top-level folders rule out find_packages), so a new sub-package left off the list
imports here and is missing from the wheel (gpuguard.launch.teardown was, for a while)."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_the_wheels_list() -> None:
    text = (REPO / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(gpuguard[\w.]*)"', text.split("packages = [", 1)[1]
                            .split("]", 1)[0]))
    folders = {os.path.relpath(root, REPO).replace(os.sep, ".")
               for root, _dirs, files in os.walk(REPO / "gpuguard", followlinks=True)
               if "__init__.py" in files and "__pycache__" not in root}
    assert folders - listed == set(), "add them to [tool.setuptools] packages"
