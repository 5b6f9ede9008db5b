"""The config file's `classify:` section, read into the classifier's `Rules`.

Also the reader of RE2 pattern lists, which `audit.suspect_patterns` shares.
"""

from __future__ import annotations

from typing import Any

from gpuguard.orphans.rules_config import (
    DEFAULT_ADOPTERS,
    DEFAULT_MARKS_DIR,
    DEFAULT_MAX_DEPTH,
    DEFAULT_PROTECT,
    ProtectPatternError,
    Rules,
    compile_protect,
)
from gpuguard.validation import At, integer, mapping, string_list


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


def _absolute_path(at: At, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise at.error(f"must be an absolute path, got {value!r}")
    return value


def parse_classify(at: At, value: Any) -> Rules:
    got = mapping(at, value, {
        "protect": patterns,
        "adopters": string_list,
        "reapers": string_list,  # the old name of `adopters`, still accepted
        "max_depth": lambda at, v: integer(at, v, minimum=1),
        "marks_dir": _absolute_path,
    })
    if "adopters" in got and "reapers" in got:
        raise at.child("reapers").error("is the old name of adopters: give one of the two")
    return Rules(
        protect=got.get("protect", DEFAULT_PROTECT),
        adopters=got.get("adopters", got.get("reapers", DEFAULT_ADOPTERS)),
        max_depth=got.get("max_depth", DEFAULT_MAX_DEPTH),
        marks_dir=got.get("marks_dir", DEFAULT_MARKS_DIR),
    )
