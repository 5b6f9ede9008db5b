"""Typed readers for untrusted input: the config file, webhook payloads, Alertmanager's answers.

Each reader checks one value and returns it typed, or raises its format's error naming
where the value sits and what is wrong: `FILE: KEY: PROBLEM` for the config file,
`alerts[3].labels: PROBLEM` for a JSON body. Also YAML loading that refuses duplicate keys.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import yaml

T = TypeVar("T")
S = TypeVar("S", bound=str)


class Invalid(Exception):
    """A value a reader refused: `SOURCE: KEY: PROBLEM`, or `KEY: PROBLEM` without a source."""

    def __init__(self, source: str | None, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}" if source is None else f"{source}: {key}: {problem}")
        self.source, self.key, self.problem = source, key, problem


class ConfigError(Invalid):
    """A config file problem, already phrased as `FILE: KEY: PROBLEM` for one line of output."""

    def __init__(self, path: str, key: str, problem: str) -> None:
        super().__init__(path, key, problem)
        self.path = path


#: How a YAML file's messages name the type of a value, and how a JSON body's do.
YAML_TYPES: Mapping[type, str] = {
    dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
    float: "a number", type(None): "nothing"}
JSON_TYPES: Mapping[type, str] = {
    dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
    float: "a number", type(None): "null"}


@dataclass(frozen=True)
class Format:
    """One kind of input: the error its readers raise and how their messages are worded.

    A terse format says only what was expected (`not a list of strings`), naming the
    container rather than the item; others say what came instead (`got a string`).
    `clip`: a value is shown by its repr, clipped to that many characters and only for
    a string (remote input may be huge); None shows any value's whole repr.
    """

    error: type[Invalid]
    types: Mapping[type, str]
    terse: bool = False
    clip: int | None = None

    def describe(self, value: Any) -> str:
        return self.types.get(type(value), type(value).__name__)

    def show(self, value: Any) -> str:
        if self.clip is None:
            return repr(value)
        return repr(value)[:self.clip] if isinstance(value, str) else self.describe(value)


#: The config file (and the web config file): YAML, ConfigError.
CONFIG_FILE = Format(ConfigError, YAML_TYPES)


@dataclass(frozen=True)
class At:
    """Where a value sits: its key (`remediate.users.deny[1]`), its source, its format."""

    format: Format
    key: str = ""
    source: str | None = None

    def child(self, name: object) -> At:
        return At(self.format, f"{self.key}.{name}" if self.key else str(name), self.source)

    def item(self, index: int) -> At:
        return At(self.format, f"{self.key}[{index}]", self.source)

    def error(self, problem: str) -> Invalid:
        return self.format.error(self.source, self.key or "(top level)", problem)

    def wrong(self, expected: str, value: Any) -> Invalid:
        """The error for a value that is not `expected` ("a list of strings")."""
        if self.format.terse:
            return self.error(f"not {expected}")
        return self.error(f"must be {expected}, got {self.format.describe(value)}")


#: A reader of one field: where it is, and its raw value -> the typed value.
Reader = Callable[[At, Any], Any]


def of_type(at: At, value: Any, kind: type[T]) -> T:
    """`value` if it is a `kind` (dict, list), named as the format names it."""
    if not isinstance(value, kind):
        raise at.wrong(at.format.types[kind], value)
    return value


def string(at: At, value: Any, *, non_empty: bool = False) -> str:
    if not isinstance(value, str) or (non_empty and not value):
        raise at.wrong("a non-empty string" if non_empty else "a string", value)
    return value


def optional_string(at: At, value: Any) -> str:
    """A string that may be absent (None, read as "")."""
    return "" if value is None else string(at, value)


def string_list(at: At, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise at.wrong("a list of strings", value)
    return tuple(value)


def string_map(at: At, value: Any, *, required: bool = True) -> dict[str, str]:
    """An object of strings (absent, None, reads as {} unless `required`); a wrong value
    is named by its key unless the format is terse."""
    if value is None and not required:
        return {}
    expected = f"{at.format.types[dict]} of strings"
    if not isinstance(value, dict):
        raise at.wrong(expected, value)
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            if at.format.terse:
                raise at.wrong(expected, value)
            string(at.child(key), item)
    return dict(value)


def number(at: At, value: Any, *, minimum: float = 0.0, above: float | None = None) -> float:
    """A finite number: YAML's .nan passes every comparison, and .inf every lower bound."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise at.wrong("a number", value)
    if not math.isfinite(value):
        raise at.error(f"must be a finite number, got {value}")
    if above is not None and value <= above:
        raise at.error(f"must be > {above:g}, got {value}")
    if value < minimum:
        raise at.error(f"must be >= {minimum:g}, got {value}")
    return float(value)


