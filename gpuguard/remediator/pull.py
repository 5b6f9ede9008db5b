"""Pull mode: poll for this host's alerts instead of receiving webhooks.

For a fleet with one central Alertmanager: no route per node, no inbound port. Every
`pull_interval_seconds` the remediator asks its source for its own firing
remediate="true" alerts named in `remediate.alerts` and hands them to the same intake a
webhook delivery goes through. The source is Alertmanager (active, unsilenced,
uninhibited alerts: engine/alerting/alertmanager.py) or Prometheus (the ALERTS series,
whose cost follows what matches: engine/alerting/prometheus.py); either way Alertmanager
confirms each reap. Why: docs/design.md, The reap (pull mode); when and how it polls a
busy source: polling.py.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from gpuguard.base.periodic import Periodic
from gpuguard.engine.alerting.alerts import Alert, Notification, PayloadError, parse_alert
from gpuguard.engine.alerting.polling import (
    FAILED_POLLS_UNHEALTHY,
    JITTER,
    STALLED_INTERVALS,
    PollStats,
    delay_after,
    first_delay,
    host_random,
    next_delay,
)
from gpuguard.engine.alerting.pulled import PollAnswer, SkipReason
from gpuguard.engine.state.decision_log import DecisionSource
from gpuguard.remediator.screening import Intake
from gpuguard.remediator.status import HealthCode

log = logging.getLogger("gpuguard.remediator.pull")

RECEIVER = "gpuguard-remediator-pull"
#: How each source is named in the log and in /healthz's details.
SOURCE_NAMES = {"alertmanager": "Alertmanager", "prometheus": "Prometheus"}


class PullSource(Protocol):
    """What the poller asks (AlertmanagerClient, PrometheusClient): one poll of this
    host's firing alerts, and the accounting /metrics reads."""

    source: str  # "alertmanager" or "prometheus": the metrics' source label
    urls: tuple[str, ...]
    timeout: float
    polls: PollStats

    def poll(self, *, hostname: str, alertnames: Iterable[str]) -> PollAnswer: ...
    def count_skipped(self, why: SkipReason, n: int = 1) -> None: ...
    def skip_counts(self) -> dict[str, int]: ...


class Puller:
    """One background thread; each poll is one delivery of this host's firing alerts.

    When: polling.py (jittered, backing off after a busy or slow Alertmanager); `rng`
    defaults to this host's own (polling.host_random), so a test can replay it.
    """

    def __init__(self, intake: Intake, client: PullSource, *, interval: float,
                 rng: random.Random | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.intake = intake
        self.client = client
        self.name = SOURCE_NAMES.get(client.source, client.source)
        self.interval = interval
        self.rng = rng if rng is not None else host_random(intake.hostname)
        self.polls = 0
        self.failed_polls = 0
        self.failures_in_a_row = 0
        self.last: PollAnswer | None = None
        self._monotonic = monotonic
        self._started: float | None = None
        self._last_completed: float | None = None
        # The first poll anywhere in the first interval (not in step with the other hosts).
        self._loop = Periodic("gpuguard-remediator-pull", interval, self._poll,
                              first=first_delay(interval, self.rng),
                              after=lambda _took: self.next_delay())

    def poll_once(self) -> int | None:
        """Deliver what the source says fires for this host now; None when it did not say."""
        answer = self.client.poll(hostname=self.intake.hostname,
                                  alertnames=self.intake.policy.alerts)
        self.last = answer
        self.polls += 1
        self._last_completed = self._monotonic()
        alerts = answer.alerts
        if alerts is None:
            self.failed_polls += 1
            self.failures_in_a_row += 1
            if self.failures_in_a_row == 1:
                log.warning("pull: no %s answered (%s: %s); nothing is delivered "
                            "until one does", self.name, answer.result, answer.detail)
            return None
        if self.failures_in_a_row:
            log.info("pull: %s answers again after %d failed poll(s)", self.name,
                     self.failures_in_a_row)
            self.failures_in_a_row = 0
        parsed: list[Alert] = []
        for i, raw in enumerate(alerts):
            try:
                parsed.append(parse_alert(f"alerts[{i}]", raw))
            except PayloadError as exc:  # e.g. a startsAt that is no RFC 3339 time
                self.client.count_skipped(SkipReason.MALFORMED)
                log.debug("pull: alert skipped: %s", exc)
        if not parsed:
            return 0
        self.intake.submit(Notification(receiver=RECEIVER, status="firing",
                                        alerts=tuple(parsed),
                                        group_key=f"pull:{self.intake.hostname}"),
                           source=DecisionSource.PULL)
        return len(parsed)

    def next_delay(self) -> float:
        """Seconds from the end of the last poll to the next one."""
        last = self.last
        if last is None:
            return next_delay(self.interval, self.rng)
        return delay_after(last.result, self.failures_in_a_row, self.interval, self.rng,
                           last.retry_after)

    def problem(self) -> tuple[HealthCode, str] | None:
        """Why /healthz should say the poller is degraded; None while it is not. A stall
        first: after failed polls a hung one still is one (which a restart mends, and the
        liveness probe restarts), while a poller that fails but polls never stalls (its
        back-off stays under the interval, the stall limit is STALLED_INTERVALS of them)."""
        since = self._last_completed if self._last_completed is not None else self._started
        if since is not None:
            limit = self.stall_limit()
            quiet = self._monotonic() - since
            if quiet > limit:
                return HealthCode.POLLER_STALLED, (f"no poll of {self.name} completed for "
                                                   f"{quiet:.0f}s (over {limit:g}s)")
        if self.failures_in_a_row >= FAILED_POLLS_UNHEALTHY:
            last = self.last
            why = f"{last.result}: {last.detail}" if last is not None else "?"
            return HealthCode.POLLER_FAILING, (f"{self.failures_in_a_row} polls of "
                                               f"{self.name} in a row failed (last {why})")
        return None

    def stall_limit(self) -> float:
        """STALLED_INTERVALS intervals at their longest, plus the longest one poll takes."""
        return (STALLED_INTERVALS * self.interval * (1 + JITTER)
                + self.client.timeout * len(self.client.urls))

    def start(self) -> None:
        self._started = self._monotonic()
        self._loop.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._loop.stop(timeout)

    def alive(self) -> bool:
        return self._loop.alive()

    def _poll(self) -> None:
        try:
            self.poll_once()
        except Exception:  # a bug must not end polling: logged, and tried again
            log.exception("pull: poll failed")
