"""The alert rules and the Grafana dashboard, shipped inside the wheel as package data.

A user who installed only the wheel has no checkout: `gpuguard assets` lists these files,
prints one, or writes them all into a folder, in the same layout as the source tree.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

#: Every shipped file, by its path in the source tree (and under the written folder).
ASSETS: tuple[str, ...] = (
    "alerts/rules.yml",
    "alerts/rules.test.yml",
    "alerts/alertmanager.yml",
    "grafana/dashboard.json",
    "grafana/provisioning/dashboards/gpuguard.yml",
    "grafana/provisioning/datasources/prometheus.yml",
)


class AssetError(Exception):
    """An unknown asset name, or a write that would overwrite a different file."""


def read(name: str) -> bytes:
    """The shipped bytes of one asset (a name from ASSETS)."""
    if name not in ASSETS:
        raise AssetError(f"no asset {name!r}; one of: {', '.join(ASSETS)}")
    folder, _, rest = name.partition("/")
    return files(f"gpuguard.{folder}").joinpath(rest).read_bytes()


def write_all(dest: Path, *, force: bool = False) -> list[Path]:
    """Write every asset under dest; return the paths written.

    Nothing is lost: unless force, an existing file with other content stops the write
    before anything is written (an identical one is left as it is).
    """
    planned = [(dest / name, read(name)) for name in ASSETS]
    blocked = [path for path, _ in planned if path.exists() and not path.is_file()]
    if blocked:
        raise AssetError(f"{blocked[0]} exists and is not a file")
    clash = [path for path, data in planned
             if path.is_file() and path.read_bytes() != data]
    if clash and not force:
        raise AssetError(f"{clash[0]} exists with other content ({len(clash)} such file(s)); "
                         "choose an empty folder or pass --force to overwrite")
    written = []
    for path, data in planned:
        if path.is_file() and path.read_bytes() == data:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    return written
