"""Policy cases end to end in-process: real trees, fake NVML, the Flask test client."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuguard.base.counters import Counters
from gpuguard.config import load_config
from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.state.ledger import Ledger
from gpuguard.gpu.nvml import Nvml
from gpuguard.remediator.app import MAX_BODY_BYTES, create_app
from gpuguard.remediator.service import build_remediator
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, stat_fields, wait_for
from tests.support.promstack import free_port
from tests.support.remediator_harness import (
    HOST,
    TOKEN,
    FakeClock,
    Harness,
    Orphan,
    account,
    alert,
    me,
    only_record,
    payload,
    spawn_orphan,
    write_config,
)


def test_orphan_is_reaped_and_audited(harness: Callable[..., Harness], trees: Trees,
                                      fake_gpu: FakeGpuWorld) -> None:
    h = harness()
    orphan = spawn_orphan(trees, fake_gpu)
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(orphan.none_alive, what="the orphan tree to be reaped")
    h.settle()
    record = only_record(h, orphan)
    assert record["decision"]["action"] == "reap"
    assert record["decision"]["reason"] == "session-ended"
    assert (record["mode"], record["kill_path"], record["outcome"]) == ("enforce", "pidfd",
                                                                        "reaped")
    assert record["alert"]["group_key"] and record["alert"]["fingerprint"]
    members = record["tree"]["members"]
    assert [(m["pid"], m["comm"]) for m in members] == [(orphan.root, "sh"),
                                                         (orphan.holder, "python")]
    assert all(m["start_time"] and m["user"] == me() for m in members)
    assert {s["result"] for s in record["signals"]} == {"sent"}
    # Written ahead: the intent record names every member before the first signal.
    (intent,) = [r for r in h.audit() if r["phase"] == "intent"]
    assert h.audit().index(intent) < h.audit().index(record) and intent["signals"] == []
    assert [(m["pid"], m["start_time"]) for m in intent["tree"]["members"]] == [
        (m["pid"], m["start_time"]) for m in members]
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert "gpuguard_remediator_reaped_processes_total 2.0" in metrics
    assert ('gpuguard_remediator_decisions_total{action="reap",reason="session-ended"} 1.0'
            in metrics)
    assert 'gpuguard_inspector_calls_total{callsite="proc_stat"}' in metrics


def test_newer_alertmanagers_payload_fields_are_accepted(harness: Callable[..., Harness],
                                                         trees: Trees,
                                                         fake_gpu: FakeGpuWorld) -> None:
    """Issue 54: Alertmanager 0.32's `notification_reason`, 0.34's `routeLabels` (checked
    against its template/template.go), and keys not invented yet, at the top and in an
    alert, change nothing: the tree is reaped as from a 0.25 delivery."""
    h = harness()
    orphan = spawn_orphan(trees, fake_gpu)
    one = orphan.alert()
    body = {**payload({**one, "someFutureAlertKey": [1, {"x": None}]}),
            "notification_reason": "repeat interval elapsed",
            "routeLabels": {"team": "gpu"}, "truncatedAlerts": 0,
            "groupLabels": {"alertname": "GPUOrphanTree", "hostname": HOST}}
    assert account(h.post(body))["status"] == "accepted"
    wait_for(orphan.none_alive, what="the orphan tree to be reaped")
    h.settle()
    assert only_record(h, orphan)["outcome"] == "reaped"


def expect_ignored(h: Harness, orphan: Orphan, reason: str, *, audited: bool = True,
                   **alert_kw: Any) -> dict[str, Any]:
    """Deliver an alert for `orphan`, let the worker finish, check nothing died and why."""
    answer = account(h.post(payload(orphan.alert(**alert_kw))))
    h.settle()
    assert orphan.all_alive()
    if answer["status"] == "ignored":
        assert answer["reason"] == reason
    else:
        assert answer["status"] == "accepted"
    snap = h.service.snapshot()
    reasons = [d["reason"] for d in snap["recent_decisions"] if d["fingerprint"]
               == answer["fingerprint"]]
    assert reason in reasons, reasons
    records = [r for r in h.audit() if r["key"]["root_pid"] == orphan.root]
    if audited:
        assert [r["decision"]["reason"] for r in records] == [reason]
        assert records[0]["signals"] == [] and records[0]["outcome"] in (None, "aborted")
    else:
        assert records == []
    return answer


def test_alerts_not_for_this_remediator_are_ignored(harness: Callable[..., Harness],
                                                    trees: Trees,
                                                    fake_gpu: FakeGpuWorld) -> None:
    h = harness()
    orphan = spawn_orphan(trees, fake_gpu)
    expect_ignored(h, orphan, "other-host", audited=False, hostname="gpu-test-2")
    expect_ignored(h, orphan, "alertname-not-listed", audited=False,
                   alertname="GPUGuardExporterDown")
    expect_ignored(h, orphan, "not-firing", audited=False, status="resolved")
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert 'gpuguard_remediator_decisions_total{action="ignore",reason="other-host"} 1.0' in metrics


def test_protected_pids_are_never_targets(harness: Callable[..., Harness]) -> None:
    h = harness()
    me_fields, parent = stat_fields(os.getpid()), stat_fields(os.getppid())
    assert me_fields is not None and parent is not None
    for pid, start in ((1, 1), (os.getpid(), me_fields["start_time"]),
                       (os.getppid(), parent["start_time"])):
        answer = account(h.post(payload(alert(pid, start))))
        assert (answer["status"], answer["reason"]) == ("ignored", "protected-pid")
    h.settle()
    assert h.audit() == [] and h.service.queue_depth() == 0


def test_root_replaced_is_not_touched(harness: Callable[..., Harness], trees: Trees,
                                      fake_gpu: FakeGpuWorld) -> None:
    h = harness()
    orphan = spawn_orphan(trees, fake_gpu)
    answer = account(h.post(payload(alert(orphan.root, orphan.root_start - 7))))
    assert answer["status"] == "accepted"
    h.settle()
    assert orphan.all_alive()
    (record,) = h.audit()
    assert record["decision"]["reason"] == "root-replaced" and record["signals"] == []


def test_protected_tree_is_not_touched(harness: Callable[..., Harness], trees: Trees,
                                       fake_gpu: FakeGpuWorld) -> None:
    h = harness()
    script = 'sh -c "{holder} --pidfile {dir}/holder jupyter-kernel" & echo $! > {dir}/root; wait'
    orphan = spawn_orphan(trees, fake_gpu, script)
    expect_ignored(h, orphan, "not-orphan:protected")


def test_normal_trees_are_not_touched(harness: Callable[..., Harness], trees: Trees,
                                      fake_gpu: FakeGpuWorld) -> None:
    h = harness()
    # Adopted, but detached on purpose (cwd /, stdin /dev/null): a daemon, verdict normal.
    daemon = ('cd /; sh -c "{holder} --pidfile {dir}/holder" </dev/null & '
              'echo $! > {dir}/root; wait')
    expect_ignored(h, spawn_orphan(trees, fake_gpu, daemon), "not-orphan:normal")
    # Its launcher is alive: not an orphan, so it roots no tree of its own.
    expect_ignored(h, spawn_orphan(trees, fake_gpu, orphan=False), "tree-not-found")


def test_unknown_tree_is_not_touched(harness: Callable[..., Harness], trees: Trees,
                                     fake_gpu: FakeGpuWorld) -> None:
    h = harness(classify={"max_depth": 1})  # every chain is "too deep": verdict unknown
    orphan = spawn_orphan(trees, fake_gpu)
    holder = stat_fields(orphan.holder)
    assert holder is not None
    # An unknown tree is rooted at its holder; an alert naming it must still not kill it.
    answer = account(h.post(payload(alert(orphan.holder, holder["start_time"]))))
    assert answer["status"] == "accepted"
    h.settle()
    assert orphan.all_alive()
    assert [r["decision"]["reason"] for r in h.audit()] == ["not-orphan:unknown"]


def test_disallowed_user_is_not_touched(harness: Callable[..., Harness], trees: Trees,
                                        fake_gpu: FakeGpuWorld) -> None:
    h = harness(users={"allow": ["*"], "deny": [me()]}, allow_root_owned=True)
    expect_ignored(h, spawn_orphan(trees, fake_gpu), "user-denied")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a root-owned tree")
def test_root_owned_tree_needs_the_policy(harness: Callable[..., Harness], trees: Trees,
                                          fake_gpu: FakeGpuWorld) -> None:
    h = harness(allow_root_owned=False)
    expect_ignored(h, spawn_orphan(trees, fake_gpu), "root-owned")


def test_rate_limit_leaves_the_next_tree_alive(harness: Callable[..., Harness], trees: Trees,
                                               fake_gpu: FakeGpuWorld) -> None:
    h = harness(rate_limit={"max_reaps": 1, "per_seconds": 3600})
    first, second = spawn_orphan(trees, fake_gpu), spawn_orphan(trees, fake_gpu)
    account(h.post(payload(first.alert())))
    wait_for(first.none_alive, what="the first reap")
    expect_ignored(h, second, "rate-limited")
    state = h.client.get("/state", headers={"Authorization": f"Bearer {TOKEN}"}).get_json()
    assert state["rate_limit"]["used"] == 1 and state["rate_limit"]["remaining"] == 0


def test_dry_run_does_everything_but_the_signals(harness: Callable[..., Harness], trees: Trees,
                                                 fake_gpu: FakeGpuWorld) -> None:
    h = harness(mode="dry-run")
    orphan = spawn_orphan(trees, fake_gpu)
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    assert orphan.all_alive()
    record = only_record(h, orphan)
    assert (record["decision"]["action"], record["mode"], record["outcome"]) == (
        "dry-run", "dry-run", "dry-run")
    assert record["signals"] == [] and len(record["tree"]["members"]) == 2
    # Dry runs dedupe too: the next delivery is a duplicate, not a second record.
    assert account(h.post(payload(orphan.alert())))["status"] == "duplicate"
    h.settle()
    assert len(h.audit()) == 1


def test_too_young_waits_for_a_delivery_then_reaps(harness: Callable[..., Harness],
                                                   trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """Without remediate.alertmanager only a delivery leads to a reap: a silence stops it."""
    clock = FakeClock()
    h = harness(clock=clock, min_age_seconds=60)
    orphan = spawn_orphan(trees, fake_gpu)
    account(h.post(payload(orphan.alert())))
    wait_for(lambda: h.decisions(orphan.root)[0]["reason"] == "too-young",
             what="the too-young deferral")
    assert orphan.all_alive() and h.service.queue_depth() == 0  # nothing runs on its own
    clock.now += 30
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    assert orphan.all_alive()  # 30 s of 60: still too young
    clock.now += 61
    h.service.wake()
    h.settle()
    assert orphan.all_alive() and h.audit() == []  # old enough, but no delivery: no reap
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(orphan.none_alive, what="the reap on the next delivery")
    h.settle()
    assert only_record(h, orphan)["decision"]["action"] == "reap"


def test_a_wall_clock_step_neither_ages_a_tree_nor_empties_the_rate_limit(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """min_age_seconds and the rate-limit window count on the boot clock: the wall clock
    set forward by a day (NTP, a VM resumed, a person) changes neither."""
    day = 86400.0
    clock = FakeClock()
    h = harness(clock=clock, min_age_seconds=60,
                rate_limit={"max_reaps": 1, "per_seconds": 3600})
    first, second = spawn_orphan(trees, fake_gpu), spawn_orphan(trees, fake_gpu)

    def deliver(orphan: Orphan) -> str:
        """One delivery; the worker's reason for it."""
        assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
        h.settle()
        return str(h.decisions(orphan.root)[0]["reason"])

    assert deliver(first) == deliver(second) == "too-young"  # both first seen now
    # /state speaks Unix seconds: the re-check is a minute from now by the wall clock.
    assert h.decisions(first.root)[0]["recheck_at"] == pytest.approx(clock.now + 60, abs=1)
    clock.step(day)
    assert deliver(first) == deliver(second) == "too-young"  # a day by the wall, 0 s really
    assert first.all_alive() and second.all_alive()
    clock.now += 61  # a minute passes: old enough
    account(h.post(payload(first.alert())))
    wait_for(first.none_alive, what="the first reap")
    h.settle()
    clock.step(day)
    assert deliver(second) == "rate-limited"  # the window is 3600 s of the boot clock
    assert second.all_alive()
    state = h.client.get("/state", headers={"Authorization": f"Bearer {TOKEN}"}).get_json()
    assert state["rate_limit"]["used"] == 1
    assert state["rate_limit"]["next_slot_at"] == pytest.approx(clock.now + 3600, abs=1)


