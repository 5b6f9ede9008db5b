"""Pull mode against a busy or slow Alertmanager (issue 43): a real HTTP peer on 127.0.0.1
that answers 503 (as Alertmanager 0.25 does past 8 GETs in flight) or drips its answer;
the real poller thread, the real /healthz and /metrics."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from gpuguard.engine.alerting.polling import (
    FAILED_POLLS_UNHEALTHY,
    FIRST_BACKOFF_SECONDS,
    JITTER,
    PollResult,
)
from gpuguard.remediator.cli import remediator_lifecycle
from gpuguard.remediator.pull import Puller
from gpuguard.remediator.status import HealthCode
from tests.e2e.test_alertmanager_client import client
from tests.live.test_pull_bounds import Intake
from tests.support.proctree import wait_for
from tests.support.remediator_harness import Harness
from tests.support.slowpeer import Reply, SlowPeer

SLACK = 0.6


def early_rng(interval: float) -> random.Random:
    """A seeded Random whose first poll comes in the first 5% of the interval."""
    seed = next(s for s in range(10_000)
                if random.Random(s).uniform(0.0, interval) < interval * 0.05)
    return random.Random(seed)


def test_a_busy_alertmanager_is_asked_again_soon_backing_off(
        peer: Callable[..., SlowPeer]) -> None:
    """Two 503s (the first with Retry-After: 2), then an answer: retried after ~2 s, then
    after ~2 s (the doubled back-off), not a whole 20 s interval after each."""
    def plan(n: int) -> Reply:
        if n == 0:
            return Reply(status=503, body=b"busy", headers={"Retry-After": "2"})
        return Reply(status=503, body=b"busy") if n == 1 else Reply(body=b"[]")

    server = peer(plan)
    puller = Puller(Intake(), client(server.url, timeout=2), interval=20,  # type: ignore[arg-type]
                    rng=early_rng(20))
    puller.start()
    try:
        wait_for(lambda: len(server.times) >= 3 and puller.failures_in_a_row == 0,
                 timeout=15, what="two retries and an answer")
    finally:
        puller.stop()
    first, second = (b - a for a, b in zip(server.times, server.times[1:], strict=False))
    assert 2.0 <= first < 2.0 + SLACK, first  # Retry-After, over the 1 s first back-off
    backoff = 2 * FIRST_BACKOFF_SECONDS
    assert backoff * (1 - JITTER) <= second < backoff * (1 + JITTER) + SLACK, second
    counts = puller.client.polls.view().counts
    assert (counts[PollResult.BUSY], counts[PollResult.OK]) == (2, 1), counts
    assert puller.polls == 3 and puller.failed_polls == 2


def test_a_dripping_peer_does_not_stop_polling(peer: Callable[..., SlowPeer]) -> None:
    """Before: one poll in 12 s (the peer's whole drip). Now each poll ends at its
    deadline, and the next comes after a back-off, never a whole interval."""
    server = peer(lambda n: Reply(drip="headers", every=0.2))
    puller = Puller(Intake(), client(server.url, timeout=0.8), interval=5,  # type: ignore[arg-type]
                    rng=early_rng(5))
    puller.start()
    started = time.monotonic()
    try:
        wait_for(lambda: puller.polls >= 3, timeout=10, what="three polls")
    finally:
        puller.stop()
    elapsed = time.monotonic() - started
    # first poll <0.25 s, 3 x 0.8 s polls, back-offs of ~1 s and ~2 s
    assert elapsed < 0.25 + 3 * 0.8 + 3.3 + SLACK, elapsed
    assert puller.client.polls.view().counts[PollResult.TIMEOUT] == 3
    assert puller.last is not None and puller.last.result == PollResult.TIMEOUT


def test_healthz_says_poller_failing_and_comes_back(harness: Callable[..., Harness],
                                                   peer: Callable[..., SlowPeer]) -> None:
    busy = [True]
    server = peer(lambda n: Reply(status=503, body=b"busy") if busy[0] else Reply(body=b"[]"))
    h = harness(alertmanager={"url": server.url, "pull": True, "pull_interval_seconds": 1,
                              "timeout_seconds": 1})
    assert h.client.get("/healthz").status_code == 200
    wait_for(lambda: len(server.paths) >= FAILED_POLLS_UNHEALTHY, timeout=10,
             what=f"{FAILED_POLLS_UNHEALTHY} polls")
    wait_for(lambda: h.client.get("/healthz").status_code == 503, timeout=5,
             what="/healthz degraded")
    health = h.client.get("/healthz")
    assert health.get_data(as_text=True) == f"{HealthCode.POLLER_FAILING}\n"
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert ('gpuguard_remediator_alertmanager_polls_total{result="busy",source="alertmanager"}'
            in metrics)
    assert ('gpuguard_remediator_alertmanager_poll_duration_seconds_bucket'
            '{le="0.005",source="alertmanager"}') in metrics
    assert ('gpuguard_remediator_alertmanager_poll_duration_seconds_count'
            '{source="alertmanager"} ') in metrics
    in_a_row = next(line for line in metrics.splitlines() if line.startswith(
        'gpuguard_remediator_alertmanager_failed_polls_in_a_row{source="alertmanager"} '))
    assert float(in_a_row.split()[1]) >= FAILED_POLLS_UNHEALTHY
    assert "gpuguard_remediator_alertmanager_poller_stalled 0.0" in metrics
    # The liveness probe: an Alertmanager outage is nothing a restart mends; a restart
    # loop would only hide it behind GPUGuardRemediatorDown.
    ok, line = remediator_lifecycle(h.service, None, False).healthy()  # type: ignore[arg-type]
    assert (ok, line) == (True, f"gpuguard-remediator is Healthy. (/healthz: "
                                f"{HealthCode.POLLER_FAILING})")
    busy[0] = False
    wait_for(lambda: h.client.get("/healthz").status_code == 200, timeout=5,
             what="/healthz ok again")


def test_a_stopped_worker_fails_the_liveness_probe(harness: Callable[..., Harness]) -> None:
    """What a restart mends (a stopped worker thread) fails /-/healthy; /healthz says it."""
    h = harness()
    probe = remediator_lifecycle(h.service, None, False)  # type: ignore[arg-type]
    assert probe.healthy() == (True, "gpuguard-remediator is Healthy.")
    h.service.stop()
    assert probe.healthy() == (False, HealthCode.WORKER_STOPPED)
    assert h.client.get("/healthz").get_data(as_text=True) == f"{HealthCode.WORKER_STOPPED}\n"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_poller_that_completes_no_poll_is_stalled(peer: Callable[..., SlowPeer]) -> None:
    server = peer(lambda n: Reply(body=b"[]"))
    clock = Clock()
    puller = Puller(Intake(), client(server.url, timeout=1), interval=10,  # type: ignore[arg-type]
                    monotonic=clock)
    assert puller.poll_once() == 0 and puller.problem() is None
    clock.now += puller.stall_limit() - 1
    assert puller.problem() is None
    clock.now += 2
    problem = puller.problem()
    assert problem is not None and problem[0] == HealthCode.POLLER_STALLED, problem


def test_a_poller_that_failed_and_then_completes_no_poll_is_stalled(
        peer: Callable[..., SlowPeer]) -> None:
    """Three failed polls, then none completes (a hung poll): that is a stalled poller,
    which a restart mends, not only a failing one. The failing code used to be answered
    first and hid the stall, so the liveness probe (/-/healthy) never restarted it. A
    failing poller that still polls cannot look stalled: its back-off never exceeds the
    interval, and the stall limit is three of them."""
    server = peer(lambda n: Reply(status=503, body=b"busy"))
    clock = Clock()
    puller = Puller(Intake(), client(server.url, timeout=1), interval=10,  # type: ignore[arg-type]
                    monotonic=clock)
    for _ in range(FAILED_POLLS_UNHEALTHY):
        assert puller.poll_once() is None
    problem = puller.problem()
    assert problem is not None and problem[0] == HealthCode.POLLER_FAILING, problem
    clock.now += puller.stall_limit() + 1
    problem = puller.problem()
    assert problem is not None and problem[0] == HealthCode.POLLER_STALLED, problem
