"""Pull mode from Prometheus through the real binaries (issue 54): exporter -> Prometheus
(the shipped rules) -> the remediator polling Prometheus's ALERTS series, and
Alertmanager asked at kill time. No webhook: Alertmanager's remediator receiver is a
null one, so whatever is reaped was found by the Prometheus poll and confirmed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import requests

from gpuguard.engine.alerting.prometheus import firing_query
from tests.e2e import test_e2e_alertmanager as am_loop
from tests.e2e.test_e2e_alertmanager import HOST, World, decisions, final, finals, reap_record
from tests.support.proctree import wait_for
from tests.support.promstack import Loop

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The fake GPU world and the loop, as test_e2e_alertmanager starts them.
world = am_loop.world
loop = am_loop.loop


def healthz(lp: Loop) -> str:
    return requests.get(f"{lp.remediator.url}/healthz", timeout=5).text.strip()


def test_prometheus_pull_reaps_and_alertmanager_still_decides(
        world: World, loop: Callable[..., Loop]) -> None:
    reap, silence = world.orphan(), world.orphan()

    def on_call(am: Any) -> None:  # before any alert can fire
        am.silence(silence.matchers())

    lp = loop(prometheus_pull=True, before_prometheus=on_call)
    assert "webhook_configs" not in next(r for r in lp.alertmanager.config["receivers"]
                                         if r["name"] == "gpuguard-remediator")
    # The remediator's own query finds the tree's alert in the real Prometheus.
    wait_for(lambda: lp.prometheus.query(firing_query(["GPUOrphanTree"], HOST)), timeout=60,
             interval=0.1, what="the alert in Prometheus")
    (since,) = [float(s["value"][1]) for s in lp.prometheus.query(
        firing_query(["GPUOrphanTree"], HOST)) if s["metric"]["root_pid"] == str(reap.root)]
    in_prometheus = time.monotonic()
    wait_for(reap.gone, timeout=60, what="the Prometheus-pull reap")
    print(f"\nprometheus pull: alert firing -> reaped {time.monotonic() - in_prometheus:.2f}s "
          "(pull_interval_seconds 1)")
    assert {d["source"] for d in decisions(lp, reap)} == {"pull", "worker"}  # no "http"
    record = reap_record(lp, reap)
    assert record["alertmanager"]["state"] == "firing"  # confirmed by Alertmanager
    assert record["alert"]["starts_at"] == since  # ALERTS_FOR_STATE's active-since

    # Prometheus says the silenced tree's alert fires; Alertmanager's silence wins.
    cancelled = final(lp, silence, "silenced")
    assert cancelled["decision"]["action"] == "cancel" and cancelled["signals"] == []
    assert silence.alive()
    metrics = requests.get(f"{lp.remediator.url}/metrics", timeout=5).text
    assert 'gpuguard_remediator_alertmanager_polls_total{result="ok",source="prometheus"}' \
        in metrics
    assert healthz(lp) == "ok"

    # Prometheus gone: /healthz says so, and says so no longer once it is back.
    lp.prometheus.stop()
    wait_for(lambda: healthz(lp) == "poller-failing", timeout=30, interval=0.2,
             what="/healthz poller-failing while Prometheus is down")
    back = lp.prometheus.restarted()
    lp.started.append(back)
    wait_for(lambda: healthz(lp) == "ok", timeout=30, interval=0.2,
             what="/healthz ok once Prometheus answers")
    assert silence.alive() and finals(lp, silence) and all(
        r["signals"] == [] for r in finals(lp, silence))
