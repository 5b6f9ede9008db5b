"""The platform back-end is behaviour, not flags (issue 51): a `Platform` supplies what
differs (default paths, permission checks, registrations, group lookups) and no caller
asks which kind of platform it runs on. A boolean field would bring the question back."""

from __future__ import annotations

import dataclasses
import re

from gpuguard.config.classify import default_rules
from gpuguard.config.remediate import Remediate, default_remediate
from gpuguard.host.backend import Platform
from gpuguard.host.platform import BACKENDS, LINUX, WINDOWS
from gpuguard.orphans.rules_config import Rules

#: Boolean fields still allowed, each with why: none (the thaw guardian, the last, is
#: engine/platforms.py's GUARDIANS).
BOOLEAN_EXCEPTIONS: frozenset[str] = frozenset()


def is_flag(annotation: object) -> bool:
    """A yes/no field's annotation: bool, or bool with None (a function returning bool
    is behaviour, not a flag)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return re.fullmatch(r"\s*(bool|bool \| None|None \| bool|Optional\[bool\])\s*", text) \
        is not None


def test_the_flag_finder_sees_optional_bools_and_not_callables() -> None:
    assert is_flag("bool") and is_flag(bool) and is_flag("bool | None")
    assert is_flag("Optional[bool]")
    assert not is_flag("Callable[[], bool]") and not is_flag("Registrations")


def test_no_boolean_flag_field_on_platform() -> None:
    """A yes/no field makes each caller branch on the platform's kind; give a hook or a
    record instead (CONTRIBUTING.md, How to add a platform)."""
    flags = {f.name for f in dataclasses.fields(Platform) if is_flag(f.type)}
    assert flags <= BOOLEAN_EXCEPTIONS, (
        f"boolean flags on Platform: {sorted(flags - BOOLEAN_EXCEPTIONS)}")


def test_linux_defaults_are_the_config_records_own() -> None:
    """Rules() and Remediate() (the records' own defaults, which tests and the console
    build) say what Linux's back-end says: one set of Linux defaults, two spellings."""
    linux = BACKENDS[LINUX].defaults
    assert default_rules(linux) == Rules()
    assert default_remediate(linux) == Remediate()


#: Paths and whether each platform calls them absolute: (Linux, Windows).
ABSOLUTE = {
    "/run/gpuguard/marks": (True, True),
    "C:\\ProgramData\\gpuguard\\marks": (False, True),
    "\\\\server\\share\\marks": (False, True),
    "relative\\marks": (False, False),
    "C:relative": (False, False),
    "\\rooted": (False, False),
}


def test_each_platform_says_which_paths_are_absolute() -> None:
    linux, windows = BACKENDS[LINUX].defaults, BACKENDS[WINDOWS].defaults
    for path, expected in ABSOLUTE.items():
        assert (linux.absolute_path(path), windows.absolute_path(path)) == expected, path


def test_a_platform_without_groups_answers_none_for_everyone() -> None:
    assert BACKENDS[WINDOWS].group_lookup()("alice") == frozenset()
