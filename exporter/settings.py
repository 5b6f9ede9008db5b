"""The exporter's sections of the config file: `quotas:`, `audit:` and `accounting:`,
read into the accounting's `Quotas`, `Audit` and `Accounting` (the remediator never
reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuguard.classify_settings import patterns
from gpuguard.exporter.accounting import (
    EVERYONE,
    Audit,
    IdleAccounting,
    Quotas,
    SizeError,
    SustainedUtilization,
    parse_size,
)
from gpuguard.exporter.unlisted import UnlistedSettings
from gpuguard.validation import At, integer, mapping, number, string_list


def _sizes(at: At, value: Any, *, everyone: bool) -> tuple[tuple[str, int], ...]:
    """A mapping of names to sizes (bytes, or strings such as "10GiB")."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise at.error(f"must be a mapping of names to sizes, got {at.format.describe(value)}")
    out = []
    for name, raw in value.items():
        if not isinstance(name, str) or not name:
            raise at.child(name).error("names must be non-empty strings (quote numeric names)")
        if name == EVERYONE and not everyone:
            raise at.child(name).error(f"the default quota is users.{EVERYONE!r}")
        try:
            out.append((name, parse_size(raw)))
        except SizeError as exc:
            raise at.child(name).error(str(exc)) from None
    return tuple(out)


def parse_quotas(at: At, value: Any) -> Quotas:
    return Quotas(**mapping(at, value, {
        "users": lambda at, v: _sizes(at, v, everyone=True),
        "groups": lambda at, v: _sizes(at, v, everyone=False),
    }))


def _ratio(at: At, value: Any) -> float:
    ratio = number(at, value, above=0)
    if ratio > 1:
        raise at.error(f"must be a ratio in (0, 1], got {value}")
    return ratio


def _sustained(at: At, value: Any) -> SustainedUtilization | None:
    if value is None:
        return None  # `sustained_utilization:` with nothing after it: off
    return SustainedUtilization(**mapping(at, value, {
        "ratio": _ratio,
        "for_seconds": lambda at, v: number(at, v, minimum=1),
    }))


def _names(at: At, value: Any) -> tuple[str, ...]:
    """Program names: one file name each, compared whole with what a process runs."""
    names = string_list(at, value)
    for i, name in enumerate(names):
        if not name or "/" in name or any(c.isspace() for c in name):
            raise at.item(i).error(f"{name!r} is not a program name (one file name: no '/', "
                                   "no spaces; for a regex use audit.suspect_patterns)")
    return names


def parse_audit(at: At, value: Any) -> Audit:
    return Audit(**mapping(at, value, {
        "suspect_names": _names,
        "suspect_patterns": patterns,
        "sustained_utilization": _sustained,
    }))


def _size(at: At, value: Any) -> int:
    try:
        return parse_size(value)
    except SizeError as exc:
        raise at.error(str(exc)) from None


def _globs(at: At, value: Any) -> tuple[str, ...]:
    """Absolute glob patterns: a relative one would depend on the daemon's directory."""
    globs = string_list(at, value)
    for i, pattern in enumerate(globs):
        if not pattern.startswith("/"):
            raise at.item(i).error(f"{pattern!r} is not an absolute path pattern")
    return globs


@dataclass(frozen=True)
class AccountingSection:
    """`accounting:`: when a holder's memory counts as idle, and the search for holders
    NVML does not list (one section, two consumers)."""

    idle: IdleAccounting = field(default_factory=IdleAccounting)
    unlisted: UnlistedSettings = field(default_factory=UnlistedSettings)


_IDLE_KEYS = frozenset({"idle_after_seconds"})


def parse_accounting(at: At, value: Any) -> AccountingSection:
    got = mapping(at, value, {
        "idle_after_seconds": lambda at, v: number(at, v, minimum=0),
        "unlisted_threshold_bytes": _size,
        "device_files": _globs,
        "unlisted_search_budget_processes": lambda at, v: integer(at, v, minimum=1),
        "unlisted_search_budget_milliseconds": lambda at, v: number(at, v, above=0),
    })
    return AccountingSection(
        idle=IdleAccounting(**{k: v for k, v in got.items() if k in _IDLE_KEYS}),
        unlisted=UnlistedSettings(**{k: v for k, v in got.items() if k not in _IDLE_KEYS}))