def test_a_wall_clock_behind_alertmanagers_counts_the_age_from_now_not_the_future(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """Issue 43: our wall clock an hour behind (stepped back) reads Alertmanager's startsAt
    as an hour ahead; the sighting stored there kept the tree too-young 120 s after the
    clock was put right. A sighting is never later than now: a minute after the
    correction the tree is old enough (min_age_seconds=60)."""
    from datetime import datetime, timezone

    hour = 3600.0
    clock = FakeClock()
    h = harness(clock=clock, min_age_seconds=60)
    orphan = spawn_orphan(trees, fake_gpu)
    starts = datetime.fromtimestamp(clock.now - 10, tz=timezone.utc).isoformat()
    clock.step(-hour)  # ours behind; Alertmanager's (startsAt) right
    assert account(h.post(payload(orphan.alert(starts_at=starts))))["status"] == "accepted"
    h.settle()
    assert h.decisions(orphan.root)[0]["reason"] == "too-young"
    clock.step(hour)  # put right
    clock.now += 61
    assert account(h.post(payload(orphan.alert(starts_at=starts))))["status"] == "accepted"
    wait_for(orphan.none_alive, what="the reap a minute after the correction")
    h.settle()
    assert only_record(h, orphan)["decision"]["action"] == "reap"


def test_resolved_alert_cancels_the_pending_reap(harness: Callable[..., Harness], trees: Trees,
                                                 fake_gpu: FakeGpuWorld) -> None:
    """With remediate.alertmanager a too-young tree stays pending (re-checked, then
    confirmed with Alertmanager at kill time); a resolved delivery withdraws it."""
    clock = FakeClock()
    h = harness(clock=clock, min_age_seconds=60,
                alertmanager={"url": f"http://127.0.0.1:{free_port()}"})
    orphan = spawn_orphan(trees, fake_gpu)
    account(h.post(payload(orphan.alert())))
    wait_for(lambda: h.decisions(orphan.root)[0]["reason"] == "too-young",
             what="the too-young deferral")
    answer = account(h.post(payload(orphan.alert(status="resolved"))))
    assert (answer["status"], answer["reason"]) == ("cancelled", "resolved")
    assert h.service.queue_depth() == 0
    clock.now += 120
    h.service.wake()
    h.settle()
    assert orphan.all_alive() and h.audit() == []


def test_answers_fast_while_nvml_is_slow(harness: Callable[..., Harness], trees: Trees,
                                         fake_gpu: FakeGpuWorld) -> None:
    h = harness()
    orphan = spawn_orphan(trees, fake_gpu)
    fake_gpu.set_delay_ms(50)  # every NVML call: one live check is ~0.5 s
    started = time.monotonic()
    answer = account(h.post(payload(orphan.alert())))
    elapsed = time.monotonic() - started
    assert answer["status"] == "accepted" and elapsed < 0.1, elapsed
    assert orphan.all_alive()  # answered before the work
    wait_for(orphan.none_alive, timeout=20, what="the reap behind a slow NVML")
    h.settle()
    fake_gpu.set_delay_ms(0)


def test_nvml_down_means_no_reap(harness: Callable[..., Harness], trees: Trees,
                                 fake_gpu: FakeGpuWorld) -> None:
    h = harness()
    orphan = spawn_orphan(trees, fake_gpu)
    fake_gpu.set_init_error(9)
    expect_ignored(h, orphan, "nvml-unavailable")


def test_worker_time_limit_stops_before_any_signal(harness: Callable[..., Harness],
                                                   trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    # A monotonic clock running 1000x fast: the live check alone outlasts the 1 s limit.
    h = harness(worker_timeout_seconds=1, monotonic=lambda: time.monotonic() * 1000)
    expect_ignored(h, spawn_orphan(trees, fake_gpu), "worker-timeout")


def test_state_and_metrics(harness: Callable[..., Harness]) -> None:
    h = harness()
    assert h.client.get("/state").status_code == 401
    assert h.client.get("/state", headers={"Authorization": "Bearer nope"}).status_code == 401
    state = h.client.get("/state", headers={"Authorization": f"Bearer {TOKEN}"}).get_json()
    assert state["hostname"] == HOST and state["mode"] == "enforce"
    assert state["pending"] == [] and state["in_flight"] is None
    assert state["rate_limit"]["remaining"] == 100
    assert h.client.get("/healthz").status_code == 200
    text = h.client.get("/metrics").get_data(as_text=True)
    for name in ("gpuguard_remediator_reaped_processes_total",
                 "gpuguard_remediator_reclaimed_bytes_total",
                 "gpuguard_remediator_reap_failures_total",
                 'gpuguard_remediator_rejected_requests_total{cause="unauthorized"} 2.0',
                 'gpuguard_remediator_rejected_requests_total{cause="too_large"} 0.0',
                 "gpuguard_remediator_queue_depth 0.0",
                 "gpuguard_inspector_proc_reads_total"):
        assert name in text, name


def test_token_file_rotation_without_restart(tmp_path: Path, fake_gpu: FakeGpuWorld) -> None:
    from gpuguard.engine.alerting.tokens import TokenFile

    path = tmp_path / "token"
    path.write_text("first-token\n")
    path.chmod(0o600)  # a token file must be private
    config = load_config(write_config(tmp_path))
    counters = Counters()
    nvml = Nvml(counters=counters)
    service = build_remediator(config, hostname=HOST, nvml=nvml, counters=counters)
    app = create_app(service, token=TokenFile(str(path)))
    try:
        client = app.test_client()

        def status(token: str) -> int:
            return client.get("/state", headers={"Authorization": f"Bearer {token}"}).status_code

        assert status("first-token") == 200 and status("second-token") == 401
        tmp = tmp_path / "token.new"
        tmp.write_text("second-token\n")
        tmp.chmod(0o600)
        tmp.replace(path)
        assert status("second-token") == 200 and status("first-token") == 401
        path.write_text("")
        assert status("second-token") == 401 and status("") == 401
    finally:
        service.stop()
        nvml.close()


def test_body_read_is_capped_without_content_length(harness: Callable[..., Harness]) -> None:
    h = harness()
    big = io.BytesIO(b"[" + b" " * (MAX_BODY_BYTES + 10) + b"]")
    resp = h.client.post("/alerts", input_stream=big, content_type="application/json",
                         headers={"Authorization": f"Bearer {TOKEN}"},
                         environ_overrides={"wsgi.input_terminated": True})
    assert resp.status_code == 413 and "limit" in resp.get_json()["error"]
    assert h.service.metrics.rejected["too_large"] == 1


def test_a_reap_cut_short_before_any_signal_is_audited_once_and_frees_its_key(
        tmp_path: Path, harness: Callable[..., Harness], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    key = TreeKey(HOST, orphan.root, orphan.root_start)
    Ledger(tmp_path / "state").begin_reap(key, "enforce", "fp-crashed")  # then "crash"
    h = harness()
    (record,) = h.audit()
    assert record["decision"]["reason"] == "interrupted" and record["alert"]["fingerprint"] == (
        "fp-crashed")
    assert record["signals"] == [] and "nothing was signalled" in record["decision"]["detail"]
    h.service.stop()
    again = harness()
    assert len(again.audit()) == 1 and orphan.all_alive()
    # Nothing was signalled: the key is free again, a later delivery decides (issue 43).
    assert account(again.post(payload(orphan.alert())))["status"] == "accepted"


def test_an_alert_kept_firing_after_its_tree_is_gone_changes_nothing(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """GPUOrphanTree's keep_firing_for (issue 50) keeps a gone tree's alert firing for
    minutes: every delivery of it meanwhile is refused, and audited once. A reaped tree's
    key is settled (`duplicate`); a tree that exited by itself reads `root-gone`; a pid
    reused since is another key (pid and start time): `root-replaced`
    (test_root_replaced_is_not_touched)."""
    clock = FakeClock()
    h = harness(clock=clock)
    reaped = spawn_orphan(trees, fake_gpu)
    assert account(h.post(payload(reaped.alert())))["status"] == "accepted"
    wait_for(reaped.none_alive, what="the orphan tree to be reaped")
    h.settle()
    exited = spawn_orphan(trees, fake_gpu)
    exited.tree.kill(exited.holder)
    exited.tree.kill(exited.root)
    records = len(h.audit())
    for _ in range(6):  # every 15 s for 90 s: past the refusal's 60 s re-check
        assert account(h.post(payload(reaped.alert())))["status"] == "duplicate"
        assert account(h.post(payload(exited.alert())))["status"] == "accepted"
        h.settle()
        clock.now += 15
    (gone,) = h.audit()[records:]
    assert gone["key"]["root_pid"] == exited.root and gone["signals"] == []
    assert gone["decision"]["reason"] == "root-gone"
    assert h.service.counts()["refusals_repeated"] == 5


@pytest.mark.parametrize("mode", ["dry-run", "enforce"])
def test_metrics_say_the_host_and_the_mode(harness: Callable[..., Harness], mode: str) -> None:
    """`gpuguard fleet` tells a host's remediator and its mode from this one series: the
    remediator's targets carry no `hostname` of their own (docs/metrics.md)."""
    h = harness(mode=mode)
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert f'gpuguard_remediator_info{{hostname="{HOST}",mode="{mode}"}} 1.0' in metrics
