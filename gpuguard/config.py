"""The one YAML config file shared by exporter and remediator.

Validation is strict because a typo in a kill policy must never be silently
ignored: unknown keys, wrong types and bad regexes are errors that name the
file, the key and the problem.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gpuguard.exporter.accounting import (
    EVERYONE,
    Audit,
    Quotas,
    SizeError,
    SustainedUtilization,
    parse_size,
)
from gpuguard.orphans.classify import (
    DEFAULT_ADOPTERS,
    DEFAULT_MARKS_DIR,
    DEFAULT_MAX_DEPTH,
    DEFAULT_PROTECT,
    ProtectPatternError,
    Rules,
    compile_protect,
)

MODES = ("dry-run", "enforce")
#: Orphan reasons (classify rule 6): the launcher killed by a signal, exited by itself,
#: gone with its exit not recorded by the listener that runs (it started later, or the
#: record was evicted), or gone where no listener runs; or only a parent in between died;
#: or the holder's own session lives under a process whose launcher is gone.
REASONS = ("launcher-killed", "session-ended", "launcher-exited", "launcher-unrecorded",
           "parent-exited", "session-orphaned")


class ConfigError(Exception):
    """A config problem, already phrased as `FILE: KEY: PROBLEM` for one line of output."""

    def __init__(self, path: str, key: str, problem: str) -> None:
        super().__init__(f"{path}: {key}: {problem}")
        self.path, self.key, self.problem = path, key, problem


#: A `remediate.users` entry naming a uid, not a user name pattern: `uid:1001`.
UID_RULE = "uid:"
#: The largest uid (uid_t is 32 bits; 4294967295, (uid_t)-1, means "no uid").
MAX_UID = 2**32 - 2


@dataclass(frozen=True)
class UserFilter:
    """`remediate.users`: glob patterns on user names and `uid:N` rules (policy.user_refusal)."""

    allow: tuple[str, ...] = ("*",)
    deny: tuple[str, ...] = ("root",)


def uid_rule(entry: str) -> int | None:
    """The uid a `uid:N` entry names; None for a user name pattern."""
    digits = entry.removeprefix(UID_RULE)
    if digits == entry or not (digits.isascii() and digits.isdigit()) or len(digits) > 10:
        return None
    return int(digits)


@dataclass(frozen=True)
class RateLimit:
    max_reaps: int = 5
    per_seconds: float = 3600.0


@dataclass(frozen=True)
class AlertmanagerConfig:
    """The `remediate.alertmanager:` section: where to double-check alerts before a reap.

    Several URLs are the peers of one HA cluster, asked in order until one answers
    (they share silences, and Prometheus sends every alert to each of them).
    """

    url: tuple[str, ...]
    credentials_file: str | None = None  # bearer token, re-read when it changes
    timeout_seconds: float = 3.0  # per request; one confirmation takes at most this * len(url)
    pull: bool = False  # also poll Alertmanager for this host's alerts, not only the webhook
    pull_interval_seconds: float = 15.0


@dataclass(frozen=True)
class Remediate:
    """The `remediate:` section: what the remediator may kill, and how."""

    mode: str = "dry-run"
    alerts: tuple[str, ...] = ("GPUOrphanTree",)
    reasons: tuple[str, ...] = ("launcher-killed", "session-ended")
    min_age_seconds: float = 300.0
    users: UserFilter = field(default_factory=UserFilter)
    rate_limit: RateLimit = field(default_factory=RateLimit)
    term_timeout_seconds: float = 10.0
    allow_root_owned: bool = False
    allow_without_pidfd: bool = False
    worker_timeout_seconds: float = 60.0
    max_pending: int = 256
    state_dir: str = "/var/lib/gpuguard"
    audit_log: str = "/var/log/gpuguard/audit.jsonl"
    alertmanager: AlertmanagerConfig | None = None


@dataclass(frozen=True)
class Config:
    classify: Rules = field(default_factory=Rules)
    remediate: Remediate = field(default_factory=Remediate)
    quotas: Quotas = field(default_factory=Quotas)  # read by the exporter (and `status`)
    audit: Audit = field(default_factory=Audit)  # read by the exporter (and `status`)
    source: str = "<defaults>"


def str_list(path: str, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(path, key, f"must be a list of strings, got {_describe(value)}")
    return tuple(value)


def _number(path: str, key: str, value: Any, *, minimum: float = 0.0,
            above: float | None = None) -> float:
    """A finite number: YAML's .nan passes every comparison, and .inf every lower bound."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(path, key, f"must be a number, got {_describe(value)}")
    if not math.isfinite(value):
        raise ConfigError(path, key, f"must be a finite number, got {value}")
    if above is not None and value <= above:
        raise ConfigError(path, key, f"must be > {above:g}, got {value}")
    if value < minimum:
        raise ConfigError(path, key, f"must be >= {minimum:g}, got {value}")
    return float(value)


