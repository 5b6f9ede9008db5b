"""The web config's `rate_limit`: a token bucket over the requests behind its auth, as
exporter-toolkit builds one (golang.org/x/time/rate: `interval` per token, `burst`
tokens at most; burst 0 admits nothing). Over the rate, 429."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def go_duration(text: str) -> float:
    """Seconds in a Go duration ("1s", "1m30s", "250ms", "0"); ValueError otherwise."""
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    for match in _PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ValueError(f"not a duration like 1s or 250ms: {text!r}")
    return total


class TokenBucket:
    """One token per `interval` seconds, at most `burst` held; full at the start."""

    def __init__(self, interval: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst),
                               self._tokens + (now - self._at) / self.interval)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False
