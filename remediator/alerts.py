"""Parse and validate Alertmanager webhook payloads (version "4").

Strict about the shape the remediator relies on (each alert's status and
string labels), tolerant of everything else: newer Alertmanager versions add
keys, and an unknown key must never turn a real alert into a 400. Every error
names the offending path (`alerts[3].labels.root_pid`) so a 400 explains itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

VERSION = "4"
STATUSES = ("firing", "resolved")
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


class PayloadError(ValueError):
    """The payload is JSON but not an Alertmanager notification; str names the problem."""


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


def _type_name(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _string(where: str, value: Any, *, required: bool = True, default: str = "") -> str:
    if value is None and not required:
        return default
    if not isinstance(value, str):
        raise PayloadError(f"{where}: must be a string, got {_type_name(value)}")
    return value


def _string_map(where: str, value: Any, *, required: bool) -> dict[str, str]:
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise PayloadError(f"{where}: must be an object of strings, got {_type_name(value)}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise PayloadError(f"{where}.{key}: must be a string, got {_type_name(item)}")
    return dict(value)


def parse_time(where: str, value: Any) -> float | None:
    """RFC 3339 (Go's time.Time JSON, nanoseconds allowed) -> Unix seconds; zero time -> None."""
    if value is None:
        return None
    text = _string(where, value)
    if text.startswith("0001-01-01T"):
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise PayloadError(f"{where}: not an RFC 3339 time: {text[:64]!r}") from None
    if when.tzinfo is None:
        raise PayloadError(f"{where}: time has no zone: {text[:64]!r}")
    return when.timestamp()


def asks_for_remediation(labels: Mapping[str, str]) -> bool:
    """Whether an alert's labels carry remediate="true", as the only reaping rule sets."""
    return labels.get(REMEDIATE_LABEL) == REMEDIATE_VALUE


def parse_alert(where: str, raw: Any) -> Alert:
    """One alert of a notification (or of a pull); PayloadError names what is off."""
    return _alert(where, raw)


def _alert(where: str, raw: Any) -> Alert:
    if not isinstance(raw, dict):
        raise PayloadError(f"{where}: must be an object, got {_type_name(raw)}")
    status = raw.get("status")
    if status not in STATUSES:
        got = repr(status)[:40] if isinstance(status, str) else _type_name(status)
        raise PayloadError(f"{where}.status: must be one of {', '.join(STATUSES)}, got {got}")
    return Alert(
        status=status,
        labels=_string_map(f"{where}.labels", raw.get("labels"), required=True),
        annotations=_string_map(f"{where}.annotations", raw.get("annotations"), required=False),
        starts_at=parse_time(f"{where}.startsAt", raw.get("startsAt")),
        ends_at=parse_time(f"{where}.endsAt", raw.get("endsAt")),
        fingerprint=_string(f"{where}.fingerprint", raw.get("fingerprint"), required=False),
        generator_url=_string(f"{where}.generatorURL", raw.get("generatorURL"), required=False),
    )


def parse_notification(data: Any) -> Notification:
    """Validate a decoded JSON body; raise PayloadError naming the first problem."""
    if not isinstance(data, dict):
        raise PayloadError(f"body: must be an object, got {_type_name(data)}")
    version = data.get("version")
    if version != VERSION:
        got = repr(version)[:40] if version is not None else "nothing"
        raise PayloadError(f"version: must be \"{VERSION}\", got {got}")
    alerts = data.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError(f"alerts: must be a list, got {_type_name(alerts)}")
    if len(alerts) > MAX_ALERTS:
        raise PayloadError(f"alerts: {len(alerts)} alerts, at most {MAX_ALERTS} per notification")
    truncated = data.get("truncatedAlerts", 0)
    if isinstance(truncated, bool) or not isinstance(truncated, int):
        raise PayloadError(f"truncatedAlerts: must be an integer, got {_type_name(truncated)}")
    return Notification(
        receiver=_string("receiver", data.get("receiver"), required=False),
        status=_string("status", data.get("status"), required=False),
        alerts=tuple(_alert(f"alerts[{i}]", raw) for i, raw in enumerate(alerts)),
        group_key=_string("groupKey", data.get("groupKey"), required=False),
        truncated_alerts=truncated,
        external_url=_string("externalURL", data.get("externalURL"), required=False),
    )
