"""What a teardown did, said on stderr: one line for people, one audit line.

`gpuguard run` runs as the user, with no access to the remediator's audit log: its audit
line (`gpuguard run: audit {JSON}`) is the teardown's record, naming each process it
signalled or kept by identity (pid, start time), comm and owner, with what became of it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuguard.engine.decision.tree import Member
from gpuguard.engine.reap.outcome import Kept, Outcome, ReapResult, SignalResult
from gpuguard.launch.teardown.reaping import REAP_DEADLINE_SECONDS
from gpuguard.orphans.process import ProcInfo
from gpuguard.orphans.vocabulary import DecisionReason

#: Rounds of reaps go on while dying members hand the launcher new children; no round
#: starts once this long has passed since the first one ended (what is left is reported).
MORE_ROUNDS_SECONDS = 60.0
#: How the audit line begins; a JSON object follows.
AUDIT = "gpuguard run: audit "
#: Why a member was not signalled although the teardown would have: its SIGSTOP refused.
STOP_REFUSED = "the kernel refused the launcher's SIGSTOP"

Identity = tuple[int, int]  # (pid, start time)


@dataclass(frozen=True)
class Teardown:
    """What the reaps of one teardown did, for its stderr lines."""

    killed: tuple[Member, ...] = ()
    survivors: tuple[Member, ...] = ()  # survived SIGKILL
    refused: tuple[Member, ...] = ()  # the kernel refused their SIGSTOP: left untouched
    exited: tuple[Member, ...] = ()  # refused so, and gone by the teardown's last read
    problems: tuple[str, ...] = ()  # reaps that refused or failed, and why; each once
    kept: tuple[Kept, ...] = ()  # marked to keep: let go of with what is below them
    #: The signals sent to each process, in order (SIGCONT too: what a freeze owed).
    signals: Mapping[Identity, tuple[str, ...]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.killed or self.survivors or self.refused or self.exited
                    or self.problems or self.kept)


def launcher_words(detail: str) -> str:
    """The reaper's details are written for the remediator; the launcher's line names
    itself and its own deadline instead."""
    return (detail.replace("remediate.worker_timeout_seconds",
                           f"the launcher's {REAP_DEADLINE_SECONDS:g} s reap deadline")
            .replace("the remediator", "the launcher"))


def _sent(results: Sequence[ReapResult]) -> dict[Identity, tuple[str, ...]]:
    """The signals each process was sent, by identity (a pid is one process per reap)."""
    sent: dict[Identity, tuple[str, ...]] = {}
    for result in results:
        who = {m.pid: (m.pid, m.start_time)
               for m in (*result.members, *result.released, *(k.member for k in result.kept))}
        for record in result.signals:
            if record.result == SignalResult.SENT and record.pid in who:
                key = who[record.pid]
                sent[key] = (*sent.get(key, ()), record.signal)
    return sent


def summarise(results: Sequence[ReapResult], left: Sequence[ProcInfo],
              rounds: int = 0, ended: frozenset[Identity] = frozenset()) -> Teardown:
    """`left`: children still below the launcher after the last of `rounds` rounds, not
    accounted for. `ended`: the (pid, start time) of members let go of that no longer
    ran at the last read (gone, by whatever hand): not survivors."""
    killed: list[Member] = []
    survivors: list[Member] = []
    refused: list[Member] = []
    kept: list[Kept] = []
    problems: list[str] = []
    for result in results:
        refused += result.released
        kept += result.kept
        if result.outcome in (Outcome.REAPED, Outcome.FAILED):
            gone = set(result.survivors)
            killed += [m for m in result.members if m.pid not in gone]
            survivors += [m for m in result.members if m.pid in gone]
    # A member let go of in one round and reaped by a later one (it dropped root) is
    # reported as what happened to it last; one let go of again by its retry (the
    # kernel allowed signal 0 but refused SIGSTOP) is named once; so is one kept.
    seen = {(m.pid, m.start_time) for m in (*killed, *survivors)}
    kept_once: list[Kept] = []
    for mark in kept:
        if (mark.member.pid, mark.member.start_time) not in seen:
            seen.add((mark.member.pid, mark.member.start_time))
            kept_once.append(mark)
    once: list[Member] = []
    for member in refused:
        if (member.pid, member.start_time) not in seen:
            seen.add((member.pid, member.start_time))
            once.append(member)
    exited = [m for m in once if (m.pid, m.start_time) in ended]
    refused = [m for m in once if (m.pid, m.start_time) not in ended]
    for result in results:
        if (result.outcome not in (Outcome.REAPED, Outcome.FAILED)
                and result.reason not in (DecisionReason.ROOT_GONE,  # exited: fine
                                          DecisionReason.ROOT_REPLACED)):
            problem = f"{result.reason}: {launcher_words(result.detail)}"
            if problem not in problems:
                problems.append(problem)
    if left:
        problems.append(f"{len(left)} process(es) still below the launcher after "
                        f"{rounds} rounds (the tree kept handing it new children for "
                        f"{MORE_ROUNDS_SECONDS:g} s)")
    return Teardown(tuple(killed), tuple(survivors), tuple(refused), tuple(exited),
                    tuple(problems), tuple(kept_once), _sent(results))


def _names(members: Sequence[Member]) -> str:
    return ", ".join(f"{m.pid} ({m.comm})" for m in members)


def teardown_line(why: str, teardown: Teardown) -> str | None:
    """The teardown's line for people; None when there was nothing to reap or keep."""
    if teardown.empty:
        return None
    parts = [f"gpuguard run: {why}: reaped {len(teardown.killed)} process(es)"
             + (f": {_names(teardown.killed)}" if teardown.killed else "")]
    if teardown.survivors:
        parts.append(f"{len(teardown.survivors)} survived SIGKILL: {_names(teardown.survivors)}")
    if teardown.refused:
        parts.append(f"{len(teardown.refused)} survived, not signalled (the kernel refused "
                     "the launcher's SIGSTOP: another user's process, such as a setuid-root "
                     f"program; needs root or CAP_KILL): {_names(teardown.refused)}")
    if teardown.exited:
        parts.append(f"{len(teardown.exited)} not signalled (the kernel refused the "
                     f"launcher's SIGSTOP), gone by the end: {_names(teardown.exited)}")
    parts += teardown.problems
    if teardown.kept:
        they = "it" if len(teardown.kept) == 1 else "they"
        parts.append(f"kept {len(teardown.kept)} with what {they} started: "
                     + ", ".join(f"{k.member.pid} ({k.member.comm}) {k.why}"
                                 for k in teardown.kept))
    return "; ".join(parts)


