"""Which pids AMD SMI lists are holders (gpuguard/gpu/amdsmi/pids.py, pure), and who used
a GPU between two reads: the sightings and counters the reader keeps, as plain data."""

from __future__ import annotations

from gpuguard.gpu.amdsmi.pids import Sighting, busy, judge
from gpuguard.gpu.reading import Listed

TICKS = 100


def test_a_process_that_started_before_the_first_listing_is_the_holder() -> None:
    verdict, seen = judge(None, 1_000, listed_at=20.0, ticks_per_second=TICKS)
    assert verdict == Listed.HOLDER
    assert seen == Sighting(20.0, 1_000)
    again, kept = judge(seen, 1_000, listed_at=25.0, ticks_per_second=TICKS)
    assert (again, kept) == (Listed.HOLDER, seen)  # the first sighting is kept, not moved


def test_a_pid_with_no_process_is_no_holder_and_its_first_listing_is_remembered() -> None:
    verdict, seen = judge(None, None, listed_at=20.0, ticks_per_second=TICKS)
    assert verdict == Listed.NO_PROCESS
    assert seen == Sighting(20.0, None)


def test_a_process_started_after_the_first_listing_is_another_process() -> None:
    # First read: nobody at the pid (ROCm's stale entry); then a new process takes the pid.
    _, seen = judge(None, None, listed_at=20.0, ticks_per_second=TICKS)
    verdict, kept = judge(seen, 2_100, listed_at=30.0, ticks_per_second=TICKS)
    assert verdict == Listed.PID_REUSED
    assert kept == seen
    # Reused between the listing call and the /proc read of the first sighting.
    assert judge(None, 2_001, listed_at=20.0, ticks_per_second=TICKS)[0] == Listed.PID_REUSED


def test_a_start_time_that_differs_from_the_first_sighting_is_another_process() -> None:
    _, seen = judge(None, 1_000, listed_at=20.0, ticks_per_second=TICKS)
    # Older than the listing, so only the comparison with the first sighting catches it.
    assert judge(seen, 900, listed_at=30.0, ticks_per_second=TICKS)[0] == Listed.PID_REUSED
    assert judge(seen, None, listed_at=30.0, ticks_per_second=TICKS)[0] == Listed.NO_PROCESS


def test_busy_is_unknown_on_the_first_read_never_idle() -> None:
    assert busy(None, {(10, 1): 5}) is None


def test_busy_is_the_holders_whose_engine_time_moved() -> None:
    previous = {(10, 1): 500, (11, 1): 700, (12, 1): 900}
    now = {(10, 1): 500, (11, 1): 800, (12, 1): 100, (13, 1): 0, (14, 1): 3}
    # 10 still; 11 grew; 12 went back (a counter reset: counted as used); 13 new with no
    # engine time; 14 new with some (spent since it was not listed).
    assert busy(previous, now) == frozenset({11, 12, 14})


def test_busy_tells_a_reused_pid_from_the_process_it_replaced() -> None:
    assert busy({(10, 1): 500}, {(10, 2): 500}) == frozenset({10})
    assert busy({(10, 1): 500}, {(10, 2): 0}) == frozenset()
