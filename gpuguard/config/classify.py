"""The config file's `classify:` section, read into the classifier's `Rules`.

Also the reader of RE2 pattern lists, which `audit.suspect_patterns` shares. The keys
left out take the platform's defaults (`Platform.defaults`, which the loader passes from
gpuguard.host.platform: on Windows rules_config.WINDOWS_PROTECT, WINDOWS_ADOPTERS,
WINDOWS_MARKS_DIR), and the platform says which paths are absolute.
"""

from __future__ import annotations

from typing import Any

from gpuguard.base.validation import At, integer, mapping, string_list
from gpuguard.host.backend import Defaults
from gpuguard.orphans.rules_config import (
    DEFAULT_MAX_DEPTH,
    ProtectPatternError,
    Rules,
    compile_protect,
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


def default_rules(defaults: Defaults) -> Rules:
    """The `classify:` defaults of a platform (`Platform.defaults`): its protect patterns,
    adopters and marks directory."""
    return Rules(protect=defaults.protect, adopters=defaults.adopters,
                 marks_dir=defaults.marks_dir)


def _absolute_path(at: At, value: Any, *, defaults: Defaults) -> str:
    """An absolute path as the platform says it: from "/", or on Windows also a drive's
    (C:\\...) or a share's."""
    if isinstance(value, str) and defaults.absolute_path(value):
        return value
    raise at.error(f"must be an absolute path, got {value!r}")


def parse_classify(at: At, value: Any, *, defaults: Defaults) -> Rules:
    """The `classify:` section; `defaults`: the platform's, for the keys it leaves out."""
    got = mapping(at, value, {
        "protect": patterns,
        "adopters": string_list,
        "reapers": string_list,  # the old name of `adopters`, still accepted
        "max_depth": lambda at, v: integer(at, v, minimum=1),
        "marks_dir": lambda at, v: _absolute_path(at, v, defaults=defaults),
    })
    if "adopters" in got and "reapers" in got:
        raise at.child("reapers").error("is the old name of adopters: give one of the two")
    return Rules(
        protect=got.get("protect", defaults.protect),
        adopters=got.get("adopters", got.get("reapers", defaults.adopters)),
        max_depth=got.get("max_depth", DEFAULT_MAX_DEPTH),
        marks_dir=got.get("marks_dir", defaults.marks_dir),
    )
