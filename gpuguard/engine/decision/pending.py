"""An accepted alert waiting for the worker (PendingItem): plain data the ledger persists
and the audit names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuguard.engine.alerting.alerts import Alert
from gpuguard.engine.decision.tree import TreeKey


@dataclass(frozen=True)
class PendingItem:
    """An accepted alert waiting for (or deferred by) the worker."""

    key: TreeKey
    alert: Alert
    group_key: str
    accepted_at: float  # boot clock
    due: float  # when the worker should (re-)check it (boot clock)

    def to_json(self) -> dict[str, Any]:
        return {"alert": self.alert.to_json(), "group_key": self.group_key,
                "accepted_at": self.accepted_at, "due": self.due}

    @classmethod
    def from_json(cls, key: TreeKey, data: dict[str, Any]) -> PendingItem:
        return cls(key, Alert.from_json(data["alert"]), str(data.get("group_key", "")),
                   float(data["accepted_at"]), float(data["due"]))
