"""The web config's rate_limit (issue 28): Go durations, and the token bucket as
golang.org/x/time/rate's Allow() answers."""

from __future__ import annotations

import pytest

from gpuguard.base.validation import ConfigError
from gpuguard.web.ratelimit import TokenBucket, go_duration
from gpuguard.web.webconfig import parse_web_config


@pytest.mark.parametrize(("text", "seconds"), [
    ("0", 0.0), ("1s", 1.0), ("250ms", 0.25), ("1m30s", 90.0), ("1.5h", 5400.0),
    ("10us", 1e-5)])
def test_go_durations(text: str, seconds: float) -> None:
    assert go_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "1", "s", "1 s", "1d", "-1s", "1s2"])
def test_not_durations(text: str) -> None:
    with pytest.raises(ValueError):
        go_duration(text)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_starts_full_refills_at_its_rate_and_holds_at_most_burst() -> None:
    clock = Clock()
    bucket = TokenBucket(1.0, 3, clock=clock)
    assert [bucket.allow() for _ in range(4)] == [True, True, True, False]
    clock.now = 1.0
    assert [bucket.allow() for _ in range(2)] == [True, False]
    clock.now = 100.0
    assert [bucket.allow() for _ in range(4)] == [True, True, True, False]


def test_burst_zero_admits_nothing() -> None:
    bucket = TokenBucket(1.0, 0, clock=Clock())
    assert not any(bucket.allow() for _ in range(10))


def test_the_web_config_reads_the_toolkit_files() -> None:
    one = parse_web_config('rate_limit:\n  interval: "1s"\n  burst: 0\n', source="w.yml")
    assert one.rate_limit == (1.0, 0)
    off = parse_web_config("rate_limit:\n  interval: 0\n  burst: 0\n", source="w.yml")
    assert off.rate_limit is None  # no interval: no limiter, as the toolkit
    with pytest.raises(ConfigError, match="rate_limit.interval: not a duration"):
        parse_web_config("rate_limit:\n  interval: soon\n", source="w.yml")
    with pytest.raises(ConfigError, match="rate_limit.burst"):
        parse_web_config("rate_limit:\n  interval: 1s\n  burst: -1\n", source="w.yml")
