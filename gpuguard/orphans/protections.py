"""What keeps a process from a reap (rules 3 and 4), defined once for the chain rules and
the member judgement; and `ProcSource`, how the classifier asks about processes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpuguard.orphans.process import ProcInfo, ProcStatus, Truncated
from gpuguard.orphans.rules_config import KEEP_MARK, Rules
from gpuguard.orphans.vocabulary import Reason, Rule


class ExitEvent(Protocol):
    """What the kernel reported about one process's exit (gpuguard.host.events.exit_store.Exit)."""

    @property
    def signal(self) -> int | None: ...
    @property
    def status(self) -> int | None: ...
    @property
    def at(self) -> float: ...


class ProcSource(Protocol):
    """What the classifier may ask about processes. Implementations do the I/O."""

    def stat(self, pid: int) -> ProcInfo | None: ...
    def fresh_stat(self, pid: int) -> ProcInfo | None: ...
    def children(self, pid: int) -> tuple[int, ...] | None: ...
    def thread_states(self, pid: int) -> tuple[str, ...] | None: ...
    def cmdline(self, info: ProcInfo) -> str | None: ...
    def cgroup(self, info: ProcInfo) -> tuple[str, ...] | None: ...
    def status(self, info: ProcInfo) -> ProcStatus | None: ...
    def keep_marker(self, info: ProcInfo) -> bool | None: ...
    def run_launcher(self, info: ProcInfo) -> tuple[int, int] | None: ...
    def registered(self, kind: str, info: ProcInfo, directory: str) -> bool | None: ...
    def memo(self, info: ProcInfo, key: object, compute: Callable[[], Any]) -> Any: ...
    def daemon_io(self, info: ProcInfo) -> bool | None: ...
    def own_nspid_depth(self) -> int: ...
    def launcher_exit(self, pid: int, after_start_time: int) -> ExitEvent | None: ...
    def listening(self) -> bool: ...
    def recall_launcher(self, root: ProcInfo, reason: str, detail: str, *,
                        recorded: bool) -> tuple[str, str]: ...


def comm_protect(info: ProcInfo, view: ProcSource, rules: Rules) -> bool:
    """Rule 3 on the comm (nothing to read: it came with the stat)."""
    return rules.protects(info.comm)


def cmdline_protect(info: ProcInfo, view: ProcSource, rules: Rules) -> bool | None:
    """Rule 3 on the command line: True when a protect pattern matches it; None when it
    cannot be read, or was cut at the read cap and nothing matched in what was read (the
    rest may hold the match). Cached per process identity, never by the text."""
    cmd = view.cmdline(info)
    if cmd is None:
        return None
    hit = bool(cmd) and view.memo(info, ("protect-cmdline", rules.protect),
                                  lambda: rules.protects(cmd))
    if hit:
        return True
    return None if isinstance(cmd, Truncated) else False


def sighup_ignored(info: ProcInfo, view: ProcSource, rules: Rules) -> bool | None:
    """Rule 4's deliberate detachment (nohup); None when the status cannot be read."""
    status = view.status(info)
    return None if status is None else status.sighup_ignored


def keep_mark(info: ProcInfo, view: ProcSource, rules: Rules) -> bool | None:
    """Rule 4's keep marker: GPUGUARD_KEEP=1 in the environment; None when unreadable."""
    return view.keep_marker(info)


def keep_registration(info: ProcInfo, view: ProcSource, rules: Rules) -> bool | None:
    """Rule 4's keep marker as a registration (`gpuguard keep PID`); None when it cannot
    be read. Its own protection, so that one that cannot be read is named as itself,
    never as an unreadable environment."""
    return view.registered(KEEP_MARK, info, rules.marks_dir)


@dataclass(frozen=True)
class Protection:
    """One thing that protects a process, and how each judgement says it."""

    rule: Rule
    reason: Reason
    #: True protects; None: could not be read (never for one that reads nothing).
    test: Callable[[ProcInfo, ProcSource, Rules], bool | None]
    reads: bool  # whether `test` reads /proc (the comm came with the stat)
    chain_detail: str  # str.format with pid and comm: a chain rule's detail
    member_detail: str  # what the member judgement says the member does
    source: str = ""  # the /proc file `test` reads, named when it cannot be ("": none)
    #: appended to a member's unknown detail when it cannot be read (with no `source`:
    #: what could not be read, said whole)
    unread_note: str = ""

    def detail(self, info: ProcInfo) -> str:
        return self.chain_detail.format(pid=info.pid, comm=info.comm)


BY_COMM = Protection(Rule.PROTECT, Reason.PROTECT_PATTERN, comm_protect, False,
                     "{pid} comm {comm!r} matches protect", "matches protect by comm")
BY_CMDLINE = Protection(
    Rule.PROTECT, Reason.PROTECT_PATTERN, cmdline_protect, True,
    "{pid} command line matches protect", "matches protect by command line", "cmdline",
    " (cmdline: unreadable, or longer than the read cap with no protect pattern "
    "matching what was read)")
IGNORES_SIGHUP = Protection(Rule.DETACH, Reason.IGNORES_SIGHUP, sighup_ignored, True,
                            "{pid} ignores SIGHUP (nohup)", "ignores SIGHUP (nohup)", "status")
KEEP_MARKER = Protection(
    Rule.DETACH, Reason.KEEP_MARKER, keep_mark, True,
    "{pid} is marked to keep (GPUGUARD_KEEP=1 in its environment)",
    "is marked to keep (GPUGUARD_KEEP=1)", "environ",
    " (environ: unreadable, or no KEY=VALUE entry left: a process that overwrote its "
    "environment, as setproctitle does, may have held GPUGUARD_KEEP=1; `gpuguard "
    "keep PID` marks it where it cannot be erased)")
KEEP_REGISTRATION = Protection(
    Rule.DETACH, Reason.KEEP_MARKER, keep_registration, True,
    "{pid} is registered to keep (`gpuguard keep`)", "is registered to keep (`gpuguard keep`)",
    "", "its `gpuguard keep` registration in classify.marks_dir (an I/O error, or a "
    "directory that cannot be searched)")
#: The keep marker's two forms: either one protects.
KEEP = (KEEP_MARKER, KEEP_REGISTRATION)
#: Every protection, in the order a member's are read and decide.
PROTECTIONS = (BY_COMM, BY_CMDLINE, IGNORES_SIGHUP, *KEEP)


def protection(info: ProcInfo, view: ProcSource, rules: Rules,
               among: Sequence[Protection] = PROTECTIONS,
               ) -> tuple[Protection | None, tuple[Protection, ...]]:
    """The first of `among` that protects `info`, else those that could not be read.

    One that reads nothing decides before anything is read; the rest are all read, and
    what is positively read protects, whatever else could not be read.
    """
    for free in (p for p in among if not p.reads):
        if free.test(info, view, rules):
            return free, ()
    read = [(p, p.test(info, view, rules)) for p in among if p.reads]
    hit = next((p for p, value in read if value), None)
    if hit is not None:
        return hit, ()
    return None, tuple(p for p, value in read if value is None)
