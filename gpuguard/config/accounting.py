"""The exporter's sections of the config file, `quotas:` and `audit:`: their values
(Quotas, Audit and what an audit matches) and their readers. Shared, like every section:
both daemons validate the whole file; only the exporter's accounting acts on these.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuguard.base.validation import At, integer, mapping, number, string_list
from gpuguard.config.classify import patterns
from gpuguard.orphans.rules_config import CACHED_TEXT, Pattern, protect_search

#: Quota units: binary (KiB = 1024 B) and decimal (KB = 1000 B), spelled exactly so.
UNITS: dict[str, int] = {
    "B": 1,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}
_SIZE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[A-Za-z]+)\s*$")

#: The `users:` key that holds everyone's default quota.
EVERYONE = "*"

#: Well-known GPU miners' executable names, compared (case-insensitively, whole name)
#: with the name of the program a process runs, never searched for in its arguments:
#: `python /home/alice/T-Rex/demo.py` runs demo.py, `python -m gminer_eval` runs python.
DEFAULT_SUSPECT_NAMES = ("xmrig", "ethminer", "t-rex", "nbminer", "lolminer",
                         "phoenixminer", "gminer")
#: A mining pool's URL anywhere in comm or command line: stratum+tcp://, +ssl, +tls (and
#: ethminer's stratum1+/stratum2+). Only miners and mining proxies are given one.
DEFAULT_SUSPECT_PATTERNS = (r"stratum[12]?\+(tcp|ssl|tls)://",)

#: gpuguard_suspect_process_info's `why`: a fixed set, so alerts can route on it.
WHY_COMM = "comm-pattern"
WHY_CMDLINE = "cmdline-pattern"
WHY_UTILIZATION = "sustained-utilization"

#: The kernel keeps a process's comm to 15 characters (TASK_COMM_LEN 16, with the NUL).
COMM_LENGTH = 15

#: `accounting.idle_after_seconds`' default: an hour without SM use (GPUIdleHolder's too).
DEFAULT_IDLE_AFTER_SECONDS = 3600.0
#: `accounting.unlisted_threshold_bytes`' default: below a CUDA context's few hundred
#: MiB (the least a real holder holds), above the driver's own rounding.
DEFAULT_THRESHOLD_BYTES = 128 * 2**20
#: The per-GPU nodes: /dev/nvidia0, /dev/nvidia1, ..., not nvidiactl or nvidia-uvm, which
#: every CUDA process and NVML client (this exporter too) opens whatever GPU it uses.
DEFAULT_DEVICE_FILES = ("/dev/nvidia[0-9]*",)
DEFAULT_BUDGET_PROCESSES = 2000
DEFAULT_BUDGET_MILLISECONDS = 50.0

class SizeError(ValueError):
    """A quota that is not a byte count or a number with one of UNITS."""


def parse_size(value: Any) -> int:
    """Bytes from an integer or a string such as "10GiB" or "10 GB" (units: UNITS)."""
    if isinstance(value, bool):
        raise SizeError(f"must be a byte count or a size such as '10GiB', got {value}")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise SizeError("must be an integer number of bytes or a string with a unit "
                        f"such as '10GiB', got {type(value).__name__} {value!r}")
    match = _SIZE.match(value)
    units = ", ".join(UNITS)
    if match is None:
        raise SizeError(f"{value!r} is not a size: give a number and one of {units}")
    unit = match.group("unit")
    if unit not in UNITS:
        raise SizeError(f"{value!r}: unknown unit {unit!r} (units: {units}; KiB/MiB/GiB/TiB "
                        "are powers of 1024, KB/MB/GB/TB powers of 1000)")
    from decimal import Decimal, InvalidOperation  # only where quotas are configured

    try:
        exact = Decimal(match.group("number")) * UNITS[unit]
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise SizeError(f"{value!r} is not a size") from None
    if exact != exact.to_integral_value():
        raise SizeError(f"{value!r} is not a whole number of bytes")
    return int(exact)


@dataclass(frozen=True)
class Quotas:
    """The `quotas:` section: GPU memory per user, per group, and `users: {"*": ...}`."""

    users: tuple[tuple[str, int], ...] = ()
    groups: tuple[tuple[str, int], ...] = ()

    @property
    def configured(self) -> bool:
        return bool(self.users or self.groups)

@dataclass(frozen=True)
class SustainedUtilization:
    """`audit.sustained_utilization`: the sole holder of a GPU busy at >= ratio for long."""

    ratio: float = 0.95
    for_seconds: float = 3600.0


@dataclass(frozen=True)
class Audit:
    """The `audit:` section: what makes a GPU holder a suspect.

    Names are compared with the program a process runs (program_names); patterns are
    searched anywhere in comm and command line by the protect patterns' matcher.
    """

    suspect_names: tuple[str, ...] = DEFAULT_SUSPECT_NAMES
    suspect_patterns: tuple[str, ...] = DEFAULT_SUSPECT_PATTERNS
    sustained_utilization: SustainedUtilization | None = None  # off unless configured
    _compiled: tuple[tuple[str, Pattern], ...] = field(default=(), compare=False, repr=False)
    _names: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    _comms: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Not checked here: the config reader checks what a file gives (`patterns`), and
        # the default pattern is checked by the tests, so RE2 loads only when a text
        # holds a default pattern's required word (`stratum`), not at every start.
        compiled = tuple((p, Pattern(p)) for p in self.suspect_patterns)
        object.__setattr__(self, "_compiled", compiled)
        # First name wins when two fold to the same key; a comm is cut like the kernel's.
        names: dict[str, str] = {}
        comms: dict[str, str] = {}
        for name in self.suspect_names:
            names.setdefault(name.lower(), name)
            comms.setdefault(name.lower()[:COMM_LENGTH], name)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_comms", comms)

    def suspect(self, comm: str, cmdline: str | None) -> tuple[str, str] | None:
        """(why, what matched) for the first hit: a suspect name as comm, then as a
        program the command line runs, then a pattern in comm, then in the command line."""
        if comm and (name := self._comms.get(comm.lower())) is not None:
            return WHY_COMM, f"suspect name {name!r}"
        for program in program_names(cmdline):
            if (name := self._names.get(program.lower())) is not None:
                return WHY_CMDLINE, f"suspect name {name!r}"
        for why, text in ((WHY_COMM, comm), (WHY_CMDLINE, cmdline)):
            if not text:
                continue
            for pattern, compiled in self._compiled:
                if _suspect_hit(compiled, text):
                    return why, f"suspect pattern {pattern!r}"
        return None


def program_names(cmdline: str | None) -> tuple[str, ...]:
    """The names of the programs a command line runs: argv[0]'s basename, and the
    basename of the first word after it that is not an option, when that word is a path
    (a loader or emulator running a program: `/lib64/ld-linux-x86-64.so.2 /tmp/xmrig`,
    `box64 ./t-rex`). Later words are arguments, not programs: `--data /datasets/t-rex`
    names a directory. Words are split at whitespace (the command line's NULs are spaces
    by then), so an argv[0] with a space in it is cut there.
    """
    words = (cmdline or "").split()
    if not words:
        return ()
    names = [words[0].rsplit("/", 1)[-1]]
    for word in words[1:]:
        if word.startswith("-"):
            continue
        if "/" in word:
            names.append(word.rsplit("/", 1)[-1])
        break
    return tuple(n for n in names if n)


def _suspect_hit(pattern: Pattern, text: str) -> bool:
    """The protect patterns' matcher (linear time), cached by text like theirs: a comm or
    a short command line (16,384 of at most CACHED_TEXT characters: 4 MiB at most); a
    long one is searched again each scan, as any user can make many (a sweep's jobs)."""
    if len(text) > CACHED_TEXT:
        return protect_search(pattern, text)
    return _cached_suspect_hit(pattern, text)


@functools.lru_cache(maxsize=16384)
def _cached_suspect_hit(pattern: Pattern, text: str) -> bool:
    return protect_search(pattern, text)


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


@dataclass(frozen=True)
class IdleAccounting:
    """`accounting:`'s idle threshold: when a holder's memory counts as idle."""

    idle_after_seconds: float = DEFAULT_IDLE_AFTER_SECONDS


@dataclass(frozen=True)
class UnlistedSettings:
    """`accounting:`'s search: when to look for holders NVML does not list, where, and
    how much one scan may spend looking."""

    unlisted_threshold_bytes: int = DEFAULT_THRESHOLD_BYTES
    device_files: tuple[str, ...] = DEFAULT_DEVICE_FILES
    unlisted_search_budget_processes: int = DEFAULT_BUDGET_PROCESSES
    unlisted_search_budget_milliseconds: float = DEFAULT_BUDGET_MILLISECONDS


@dataclass(frozen=True)
class AccountingSection:
    """`accounting:`: the idle threshold and the unlisted-holder search (one section,
    two consumers)."""

    idle: IdleAccounting = field(default_factory=IdleAccounting)
    unlisted: UnlistedSettings = field(default_factory=UnlistedSettings)


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
