"""The background scan loop: NVML holders -> classify() -> immutable Snapshot.

HTTP never waits for a scan: scrapes render the last Snapshot, which is
replaced atomically (one reference assignment) when a scan finishes. Nor for NSS: the
user names a scrape shows are resolved on the scan thread, once per scan, into the
Snapshot (`users`), so every series of one scrape names a uid alike.

Where the platform has a process table (Windows, gpuguard.host.platform) a scan reads it
(`table`) and judges it with classify_windows(); the Snapshot is the same, so the
metrics are too (`root_start_time`: the creation time in integer ms). NVML cannot size
processes under WDDM: there the `nvml` is the GPU seam's source sized by WDDM's figures
(gpuguard/gpu/vendors/__init__.py, platform_scanner).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from gpuguard.base.counters import COUNTERS, Counters
from gpuguard.base.periodic import Periodic
from gpuguard.config.accounting import (
    AccountingSection,
    Audit,
    IdleAccounting,
    Quotas,
    UnlistedSettings,
)
from gpuguard.engine.scan.accounting import Accounting, HolderFacts, account, balance
from gpuguard.engine.scan.attribution import attribute
from gpuguard.engine.scan.orphan_clock import OrphanClock
from gpuguard.engine.scan.unlisted import (
    SearchProgress,
    UnlistedHolder,
    UnseenOnGpu,
    search_holders,
    unattributed_gpus,
    unseen,
)
from gpuguard.gpu.reading import GpuReading
from gpuguard.gpu.source import GpuSource
from gpuguard.gpu.vendors import Choice, gpu_source
from gpuguard.host.fdsearch import FdSearch, device_files
from gpuguard.host.platform import PLATFORM, Platform, TableSource
from gpuguard.host.procfs import SCAN_THREAD_TURNS, ProcessView
from gpuguard.host.users import (
    DEFAULT_MAX_ENTRIES,
    FAILURE_TTL_SECONDS,
    USERS,
    UserNames,
    label_names,
)
from gpuguard.host.windows.tree import WinProcInfo, classify_windows
from gpuguard.orphans.chain import chain_set
from gpuguard.orphans.classify import classify
from gpuguard.orphans.idleness import IdleBook, UseSighting, observe, sightings_of
from gpuguard.orphans.process import ProcInfo, ProcUnreadable
from gpuguard.orphans.protections import ProcSource
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.verdicts import Tree
from gpuguard.orphans.vocabulary import Reason, Verdict

#: Its name from before the scan moved to the engine: log lines carry it (logger=...) and
#: operators filter on it (tests/pure/test_logger_names.py).
log = logging.getLogger("gpuguard.exporter.scanner")

#: The boot clock orphan ages count on: the platform's (CLOCK_BOOTTIME on Linux; Windows'
#: monotonic clock, which never steps either).
BOOT_CLOCK: Callable[[], float] = PLATFORM.boot_clock

#: Stages of gpuguard_scan_errors_total; fixed so every series exists from the start.
ERROR_STAGES = ("nvml_init", "nvml_device", "nvml_processes", "procfs", "scan")


def procfs_errors(trees: Sequence[Tree], *, host_pids: bool) -> list[tuple[str, str]]:
    """The `procfs` stage's errors of one scan: holders whose /proc could not be read, and
    holders /proc does not show unless it shows every pid NVML reports (`host_pids`):
    then they exited since NVML listed them, which is no error."""
    hidden = (Reason.UNREADABLE,) if host_pids else (Reason.NOT_VISIBLE, Reason.UNREADABLE)
    return [("procfs", f"holder {tree.root_pid}: {tree.evidence.detail}") for tree in trees
            if tree.verdict == Verdict.UNKNOWN and tree.reason in hidden]


class ScanSource(ProcSource, Protocol):
    """A process source that scans repeatedly: `begin_scan()` ends the last scan's reads."""

    def begin_scan(self) -> None: ...


@dataclass(frozen=True)
class OrphanInfo:
    """What the scanner adds to an orphan tree: how long, and how big."""

    first_seen: float  # wall-clock time of the first scan that saw it orphaned (display)
    age_seconds: float
    processes: int  # the root and all its descendants


