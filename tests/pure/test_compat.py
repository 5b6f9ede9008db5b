"""gpuguard.base.compat: on 3.10 the shims must behave as 3.11's standard library does, which is
what the same tests check on 3.11+ (.ci/run runs tests/pure on 3.10, 3.11 and 3.13)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from gpuguard.base.compat import StrEnum, fromisoformat
from gpuguard.orphans.vocabulary import Reason, Verdict


class Colour(StrEnum):
    DARK_RED = "dark-red"
    PLAIN = "plain"


@pytest.mark.parametrize("member", [Colour.DARK_RED, Verdict.ORPHAN, Reason.LAUNCHER_KILLED])
def test_a_member_reads_as_its_value_everywhere(member: StrEnum) -> None:
    """JSON, metric labels, audit records and messages carry the value, never Cls.NAME."""
    value = member.value
    assert isinstance(member, str) and member == value and hash(member) == hash(value)
    assert str(member) == f"{member}" == format(member) == value
    assert "%s" % member == value  # noqa: UP031 - how logging formats its arguments
    assert f"{member:>20}" == f"{value:>20}" and f"{member:.3}" == value[:3]
    assert json.dumps(member) == json.dumps(value)
    assert json.dumps({member: [member]}) == json.dumps({value: [value]})
    assert ",".join([member, member]) == f"{value},{value}"
    assert repr(member) == f"<{type(member).__name__}.{member.name}: {value!r}>"
    assert type(member)(value) is member


def test_members_are_str_subclasses_and_compare_by_value() -> None:
    assert issubclass(Colour, str)
    assert sorted([Colour.PLAIN, Colour.DARK_RED]) == ["dark-red", "plain"]
    assert Colour("plain") is Colour.PLAIN
    with pytest.raises(ValueError):
        Colour("PLAIN")


UTC = timezone.utc


@pytest.mark.parametrize(("text", "expected"), [
    ("2024-01-01T00:00:00Z", datetime(2024, 1, 1, tzinfo=UTC)),
    # Go's time.Time JSON (Alertmanager's startsAt): nanoseconds, cut to microseconds.
    ("2024-01-01T00:00:00.123456789Z", datetime(2024, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)),
    ("2024-01-01T00:00:00.1Z", datetime(2024, 1, 1, 0, 0, 0, 100000, tzinfo=UTC)),
    ("2024-01-01T12:30:00.12+02:00",
     datetime(2024, 1, 1, 12, 30, 0, 120000, tzinfo=timezone(timedelta(hours=2)))),
    ("2024-01-01T00:00:00-05:30", datetime(2024, 1, 1, tzinfo=timezone(-timedelta(hours=5.5)))),
    ("2024-01-01 00:00:00Z", datetime(2024, 1, 1, tzinfo=UTC)),
    ("2024-01-01T00:00:00+0200", datetime(2024, 1, 1, tzinfo=timezone(timedelta(hours=2)))),
    ("2024-01-01T00:00:00", datetime(2024, 1, 1)),
    ("2024-01-01T00:00:00.123+00:00", datetime(2024, 1, 1, 0, 0, 0, 123000, tzinfo=UTC)),
])
def test_rfc3339_times_parse_as_on_3_11(text: str, expected: datetime) -> None:
    parsed = fromisoformat(text)
    assert parsed == expected and parsed.utcoffset() == expected.utcoffset()


@pytest.mark.parametrize("text", ["garbage", "2024-13-01T00:00:00Z", "2024-01-01T00:00:00zz",
                                  "", "2024-01-01T25:00:00Z"])
def test_what_is_not_a_time_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        fromisoformat(text)
