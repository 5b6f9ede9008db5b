"""A background loop: call one function every N seconds on a daemon thread until stopped.

The exporter's scanner, the idle watch and the remediator's Alertmanager poller (its own
jittered delays) all need this; the function itself must not raise (each caller counts or
logs its failures).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Periodic:
    """Calls `tick` at a fixed rate (the interval counts from the start of each call), or
    when `first` and `after` say: `first` seconds after start, then `after(elapsed)`
    seconds after the end of each call (the poller's jitter and back-off)."""

    def __init__(self, name: str, interval: float, tick: Callable[[], object], *,
                 first: float = 0.0, after: Callable[[float], float] | None = None) -> None:
        self.name = name
        self.interval = interval
        self._tick = tick
        self._first = first
        self._after = after if after is not None else (lambda took: self.interval - took)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        if self._first > 0 and self._stop.wait(self._first):
            return
        while not self._stop.is_set():
            began = time.monotonic()
            self._tick()
            self._stop.wait(max(0.0, self._after(time.monotonic() - began)))
