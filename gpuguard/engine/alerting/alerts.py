"""Parse and validate Alertmanager webhook payloads (version "4").

Strict about the shape the remediator relies on (each alert's status and
string labels), tolerant of everything else: newer Alertmanager versions add
keys, and an unknown key must never turn a real alert into a 400. Every error
names the offending path (`alerts[3].labels.root_pid`) so a 400 explains itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuguard.base.compat import StrEnum, fromisoformat
from gpuguard.base.validation import (
    JSON_TYPES,
    At,
    Format,
    Invalid,
    choice,
    integer,
    of_type,
    optional_string,
    string,
    string_map,
)

VERSION = "4"
#: More alerts than this in one notification is a sender bug or an attack; the
#: remediator's route groups by tree, so a real notification carries one or a few.
MAX_ALERTS = 1000
#: Alertmanager's "not set" time (endsAt while firing).
ZERO_TIME = "0001-01-01T00:00:00Z"
#: The label a rule sets to ask for a reap (alerts/rules.yml: remediate: "true"). The
#: webhook path gets only such alerts from Alertmanager's route (alerts/alertmanager.yml
#: matches it); pull mode asks for and re-checks it itself (`asks_for_remediation`).
REMEDIATE_LABEL = "remediate"
REMEDIATE_VALUE = "true"


class AlertStatus(StrEnum):
    FIRING = "firing"
    RESOLVED = "resolved"


class PayloadError(Invalid, ValueError):
    """The payload is JSON but not an Alertmanager notification; str names the problem."""


#: A webhook body: JSON from the network, so a value shown in a message is clipped.
PAYLOAD = Format(PayloadError, JSON_TYPES, clip=40)


@dataclass(frozen=True)
class Alert:
    """One alert of a notification, with its own status and labels (never the group's)."""

    status: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str] = field(default_factory=dict)
    starts_at: float | None = None  # Unix seconds; None when absent or Alertmanager's zero time
    ends_at: float | None = None
    fingerprint: str = ""
    generator_url: str = ""

    def label(self, name: str) -> str | None:
        return self.labels.get(name)

    def to_json(self) -> dict[str, Any]:
        """The fields the remediator keeps (ledger, audit): enough to re-decide after a restart."""
        return {
            "status": self.status,
            "labels": dict(self.labels),
            "startsAt": self.starts_at,
            "endsAt": self.ends_at,
            "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Alert:
        """Inverse of to_json (trusted input: our own ledger file)."""
        return cls(
            status=str(data["status"]),
            labels={str(k): str(v) for k, v in dict(data["labels"]).items()},
            starts_at=data.get("startsAt"),
            ends_at=data.get("endsAt"),
            fingerprint=str(data.get("fingerprint", "")),
        )


@dataclass(frozen=True)
class Notification:
    """One webhook delivery: a group of alerts plus the group's identity."""

    receiver: str
    status: str
    alerts: tuple[Alert, ...]
    group_key: str = ""
    truncated_alerts: int = 0
    external_url: str = ""


def _time(at: At, value: Any) -> float | None:
    """RFC 3339 (Go's time.Time JSON, nanoseconds allowed) -> Unix seconds; zero time -> None."""
    if value is None:
        return None
    text = string(at, value)
    if text.startswith("0001-01-01T"):
        return None
    try:
        when = fromisoformat(text)  # 3.11's, on 3.10 too
    except ValueError:
        raise at.error(f"not an RFC 3339 time: {text[:64]!r}") from None
    if when.tzinfo is None:
        raise at.error(f"time has no zone: {text[:64]!r}")
    return when.timestamp()


def asks_for_remediation(labels: Mapping[str, str]) -> bool:
    """Whether an alert's labels carry remediate="true", as the only reaping rule sets."""
    return labels.get(REMEDIATE_LABEL) == REMEDIATE_VALUE


def parse_alert(where: str, raw: Any) -> Alert:
    """One alert of a notification (or of a pull); PayloadError names what is off."""
    return _alert(At(PAYLOAD, where), raw)


def _alert(at: At, raw: Any) -> Alert:
    of_type(at, raw, dict)
    return Alert(
        status=choice(at.child("status"), raw.get("status"), tuple(AlertStatus)),
        labels=string_map(at.child("labels"), raw.get("labels")),
        annotations=string_map(at.child("annotations"), raw.get("annotations"), required=False),
        starts_at=_time(at.child("startsAt"), raw.get("startsAt")),
        ends_at=_time(at.child("endsAt"), raw.get("endsAt")),
        fingerprint=optional_string(at.child("fingerprint"), raw.get("fingerprint")),
        generator_url=optional_string(at.child("generatorURL"), raw.get("generatorURL")),
    )


def parse_notification(data: Any) -> Notification:
    """Validate a decoded JSON body; raise PayloadError naming the first problem."""
    of_type(At(PAYLOAD, "body"), data, dict)
    version = data.get("version")
    if version != VERSION:
        got = repr(version)[:40] if version is not None else "nothing"
        raise At(PAYLOAD, "version").error(f"must be \"{VERSION}\", got {got}")
    alerts = of_type(At(PAYLOAD, "alerts"), data.get("alerts"), list)
    if len(alerts) > MAX_ALERTS:
        raise At(PAYLOAD, "alerts").error(f"{len(alerts)} alerts, at most {MAX_ALERTS} per "
                                          "notification")
    truncated = integer(At(PAYLOAD, "truncatedAlerts"), data.get("truncatedAlerts", 0),
                        minimum=None)
    return Notification(
        receiver=optional_string(At(PAYLOAD, "receiver"), data.get("receiver")),
        status=optional_string(At(PAYLOAD, "status"), data.get("status")),
        alerts=tuple(_alert(At(PAYLOAD, "alerts").item(i), raw) for i, raw in enumerate(alerts)),
        group_key=optional_string(At(PAYLOAD, "groupKey"), data.get("groupKey")),
        truncated_alerts=truncated,
        external_url=optional_string(At(PAYLOAD, "externalURL"), data.get("externalURL")),
    )
