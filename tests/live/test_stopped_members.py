"""A reap never leans on a stop it did not make (issue 47, part B).

A member found stopped (state T) before this reap sends it SIGSTOP was stopped by
someone else: its owner (Ctrl-Z), a debugger, another reaper (`gpuguard reap --apply`
holding the same tree), one that died. That someone decides when it runs again, so the
reap cannot judge it frozen, nor kill it on that freeze: it refuses the tree
(`member-stopped`) before any SIGTERM, sends that member nothing, continues what it
stopped itself and leaves the other's stop in place. Whatever this reap sends SIGSTOP is
its own, whatever /proc said before the send: continued on every way out that does not
kill it.

Real trees, the real Reaper; "someone else" is this test, with kill(2).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable

import pytest

from gpuguard.base.counters import Counters
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import Member
from gpuguard.engine.reap.outcome import ReapResult
from gpuguard.engine.reap.reaper import Reaper
from tests.live.test_remediator_reaper import (
    POLICY,
    RULES,
    DriverLikeNvml,
    Written,
    nvml,
    plan_for,
    sent,
    stopped,
)
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, wait_for
from tests.support.remediator_harness import Orphan, spawn_orphan

__all__ = ["nvml"]  # the fixture, imported for its name

#: The orphan root sh with the GPU holder and a plain sibling holder.
WITH_SIBLING = ('sh -c "{holder} --pidfile {dir}/holder & {holder} --pidfile {dir}/sibling '
                '& wait" & echo $! > {dir}/root; wait')
#: The holder starts ignoring SIGHUP on SIGTERM and lives on (so the reap fails after
#: SIGTERM, before SIGKILL); the sibling ignores SIGTERM.
FAILS_AFTER_TERM = ('sh -c "{holder} --hup-on-term --pidfile {dir}/holder & {holder} '
                    '--ignore-term --pidfile {dir}/sibling & wait" & echo $! > {dir}/root; wait')

#: The sibling ignores SIGTERM (it outlives the grace); the rest die of it.
SIBLING_IGNORES_TERM = ('sh -c "{holder} --pidfile {dir}/holder & {holder} --ignore-term '
                        '--pidfile {dir}/sibling & wait" & echo $! > {dir}/root; wait')

Marks = list[tuple[tuple[int, ...], bool]]


def stop(pid: int) -> None:
    """Someone else's SIGSTOP, waited for (the stop takes effect when the target runs)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: stopped(pid), what=f"{pid} to stop")


def reap(plan: ReapPlan, nvml: DriverLikeNvml, *, journal: Callable[..., None] | None = None,
         confirm: Callable[[], tuple[str, str] | None] | None = None,
         marks: Marks | None = None, **reaper_kw: object) -> ReapResult:
    """The real Reaper, with the worker's hooks: its journal, its Alertmanager question and
    its crash ledger's held marks (kept in `marks`)."""
    reaper = Reaper(nvml=nvml, counters=Counters(), **reaper_kw)  # type: ignore[arg-type]
    kept = marks if marks is not None else []
    return reaper.reap(plan, policy=POLICY, rules=RULES, protected_pids=frozenset({1, os.getpid()}),
                       deadline=time.monotonic() + 30,
                       journal=journal if journal is not None else Written(), confirm=confirm,
                       holding=lambda members, held: kept.append(
                           (tuple(pid for pid, _ in members), held)))


def held_last(marks: Marks, pid: int) -> bool:
    """Whether crash recovery would continue `pid`: its last mark."""
    held = False
    for pids, mark in marks:
        if pid in pids:
            held = mark
    return held


def stops_continued(result: ReapResult) -> list[int]:
    """Members this reap sent SIGSTOP and did not continue after their last SIGSTOP."""
    owed: set[int] = set()
    for record in result.signals:
        if record.signal == "SIGSTOP" and record.result == "sent":
            owed.add(record.pid)
        elif record.signal == "SIGCONT" and record.result in ("sent", "gone"):
            owed.discard(record.pid)
    return sorted(owed)


