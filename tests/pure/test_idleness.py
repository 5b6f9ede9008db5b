"""The idle clock (gpuguard/orphans/idleness.py) and the policy's use of it
(policy.idle_refusal), on synthetic sightings and trees."""

from __future__ import annotations

import dataclasses

from gpuguard.engine.decision.policy import idle_refusal
from gpuguard.engine.decision.tree import HolderIdle, LiveTree, Member, TreeKey
from gpuguard.orphans.idleness import (
    STEP_TOLERANCE_SECONDS,
    IdleBook,
    SampleMark,
    UseSighting,
    next_mark,
    observe,
    rebased_mark,
    sightings_of,
)
from gpuguard.orphans.process import Holder

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


# -- the sample mark: NVML's lastSeenTimeStamp, tied to the wall time of its read ---------

WALL, BOOT = 1_800_000_000.0, 5_000.0  # a wall time and a boot time read together
US = 1_000_000


def test_the_mark_is_the_newest_stamp_never_past_the_read() -> None:
    mark = next_mark(0, [int((WALL - 2) * US), int((WALL - 1) * US)], WALL, BOOT)
    assert mark == SampleMark(int((WALL - 1) * US), WALL - BOOT)
    assert next_mark(mark.since_us, [], WALL + 1, BOOT + 1).since_us == mark.since_us
    # A sample from ahead of the wall clock leaves the mark at the read's wall time.
    ahead = next_mark(mark.since_us, [int((WALL + 3600) * US)], WALL + 2, BOOT + 2)
    assert ahead.since_us == int((WALL + 2) * US)


def test_time_passing_and_slew_are_no_step() -> None:
    mark = next_mark(0, [int(WALL * US)], WALL, BOOT)
    assert not mark.stepped(WALL + 15, BOOT + 15)
    assert not mark.stepped(WALL + 15 + STEP_TOLERANCE_SECONDS / 2, BOOT + 15)
    assert not mark.stepped(WALL + 3600 * 24, BOOT + 3600 * 24)  # a day without a read


def test_a_step_either_way_voids_the_mark() -> None:
    mark = next_mark(0, [int(WALL * US)], WALL, BOOT)
    assert mark.stepped(WALL + 1 - 3600, BOOT + 1)  # NTP steps a fast clock back an hour
    assert mark.stepped(WALL + 1 + 600, BOOT + 1)  # or forward
    assert mark.stepped(WALL + 1 - 2 * STEP_TOLERANCE_SECONDS, BOOT + 1)


def test_a_mark_ahead_of_the_wall_clock_is_a_step_whatever_the_offset() -> None:
    """Both clocks moved back together (a restored VM: the offset is the same), yet the
    mark is an hour ahead of now: every new sample would hide behind it."""
    mark = SampleMark(int(WALL * US), WALL - BOOT)
    assert mark.stepped(WALL - 3600, BOOT - 3600)
    assert not mark.stepped(WALL - STEP_TOLERANCE_SECONDS / 2, BOOT - STEP_TOLERANCE_SECONDS / 2)


def test_a_rebased_mark_asks_from_the_new_wall_time() -> None:
    mark = rebased_mark(WALL - 3600, BOOT)
    assert mark == SampleMark(int((WALL - 3600) * US), WALL - 3600 - BOOT)
    assert not mark.stepped(WALL - 3599, BOOT + 1)


def test_a_step_read_restarts_every_holder_on_every_gpu() -> None:
    """The read that sees a step answers unknown for every GPU: no holder keeps the idle
    time it had, and the clock counts from the next read that can say."""
    book = observe(IdleBook(), [seen(1, False), seen(2, False, GPU1)], 100.0)
    book = observe(book, [seen(1, False), seen(2, False, GPU1)], 200.0)
    assert book.process_idle_seconds(1, 7, 200.0) == 100.0
    stepped = sightings_of([(1, 7, GPU0), (2, 7, GPU1)], {GPU0: None, GPU1: None})
    book = observe(book, stepped, 201.0)
    assert [book.idle_seconds(k, 201.0) for k in book.entries] == [None, None]
    book = observe(book, [seen(1, False), seen(2, False, GPU1)], 202.0)
    assert book.idle_seconds((1, 7, GPU0), 260.0) == 58.0