def audit_line(why: str, teardown: Teardown, launcher: Identity) -> str | None:
    """The teardown's audit line: every process it signalled or kept, by identity, with
    its outcome (killed, survived-sigkill, not-signalled, gone, kept) and the signals it
    was sent; None when there was nothing to reap or keep."""
    if teardown.empty:
        return None

    def entry(member: Member, outcome: str, because: str = "") -> dict[str, object]:
        found: dict[str, object] = {
            "pid": member.pid, "start_time": member.start_time, "comm": member.comm,
            "user": member.user, "uid": member.uid, "outcome": outcome,
            "signals": list(teardown.signals.get((member.pid, member.start_time), ()))}
        if because:
            found["why"] = because
        return found

    processes = [*(entry(m, "killed") for m in teardown.killed),
                 *(entry(m, "survived-sigkill") for m in teardown.survivors),
                 *(entry(m, "not-signalled", STOP_REFUSED) for m in teardown.refused),
                 *(entry(m, "gone", f"{STOP_REFUSED}; gone by the end")
                   for m in teardown.exited),
                 *(entry(k.member, "kept", k.why) for k in teardown.kept)]
    record = {"event": "teardown", "why": why,
              "launcher": {"pid": launcher[0], "start_time": launcher[1]},
              "processes": processes, "problems": list(teardown.problems)}
    return AUDIT + json.dumps(record)
