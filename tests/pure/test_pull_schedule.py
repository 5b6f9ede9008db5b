"""Pull mode's schedule (gpuguard.engine.alerting.polling): jittered polls, back-off after a busy
or slow Alertmanager, HA peers in a per-host order, and the poll accounting (issue 43)."""

from __future__ import annotations

import random
import statistics

import pytest

from gpuguard.engine.alerting.polling import (
    DURATION_BUCKETS,
    FIRST_BACKOFF_SECONDS,
    JITTER,
    PollResult,
    PollStats,
    backoff_delay,
    delay_after,
    first_delay,
    host_random,
    next_delay,
    peer_order,
    retry_after_seconds,
)

HOSTS = [f"gpu-node-{i:03d}" for i in range(200)]


def test_first_polls_spread_over_the_interval_and_are_the_same_per_host() -> None:
    firsts = [first_delay(15.0, host_random(h)) for h in HOSTS]
    assert all(0 <= d < 15.0 for d in firsts)
    # Not in step: the fleet's first polls fill the interval (each 1.5 s slice has some).
    assert {int(d // 1.5) for d in firsts} == set(range(10))
    assert firsts == [first_delay(15.0, host_random(h)) for h in HOSTS]  # replayable


def test_each_next_poll_is_the_interval_plus_or_minus_the_jitter() -> None:
    rng = host_random("gpu-node-001")
    delays = [next_delay(15.0, rng) for _ in range(2000)]
    assert min(delays) >= 15.0 * (1 - JITTER) and max(delays) <= 15.0 * (1 + JITTER)
    assert statistics.pstdev(delays) > 0.5  # jittered, not a constant
    assert abs(statistics.mean(delays) - 15.0) < 0.1


def test_backoff_doubles_from_the_first_retry_and_stops_at_the_interval() -> None:
    rng = random.Random(1)
    got = [backoff_delay(n, 60.0, rng) for n in range(1, 10)]
    want = [FIRST_BACKOFF_SECONDS * 2 ** (n - 1) for n in range(1, 10)]
    for delay, base in zip(got, want, strict=True):
        assert min(base * (1 - JITTER), 60.0) <= delay <= min(base * (1 + JITTER), 60.0)
    assert got[-3:] == [60.0, 60.0, 60.0]
    assert backoff_delay(10_000, 60.0, rng) == 60.0  # no overflow, still the cap
    # An interval shorter than the first retry: the interval.
    assert backoff_delay(1, 1.0, rng) <= 1.0


def test_retry_after_is_honoured_up_to_the_interval() -> None:
    rng = random.Random(2)
    assert backoff_delay(1, 60.0, rng, retry_after=5.0) == 5.0
    assert backoff_delay(1, 60.0, rng, retry_after=600.0) == 60.0
    assert backoff_delay(6, 60.0, rng, retry_after=0.0) >= 32 * (1 - JITTER)  # never sooner
    assert retry_after_seconds("7") == 7.0 and retry_after_seconds(" 0 ") == 0.0
    for nonsense in (None, "", "-1", "1.5", "Wed, 21 Oct 2026 07:28:00 GMT", "soon",
                     "\u00b2", "\u0663"):  # str.isdigit() takes both; float() refuses '²'

        assert retry_after_seconds(nonsense) is None


@pytest.mark.parametrize(("result", "sooner"), [
    (PollResult.OK, False), (PollResult.ERROR, False), (PollResult.UNAUTHORIZED, False),
    (PollResult.BUSY, True), (PollResult.TIMEOUT, True)])
def test_only_busy_and_timeout_are_retried_sooner(result: PollResult, sooner: bool) -> None:
    delay = delay_after(result, 1, 30.0, random.Random(3), None)
    if sooner:
        assert delay <= FIRST_BACKOFF_SECONDS * (1 + JITTER)
    else:
        assert 30.0 * (1 - JITTER) <= delay <= 30.0 * (1 + JITTER)


def test_peers_are_rotated_per_host() -> None:
    urls = ("http://am-0:9093", "http://am-1:9093", "http://am-2:9093")
    orders = {h: peer_order(urls, h) for h in HOSTS}
    for order in orders.values():
        start = urls.index(order[0])
        assert order == urls[start:] + urls[:start]  # every peer, the cyclic order kept
    firsts = [order[0] for order in orders.values()]
    assert {u: firsts.count(u) for u in urls} == pytest.approx(
        dict.fromkeys(urls, len(HOSTS) / 3), rel=0.35)  # the fleet spread over the peers
    assert peer_order(urls, "gpu-node-007") == orders["gpu-node-007"]  # stable
    assert peer_order(urls[:1], "x") == urls[:1] and peer_order((), "x") == ()


def test_poll_stats_count_time_and_judge_in_a_row() -> None:
    stats = PollStats()
    assert stats.record(PollResult.BUSY, 0.004, 1.0) == 1
    assert stats.record(PollResult.TIMEOUT, 3.0, 5.0) == 2
    assert stats.record(PollResult.OK, 0.2, 6.0) == 0
    view = stats.view()
    assert view.counts == {"ok": 1, "busy": 1, "timeout": 1, "unauthorized": 0, "error": 0}
    assert len(view.buckets) == len(DURATION_BUCKETS) + 1 and view.buckets[-1] == 3
    cumulative = dict(zip(DURATION_BUCKETS, view.buckets, strict=False))
    assert (cumulative[0.005], cumulative[0.25], cumulative[2.5], cumulative[5.0]) == (1, 2, 2, 3)
    assert view.duration_sum == pytest.approx(3.204)
    assert (view.failures_in_a_row, view.last_completed, view.last_ok) == (0, 6.0, 6.0)
