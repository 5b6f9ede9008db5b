"""The idle clock (gpuguard/orphans/idleness.py) and the policy's use of it
(policy.idle_refusal), on synthetic sightings and trees."""

from __future__ import annotations

import dataclasses

from gpuguard.orphans.idleness import IdleBook, UseSighting, observe, sightings_of
from gpuguard.orphans.process import Holder
from gpuguard.remediator.decision.policy import idle_refusal
from gpuguard.remediator.decision.tree import HolderIdle, LiveTree, Member, TreeKey

GPU0, GPU1 = "GPU-0", "GPU-1"
KEY = TreeKey("node", 10, 100)


def seen(pid: int, busy: bool | None, gpu: str = GPU0, start: int = 7) -> UseSighting:
    return UseSighting(pid, start, gpu, busy)


def test_idle_counts_from_first_sight_then_from_the_last_busy_read() -> None:
    book = observe(IdleBook(), [seen(1, False), seen(2, True)], 100.0)
    assert book.idle_seconds((1, 7, GPU0), 100.0) == 0.0
    book = observe(book, [seen(1, False), seen(2, False)], 130.0)
    assert book.idle_seconds((1, 7, GPU0), 130.0) == 30.0
    assert book.idle_seconds((2, 7, GPU0), 130.0) == 30.0  # busy at 100, not since
    book = observe(book, [seen(1, True), seen(2, False)], 150.0)
    assert book.idle_seconds((1, 7, GPU0), 170.0) == 20.0
    assert book.watched_seconds((1, 7, GPU0), 170.0) == 70.0


def test_unknown_is_absent_and_restarts_the_clock() -> None:
    book = observe(IdleBook(), [seen(1, False)], 100.0)
    book = observe(book, [seen(1, None)], 200.0)
    assert book.idle_seconds((1, 7, GPU0), 200.0) is None
    book = observe(book, [seen(1, False)], 210.0)
    assert book.idle_seconds((1, 7, GPU0), 210.0) == 0.0  # not 110: nobody could look


def test_entries_leave_with_their_holder_and_a_new_start_time_is_a_new_process() -> None:
    book = observe(IdleBook(), [seen(1, False), seen(2, False)], 100.0)
    book = observe(book, [seen(1, False, start=8)], 150.0)  # pid 1 reused, pid 2 gone
    assert set(book.entries) == {(1, 8, GPU0)}
    assert book.idle_seconds((1, 8, GPU0), 150.0) == 0.0


def test_a_process_is_as_idle_as_its_busiest_gpu() -> None:
    book = observe(IdleBook(), [seen(1, False), seen(1, False, GPU1)], 100.0)
    book = observe(book, [seen(1, False), seen(1, True, GPU1)], 140.0)
    assert book.process_idle_seconds(1, 7, 150.0) == 10.0
    book = observe(book, [seen(1, False), seen(1, None, GPU1)], 160.0)
    assert book.process_idle_seconds(1, 7, 160.0) is None


def test_sightings_leave_out_holders_without_identity() -> None:
    got = sightings_of([(1, 7, GPU0), (2, None, GPU0), (3, 9, GPU1)],
                       {GPU0: frozenset({1}), GPU1: None})
    assert got == [seen(1, True), UseSighting(3, 9, GPU1, None)]


def tree(*idle: HolderIdle) -> LiveTree:
    root = Member(10, 1, 100, 1000, "alice", "sh")
    return LiveTree(root=root, tree_found=True, verdict="orphan", reason="session-ended",
                    members=(root, dataclasses.replace(root, pid=11, ppid=10)),
                    holders=(Holder(11, GPU0, 0, 1, "C"), Holder(11, GPU1, 1, 1, "C")), idle=idle)


def test_idle_refusal() -> None:
    both = (HolderIdle(11, GPU0, 90.0, 90.0), HolderIdle(11, GPU1, 70.0, 90.0))
    assert idle_refusal(KEY, tree(*both), 0) is None
    assert idle_refusal(KEY, tree(), 0) is None  # off: nothing asked
    assert idle_refusal(KEY, tree(*both), 60) is None
    busy = idle_refusal(KEY, tree(*both), 80, now=1000.0)
    assert busy is not None and busy.reason == "not-idle"
    assert "GPU 1 used an SM 70s ago" in busy.detail
    assert busy.recheck_at == 1010.0  # the least idle holder qualifies in 10 s at the earliest
    young = idle_refusal(KEY, tree(HolderIdle(11, GPU0, 30.0, 30.0), both[1]), 60)
    assert young is not None and young.reason == "not-idle"
    assert "watched for only 30s" in young.detail
    unknown = idle_refusal(KEY, tree(both[0], HolderIdle(11, GPU1, None, None)), 60)
    assert unknown is not None and unknown.reason == "idle-unknown"
    missing = idle_refusal(KEY, tree(both[0]), 60)  # no fact for GPU 1 at all
    assert missing is not None and missing.reason == "idle-unknown"


def test_a_read_after_a_stall_restarts_every_clock() -> None:
    """What a holder did while nobody read NVML (its samples last seconds) is not
    idleness: a gap over max_gap since the previous read counts from the new read."""
    book = observe(IdleBook(), [seen(1, False)], 100.0, max_gap=15.0)
    book = observe(book, [seen(1, False)], 110.0, max_gap=15.0)
    assert book.idle_seconds(seen(1, False).key, 110.0) == 10.0
    book = observe(book, [seen(1, False)], 3700.0, max_gap=15.0)  # an hour unread
    assert book.idle_seconds(seen(1, False).key, 3700.0) == 0.0
    assert book.watched_seconds(seen(1, False).key, 3700.0) == 0.0
    book = observe(book, [seen(1, False)], 3710.0, max_gap=15.0)
    assert book.idle_seconds(seen(1, False).key, 3710.0) == 10.0
