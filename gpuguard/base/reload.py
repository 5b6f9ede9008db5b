"""SIGHUP reloads a daemon's configuration, as Prometheus and Alertmanager do.

The signal handler only starts a thread: the reload reads files and takes locks, which
must not happen inside a handler that interrupted the serving loop (or a reap). At most
one such thread runs: a SIGHUP during a reload asks for one more reload after it, however
many came (each started its own thread before, and a config file that blocks, say on a
network mount, piled them up). A bad file is refused with one log line and the running
configuration stays; the outcome is exported under Prometheus's own names with our
prefix.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class ReloadRefused(Exception):
    """A new configuration that this daemon cannot take while running (the message says
    which key and why); the running one is kept."""


class Reloader(Collector):
    """One reload at a time, started from SIGHUP; also the collector of its outcome."""

    def __init__(self, program: str, reload: Callable[[], None], *,
                 log: logging.Logger, clock: Callable[[], float] = time.time) -> None:
        self.program = program
        self._reload = reload
        self._log = log
        self._clock = clock
        self._lock = threading.Lock()
        # Guards the two flags below. Re-entrant: the SIGHUP handler runs on the main
        # thread between two bytecodes, possibly inside request() itself.
        self._gate = threading.RLock()
        self._running = False  # a reload thread is on its way
        self._again = False  # a SIGHUP came while it was: one more reload after this one
        self.successful = True  # the configuration the daemon started with loaded
        self.success_time = clock()
        self.attempts = 0
        self.threads = 0  # reload threads started so far

    def request(self, _signum: int = 0, _frame: object = None) -> None:
        """The SIGHUP handler: hand the reload to a thread and return at once; while one
        runs, only note that one more reload is wanted."""
        with self._gate:
            if self._running:
                self._again = True
                return
            self._running = True
            self.threads += 1
        threading.Thread(target=self._drain, name=f"{self.program}-reload",
                         daemon=True).start()

    @property
    def busy(self) -> bool:
        """A reload thread is running (or about to)."""
        with self._gate:
            return self._running

    def _drain(self) -> None:
        """Reload until no SIGHUP came during the last reload (so the last file wins)."""
        while True:
            try:
                self.run()
            except BaseException:  # run() keeps Exception; the next SIGHUP must still work
                with self._gate:
                    self._running = self._again = False
                raise
            with self._gate:
                if not self._again:
                    self._running = False
                    return
                self._again = False

    def run(self) -> bool:
        """Reload now; True when the new configuration is in use."""
        return self.attempt() is None

    def attempt(self) -> str | None:
        """Reload now, as SIGHUP does (after any reload under way): None when the new
        configuration is in use, else why it is not (POST /-/reload answers it)."""
        with self._lock:
            self.attempts += 1
            try:
                self._reload()
            except ReloadRefused as exc:
                self._log.error("reload refused, running configuration kept: %s", exc)
                self.successful = False
                return f"reload refused, running configuration kept: {exc}"
            except Exception as exc:  # a ConfigError, an unreadable file: keep running
                self._log.error("reload failed, running configuration kept: %s", exc)
                self.successful = False
                return f"reload failed, running configuration kept: {exc}"
            self.successful = True
            self.success_time = self._clock()
            self._log.info("configuration reloaded")
            return None

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self.collect())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "gpuguard_config_last_reload_successful",
            "Whether the last configuration reload (SIGHUP) succeeded (1) or was refused (0).",
            value=1.0 if self.successful else 0.0)
        yield GaugeMetricFamily(
            "gpuguard_config_last_reload_success_timestamp_seconds",
            "When the configuration in use was loaded (Unix time).", value=self.success_time)


class EarlyHangups:
    """A SIGHUP before the daemon serves (systemd's ExecReload= may send one right after a
    start) is noted, never fatal: its default action would end the daemon mid-start, a
    death systemd counts as clean and does not restart. Handed to the reloader later."""

    def __init__(self) -> None:
        self.pending = False
        # Signal handlers can only be set from the main thread; Windows has no SIGHUP
        # (a changed config takes a restart of the service there).
        self._installed = (threading.current_thread() is threading.main_thread()
                           and hasattr(signal, "SIGHUP"))
        if self._installed:
            signal.signal(signal.SIGHUP, self._note)

    def _note(self, _signum: int, _frame: object) -> None:
        self.pending = True

    def hand_to(self, reloader: Reloader) -> None:
        """From now on SIGHUP reloads; one that came before reloads now."""
        if self._installed:
            signal.signal(signal.SIGHUP, reloader.request)
        if self.pending:
            self.pending = False
            reloader.request()
