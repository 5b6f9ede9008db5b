"""What Python 3.10 lacks and gpuguard uses: one place, so the rest reads as 3.11+ code."""

from __future__ import annotations

import re
import sys
from datetime import datetime
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum

    fromisoformat = datetime.fromisoformat
else:

    class StrEnum(str, Enum):
        """3.11's StrEnum: members are strings, and str() and format() give the value."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)

    # The seconds' fraction and zone of an ISO 8601 time, as 3.10's parser cannot read
    # them: "Z", a fraction of other than 3 or 6 digits (Go writes up to 9), +HH and +HHMM.
    _TAIL = re.compile(
        r"(?P<head>.*[T ]\d\d:\d\d(?::\d\d)?)(?:\.(?P<frac>\d*))?(?P<zone>Z|[+-].*)?", re.DOTALL)
    _SHORT_ZONE = re.compile(r"([+-]\d\d)(\d\d)?")

    def fromisoformat(text: str) -> datetime:
        """3.11's datetime.fromisoformat for RFC 3339 times: "Z" is UTC, and a fraction of
        any length is cut (or padded) to microseconds, and a zone may be +HH or +HHMM."""
        found = _TAIL.fullmatch(text)
        if found is not None:
            frac, zone = found["frac"], found["zone"] or ""
            if short := _SHORT_ZONE.fullmatch(zone):  # +HH or +HHMM
                zone = f"{short[1]}:{short[2] or '00'}"
            text = "".join((found["head"], f".{frac[:6]:0<6}" if frac else "",
                            "+00:00" if zone == "Z" else zone))
        return datetime.fromisoformat(text)


__all__ = ["StrEnum", "fromisoformat"]
