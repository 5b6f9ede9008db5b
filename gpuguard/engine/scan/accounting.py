"""GPU accounting beyond orphans: per-user sums and quotas, suspect processes, and the
memory no listed process accounts for. Pure: the scanner gathers the facts (NVML's
reading, each holder's comm, command line and cgroup from the identity cache) and
these functions turn them into what the exporter publishes. Nothing here leads to a
reap: the remediator never reads any of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuguard.config.accounting import (
    DEFAULT_IDLE_AFTER_SECONDS,
    EVERYONE,
    WHY_COMM,
    WHY_UTILIZATION,
    Audit,
    IdleAccounting,
    Quotas,
    SustainedUtilization,
)
from gpuguard.engine.scan.attribution import Attribution
from gpuguard.gpu.reading import GpuSample
from gpuguard.orphans.process import Holder

#: What uid 0 is called: "root", or the bare uid where the exporter's passwd lacks it.
#: The default quota never applies to it (see resolve_quota).
SUPERUSER = frozenset({"root", "0"})

#: GpuBalance.why_unknown when the driver's used figure includes its reserved memory.
WHY_V1_MEMORY = ("used memory includes the driver's reserved memory "
                 "(driver without nvmlDeviceGetMemoryInfo_v2)")


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
            settings: IdleAccounting | None = None) -> Accounting:
    """Everything the accounting series say, from one scan's facts."""
    settings = settings if settings is not None else IdleAccounting()
    hot_now = track_hot(hot, gpus, holders, facts, audit.sustained_utilization, now)
    return Accounting(
        users=user_usage(holders, facts, quotas, groups, idle, settings.idle_after_seconds),
        suspects=suspects(facts, audit, hot_now, gpus, now),
        gpus=balance(gpus, holders),
        attribution={pid: fact.attribution for pid, fact in facts.items()},
        hot=hot_now,
    )
