"""A daemon's small state file of this boot's rows: `{"boot_id": ..., "roots": [...]}`.

The launcher memory (launchers.json) and the orphan clock (orphans.json) keep facts
about live processes by pid and start time, which mean nothing after a reboot: a file
of another boot reads as empty. Written whole and atomically (a temporary file, fsync,
rename), so a crash leaves the old file or the new one, never half of either.
"""

from __future__ import annotations

import json
import os
from typing import Any


def read_rows(path: str, boot: str) -> list[Any]:
    """The rows `path` holds for this boot ([] without the file, for another boot, or
    without a boot id to compare). Raises OSError or ValueError for a file that cannot
    be read or parsed: the caller says what starting empty costs."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return []
    if not isinstance(data, dict) or not boot or data.get("boot_id") != boot:
        return []  # another boot's pids and boot clock
    rows = data.get("roots", [])
    return rows if isinstance(rows, list) else []


def write_rows(path: str, boot: str, rows: list[Any]) -> None:
    """Replace `path` with this boot's `rows`, atomically. Raises OSError."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"boot_id": boot, "roots": rows}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
