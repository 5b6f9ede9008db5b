"""A background loop: call one function every N seconds on a daemon thread until stopped.

The exporter's scanner, the idle watch and the remediator's Alertmanager poller (its own
jittered delays) all need this; the function itself must not raise (each caller counts or
logs its failures).

`run_soon()` asks for an early call (the exporter's scanner, woken by the exit of a
process on a GPU holder's chain: docs/exporter.md, Event-driven rescans). It is
debounced and bounded: the loop waits `settle` seconds after the first request, so a burst
of requests (one launcher's whole process group dying) costs one call, and never starts an
early call sooner than `min_gap` seconds after the start of the last call, so requests at
any rate cost at most 1/min_gap early calls a second. The regular rate counts from the
start of each call, early or not: an early call moves the next regular one later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: An early call waits this long after the first request: what the rest of a burst takes
#: to arrive (a process group's SIGKILL reaches every member within a few milliseconds).
SETTLE_S = 0.03
#: And starts at least this long after the start of the last call: at most 4 a second.
MIN_GAP_S = 0.25


class Periodic:
    """Calls `tick` at a fixed rate (the interval counts from the start of each call), or
    when `first` and `after` say: `first` seconds after start, then `after(elapsed)`
    seconds after the end of each call (the poller's jitter and back-off); and early,
    debounced and bounded, after `run_soon()`."""

    def __init__(self, name: str, interval: float, tick: Callable[[], object], *,
                 first: float = 0.0, after: Callable[[float], float] | None = None,
                 settle: float = SETTLE_S, min_gap: float = MIN_GAP_S) -> None:
        self.name = name
        self.interval = interval
        self._tick = tick
        self._first = first
        self._after = after if after is not None else (lambda took: self.interval - took)
        self._settle = settle
        self._min_gap = min_gap
        self._stop = threading.Event()
        self._soon = threading.Event()
        self._thread: threading.Thread | None = None
        self._began = -float("inf")  # monotonic start of the last call
        #: Calls made early, on a run_soon() request, once each has returned (written by
        #: the loop thread only).
        self.early = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._soon.set()  # wakes a wait for either
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run_soon(self) -> None:
        """Ask for an early call. Never blocks (an Event's set): callable from any thread,
        the process-event reader's included, at any rate."""
        self._soon.set()

    def _run(self) -> None:
        if self._first > 0 and self._stop.wait(self._first):
            return
        early = False
        while not self._stop.is_set():
            self._began = time.monotonic()
            self._soon.clear()  # this call covers every request made so far
            self._tick()
            if early:
                self.early += 1
            ended = time.monotonic()
            early = self._wait(ended + max(0.0, self._after(ended - self._began)))

    def _wait(self, due: float) -> bool:
        """Until `due` (monotonic) or an early call's time, whichever comes first; True for
        an early call. A request made during a call is kept: it asks for another."""
        while not self._stop.is_set():
            left = due - time.monotonic()
            if left <= 0:
                return False
            if not self._soon.wait(left) or self._stop.is_set():
                continue
            start = max(time.monotonic() + self._settle, self._began + self._min_gap)
            if start >= due:  # the regular call comes first and covers the request
                self._stop.wait(max(0.0, due - time.monotonic()))
                return False
            self._stop.wait(max(0.0, start - time.monotonic()))  # requests meanwhile: one call
            return not self._stop.is_set()
        return False
