"""The remediator's /metrics: Prometheus families built fresh on every scrape from its
counters, its Alertmanager client's, the inspector's and the process events'."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gpuguard.engine.alerting.peers import RequestResult
from gpuguard.engine.alerting.polling import DURATION_BUCKETS, PollResult, PollStats
from gpuguard.engine.alerting.pulled import SkipReason
from gpuguard.engine.reading_metrics import (
    event_metrics,
    foreign_marks_metric,
    inspector_metrics,
)
from gpuguard.remediator.pull import PullSource
from gpuguard.remediator.service import Remediator
from gpuguard.remediator.status import HealthCode


class RemediatorCollector(Collector):
    def __init__(self, service: Remediator) -> None:
        self.service = service

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so `/metrics?name[]=...` can find them."""
        for family in self.collect():
            family.samples = []
            yield family

    def collect(self) -> Iterator[Metric]:
        yield self._info()
        yield from self._own()
        yield from self._alertmanager()
        yield from self._polls()
        yield from self._stuck()
        yield GaugeMetricFamily("gpuguard_remediator_queue_depth",
                                "Accepted alerts not finished yet (queued or deferred).",
                                value=self.service.queue_depth())
        yield from inspector_metrics(self.service.counters)
        yield from event_metrics(self.service.events)
        yield foreign_marks_metric()

    def _info(self) -> Metric:
        """This remediator's host and mode, in one info series (the exporter's
        gpuguard_host_info's convention): its target carries neither, and `gpuguard fleet`
        joins it to the host's exporter on `hostname`."""
        info = GaugeMetricFamily("gpuguard_remediator_info",
                                 "This remediator: the host it acts for (--hostname) and its "
                                 "policy's mode.", labels=["hostname", "mode"])
        info.add_metric([self.service.hostname, str(self.service.policy.mode)], 1)
        return info

    def _own(self) -> Iterator[Metric]:
        c = self.service.counts()
        decisions = CounterMetricFamily("gpuguard_remediator_decisions",
                                        "Decisions by action and reason code.",
                                        labels=["action", "reason"])
        for (action, reason), count in sorted(c["decisions"].items()):
            decisions.add_metric([action, reason], count)
        yield decisions
        yield CounterMetricFamily("gpuguard_remediator_reaped_processes",
                                  "Processes a reap in enforce mode left gone or zombie.",
                                  value=c["reaped_processes"])
        yield CounterMetricFamily("gpuguard_remediator_reclaimed_bytes",
                                  "GPU memory freed by reaps, as NVML reported after each.",
                                  value=c["reclaimed_bytes"])
        yield CounterMetricFamily("gpuguard_remediator_reap_failures",
                                  "Reaps that left survivors, raised, or were interrupted.",
                                  value=c["reap_failures"])
        yield CounterMetricFamily("gpuguard_remediator_refusals_repeated",
                                  "Refusals identical to the tree's last one (reason, members),"
                                  " counted instead of audited in full again.",
                                  value=c["refusals_repeated"])
        yield CounterMetricFamily("gpuguard_remediator_audit_write_failures",
                                  "Audit records that could not be written; no reap signals "
                                  "anything without its record.",
                                  value=c["audit_failures"])
        yield CounterMetricFamily("gpuguard_remediator_audit_damaged_lines",
                                  "Damaged audit log lines (a write cut short by a crash or "
                                  "a full disk) that a read skipped or a write ended; each "
                                  "counted once.",
                                  value=c["audit_damaged_lines"])
        yield GaugeMetricFamily("gpuguard_remediator_audit_ok",
                                "1 while the last audit write succeeded and no record is "
                                "owed (0: reaps may be refused).",
                                value=1 if c["audit_ok"] else 0)
        rejected = CounterMetricFamily("gpuguard_remediator_rejected_requests",
                                       "POST /alerts requests refused, by cause.",
                                       labels=["cause"])
        for cause, count in c["rejected"].items():
            rejected.add_metric([cause], count)
        yield rejected

    def _alertmanager(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "gpuguard_remediator_alertmanager_requests",
            "Requests to Alertmanager's API (kill-time confirmation, pull), by result.",
            labels=["result"])
        client = self.service.alertmanager
        counts = client.request_counts() if client is not None else dict.fromkeys(RequestResult, 0)
        for result, count in sorted(counts.items()):
            requests.add_metric([result], count)
        yield requests

    def _polls(self) -> Iterator[Metric]:
        """Pull mode's polls, labelled by `source` (alertmanager, prometheus): one poller,
        one set of families, whichever it polls (without pull mode: the Alertmanager
        client's, as before the source label, or zeros)."""
        pulling: PullSource | None = self.service.pull_source or self.service.alertmanager
        source = pulling.source if pulling is not None else "alertmanager"
        skipped = CounterMetricFamily(
            "gpuguard_remediator_pull_alerts_skipped",
            "Alerts a poll left out, by why (malformed, other-host, "
            "alertname-not-listed, not-remediate, not-active, over-limit) and source.",
            labels=["why", "source"])
        skips = pulling.skip_counts() if pulling is not None else dict.fromkeys(SkipReason, 0)
        for why in SkipReason:
            skipped.add_metric([why, source], skips[why])
        yield skipped
        view = (pulling.polls if pulling is not None else PollStats()).view()
        polls = CounterMetricFamily(
            "gpuguard_remediator_alertmanager_polls",
            "Pull mode's polls, by result (ok, busy: 503 or 429, timeout, unauthorized, "
            "error) and source (alertmanager, or prometheus: remediate.prometheus).",
            labels=["result", "source"])
        for result in PollResult:
            polls.add_metric([result, source], view.counts[result])
        yield polls
        bounds = [*(f"{b:g}" for b in DURATION_BUCKETS), "+Inf"]
        duration = HistogramMetricFamily(
            "gpuguard_remediator_alertmanager_poll_duration_seconds",
            "How long each poll took, every peer it tried included, by source.",
            labels=["source"])
        duration.add_metric([source], buckets=list(zip(bounds, view.buckets, strict=True)),
                            sum_value=view.duration_sum)
        yield duration
        in_a_row = GaugeMetricFamily(
            "gpuguard_remediator_alertmanager_failed_polls_in_a_row",
            "Polls that failed since the last one that did not (pull mode), by source.",
            labels=["source"])
        in_a_row.add_metric([source], view.failures_in_a_row)
        yield in_a_row

    def _stuck(self) -> Iterator[Metric]:
        status = self.service.status
        busy, limit = status.worker_busy()
        yield GaugeMetricFamily(
            "gpuguard_remediator_worker_busy_seconds",
            "How long the worker has been on its current item (0 when idle).", value=busy)
        yield GaugeMetricFamily(
            "gpuguard_remediator_worker_stuck",
            "1 while the worker has been on one item longer than any item may take "
            "(/healthz: worker-stuck).", value=1 if busy > limit else 0)
        problem = status.poller_problem()
        yield GaugeMetricFamily(
            "gpuguard_remediator_alertmanager_poller_stalled",
            "1 while no poll (of Alertmanager or Prometheus) has completed for several intervals "
            "(/healthz: poller-stalled).",
            value=1 if problem is not None and problem[0] == HealthCode.POLLER_STALLED else 0)
        yield GaugeMetricFamily(
            "gpuguard_remediator_recovery_waiting",
            "1 while processes a crashed reap left stopped wait for the host's reap lock "
            "to be continued (/healthz: recovery-waiting).",
            value=0 if status.recovery_waiting() is None else 1)
