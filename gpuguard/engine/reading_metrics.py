"""The metric families both daemons export about their own reading of the host: the
per-callsite cost of /proc reads and NVML calls, the process-event listener, foreign
registration files. The exporter's collector (gpuguard/exporter/metrics.py) and the
remediator's (gpuguard/remediator/exposition.py) both yield them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuguard.base.counters import CALLSITES, Counters
from gpuguard.host.events.exit_store import EVICTION_CAUSES
from gpuguard.host.events.listener import KINDS, ProcessEvents
from gpuguard.host.marks import FOREIGN


def event_metrics(events: ProcessEvents | None) -> Iterator[Metric]:
    """The process-event listener's own counts (every kind from 0; all 0 without one) and
    whether it runs (absent without one)."""
    family = CounterMetricFamily("gpuguard_process_events",
                                 "Kernel process events read (exit, other) or dropped by an "
                                 "overrun socket (dropped).", labels=["kind"])
    counts = events.counts() if events is not None else {}
    for kind in KINDS:
        family.add_metric([kind], counts.get(kind, 0))
    yield family
    evicted = CounterMetricFamily(
        "gpuguard_process_events_evicted",
        "Exit records dropped by the listener: from its general ring (store=general) to "
        "make room (count) or for their age (age); from the store of its holders' chains "
        "(store=watched) to make room, which loses launcher evidence and should never "
        "happen.", labels=["store", "cause"])
    gone = events.evictions() if events is not None else {}
    for cause in EVICTION_CAUSES:
        evicted.add_metric(["general", cause], gone.get(cause, 0))
    evicted.add_metric(["watched", "count"],
                       events.watched_evictions() if events is not None else 0)
    yield evicted
    yield GaugeMetricFamily(
        "gpuguard_process_events_watched_pids",
        "Pids whose exits the listener keeps apart from its general ring: the GPU "
        "holders, their ancestors and their session leaders, as last published.",
        value=len(events.watched()) if events is not None else 0)
    if events is None:
        return  # a platform without a listener (Windows): absent, not down (the alert's 0)
    yield GaugeMetricFamily("gpuguard_process_events_up",
                            "1 while the process-event listener runs (launcher evidence).",
                            value=1 if events.alive() else 0)


def foreign_marks_metric() -> Metric:
    """Files at a registration's name that no trusted writer made, each counted once
    (gpuguard/host/marks.py; also used by the remediator)."""
    return CounterMetricFamily(
        "gpuguard_foreign_marks",
        "Files found at a keep or run registration's name that the registrar did not "
        "write (another user's, a link, not a regular file): ignored, each counted once.",
        value=FOREIGN.total())


def inspector_metrics(counters: Counters) -> Iterator[Metric]:
    """Per-callsite cost of our own /proc reads and NVML calls (also used by the remediator)."""
    calls = CounterMetricFamily("gpuguard_inspector_calls",
                                "Inspector calls by callsite.", labels=["callsite"])
    seconds = CounterMetricFamily("gpuguard_inspector_seconds",
                                  "Seconds spent in inspector calls by callsite.",
                                  labels=["callsite"])
    reads = CounterMetricFamily("gpuguard_inspector_proc_reads",
                                "/proc files read by callsite.", labels=["callsite"])
    snap = counters.snapshot()
    for callsite in CALLSITES:
        cost = snap[callsite]
        calls.add_metric([callsite], cost.calls)
        seconds.add_metric([callsite], cost.seconds)
        reads.add_metric([callsite], cost.proc_reads)
    yield calls
    yield seconds
    yield reads
