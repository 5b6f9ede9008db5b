"""The rate-limit window the other reaping paths share with the remediator.

`gpuguard reap --apply` and MCP `gpu_reap` record each reap they begin in
`STATE_DIR/manual-reaps.json` (while they hold the host's reap lock, reap_lock.py), and
read the remediator's own reaps and orphan sightings from its state file; the remediator
reads theirs when it decides under the same lock. So every path counts in one window, and
the paths without an alert learn a tree's age from the remediator's records.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.config.remediate import Mode
from gpuguard.engine.decision.tree import ReapMark, TreeKey
from gpuguard.engine.state.ledger import FILE_NAME, read_state, window_owner

WINDOW_NAME = "manual-reaps.json"
WINDOW_VERSION = 1
#: The most reaps the file keeps (the newest): more than any window counts in practice.
MAX_MANUAL_REAPS = 10_000


class WindowUnreadable(Exception):
    """A window file exists but cannot be read or used: the window cannot be counted."""


@dataclass(frozen=True)
class ReapHistoryView:
    """What a path without an alert needs of the past: the enforce-mode window of every
    path (boot clock, owners) and the remediator's orphan sightings (boot clock)."""

    reaps: tuple[ReapMark, ...] = ()
    first_seen: dict[TreeKey, float] = field(default_factory=dict)


def read_manual_reaps(state_dir: str | Path, *, boot: str) -> tuple[ReapMark, ...]:
    """The reaps `gpuguard reap --apply` and MCP recorded (none: no file). An earlier
    boot's are placed before this boot's 0, as the ledger places its own."""
    path = Path(state_dir) / WINDOW_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ()
    except OSError as exc:
        raise WindowUnreadable(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise WindowUnreadable(f"{path}: unusable ({exc})") from None
    try:
        data = json.loads(text)
        if data.get("version") != WINDOW_VERSION:
            raise ValueError(f"unknown format version {data.get('version')!r}")
        same_boot = bool(boot.strip()) and data.get("boot_id") == boot
        written = float(data["boot_clock"])
        marks = []
        for row in data.get("reaps", []):
            at = float(row[0])
            uid = int(row[1]) if row[1] is not None else None
            name = str(row[2]) if len(row) > 2 and row[2] is not None else None
            marks.append(ReapMark(at if same_boot else min(at - written, 0.0), uid, name))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError,
            RecursionError) as exc:
        raise WindowUnreadable(f"{path}: unusable ({exc})") from None
    return tuple(marks)


def record_manual_reap(state_dir: str | Path, mark: ReapMark, *, boot: str,
                       boot_now: float, remove: bool = False) -> None:
    """Add `mark` to the file (or, `remove`, take it out again: a reap that signalled
    nothing uses no slot), atomically; OSError or WindowUnreadable when it cannot."""
    directory = Path(state_dir)
    marks = list(read_manual_reaps(directory, boot=boot))
    if remove:
        if mark in marks:
            marks.remove(mark)
    else:
        marks.append(mark)
    marks = marks[-MAX_MANUAL_REAPS:]
    payload = json.dumps({"version": WINDOW_VERSION, "boot_id": boot, "boot_clock": boot_now,
                          "reaps": [[m.at, m.uid, m.name] for m in marks]}, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{WINDOW_NAME}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload.encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, directory / WINDOW_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_history(state_dir: str | Path, *, boot: str, boot_now: float,
                 wall: float) -> ReapHistoryView:
    """Every path's enforce-mode reaps and the remediator's sightings, read without
    writing anything (the remediator owns its state file). No state file: the remediator
    has not run here. WindowUnreadable when a file exists and cannot be used."""
    directory = Path(state_dir)
    path = directory / FILE_NAME
    reaps = list(read_manual_reaps(directory, boot=boot))
    first_seen: dict[TreeKey, float] = {}
    try:
        text: str | None = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = None
    except OSError as exc:
        raise WindowUnreadable(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise WindowUnreadable(f"{path}: unusable ({exc})") from None
    if text is not None:
        try:
            data: dict[str, Any] = read_state(json.loads(text), boot, wall, boot_now)
            for row in data.get("reaps", []):
                if str(row[1]) == Mode.ENFORCE:
                    reaps.append(ReapMark(float(row[0]), *window_owner(row)))
            first_seen = {TreeKey.parse(k): float(v)
                          for k, v in data.get("first_seen", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError, IndexError,
                RecursionError) as exc:
            raise WindowUnreadable(f"{path}: unusable ({exc})") from None
    return ReapHistoryView(tuple(reaps), first_seen)