#: A duration's units, in seconds: `90s`, `30m`, `1h`, `2d` (one number, one unit).
DURATION_UNITS: Mapping[str, float] = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*\Z")


def duration(at: At, value: Any, *, above: float = 0.0) -> float:
    """Seconds, from a number (seconds, as every `*_seconds` key) or a string of one
    number and one unit (`90s`, `30m`, `1h`, `1.5h`, `2d`): the form a person writes an
    hour in. Anything else (`1h30m`, `"60"`, `1 hour`, `-1h`) is an error naming both forms."""
    if not isinstance(value, str):
        return number(at, value, above=above)
    match = _DURATION.match(value)
    if match is None:
        raise at.error(f"must be seconds (a number) or a number and one unit of "
                       f"{', '.join(DURATION_UNITS)} (such as '90s', '30m', '1h', '2d'), "
                       f"got {at.format.show(value)}")
    seconds = float(match.group(1)) * DURATION_UNITS[match.group(2)]
    if seconds <= above:
        raise at.error(f"must be longer than {above:g}s, got {value!r}")
    return seconds


def integer(at: At, value: Any, *, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise at.wrong("an integer", value)
    if minimum is not None and value < minimum:
        raise at.error(f"must be >= {minimum}, got {value}")
    return value


def boolean(at: At, value: Any) -> bool:
    if not isinstance(value, bool):
        raise at.wrong("true or false", value)
    return value


def choice(at: At, value: Any, options: Sequence[S]) -> S:
    """The option equal to `value` (an enum member for its string)."""
    for option in options:
        if option == value:
            return option
    raise at.error(f"must be one of {', '.join(options)}, got {at.format.show(value)}")


def choice_list(at: At, value: Any, options: Sequence[S]) -> tuple[S, ...]:
    """A list of options, as `choice` reads each."""
    chosen = []
    for item in string_list(at, value):
        if item not in options:
            raise at.error(f"{item!r} is not one of {', '.join(options)}")
        chosen.append(choice(at, item, options))
    return tuple(chosen)


def mapping(at: At, value: Any, readers: Mapping[str, Reader]) -> dict[str, Any]:
    """A mapping whose every key is one of `readers`, each value read by its reader.

    Nothing (None) reads as {}: `section:` with nothing after it takes the defaults.
    """
    if value is None:
        return {}
    out = {}
    for sub, raw in of_type(at, value, dict).items():
        if sub not in readers:
            known = ", ".join(sorted(readers))
            raise at.child(sub).error(f"unknown key (known keys: {known})")
        out[sub] = readers[sub](at.child(sub), raw)
    return out


#: The tag PyYAML gives a `<<` key (a merge), written `<<` and not quoted.
_MERGE = "tag:yaml.org,2002:merge"

#: A key given twice: (dotted key, its first line, its second line, the line of the `<<`
#: merge that brought one of them in, or None for two keys written in one mapping).
Duplicate = tuple[str, int, int, "int | None"]


def _merge_sources(value: yaml.Node) -> list[yaml.MappingNode]:
    """The mappings a `<<` value merges: one, or a list (anything else PyYAML refuses)."""
    import yaml

    items = value.value if isinstance(value, yaml.SequenceNode) else [value]
    return [item for item in items if isinstance(item, yaml.MappingNode)]


def _keys_given(node: yaml.MappingNode,
                memo: dict[int, dict[str, yaml.Node]]) -> dict[str, yaml.Node]:
    """Every key a mapping gives, through its own merges too: name -> the key node.

    Memoised by node, so a chain of merges of merges costs one walk of each mapping; a
    merge cycle (an anchor merged into itself) gives nothing more.
    """
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = {}
    keys: dict[str, yaml.Node] = {}
    for key_node, value_node in node.value:
        if key_node.tag == _MERGE:
            for source in _merge_sources(value_node):
                for name, given in _keys_given(source, memo).items():
                    keys.setdefault(name, given)
        else:
            keys.setdefault(str(key_node.value), key_node)
    memo[id(node)] = keys
    return keys


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _duplicate_key(node: yaml.Node | None, path: str = "", visited: set[int] | None = None,
                   memo: dict[int, dict[str, yaml.Node]] | None = None) -> Duplicate | None:
    """The first key given twice in one mapping, at any depth.

    PyYAML keeps the last value, so `mode: dry-run` at the top of a section and
    `mode: enforce` further down would load as enforce: one file, two readings. Merges
    (`<<`) count: a key two merge sources give (PyYAML keeps the last source's, the YAML
    spec the first's), or one a merge brings in and the mapping sets again (YAML keeps the
    mapping's, but a reader of the file sees the key twice), nested merges included. The
    same key node reached twice (one anchor merged by two paths) is one key, not two.
    Each node is walked once, so aliases (even to themselves) cost nothing more.
    """
    import yaml  # only where a file is read (docs/exporter.md, Memory)

    visited = set() if visited is None else visited
    memo = {} if memo is None else memo
    if node is None or id(node) in visited:
        return None
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        merged: dict[str, tuple[yaml.Node, int]] = {}
        for key_node, value_node in node.value:
            name = str(key_node.value)
            line = _line(key_node)
            if key_node.tag == _MERGE:
                for source in _merge_sources(value_node):
                    for given_name, given in _keys_given(source, memo).items():
                        first, _ = merged.setdefault(given_name, (given, line))
                        if first is not given:
                            full = f"{path}.{given_name}" if path else given_name
                            return full, _line(first), _line(given), line
                # The sources' own keys land in this mapping: checked under its path.
                if (found := _duplicate_key(value_node, path, visited, memo)) is not None:
                    return found
                continue
            full = f"{path}.{name}" if path else name
            if name in seen:
                return full, seen[name], line, None
            seen[name] = line
            if (found := _duplicate_key(value_node, full, visited, memo)) is not None:
                return found
        for name, line in seen.items():
            if name in merged:
                full = f"{path}.{name}" if path else name
                given, merge_line = merged[name]
                return full, _line(given), line, merge_line
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if (found := _duplicate_key(item, f"{path}[{i}]", visited, memo)) is not None:
                return found
    return None


def parse_yaml(text: str, *, source: str) -> Any:
    """YAML text as data; a duplicate key or invalid YAML is a ConfigError naming the line."""
    import yaml  # a daemon run without a file never maps PyYAML (docs/exporter.md, Memory)

    try:
        duplicate = _duplicate_key(yaml.compose(text, Loader=yaml.SafeLoader))
        if duplicate is not None:
            key, first, again, merge = duplicate
            if merge is None:
                raise ConfigError(source, key, f"duplicate key (lines {first} and {again}): "
                                  "YAML would silently keep only the last")
            raise ConfigError(source, key, f"duplicate key (lines {first} and {again}, "
                              f"through the << merge on line {merge}): YAML would silently "
                              "keep only one; give each key once")
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "(document)"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, where, f"invalid YAML: {problem}") from None