def _int(path: str, key: str, value: Any, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, key, f"must be an integer, got {_describe(value)}")
    if value < minimum:
        raise ConfigError(path, key, f"must be >= {minimum}, got {value}")
    return value


def bool_value(path: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(path, key, f"must be true or false, got {_describe(value)}")
    return value


def _str(path: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(path, key, f"must be a non-empty string, got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
             int: "an integer", float: "a number", type(None): "nothing"}
    return names.get(type(value), type(value).__name__)


def section(path: str, key: str, value: Any, allowed: dict[str, Callable[..., Any]]) -> dict:
    """Check a mapping's keys against `allowed` and convert each value."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(path, key or "(top level)", f"must be a mapping, got {_describe(value)}")
    out = {}
    for sub, raw in value.items():
        full = f"{key}.{sub}" if key else str(sub)
        if sub not in allowed:
            known = ", ".join(sorted(allowed))
            raise ConfigError(path, full, f"unknown key (known keys: {known})")
        out[sub] = allowed[sub](path, full, raw)
    return out


def _patterns(path: str, key: str, value: Any) -> tuple[str, ...]:
    """Patterns for the bounded matcher (RE2): protect patterns and suspect patterns alike."""
    patterns = str_list(path, key, value)
    for i, pattern in enumerate(patterns):
        try:
            compile_protect(pattern)
        except ProtectPatternError as exc:
            raise ConfigError(path, f"{key}[{i}]", f"bad regex {pattern!r}: {exc} (protect "
                              "and suspect patterns use RE2 syntax: no back-references or "
                              "look-arounds)") from None
    return patterns


def _choice(choices: tuple[str, ...]) -> Callable[[str, str, Any], str]:
    def check(path: str, key: str, value: Any) -> str:
        if value not in choices:
            raise ConfigError(path, key, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    return check


def _choices(choices: tuple[str, ...]) -> Callable[[str, str, Any], tuple[str, ...]]:
    def check(path: str, key: str, value: Any) -> tuple[str, ...]:
        items = str_list(path, key, value)
        for item in items:
            if item not in choices:
                raise ConfigError(path, key, f"{item!r} is not one of {', '.join(choices)}")
        return items

    return check


def _classify(path: str, key: str, value: Any) -> Rules:
    got = section(path, key, value, {
        "protect": _patterns,
        "adopters": str_list,
        "reapers": str_list,  # the old name of `adopters`, still accepted
        "max_depth": lambda p, k, v: _int(p, k, v, minimum=1),
        "marks_dir": _absolute_path,
    })
    if "adopters" in got and "reapers" in got:
        raise ConfigError(path, f"{key}.reapers",
                          "is the old name of adopters: give one of the two")
    return Rules(
        protect=got.get("protect", DEFAULT_PROTECT),
        adopters=got.get("adopters", got.get("reapers", DEFAULT_ADOPTERS)),
        max_depth=got.get("max_depth", DEFAULT_MAX_DEPTH),
        marks_dir=got.get("marks_dir", DEFAULT_MARKS_DIR),
    )


def _absolute_path(path: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(path, key, f"must be an absolute path, got {value!r}")
    return value


def _user_entries(path: str, key: str, value: Any) -> tuple[str, ...]:
    """User name patterns and `uid:N` rules; a bare number is neither, and says so."""
    for i, item in enumerate(value if isinstance(value, list) else ()):
        if isinstance(item, int) and not isinstance(item, bool):
            raise ConfigError(path, f"{key}[{i}]", f"{item} is a number: write "
                              f"\"uid:{item}\" to name a uid (user names are strings)")
    entries = str_list(path, key, value)
    for i, entry in enumerate(entries):
        if entry.startswith(UID_RULE):
            uid = uid_rule(entry)
            if uid is None or uid > MAX_UID:
                raise ConfigError(path, f"{key}[{i}]", f"{entry!r} is not a uid rule: write "
                                  f"uid: and a decimal uid from 0 to {MAX_UID}, e.g. uid:1001")
        elif entry.isascii() and entry.isdigit():
            raise ConfigError(path, f"{key}[{i}]", f"{entry!r} is a number, which no user "
                              f"name is: write \"uid:{entry}\" to name a uid")
        elif not entry:
            raise ConfigError(path, f"{key}[{i}]", "an empty pattern matches no user")
    return entries


def _users(path: str, key: str, value: Any) -> UserFilter:
    got = section(path, key, value, {"allow": _user_entries, "deny": _user_entries})
    return UserFilter(**got)


def _rate_limit(path: str, key: str, value: Any) -> RateLimit:
    got = section(path, key, value, {
        "max_reaps": lambda p, k, v: _int(p, k, v, minimum=0),
        "per_seconds": lambda p, k, v: _number(p, k, v, minimum=1),
    })
    return RateLimit(**got)


def _alertmanager_url(path: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(path, key, f"must be a non-empty string, got {_describe(value)}")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ConfigError(path, key, f"not a valid URL {value!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(path, key,
                          f"must be an http:// or https:// URL with a host, got {value!r}")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ConfigError(path, key, f"must not contain spaces or control characters: {value!r}")
    if parts.query or parts.fragment:
        raise ConfigError(path, key, f"must not have a query or fragment, got {value!r}")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(path, key, "must not carry credentials (use credentials_file)")
    return value


def _alertmanager_urls(path: str, key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (_alertmanager_url(path, key, value),)
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else _describe(value)
        raise ConfigError(path, key, f"must be a URL or a non-empty list of URLs, got {got}")
    return tuple(_alertmanager_url(path, f"{key}[{i}]", item) for i, item in enumerate(value))


def _alertmanager(path: str, key: str, value: Any) -> AlertmanagerConfig:
    got = section(path, key, value, {
        "url": _alertmanager_urls,
        "credentials_file": _str,
        "timeout_seconds": lambda p, k, v: _number(p, k, v, above=0),
        "pull": bool_value,
        "pull_interval_seconds": lambda p, k, v: _number(p, k, v, minimum=1),
    })
    if "url" not in got:
        raise ConfigError(path, f"{key}.url", "required when the alertmanager section is present")
    return AlertmanagerConfig(**got)


def _remediate(path: str, key: str, value: Any) -> Remediate:
    got = section(path, key, value, {
        "mode": _choice(MODES),
        "alerts": str_list,
        "reasons": _choices(REASONS),
        "min_age_seconds": _number,
        "users": _users,
        "rate_limit": _rate_limit,
        "term_timeout_seconds": lambda p, k, v: _number(p, k, v, minimum=0.1),
        "worker_timeout_seconds": lambda p, k, v: _number(p, k, v, minimum=1),
        "max_pending": lambda p, k, v: _int(p, k, v, minimum=1),
        "allow_root_owned": bool_value,
        "allow_without_pidfd": bool_value,
        "state_dir": _str,
        "audit_log": _str,
        "alertmanager": _alertmanager,
    })
    return Remediate(**got)


def _sizes(path: str, key: str, value: Any, *, everyone: bool) -> tuple[tuple[str, int], ...]:
    """A mapping of names to sizes (bytes, or strings such as "10GiB")."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ConfigError(path, key, f"must be a mapping of names to sizes, got {_describe(value)}")
    out = []
    for name, raw in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(path, f"{key}.{name}", "names must be non-empty strings (quote "
                              "numeric names)")
        if name == EVERYONE and not everyone:
            raise ConfigError(path, f"{key}.{name}", f"the default quota is users.{EVERYONE!r}")
        try:
            out.append((name, parse_size(raw)))
        except SizeError as exc:
            raise ConfigError(path, f"{key}.{name}", str(exc)) from None
    return tuple(out)


def _quotas(path: str, key: str, value: Any) -> Quotas:
    got = section(path, key, value, {
        "users": lambda p, k, v: _sizes(p, k, v, everyone=True),
        "groups": lambda p, k, v: _sizes(p, k, v, everyone=False),
    })
    return Quotas(**got)


def _ratio(path: str, key: str, value: Any) -> float:
    ratio = _number(path, key, value, above=0)
    if ratio > 1:
        raise ConfigError(path, key, f"must be a ratio in (0, 1], got {value}")
    return ratio


def _sustained(path: str, key: str, value: Any) -> SustainedUtilization | None:
    if value is None:
        return None  # `sustained_utilization:` with nothing after it: off
    got = section(path, key, value, {
        "ratio": _ratio,
        "for_seconds": lambda p, k, v: _number(p, k, v, minimum=1),
    })
    return SustainedUtilization(**got)


def _names(path: str, key: str, value: Any) -> tuple[str, ...]:
    """Program names: one file name each, compared whole with what a process runs."""
    names = str_list(path, key, value)
    for i, name in enumerate(names):
        if not name or "/" in name or any(c.isspace() for c in name):
            raise ConfigError(path, f"{key}[{i}]", f"{name!r} is not a program name (one "
                              "file name: no '/', no spaces; for a regex use "
                              "audit.suspect_patterns)")
    return names


def _audit(path: str, key: str, value: Any) -> Audit:
    got = section(path, key, value, {
        "suspect_names": _names,
        "suspect_patterns": _patterns,
        "sustained_utilization": _sustained,
    })
    return Audit(**got)


def _duplicate_key(node: yaml.Node | None, path: str = "",
                   visited: set[int] | None = None) -> tuple[str, int, int] | None:
    """The first key given twice in one mapping, at any depth: (dotted key, line, line).

    PyYAML keeps the last value, so `mode: dry-run` at the top of a section and
    `mode: enforce` further down would load as enforce: one file, two readings. A key
    that a `<<` merge brings in and the mapping sets again counts as given twice.
    Each node is walked once, so aliases (even to themselves) cost nothing more.
    """
    visited = set() if visited is None else visited
    if node is None or id(node) in visited:
        return None
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        merged: dict[str, int] = {}
        for key_node, value_node in node.value:
            name = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:merge":
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) \
                    else [value_node]
                for source in sources:
                    if isinstance(source, yaml.MappingNode):
                        for merged_key, _ in source.value:
                            merged.setdefault(str(merged_key.value), line)
                continue
            full = f"{path}.{name}" if path else name
            if name in seen:
                return full, seen[name], line
            seen[name] = line
            if (found := _duplicate_key(value_node, full, visited)) is not None:
                return found
        for name, line in seen.items():
            if name in merged:
                full = f"{path}.{name}" if path else name
                return full, merged[name], line
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if (found := _duplicate_key(item, f"{path}[{i}]", visited)) is not None:
                return found
    return None


def parse_yaml(text: str, *, source: str) -> Any:
    """YAML text as data; a duplicate key or invalid YAML is a ConfigError naming the line."""
    try:
        duplicate = _duplicate_key(yaml.compose(text, Loader=yaml.SafeLoader))
        if duplicate is not None:
            key, first, again = duplicate
            raise ConfigError(source, key, f"duplicate key (lines {first} and {again}): "
                              "YAML would silently keep only the last")
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "(document)"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, where, f"invalid YAML: {problem}") from None


def parse_config(text: str, *, source: str = "<string>") -> Config:
    data = parse_yaml(text, source=source)
    got = section(source, "", data, {"classify": _classify, "remediate": _remediate,
                                     "quotas": _quotas, "audit": _audit})
    return Config(
        classify=got.get("classify", Rules()),
        remediate=got.get("remediate", Remediate()),
        quotas=got.get("quotas", Quotas()),
        audit=got.get("audit", Audit()),
        source=source,
    )


def load_config(path: str | Path | None) -> Config:
    """Load and validate `path`; None means the built-in defaults."""
    if path is None:
        return Config()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "(file)", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "(file)", f"cannot read: {exc}") from None
    return parse_config(text, source=str(path))
