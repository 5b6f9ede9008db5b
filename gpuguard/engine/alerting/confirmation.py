"""Alertmanager's word on one tree's alert (Confirmation, ConfirmationState), as plain data.

The Alertmanager client answers with it, the reap and its settlement act on it, the audit
records it and the console shows it: none of them needs the HTTP client to read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuguard.base.compat import StrEnum


class ConfirmationState(StrEnum):
    """Alertmanager's view of one tree's alert (`Confirmation.state`)."""

    FIRING = "firing"
    SILENCED = "silenced"
    INHIBITED = "inhibited"
    NOT_FIRING = "not-firing"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Confirmation:
    """Alertmanager's view of one tree's alert, as an audit line can state it.

    `silence_creators` holds the `createdBy` of each silence in `silenced_by` that
    could be fetched (deduplicated, in order); a failed lookup leaves the state
    "silenced" and says so in `detail`. `url` is the peer that answered (None when
    none did).
    """

    state: ConfirmationState
    detail: str
    silenced_by: tuple[str, ...] = ()
    silence_creators: tuple[str, ...] = ()
    inhibited_by: tuple[str, ...] = ()
    url: str | None = None

    @property
    def firing(self) -> bool:
        """True only for an active, unsilenced, uninhibited alert: the one case to act on."""
        return self.state == ConfirmationState.FIRING

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "detail": self.detail,
            "silenced_by": list(self.silenced_by),
            "silence_creators": list(self.silence_creators),
            "inhibited_by": list(self.inhibited_by),
            "url": self.url,
        }
