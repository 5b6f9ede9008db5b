"""How a benchmark target is judged: what a short run on CI's shared cores fails on and
what it only reports (benchmarks/harness.py, Target)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.harness import SHORT_SLACK, Result  # noqa: E402


def judged(short: bool, value: float, bound: dict[str, float]) -> str:
    result = Result("b", short=short)
    result.timed_ratio("r", value, at_most=bound.get("at_most"), at_least=bound.get("at_least"))
    return result.targets[0].status


@pytest.mark.parametrize(("value", "bound", "short", "status"), [
    (1.4, {"at_most": 1.5}, True, "PASS"),
    (1.55, {"at_most": 1.5}, True, "SLOW"),  # CI's miss by a hair: reported
    (1.5 * SHORT_SLACK + 0.01, {"at_most": 1.5}, True, "FAIL"),  # a regression: failed
    (1.55, {"at_most": 1.5}, False, "FAIL"),  # the full run judges the goal itself
    (5.4, {"at_least": 5.0}, True, "PASS"),
    (4.0, {"at_least": 5.0}, True, "SLOW"),
    (1.0, {"at_least": 5.0}, True, "FAIL"),  # every thread read every scan again
    (4.0, {"at_least": 5.0}, False, "FAIL"),
])
def test_a_short_run_fails_a_timed_ratio_only_when_it_is_far_off(
        value: float, bound: dict[str, float], short: bool, status: str) -> None:
    assert judged(short, value, bound) == status


def test_a_short_run_still_fails_a_count_and_reports_an_absolute_time() -> None:
    result = Result("b", short=True)
    result.target("reads per scan", "300", "<= 260", False)
    result.target("p99", "900 ms", "< 250 ms", False, absolute=True)
    assert [t.status for t in result.targets] == ["FAIL", "SLOW"]
    assert [t.name for t in result.failed()] == ["reads per scan"]


def test_a_timed_ratio_takes_exactly_one_bound() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Result("b").timed_ratio("r", 1.0)
    with pytest.raises(ValueError, match="exactly one"):
        Result("b").timed_ratio("r", 1.0, at_most=2, at_least=1)
