"""A background loop: call one function every N seconds on a daemon thread until stopped.

The exporter's scanner and the remediator's Alertmanager poller both need exactly
this; the function itself must not raise (each caller counts or logs its failures).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Periodic:
    """Calls `tick` at a fixed rate (the interval counts from the start of each call)."""

    def __init__(self, name: str, interval: float, tick: Callable[[], object]) -> None:
        self.name = name
        self.interval = interval
        self._tick = tick
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
        while not self._stop.is_set():
            began = time.monotonic()
            self._tick()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - began)))
