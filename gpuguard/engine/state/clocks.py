"""The remediator's three clocks, injected together (tests move them by hand).

The wall clock dates audit records and /state; the boot clock (the ledger's, which no
wall-clock step moves) counts ages, rate-limit windows and due times; the monotonic
clock bounds one item's work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Clocks:
    wall: Callable[[], float]
    boot: Callable[[], float]
    monotonic: Callable[[], float]

    def on_wall(self, boot_time: float) -> float:
        """A boot-clock time as Unix seconds, for people (the clocks' offset now)."""
        return boot_time + (self.wall() - self.boot())