@dataclass(frozen=True)
class Snapshot:
    taken_at: float  # wall-clock end of the scan
    duration_seconds: float
    reading: GpuReading
    trees: tuple[Tree, ...]
    orphans: dict[tuple[int, int], OrphanInfo] = field(default_factory=dict)
    proc_reads: int = 0  # /proc reads made by this scan
    errors: tuple[tuple[str, str], ...] = ()
    accounting: Accounting = field(default_factory=Accounting)
    #: uid -> user label (a name, or the decimal uid), resolved once by this scan for
    #: every process its series name: a scrape reads them and never asks NSS.
    users: Mapping[int, str] = field(default_factory=dict)
    #: Each holding's idle clock after this scan, and this scan's time on its clock.
    idle: IdleBook = field(default_factory=IdleBook)
    idle_at: float = 0.0

    def idle_seconds(self, pid: int, start_time: int, gpu_uuid: str) -> float | None:
        """Seconds since this holder last used an SM on that GPU (None: unknown)."""
        return self.idle.idle_seconds((pid, start_time, gpu_uuid), self.idle_at)

    def tree_idle_seconds(self, tree: Tree) -> float | None:
        """The least idle of a tree's holders; None when any holder's is unknown."""
        values = [self.idle_seconds(hv.chain[0].pid, hv.chain[0].start_time,
                                    hv.holder.gpu_uuid) if hv.chain else None
                  for hv in tree.holder_verdicts]
        if not values or any(v is None for v in values):
            return None
        return min(v for v in values if v is not None)
    #: Processes with a GPU device file open that NVML does not list (found only while
    #: some GPU's unattributed memory is above the threshold), and the search's progress.
    unlisted: tuple[UnlistedHolder, ...] = ()
    search: SearchProgress | None = None
    #: Per GPU, the pids NVML lists that this /proc does not show.
    unseen: tuple[UnseenOnGpu, ...] = ()

    def owner(self, info: ProcInfo) -> str:
        """owner() from this scan's names."""
        return owner(info, self.users)


def user_name(uid: int | None) -> str:
    """A uid's name for display outside the exporter (the console), or the bare uid
    when NSS has none: asks USERS (gpuguard/host/users.py), which never caches a failure.
    The exporter's own labels come from its scans' names (Snapshot.users)."""
    return USERS.label(uid)


def owner(info: ProcInfo, names: Mapping[int, str] | None = None) -> str:
    """The user label of a process: its Windows account as psutil gave it ("" when access
    was denied), else its uid's name from `names` (one scan's: a uid it lacks shows as
    its number, NSS is not asked), or without `names` user_name()."""
    if isinstance(info, WinProcInfo):
        return info.proc.username or ""
    if names is None:
        return user_name(info.uid)
    return names.get(info.uid, str(info.uid))


def labelled_uids(trees: Sequence[Tree]) -> list[int]:
    """The uids one scan's series name: each holder's and each orphan root's."""
    uids: list[int] = []
    for tree in trees:
        procs = [hv.chain[0] for hv in tree.holder_verdicts if hv.chain]
        procs += [tree.root] if tree.root is not None else []
        uids += [p.uid for p in procs if not isinstance(p, WinProcInfo)]
    return uids


