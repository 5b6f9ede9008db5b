"""Pull mode: poll Alertmanager for this host's alerts instead of receiving webhooks.

For a fleet with one central Alertmanager: no route per node, no inbound port. Every
`pull_interval_seconds` the remediator asks for its own active, unsilenced,
uninhibited remediate="true" alerts named in `remediate.alerts` and hands them to the
same intake a webhook delivery goes through. Why: docs/design.md, The reap (pull mode).
"""

from __future__ import annotations

import logging

from gpuguard.periodic import Periodic
from gpuguard.remediator.alertmanager import AlertmanagerClient, SkipReason
from gpuguard.remediator.alerts import Alert, Notification, PayloadError, parse_alert
from gpuguard.remediator.decision_log import DecisionSource
from gpuguard.remediator.intake import Intake

log = logging.getLogger("gpuguard.remediator.pull")

RECEIVER = "gpuguard-remediator-pull"


class Puller:
    """One background thread; each poll is one delivery of this host's firing alerts."""

    def __init__(self, intake: Intake, client: AlertmanagerClient, *,
                 interval: float) -> None:
        self.intake = intake
        self.client = client
        self.interval = interval
        self.polls = 0
        self.failed_polls = 0
        self._failing = False
        self._loop = Periodic("gpuguard-remediator-pull", interval, self._tick)

    def poll_once(self) -> int | None:
        """Deliver what Alertmanager says fires for this host now; None when it did not say."""
        alerts = self.client.active_alerts(hostname=self.intake.hostname,
                                           alertnames=self.intake.policy.alerts)
        self.polls += 1
        if alerts is None:
            self.failed_polls += 1
            if not self._failing:
                log.warning("pull: no Alertmanager answered (%s); nothing is delivered until "
                            "one does", ", ".join(self.client.urls))
                self._failing = True
            return None
        if self._failing:
            log.info("pull: Alertmanager answers again")
            self._failing = False
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

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._loop.stop(timeout)

    def alive(self) -> bool:
        return self._loop.alive()

    def _tick(self) -> None:
        try:
            self.poll_once()
        except Exception:  # a bug must not end polling: logged, and tried again
            log.exception("pull: poll failed")
