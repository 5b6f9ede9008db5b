"""GPU accounting beyond orphans: per-user sums and quotas, suspect processes, and the
memory no listed process accounts for. Pure: the scanner gathers the facts (NVML's
reading, each holder's comm, command line and cgroup from the identity cache) and
these functions turn them into what the exporter publishes. Nothing here leads to a
reap: the remediator never reads any of it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuguard.exporter.attribution import Attribution
from gpuguard.host.counters import COUNTERS
from gpuguard.host.nvml import GpuSample
from gpuguard.orphans.process import Holder
from gpuguard.orphans.rules_config import compile_protect

#: Quota units: binary (KiB = 1024 B) and decimal (KB = 1000 B), spelled exactly so.
UNITS: dict[str, int] = {
    "B": 1,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}
_SIZE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[A-Za-z]+)\s*$")

#: The `users:` key that holds everyone's default quota.
EVERYONE = "*"
#: What uid 0 is called: "root", or the bare uid where the exporter's passwd lacks it.
#: The default quota never applies to it (see resolve_quota).
SUPERUSER = frozenset({"root", "0"})

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

#: GpuBalance.why_unknown when the driver's used figure includes its reserved memory.
WHY_V1_MEMORY = ("used memory includes the driver's reserved memory "
                 "(driver without nvmlDeviceGetMemoryInfo_v2)")

#: The kernel keeps a process's comm to 15 characters (TASK_COMM_LEN 16, with the NUL).
COMM_LENGTH = 15


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


def resolve_quota(user: str, groups: Callable[[str], Iterable[str]], quotas: Quotas) -> int | None:
    """One user's quota: their own entry, else the largest of their groups', else "*"
    (except for root).

    A named user's entry wins even when smaller than a group's (naming a person is the
    most specific thing a config can say). Among groups the largest wins: a quota grants
    memory, so belonging to one more group never takes any away. `groups` is asked only
    when some group has a quota and the user has no entry of their own. "*" is for
    people: most GPU containers run as uid 0, so "root" sums every container on a node
    and would be over any per-person default as soon as the node is busy; root has a
    quota only where the config names it (or one of its groups).
    """
    by_user = dict(quotas.users)
    if user in by_user:
        return by_user[user]
    if quotas.groups:
        by_group = dict(quotas.groups)
        granted = [by_group[g] for g in groups(user) if g in by_group]
        if granted:
            return max(granted)
    return None if user in SUPERUSER else by_user.get(EVERYONE)


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
    _compiled: tuple[tuple[str, Any], ...] = field(default=(), compare=False, repr=False)
    _names: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    _comms: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        compiled = tuple((p, compile_protect(p)) for p in self.suspect_patterns)
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


@functools.lru_cache(maxsize=16384)
def _suspect_hit(pattern: Any, text: str) -> bool:
    """The protect patterns' matcher (RE2, linear time), cached by text like theirs; its
    time shows under the same callsite."""
    with COUNTERS.track("protect_match"):
        return pattern.search(text) is not None


@dataclass(frozen=True)
class HolderFacts:
    """What the scan knows of one GPU-holding process (from the identity cache)."""

    pid: int
    start_time: int
    user: str
    comm: str
    cmdline: str | None  # None when unreadable
    attribution: Attribution = Attribution()

    @property
    def identity(self) -> tuple[int, int]:
        return (self.pid, self.start_time)


#: `accounting.idle_after_seconds`' default: an hour without using an SM. A notebook
#: between cells or a job between epochs is idle for minutes; an hour is memory held for
#: nothing that someone should hear about.
DEFAULT_IDLE_AFTER_SECONDS = 3600.0


@dataclass(frozen=True)
class IdleAccounting:
    """The `accounting:` section: when a holder's memory counts as idle."""

    idle_after_seconds: float = DEFAULT_IDLE_AFTER_SECONDS


#: (pid, GPU uuid) -> seconds since that holder last used an SM there (None: unknown).
IdleTimes = Mapping[tuple[int, str], float | None]


