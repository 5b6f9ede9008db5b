"""The reaper on real process trees: identity checks, freeze, TERM/KILL, kill paths."""

from __future__ import annotations

import dataclasses
import errno
import os
import time
from collections.abc import Iterator

import pytest

from exporter.classify import Rules
from exporter.config import Remediate, UserFilter
from exporter.counters import Counters
from exporter.nvml import Nvml, NvmlReading
from remediator.policy import Member, TreeKey
from remediator.reaper import PID, PIDFD, Journal, Reaper, ReapPlan, ReapResult, inspect_tree
from tests.fakenvml import FakeGpuWorld
from tests.proctree import Trees, alive, stat_fields
from tests.remediator_helpers import GIB, HOST, STUBBORN, Orphan, spawn_orphan

#: Lets the tests' own processes through whoever runs them (CI runs as root).
RULES = Rules()
POLICY = Remediate(mode="enforce", term_timeout_seconds=2, allow_root_owned=True,
                   users=UserFilter(allow=("*",), deny=()))


class DriverLikeNvml:
    """The real Nvml over the fake library, minus holders that have exited (as a driver does)."""

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml

    def read(self) -> NvmlReading:
        reading = self.nvml.read()
        live = tuple(h for h in reading.holders if alive(h.pid))
        return dataclasses.replace(reading, holders=live)


@pytest.fixture
def nvml(fake_gpu: FakeGpuWorld) -> Iterator[DriverLikeNvml]:
    real = Nvml(counters=Counters())
    yield DriverLikeNvml(real)
    real.close()


def plan_for(orphan: Orphan, nvml: DriverLikeNvml, *, dry_run: bool = False) -> ReapPlan:
    key = TreeKey(HOST, orphan.root, orphan.root_start)
    live = inspect_tree(key, nvml=nvml, rules=Rules(), counters=Counters())
    assert live.tree_found and live.verdict == "orphan", live
    assert [m.pid for m in live.members] == orphan.members
    return ReapPlan(key, live.members, live.holders, live.gpu_bytes, dry_run)


def reap(plan: ReapPlan, nvml: DriverLikeNvml, *, policy: Remediate = POLICY,
         protected: frozenset[int] = frozenset({1, os.getpid()}), deadline: float | None = None,
         journal: Journal | None = None, rules: Rules = RULES,
         **reaper_kw: object) -> ReapResult:
    reaper = Reaper(nvml=nvml, counters=Counters(), **reaper_kw)  # type: ignore[arg-type]
    return reaper.reap(plan, policy=policy, rules=rules, protected_pids=protected,
                       deadline=deadline if deadline is not None else time.monotonic() + 30,
                       journal=journal if journal is not None else Written())


class Written:
    """A journal that keeps what it was asked to write, in order."""

    def __init__(self) -> None:
        self.records: list[tuple[str, tuple[int, ...]]] = []

    def __call__(self, phase: str, members: tuple[Member, ...]) -> None:
        self.records.append((phase, tuple(m.pid for m in members)))


def sent(result: ReapResult) -> list[tuple[int, str]]:
    return [(s.pid, s.signal) for s in result.signals if s.result == "sent"]


def test_term_ignoring_member_gets_sigkill_through_its_pidfd(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu, STUBBORN)
    policy = dataclasses.replace(POLICY, term_timeout_seconds=0.3)
    result = reap(plan_for(orphan, nvml), nvml, policy=policy)
    assert (result.outcome, result.kill_path) == ("reaped", PIDFD), result
    assert orphan.none_alive()
    signals = sent(result)
    assert signals[:2] == [(orphan.root, "SIGSTOP"), (orphan.holder, "SIGSTOP")]
    assert (orphan.holder, "SIGTERM") in signals and (orphan.holder, "SIGKILL") in signals
    assert signals.index((orphan.root, "SIGTERM")) < signals.index((orphan.root, "SIGCONT"))
    assert result.reclaimed_bytes == 2 * GIB and result.gpu_bytes_after == 0
    assert result.killed == 2 and result.survivors == ()


def test_without_pidfd_it_refuses_unless_the_policy_opts_in(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    refused = reap(plan, nvml, pidfd_open=None)
    assert (refused.outcome, refused.reason, refused.kill_path) == ("aborted", "no-pidfd", None)
    assert refused.signals == () and orphan.all_alive()

    def enosys(pid: int) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    refused = reap(plan, nvml, pidfd_open=enosys)
    assert (refused.outcome, refused.reason) == ("aborted", "no-pidfd") and orphan.all_alive()

    weaker = dataclasses.replace(POLICY, allow_without_pidfd=True)
    result = reap(plan, nvml, policy=weaker, pidfd_open=enosys)
    assert (result.outcome, result.kill_path) == ("reaped", PID)
    assert orphan.none_alive()


def test_root_replaced_since_the_decision_is_not_touched(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    root = dataclasses.replace(plan.members[0], start_time=plan.members[0].start_time - 1)
    result = reap(dataclasses.replace(plan, members=(root, *plan.members[1:])), nvml)
    assert (result.outcome, result.reason) == ("aborted", "root-replaced")
    assert result.signals == () and orphan.all_alive()


def test_a_refused_process_joining_during_the_freeze_aborts_and_thaws(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    only_root = dataclasses.replace(plan, members=plan.members[:1])
    result = reap(only_root, nvml, protected=frozenset({1, os.getpid(), orphan.holder}))
    assert (result.outcome, result.reason) == ("aborted", "protected-pid")
    assert sent(result) == [(orphan.root, "SIGSTOP"), (orphan.root, "SIGCONT")]
    assert orphan.all_alive()
    for pid in orphan.members:
        fields = stat_fields(pid)
        assert fields is not None and fields["state"] != "T", f"{pid} left stopped"


def test_dry_run_and_timeout_send_nothing(trees: Trees, fake_gpu: FakeGpuWorld,
                                          nvml: DriverLikeNvml) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    dry = reap(plan_for(orphan, nvml, dry_run=True), nvml)
    assert dry.outcome == "dry-run" and dry.signals == () and dry.killed == 0
    assert [m.pid for m in dry.members] == orphan.members
    late = reap(plan_for(orphan, nvml), nvml, deadline=time.monotonic() - 1)
    assert (late.outcome, late.reason, late.signals) == ("aborted", "worker-timeout", ())
    assert orphan.all_alive()