class GroupCache:
    """A user's group names (primary and supplementary), from NSS (/etc/group), cached.

    Asked only for users who hold GPU memory, have no quota of their own and when some
    group has one; an answer is kept for `ttl` seconds, so a membership change shows
    within that time without a lookup per scan, for at most `max_entries` users (the
    oldest answer goes first). Asked on the scan thread, so each lookup
    is bounded as the user labels' are (users.label_groups): a lookup NSS does not answer
    in time counts as no groups (the user's own quota or "*" applies) for `failure_ttl`.
    """

    def __init__(self, ttl: float = 300.0, clock: Callable[[], float] = time.monotonic, *,
                 lookup: Callable[[str], frozenset[str]] | None = None,
                 failure_ttl: float = FAILURE_TTL_SECONDS,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        """`lookup`: user -> group names; by default the platform's (`group_lookup`: NSS,
        bounded, on Linux; Windows has no groups, so only per-user quotas and "*" apply
        there)."""
        self._ttl = ttl
        self._failure_ttl = failure_ttl
        self._max = max(1, max_entries)
        self._clock = clock
        self._lookup = lookup if lookup is not None else PLATFORM.group_lookup()
        #: user -> (asked at, group names, whether NSS answered)
        self._cache: dict[str, tuple[float, frozenset[str], bool]] = {}
        self.lookups = 0

    def __call__(self, user: str) -> frozenset[str]:
        now = self._clock()
        hit = self._cache.get(user)
        if hit is not None and now - hit[0] < (self._ttl if hit[2] else self._failure_ttl):
            return hit[1]
        self.lookups += 1
        try:
            groups, answered = self._lookup(user), True
        except TimeoutError:  # NSS did not answer in time (group_names answers the rest)
            groups, answered = frozenset(), False
        self._cache.pop(user, None)  # re-inserted last: the oldest answer goes first
        while len(self._cache) >= self._max:
            del self._cache[next(iter(self._cache))]
        self._cache[user] = (now, groups, answered)
        return groups


def holder_facts(trees: Sequence[Tree], view: ProcSource,
                 names: Mapping[int, str]) -> dict[int, HolderFacts]:
    """Each visible holder's comm, command line and container, from the identity cache.

    classify() has read the command line and cgroup of most holders already (rules 3
    and 5); a holder decided earlier (protected by its comm, say) costs one read of each
    the first time it is seen, and nothing after: no process but a holder is read.
    """
    facts: dict[int, HolderFacts] = {}
    for tree in trees:
        for hv in tree.holder_verdicts:
            me = hv.chain[0] if hv.chain else None
            if me is None or me.pid in facts:
                continue
            facts[me.pid] = HolderFacts(me.pid, me.start_time, owner(me, names), me.comm,
                                        _or_none(view.cmdline, me),
                                        attribute(_or_none(view.cgroup, me)))
    return facts


T = TypeVar("T")


def _or_none(read: Callable[[ProcInfo], T | None], info: ProcInfo) -> T | None:
    """One holder's fact for its series, None when it cannot be read or parsed: one
    process's text never costs the scan (its tree already reads unknown if it mattered)."""
    try:
        return read(info)
    except ProcUnreadable:
        return None


def holding_sightings(trees: Sequence[Tree], reading: GpuReading) -> list[UseSighting]:
    """Each visible holder on each GPU against that GPU's busy pids, for the idle clock."""
    busy = {gpu.uuid: gpu.busy_pids for gpu in reading.gpus}
    return sightings_of(((hv.holder.pid, hv.chain[0].start_time if hv.chain else None,
                          hv.holder.gpu_uuid)
                         for tree in trees for hv in tree.holder_verdicts), busy)


def windows_holder_facts(trees: Sequence[Tree]) -> dict[int, HolderFacts]:
    """holder_facts from the Windows table's rows (no cgroups: no container)."""
    facts: dict[int, HolderFacts] = {}
    for tree in trees:
        for hv in tree.holder_verdicts:
            me = hv.chain[0] if hv.chain else None
            if not isinstance(me, WinProcInfo) or me.pid in facts:
                continue
            cmdline = " ".join(me.proc.cmdline) if me.proc.readable else None
            facts[me.pid] = HolderFacts(me.pid, me.start_time, owner(me), me.comm, cmdline)
    return facts


def unlisted_holders(trees: Sequence[Tree], files: Mapping[int, str],
                     names: Mapping[int, str]) -> tuple[UnlistedHolder, ...]:
    """The search's finds (`files`: pid -> the device file it has open) as the classifier
    judged them, each its own verdict, like gpuguard_gpu_process_info's."""
    out: dict[int, UnlistedHolder] = {}
    for tree in trees:
        for hv in tree.holder_verdicts:
            me = hv.chain[0] if hv.chain else None
            if me is None or me.pid in out:
                continue  # gone since it was found: nothing to report
            h = hv.holder
            out[me.pid] = UnlistedHolder(
                me.pid, me.start_time, owner(me, names), me.comm, files.get(me.pid, ""),
                h.gpu_index if h.gpu_uuid else None, h.gpu_uuid or None,
                str(hv.verdict), str(hv.reason))
    return tuple(out[pid] for pid in sorted(out))


class Scanner:
    """Runs scans; keeps the orphan first-seen clock and cumulative scan counters."""

    def __init__(
        self,
        *,
        rules: Rules,
        nvml: GpuSource,
        view: ScanSource | None = None,
        counters: Counters = COUNTERS,
        interval: float = 5.0,
        clock: Callable[[], float] = time.time,
        boot_clock: Callable[[], float] = BOOT_CLOCK,
        quotas: Quotas | None = None,
        audit: Audit | None = None,
        groups: Callable[[str], frozenset[str]] | None = None,
        table: TableSource | None = None,
        users: UserNames | None = None,
        accounting: IdleAccounting | None = None,
        unlisted: UnlistedSettings | None = None,
        search: FdSearch | None = None,
        orphan_clock: OrphanClock | None = None,
        watch: Callable[[Mapping[int, int]], None] | None = None,
        host_pids: bool | None = None,
    ) -> None:
        """`table` given, scans judge its rows by the Windows rules (and `view` is not
        read): platform_scanner() gives it where the platform has one. `users`
        names uids for labels (default: label_names(), bounded lookups; never a
        decision's resolver). `watch` is given each complete scan's chain set, each pid
        charged to its holder's uid (the process-event listener's `watch`: those exits
        outlast its general ring, and wake early scans). `host_pids`: whether this process
        sees every pid NVML reports (the host's PID namespace, or Windows' table; default:
        the platform says), so that a listed holder missing from them has exited since."""
        self.rules = rules
        self.quotas = quotas if quotas is not None else Quotas()
        self.audit = audit if audit is not None else Audit()
        self.accounting = accounting if accounting is not None else IdleAccounting()
        self.groups = groups if groups is not None else GroupCache()
        self.users = users if users is not None else label_names()
        self.unlisted = unlisted if unlisted is not None else UnlistedSettings()
        self.search = search if search is not None else FdSearch(counters=counters)
        self.nvml = nvml
        self.counters = counters
        self.table = table
        self.view: ScanSource = view if view is not None else ProcessView(
            counters=counters, thread_turns=SCAN_THREAD_TURNS)
        self.interval = interval
        self.watch = watch
        #: NVML lists a process for a while after it exits: where /proc shows every pid
        #: NVML reports, a listed holder missing from it exited since (counted with the
        #: unseen processes, gpuguard_gpu_unseen_processes), not a scan error. Elsewhere
        #: (a child PID namespace, or cannot tell) it may be one this /proc cannot show:
        #: a `procfs` error, which asks whether the exporter is in the host's namespace.
        self.host_pids = (host_pids if host_pids is not None
                          else not PLATFORM.outside_host_pid_namespace())
        self._clock = clock
        #: Orphan ages count on the boot clock: a step of the wall clock cannot age a tree
        #: (and fire its alert early).
        self._boot_clock = boot_clock
        #: Each orphan root's first sighting (boot clock), on disk with --state-dir.
        self._orphan_clock = orphan_clock if orphan_clock is not None else OrphanClock()
        self._idle = IdleBook()  # each holding's idle clock, on the boot clock
        self._lock = threading.Lock()
        self._latest: Snapshot | None = None
        self.scans_total = 0
        self.errors_total = dict.fromkeys(ERROR_STAGES, 0)
        self._loop: Periodic | None = None
        self._settings_lock = threading.Lock()  # one scan sees one config, old or new

    def reconfigure(self, *, rules: Rules, quotas: Quotas, audit: Audit,
                    accounting: IdleAccounting | None = None,
                    unlisted: UnlistedSettings | None = None) -> None:
        """A reloaded config (SIGHUP): used whole from the next scan on."""
        with self._settings_lock:
            self.rules, self.quotas, self.audit = rules, quotas, audit
            if accounting is not None:
                self.accounting = accounting
            if unlisted is not None:
                self.unlisted = unlisted

    @property
    def latest(self) -> Snapshot | None:
        return self._latest

    def scan_once(self) -> Snapshot:
        start = time.perf_counter()
        with self._settings_lock:
            rules, quotas, audit, unlisted = self.rules, self.quotas, self.audit, self.unlisted
            settings = self.accounting
        reads_before = self.counters.proc_reads()
        errors: list[tuple[str, str]] = []
        try:
            reading = self.nvml.read()
        except Exception as exc:  # Nvml.read reports failures itself; this is the last net
            log.exception("NVML read failed")
            reading = GpuReading(False, None, (), (), (("scan", f"NVML: {exc}"),))
        errors.extend(reading.errors)
        trees: list[Tree] = []
        orphans: dict[tuple[int, int], OrphanInfo] = {}
        accounting = Accounting()
        names: dict[int, str] = {}
        found: list[Tree] = []
        files: dict[int, str] = {}
        search: SearchProgress | None = None
        now = self._clock()
        boot_now = self._boot_clock()
        try:
            trees = self._classify(reading, rules)
            self._publish_chains(reading, trees)
            errors.extend(procfs_errors(trees, host_pids=self.host_pids))
            orphaned = [(t.root.identity, t) for t in trees
                        if t.verdict == Verdict.ORPHAN and t.root is not None]
            # Kept across restarts (--state-dir); a scan NVML could not finish forgets no one.
            ages = self._orphan_clock.ages([key for key, _ in orphaned], boot_now,
                                           complete=reading.up and not reading.errors)
            for key, tree in orphaned:
                orphans[key] = OrphanInfo(now - ages[key], ages[key], len(tree.members))
            # A scan after a stall restarts every idle clock (orphans/idleness.observe).
            self._idle = observe(self._idle, holding_sightings(trees, reading), boot_now,
                                 max_gap=3 * self.interval)
            previous = self._latest.accounting.hot if self._latest is not None else {}
            found, files, search = self._search_unlisted(reading, unlisted, rules)
            names = self.users.labels(labelled_uids(trees) + labelled_uids(found))
            facts = (holder_facts(trees, self.view, names) if self.table is None
                     else windows_holder_facts(trees))
            idle = {(hv.holder.pid, hv.holder.gpu_uuid): self._idle.idle_seconds(
                        (hv.holder.pid, hv.chain[0].start_time, hv.holder.gpu_uuid), boot_now)
                    for tree in trees for hv in tree.holder_verdicts if hv.chain}
            accounting = account(reading.gpus, reading.holders, facts,
                                 quotas=quotas, audit=audit, groups=self.groups,
                                 hot=previous, now=now, idle=idle, settings=settings)
        except Exception as exc:  # a scan bug must not kill the loop; it is counted instead
            log.exception("scan failed")
            errors.append(("scan", f"{type(exc).__name__}: {exc}"))
        snapshot = Snapshot(
            taken_at=self._clock(),
            duration_seconds=time.perf_counter() - start,
            reading=reading,
            trees=tuple(trees),
            orphans=orphans,
            proc_reads=self.counters.proc_reads() - reads_before,
            errors=tuple(errors),
            accounting=accounting,
            users=names,
            idle=self._idle,
            idle_at=boot_now,
            unlisted=unlisted_holders(found, files, names),
            search=search,
            unseen=unseen(reading.gpus, trees),
        )
        with self._lock:
            self.scans_total += 1
            for stage, _ in errors:
                self.errors_total[stage] = self.errors_total.get(stage, 0) + 1
            self._latest = snapshot
        return snapshot

    def _classify(self, reading: GpuReading, rules: Rules) -> list[Tree]:
        """The holders judged: over /proc, or over one read of the Windows table."""
        if self.table is None:
            self.view.begin_scan()
            return classify(reading.holders, self.view, rules)
        return classify_windows(self.table(), reading.holders, rules)

    def _publish_chains(self, reading: GpuReading, trees: Sequence[Tree]) -> None:
        """Hand `watch` the pids on this scan's holders' chains and their session leaders
        (the holders themselves included: their exits change the trees), each charged to
        its holder's uid; only from a complete reading (one that missed a GPU would stop
        watching its launchers), so an incomplete one keeps the last set."""
        if self.watch is not None and reading.up and not reading.errors:
            self.watch(chain_set(hv.chain for tree in trees for hv in tree.holder_verdicts))

    def _search_unlisted(self, reading: GpuReading, settings: UnlistedSettings,
                         rules: Rules) -> tuple[list[Tree], dict[int, str], SearchProgress]:
        """One bounded step of the search for holders NVML does not list, judged by the
        classifier like NVML's holders (their trees are kept apart: never an orphan
        series, never an alert). Only while some GPU's unattributed memory is above the
        threshold: otherwise the search is forgotten and nothing is read."""
        wanted = unattributed_gpus(balance(reading.gpus, reading.holders),
                                   settings.unlisted_threshold_bytes)
        if not wanted or self.table is not None:  # Windows: no /proc to search
            self.search.reset()
            return [], {}, SearchProgress(False, 0, 0, 0, 0, 0)
        files = device_files(settings.device_files)
        step = self.search.step(files,
                                max_processes=settings.unlisted_search_budget_processes,
                                max_seconds=settings.unlisted_search_budget_milliseconds / 1000,
                                identify=self._start_time)
        rdevs = {f.path: f.rdev for f in files}
        # The node's minor number, as the read's `device` label names it ("nvidiaN").
        minors = {g.uuid: int(g.device[len("nvidia"):]) for g in reading.gpus if g.device}
        # A pid reused since it was found names someone else: left out until looked at again.
        found = {pid: path for pid, path in step.found.items()
                 if (t := step.started.get(pid)) is not None and t == self._start_time(pid)}
        holders = search_holders(found, reading.holders, rdevs, reading.gpus, minors)
        trees = classify(holders, self.view, rules) if holders else []
        listed = {h.pid for h in reading.holders}
        return trees, found, SearchProgress(True, step.passes, step.examined, step.unreadable,
                                     len([p for p in step.found if p not in listed]),
                                     len(holders))

    def _start_time(self, pid: int) -> int | None:
        """A pid's start time, from this scan's stat reads (one read a pid a scan)."""
        info = self.view.stat(pid)
        return None if info is None else info.start_time

    def counts(self) -> tuple[int, dict[str, int]]:
        with self._lock:
            return self.scans_total, dict(self.errors_total)

    # -- background loop -------------------------------------------------------------

    def early_scans(self) -> int:
        """Scans run early since start, each woken by an exit on a holder's chain."""
        return self._loop.early if self._loop is not None else 0

    def wake(self) -> None:
        """An exit of a process the last scan found on a GPU holder's chain: scan early,
        debounced and bounded (gpuguard/base/periodic.py), so its orphan, or its holder's end,
        is on /metrics within a few tens of ms, not at the next interval. Never blocks:
        the process-event reader calls it (ProcessEvents.on_watched_exit)."""
        if self._loop is not None:
            self._loop.run_soon()

    def start(self) -> None:
        self._loop = Periodic("gpuguard-scanner", self.interval, self.scan_once)
        self._loop.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None:
            self._loop.stop(timeout)

    def alive(self) -> bool:
        return self._loop is not None and self._loop.alive()


def platform_scanner(platform: Platform, *, rules: Rules, quotas: Quotas, audit: Audit,
                     accounting: AccountingSection | None = None, interval: float = 5.0,
                     view: Callable[[], ScanSource] | None = None,
                     orphan_clock: OrphanClock | None = None,
                     watch: Callable[[Mapping[int, int]], None] | None = None,
                     gpus: Choice | None = None) -> Scanner:
    """The scanner of `platform`: its GPU source (gpuguard/gpu/vendors/__init__.py), boot clock
    and groups, over its process table where it has one (Windows: psutil's, judged by the
    Windows rules), else over the /proc view `view` builds (called only then); `watch`:
    see Scanner; `gpus`: the GPU back-ends (None: those found). The exporter and `gpuguard
    status` both build theirs here."""
    def over_procfs() -> tuple[ScanSource | None, TableSource | None]:
        return (view() if view is not None else None), None

    def over_table(read: TableSource) -> tuple[ScanSource | None, TableSource | None]:
        return None, read

    scan_view, table = platform.processes(procfs=over_procfs, table=over_table)
    return Scanner(rules=rules, nvml=gpu_source(platform, COUNTERS, choice=gpus), interval=interval,
                   view=scan_view, table=table, boot_clock=platform.boot_clock,
                   groups=GroupCache(lookup=platform.group_lookup()), quotas=quotas, audit=audit,
                   accounting=accounting.idle if accounting is not None else None,
                   unlisted=accounting.unlisted if accounting is not None else None,
                   orphan_clock=orphan_clock, watch=watch,
                   host_pids=not platform.outside_host_pid_namespace())
