"""The config file's `classify:` section, read into the classifier's `Rules`.

Also the reader of RE2 pattern lists, which `audit.suspect_patterns` shares. On Windows
(`windows=True`, which the loader passes from gpuguard.host.platform) the keys left out
take Windows' defaults (rules_config.WINDOWS_PROTECT, WINDOWS_ADOPTERS,
WINDOWS_MARKS_DIR).
"""

from __future__ import annotations

import ntpath
from typing import Any

from gpuguard.base.validation import At, integer, mapping, string_list
from gpuguard.orphans.rules_config import (
    DEFAULT_MAX_DEPTH,
    ProtectPatternError,
    Rules,
    compile_protect,
    default_rules,
)


def patterns(at: At, value: Any) -> tuple[str, ...]:
    """Patterns for the bounded matcher (RE2): protect patterns and suspect patterns alike."""
    found = string_list(at, value)
    for i, pattern in enumerate(found):
        try:
            compile_protect(pattern)
        except ProtectPatternError as exc:
            raise at.item(i).error(f"bad regex {pattern!r}: {exc} (protect and suspect "
                                   "patterns use RE2 syntax: no back-references or "
                                   "look-arounds)") from None
    return found


def _absolute_path(at: At, value: Any, *, windows: bool = False) -> str:
    """An absolute path: from "/", or on Windows also a drive's (C:\\...) or a share's."""
    if isinstance(value, str) and (value.startswith("/") or (
            windows and ntpath.isabs(value) and ntpath.splitdrive(value)[0])):
        return value
    raise at.error(f"must be an absolute path, got {value!r}")


def parse_classify(at: At, value: Any, *, windows: bool = False) -> Rules:
    got = mapping(at, value, {
        "protect": patterns,
        "adopters": string_list,
        "reapers": string_list,  # the old name of `adopters`, still accepted
        "max_depth": lambda at, v: integer(at, v, minimum=1),
        "marks_dir": lambda at, v: _absolute_path(at, v, windows=windows),
    })
    if "adopters" in got and "reapers" in got:
        raise at.child("reapers").error("is the old name of adopters: give one of the two")
    defaults = default_rules(windows=windows)
    return Rules(
        protect=got.get("protect", defaults.protect),
        adopters=got.get("adopters", got.get("reapers", defaults.adopters)),
        max_depth=got.get("max_depth", DEFAULT_MAX_DEPTH),
        marks_dir=got.get("marks_dir", defaults.marks_dir),
    )
