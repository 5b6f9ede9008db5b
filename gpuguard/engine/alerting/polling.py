"""Pull mode's schedule and accounting: when to poll next, which peer first, what polls did.

Measured against one Alertmanager 0.25 holding 10,000 alerts (issue 43): it sheds GETs
beyond 8 in flight with 503, and a fleet whose remediators all poll in step, try the HA
peers in the same order and wait a whole interval after a 503 loses polls while every
/healthz says ok. So: the first poll at a random offset in the interval and each next at
interval * (1 +- JITTER); after a 503 (or 429) or a timeout, retries sooner, backing off
exponentially up to the interval (a Retry-After honoured up to the same cap); the peers
in an order of this host's own; and the polls counted, timed and judged for /healthz.
Everything random here comes from a Random seeded by the host name, so a test can
replay a host's schedule.
"""

from __future__ import annotations

import random
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from gpuguard.base.compat import StrEnum

#: Each interval is interval * (1 +- JITTER).
JITTER = 0.1
#: The first retry after a busy or slow Alertmanager; each next one doubles, up to the
#: interval.
FIRST_BACKOFF_SECONDS = 1.0
#: /healthz says `poller-failing` after this many failed polls in a row.
FAILED_POLLS_UNHEALTHY = 3
#: ... and `poller-stalled` when no poll has completed for this many intervals (plus the
#: longest a poll may take: timeout_seconds per peer).
STALLED_INTERVALS = 3
#: Poll latency histogram buckets (seconds); timeouts land in the last ones.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PollResult(StrEnum):
    """How one poll went (gpuguard_remediator_alertmanager_polls_total{result})."""

    OK = "ok"
    BUSY = "busy"  # every peer failed, one at least with 503 or 429: retried sooner
    TIMEOUT = "timeout"  # every peer failed, one at least by the deadline: retried sooner
    UNAUTHORIZED = "unauthorized"
    ERROR = "error"

    @property
    def retried_sooner(self) -> bool:
        return self in (PollResult.BUSY, PollResult.TIMEOUT)


def host_random(hostname: str) -> random.Random:
    """The schedule's randomness for one host: different per host, the same per run."""
    return random.Random(f"gpuguard-pull:{hostname}")


def peer_order(urls: Sequence[str], hostname: str) -> tuple[str, ...]:
    """The HA peers rotated by a stable hash of the host name: each host starts at its
    own peer (all of them still in the configured cyclic order)."""
    if not urls:
        return ()
    start = zlib.crc32(hostname.encode("utf-8", "surrogateescape")) % len(urls)
    return tuple(urls[start:]) + tuple(urls[:start])


def first_delay(interval: float, rng: random.Random) -> float:
    """Seconds from start to the first poll: anywhere in the first interval."""
    return rng.uniform(0.0, interval)


def next_delay(interval: float, rng: random.Random) -> float:
    """Seconds from the end of a poll that went well (or failed for good) to the next."""
    return interval * rng.uniform(1.0 - JITTER, 1.0 + JITTER)


def backoff_delay(failures: int, interval: float, rng: random.Random,
                  retry_after: float | None = None) -> float:
    """Seconds to wait after the `failures`-th busy or timed-out poll in a row (1, 2, ...):
    FIRST_BACKOFF_SECONDS doubling each time, jittered, never under what Retry-After
    asked, never over the interval."""
    base = FIRST_BACKOFF_SECONDS * 2.0 ** max(0, min(failures - 1, 30))
    delay = base * rng.uniform(1.0 - JITTER, 1.0 + JITTER)
    if retry_after is not None:
        delay = max(delay, retry_after)
    return min(delay, interval)


def delay_after(result: PollResult, failures: int, interval: float, rng: random.Random,
                retry_after: float | None) -> float:
    """Seconds until the next poll after one with `result`, `failures` failed in a row."""
    if result.retried_sooner:
        return backoff_delay(failures, interval, rng, retry_after)
    return next_delay(interval, rng)


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header's delay-seconds; None for absent, a date, or nonsense (an
    HTTP-date would need the wall clock, and Alertmanager sends none)."""
    seconds = (value or "").strip()
    if not (seconds.isascii() and seconds.isdigit()):  # str.isdigit() alone takes '²'
        return None
    return float(seconds)


@dataclass(frozen=True)
class PollView:
    """One scrape's copy of the poll accounting."""

    counts: dict[PollResult, int]
    buckets: tuple[int, ...]  # cumulative, one per DURATION_BUCKETS entry, then +Inf
    duration_sum: float
    failures_in_a_row: int
    last_completed: float | None  # monotonic clock
    last_ok: float | None  # monotonic clock


class PollStats:
    """What polls did: counts by result, latency, failures in a row, when one last ended.
    Thread-safe (the poller writes, scrapes and /healthz read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(PollResult, 0)
        self._buckets = [0] * (len(DURATION_BUCKETS) + 1)
        self._sum = 0.0
        self._failures = 0
        self._last_completed: float | None = None
        self._last_ok: float | None = None

    def record(self, result: PollResult, seconds: float, now: float) -> int:
        """Count one poll that ended at `now`; how many failed in a row (0 after an ok)."""
        with self._lock:
            self._counts[result] += 1
            for i, bound in enumerate((*DURATION_BUCKETS, float("inf"))):
                if seconds <= bound:
                    self._buckets[i] += 1
            self._sum += seconds
            self._failures = 0 if result == PollResult.OK else self._failures + 1
            self._last_completed = now
            if result == PollResult.OK:
                self._last_ok = now
            return self._failures

    def view(self) -> PollView:
        with self._lock:
            return PollView(dict(self._counts), tuple(self._buckets), self._sum,
                            self._failures, self._last_completed, self._last_ok)
