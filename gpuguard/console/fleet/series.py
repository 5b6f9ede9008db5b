"""What Prometheus and Alertmanager answer, read into plain records: one instant vector
per query, Alertmanager's alerts and its silences.

Pure: the bodies come in decoded, from sources.py. Every answer is remote input, so each
reader checks its shape and says in one line what is off (`ShapeError`); a sample or an
alert of another shape fails the whole answer, since a view that silently dropped one
would show a tree as not alerting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpuguard.base.validation import (
    JSON_TYPES,
    At,
    Format,
    Invalid,
    of_type,
    optional_string,
    string,
    string_list,
    string_map,
)


class ShapeError(Invalid, ValueError):
    """A body that is JSON but not what Prometheus 2.x or Alertmanager 0.25+ send."""


#: Remote answers: messages say what was expected where, and repeat little of the value.
ANSWER = Format(ShapeError, JSON_TYPES, terse=True, clip=60)


@dataclass(frozen=True)
class Sample:
    """One series of an instant vector: its labels and its value (None: NaN or infinite)."""

    labels: dict[str, str]
    value: float | None

    def target(self) -> tuple[str, str]:
        """The scrape target that exported it: (job, instance)."""
        return self.labels.get("job", ""), self.labels.get("instance", "")


@dataclass(frozen=True)
class AmAlert:
    """One alert as Alertmanager's GET /api/v2/alerts gives it."""

    labels: dict[str, str]
    state: str  # active, suppressed, unprocessed
    silenced_by: tuple[str, ...]
    inhibited_by: tuple[str, ...]
    starts_at: str


@dataclass(frozen=True)
class Silence:
    """One silence as GET /api/v2/silences gives it: who set it, why, until when."""

    id: str
    created_by: str
    comment: str
    ends_at: str
    state: str  # active, pending, expired


def vector(data: Any, query: str) -> list[Sample]:
    """GET /api/v1/query's body (status success, an instant vector) -> its samples."""
    at = At(ANSWER, f"answer to {query}")
    body = of_type(at, data, dict)
    if body.get("status") != "success":
        why = body.get("error")
        why = why[:200] if isinstance(why, str) else "no error given"
        raise at.child("status").error(f"not success ({why})")
    result = of_type(at.child("data"), body.get("data"), dict)
    if result.get("resultType") != "vector":
        raise at.child("data.resultType").error("not vector")
    return [_sample(at.child("data.result").item(i), raw)
            for i, raw in enumerate(of_type(at.child("data.result"), result.get("result"), list))]


def _sample(at: At, raw: Any) -> Sample:
    item = of_type(at, raw, dict)
    pair = of_type(at.child("value"), item.get("value"), list)
    if len(pair) != 2:
        raise at.child("value").error("not [time, value]")
    text = string(at.child("value[1]"), pair[1])
    try:
        value: float | None = float(text)
    except ValueError:
        raise at.child("value[1]").error("not a number") from None
    if value is not None and not math.isfinite(value):
        value = None
    return Sample(string_map(at.child("metric"), item.get("metric")), value)


def am_alerts(data: Any) -> list[AmAlert]:
    """GET /api/v2/alerts's body -> its alerts."""
    out = []
    for i, raw in enumerate(of_type(At(ANSWER, "alerts"), data, list)):
        at = At(ANSWER, "alerts").item(i)
        item = of_type(at, raw, dict)
        status = of_type(at.child("status"), item.get("status"), dict)
        out.append(AmAlert(
            labels=string_map(at.child("labels"), item.get("labels")),
            state=string(at.child("status.state"), status.get("state")),
            silenced_by=_ids(at.child("status.silencedBy"), status.get("silencedBy")),
            inhibited_by=_ids(at.child("status.inhibitedBy"), status.get("inhibitedBy")),
            starts_at=optional_string(at.child("startsAt"), item.get("startsAt")),
        ))
    return out


def silences(data: Any) -> dict[str, Silence]:
    """GET /api/v2/silences's body -> its silences by id."""
    out = {}
    for i, raw in enumerate(of_type(At(ANSWER, "silences"), data, list)):
        at = At(ANSWER, "silences").item(i)
        item = of_type(at, raw, dict)
        status = of_type(at.child("status"), item.get("status"), dict)
        found = Silence(
            id=string(at.child("id"), item.get("id"), non_empty=True),
            created_by=optional_string(at.child("createdBy"), item.get("createdBy")),
            comment=optional_string(at.child("comment"), item.get("comment")),
            ends_at=optional_string(at.child("endsAt"), item.get("endsAt")),
            state=string(at.child("status.state"), status.get("state")),
        )
        out[found.id] = found
    return out


def _ids(at: At, value: Any) -> tuple[str, ...]:
    return () if value is None else string_list(at, value)