@pytest.mark.parametrize("when", ["before-the-reap", "before-its-sigstop"])
def test_a_member_someone_else_stopped_refuses_the_reap_and_stays_stopped(
        when: str, trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    """before-the-reap: held and read in T. before-its-sigstop: stopped by the other
    reaper once the intent record is written, so only the read right before our own
    SIGSTOP sees it. Before: "stopped already" was ours to kill: reaped."""
    orphan = spawn_orphan(trees, fake_gpu, WITH_SIBLING)
    sibling = orphan.tree.pid("sibling")
    plan = plan_for(orphan, nvml, extra=(sibling,))
    journal = Written()

    def stop_at_intent(phase: str, members: tuple[Member, ...]) -> None:
        journal(phase, members)
        if phase == "intent":
            stop(orphan.holder)

    if when == "before-the-reap":
        stop(orphan.holder)
    marks: Marks = []
    try:
        result = reap(plan, nvml, marks=marks,
                      journal=stop_at_intent if when == "before-its-sigstop" else journal)
        assert (result.outcome, result.reason) == ("aborted", "member-stopped"), result
        assert f"{orphan.holder} " in result.detail, result.detail
        assert not any(s.pid == orphan.holder for s in result.signals), result.signals
        assert not any(sig in ("SIGTERM", "SIGKILL") for _, sig in sent(result))
        assert stopped(orphan.holder), "the other's stop was lifted"
        assert alive(orphan.root) and alive(sibling)
        wait_for(lambda: not stopped(orphan.root) and not stopped(sibling),
                 what="what the reap stopped to be continued")
        assert stops_continued(result) == []
        # Crash recovery would not continue it either: never marked, or unmarked.
        assert not held_last(marks, orphan.holder), marks
    finally:
        os.kill(orphan.holder, signal.SIGCONT)


def test_a_sigcont_between_its_read_and_its_sigstop_leaves_nothing_stopped(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    """The review's reproduction: another reaper holds the holder stopped; its Ctrl-C
    continues it right between this reap's read of T and its own SIGSTOP. Before: the
    read said "stopped already", so the SIGSTOP that did stop it was not ours: never
    continued when the reap was refused (here, Alertmanager no longer firing once the
    tree is frozen), the holder left in T for good."""
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    stop(orphan.holder)  # the other reaper's freeze
    fds: dict[int, int] = {}
    other_let_go = threading.Event()

    def pidfd_open(pid: int) -> int:
        fd = os.pidfd_open(pid)
        fds[fd] = pid
        return fd

    def pidfd_send(fd: int, sig: int) -> None:
        if sig == signal.SIGSTOP and fds.get(fd) == orphan.holder and not other_let_go.is_set():
            other_let_go.set()  # the other reaper's Ctrl-C: it continues what it stopped
            os.kill(orphan.holder, signal.SIGCONT)
            wait_for(lambda: not stopped(orphan.holder), what="the other's SIGCONT")
        signal.pidfd_send_signal(fd, sig)

    asked: list[int] = []

    def confirm() -> tuple[str, str] | None:
        asked.append(1)
        return None if len(asked) == 1 else ("not-firing", "the alert resolved")

    try:
        result = reap(plan, nvml, confirm=confirm, pidfd_open=pidfd_open,
                      pidfd_send=pidfd_send)
        assert result.outcome == "aborted", result
        if not other_let_go.is_set():  # refused before its SIGSTOP: the other lets go now
            assert result.reason == "member-stopped", result
            os.kill(orphan.holder, signal.SIGCONT)
        assert stops_continued(result) == [], result.signals
        assert orphan.all_alive()
        wait_for(lambda: not any(stopped(p) for p in orphan.members),
                 what="every member running again")
    finally:
        os.kill(orphan.holder, signal.SIGCONT)


def test_a_member_its_owner_stopped_is_left_stopped_when_the_reap_fails_after_sigterm(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    """The review's Low finding: the sibling's owner stopped it (Ctrl-Z) before the reap.
    Before: SIGTERM and SIGCONT like everyone (it ignores SIGTERM), then the holder began
    ignoring SIGHUP on its SIGTERM, the reap failed before SIGKILL, and the sibling was
    left running. Now it refuses the tree before any signal, the sibling still stopped."""
    orphan = spawn_orphan(trees, fake_gpu, FAILS_AFTER_TERM)
    sibling = orphan.tree.pid("sibling")
    plan = plan_for(orphan, nvml, extra=(sibling,))
    stop(sibling)
    try:
        result = reap(plan, nvml)
        assert (result.outcome, result.reason) == ("aborted", "member-stopped"), result
        assert stopped(sibling), "a member its owner had stopped was left running"
        assert not any(sig in ("SIGTERM", "SIGKILL") for _, sig in sent(result))
        assert orphan.all_alive() and alive(sibling)
    finally:
        os.kill(sibling, signal.SIGCONT)


class Adversary:
    """Another stopper (a reaper, a debugger's user) that SIGSTOPs and SIGCONTs one member
    in a tight loop, then lets it go: its last word is SIGCONT."""

    def __init__(self, pid: int, seed: int) -> None:
        self.pid = pid
        self.random = random.Random(seed)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            for sig in (signal.SIGSTOP, signal.SIGCONT):
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    return
                time.sleep(self.random.choice((0, 0.0002, 0.001)))

    def let_go(self) -> None:
        self.done.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


TRIALS = 30


def race(trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml, trial: int) -> str:
    """One trial of the race below: its outcome and reason."""
    orphan: Orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    asked: list[int] = []

    def confirm() -> tuple[str, str] | None:
        asked.append(1)
        refuse = trial % 2 == 1 and len(asked) > 1  # the second ask: the tree frozen
        return ("not-firing", "the alert resolved") if refuse else None

    adversary = Adversary(orphan.holder, seed=trial)
    try:
        result = reap(plan, nvml, confirm=confirm)
    finally:
        adversary.let_go()
    assert result.outcome in ("reaped", "aborted"), (trial, result)
    if result.outcome == "reaped":
        assert orphan.none_alive(), (trial, result)
        return "reaped"
    assert result.reason in ("member-stopped", "not-firing"), (trial, result)
    assert stops_continued(result) == [], (trial, result.signals)
    assert not any(sig in ("SIGTERM", "SIGKILL") for _, sig in sent(result)), trial
    assert orphan.all_alive(), trial
    wait_for(lambda: not any(stopped(p) for p in orphan.members),
             what=f"trial {trial}: every member running again")
    for pid in orphan.members:
        orphan.tree.kill(pid)
    return f"aborted:{result.reason}"


def test_a_stopper_racing_the_reap_leaves_no_member_stopped(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    """30 trials: an adversary stops and continues the holder in a tight loop while the
    real Reaper reaps the tree; every other trial Alertmanager stops firing once the tree
    is frozen (the reap is refused there, if it got so far). Each ends in a full reap or a
    refusal where every member this reap sent SIGSTOP got its SIGCONT after it; once the
    adversary has let go, no member is left in T. Before: a SIGSTOP sent after a read of T
    was not ours, never continued on a refusal (7 of the 15 refused trials)."""
    outcomes: dict[str, int] = {}
    for trial in range(TRIALS):
        outcome = race(trees, fake_gpu, nvml, trial)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\n{TRIALS} trials: {outcomes}")


def test_a_survivor_someone_else_stopped_during_the_term_grace_is_not_killed(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    """The review's second-reaper case: a reaper that does not share this one's lock (a
    console with a config of its own) freezes the tree while this reap waits out its
    SIGTERM grace (the members run then: SIGTERM and SIGCONT went out). Before: the
    survivors were SIGSTOPped again and SIGKILLed on the other's freeze. Now the re-stop
    reads each survivor first: stopped by someone else, nobody is SIGKILLed
    (member-stopped) and the other's stop stays."""
    orphan = spawn_orphan(trees, fake_gpu, SIBLING_IGNORES_TERM)
    sibling = orphan.tree.pid("sibling")  # ignores SIGTERM: a survivor of the grace
    plan = plan_for(orphan, nvml, extra=(sibling,))
    fds: dict[int, int] = {}

    def pidfd_open(pid: int) -> int:
        fd = os.pidfd_open(pid)
        fds[fd] = pid
        return fd

    def pidfd_send(fd: int, sig: int) -> None:
        signal.pidfd_send_signal(fd, sig)
        if sig == signal.SIGCONT and fds.get(fd) == sibling and not stopped(sibling):
            stop(sibling)  # the other reaper's freeze, during this one's grace

    try:
        result = reap(plan, nvml, pidfd_open=pidfd_open, pidfd_send=pidfd_send)
        assert (result.outcome, result.reason) == ("failed", "member-stopped"), result
        assert not any(sig == "SIGKILL" for _, sig in sent(result)), result.signals
        assert stopped(sibling), "the other's stop was lifted"
    finally:
        for pid in (sibling, orphan.holder, orphan.root):
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