@dataclass(frozen=True)
class UserUsage:
    user: str
    used_bytes: int  # every holding of the user's processes on every GPU (unknown ones as 0)
    quota_bytes: int | None  # None: no quota applies
    #: Of used_bytes, what holders idle for at least accounting.idle_after_seconds hold
    #: (a holder whose idleness is unknown counts as not idle).
    idle_bytes: int = 0


@dataclass(frozen=True)
class Suspect:
    pid: int
    start_time: int
    user: str
    comm: str
    why: str  # WHY_COMM, WHY_CMDLINE or WHY_UTILIZATION
    detail: str


@dataclass(frozen=True)
class GpuBalance:
    """One GPU's reconciliation: used memory against what its listed processes hold."""

    index: int
    uuid: str
    used_bytes: int | None  # the driver's figure; with reserved memory where it lacks _v2
    processes_bytes: int  # sum of the figures the driver gave per process
    processes: int
    unattributed_bytes: int | None  # None: cannot be computed (why_unknown says why)
    why_unknown: str | None = None


@dataclass(frozen=True)
class HotGpu:
    """A GPU seen at >= the sustained ratio on every scan since `since`, one holder."""

    holder: tuple[int, int]  # (pid, start_time) of its only holder
    since: float


@dataclass(frozen=True)
class Accounting:
    users: tuple[UserUsage, ...] = ()
    suspects: tuple[Suspect, ...] = ()
    gpus: tuple[GpuBalance, ...] = ()
    attribution: Mapping[int, Attribution] = field(default_factory=dict)  # by holder pid
    hot: Mapping[str, HotGpu] = field(default_factory=dict)  # by GPU uuid, for the next scan

    def suspect_of(self, pid: int) -> Suspect | None:
        return next((s for s in self.suspects if s.pid == pid), None)


def user_usage(holders: Sequence[Holder], facts: Mapping[int, HolderFacts],
               quotas: Quotas, groups: Callable[[str], Iterable[str]],
               idle: IdleTimes | None = None,
               idle_after: float = DEFAULT_IDLE_AFTER_SECONDS) -> tuple[UserUsage, ...]:
    """Per user, the sum over their processes' holdings, and the part of it held by
    holders idle for `idle_after` seconds or more; holders not in /proc count for
    nobody. A holding the driver cannot size counts 0 (the sum is then a lower bound)."""
    totals: dict[str, int] = {}
    idle_totals: dict[str, int] = {}
    for holder in holders:
        fact = facts.get(holder.pid)
        if fact is None or not fact.user:
            continue
        totals[fact.user] = totals.get(fact.user, 0) + (holder.used_bytes or 0)
        seconds = (idle or {}).get((holder.pid, holder.gpu_uuid))
        if seconds is not None and seconds >= idle_after:
            idle_totals[fact.user] = idle_totals.get(fact.user, 0) + (holder.used_bytes or 0)
    return tuple(UserUsage(user, used, resolve_quota(user, groups, quotas) if
                           quotas.configured else None, idle_totals.get(user, 0))
                 for user, used in sorted(totals.items()))


def balance(gpus: Sequence[GpuSample], holders: Sequence[Holder]) -> tuple[GpuBalance, ...]:
    """Used memory minus what the listed processes hold, per GPU.

    Unknown (None), never 0, when the figure would be a guess: used memory unavailable
    or including the driver's reserved memory (no _v2 call: reserved memory, which no
    process holds, would read as unattributed), the process list unavailable, or one
    process whose usage the driver cannot give (its share is unknown, so the rest is
    too). Below zero reads 0: the per-process
    figures can add up to more than used (MIG, the driver's own rounding), and memory
    that no process holds cannot be negative.
    """
    out = []
    for gpu in gpus:
        mine = [h for h in holders if h.gpu_uuid == gpu.uuid]
        known = sum(h.used_bytes or 0 for h in mine)
        blind = [h.pid for h in mine if h.used_bytes is None]
        why: str | None = None
        if gpu.memory_used_bytes is None:
            why = "used memory unavailable"
        elif not gpu.used_excludes_reserved:
            why = WHY_V1_MEMORY
        elif not gpu.processes_listed:
            why = "process list unavailable"
        elif blind:
            why = f"usage of pid {blind[0]} unavailable"
        unattributed = None if why else max(0, (gpu.memory_used_bytes or 0) - known)
        out.append(GpuBalance(gpu.index, gpu.uuid, gpu.memory_used_bytes, known,
                              len({h.pid for h in mine}), unattributed, why))
    return tuple(out)


def track_hot(previous: Mapping[str, HotGpu], gpus: Sequence[GpuSample],
              holders: Sequence[Holder], facts: Mapping[int, HolderFacts],
              rule: SustainedUtilization | None, now: float) -> dict[str, HotGpu]:
    """GPUs busy at >= rule.ratio on this scan with one holder, and since when.

    The clock restarts when a scan sees the GPU below the ratio, with no holder or more
    than one, or with a different process as its holder. Utilisation is sampled once per
    scan: a dip between two scans is not seen.
    """
    if rule is None:
        return {}
    out: dict[str, HotGpu] = {}
    for gpu in gpus:
        if gpu.utilization_ratio is None or gpu.utilization_ratio < rule.ratio:
            continue
        pids = {h.pid for h in holders if h.gpu_uuid == gpu.uuid}
        if len(pids) != 1:
            continue
        fact = facts.get(next(iter(pids)))
        if fact is None:
            continue
        before = previous.get(gpu.uuid)
        since = before.since if before is not None and before.holder == fact.identity else now
        out[gpu.uuid] = HotGpu(fact.identity, since)
    return out


def suspects(facts: Mapping[int, HolderFacts], audit: Audit, hot: Mapping[str, HotGpu],
             gpus: Sequence[GpuSample], now: float) -> tuple[Suspect, ...]:
    """Holders whose comm or command line matches a suspect name or pattern, then sole
    holders of a GPU kept busy for the sustained window; one entry per process, first
    reason wins."""
    found: dict[int, Suspect] = {}
    for fact in sorted(facts.values(), key=lambda f: f.pid):
        hit = audit.suspect(fact.comm, fact.cmdline)
        if hit is not None:
            why, matched = hit
            what = f"comm {fact.comm!r}" if why == WHY_COMM else "command line"
            found[fact.pid] = Suspect(fact.pid, fact.start_time, fact.user, fact.comm, why,
                                      f"{what} matches {matched}")
    rule = audit.sustained_utilization
    by_identity = {f.identity: f for f in facts.values()}
    index = {g.uuid: g.index for g in gpus}
    for uuid, state in sorted(hot.items()):
        busy = by_identity.get(state.holder)
        if rule is None or busy is None or busy.pid in found:
            continue
        if now - state.since >= rule.for_seconds:
            found[busy.pid] = Suspect(
                busy.pid, busy.start_time, busy.user, busy.comm, WHY_UTILIZATION,
                f"only holder of GPU {index.get(uuid, '?')}, at >= {rule.ratio:.0%} "
                f"utilization on every scan for {now - state.since:.0f}s")
    return tuple(found[pid] for pid in sorted(found))


def account(gpus: Sequence[GpuSample], holders: Sequence[Holder],
            facts: Mapping[int, HolderFacts], *, quotas: Quotas, audit: Audit,
            groups: Callable[[str], Iterable[str]], hot: Mapping[str, HotGpu],
            now: float, idle: IdleTimes | None = None,
            settings: IdleAccounting = IdleAccounting()) -> Accounting:
    """Everything the accounting series say, from one scan's facts."""
    hot_now = track_hot(hot, gpus, holders, facts, audit.sustained_utilization, now)
    return Accounting(
        users=user_usage(holders, facts, quotas, groups, idle, settings.idle_after_seconds),
        suspects=suspects(facts, audit, hot_now, gpus, now),
        gpus=balance(gpus, holders),
        attribution={pid: fact.attribution for pid, fact in facts.items()},
        hot=hot_now,
    )
