"""`gpuguard fleet`'s joins on synthetic query answers: trees to hosts, alerts to trees,
Alertmanager's silences and inhibitions, daemons to hosts; and what the queries are."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuguard.config import Config
from gpuguard.config.remediate import AlertmanagerConfig, Remediate
from gpuguard.console.contract import FLEET_EPILOG, FLEET_SCHEMA
from gpuguard.console.fleet.series import (
    AmAlert,
    Sample,
    ShapeError,
    Silence,
    am_alerts,
    silences,
    vector,
)
from gpuguard.console.fleet.sources import (
    AM_ALERTS_PATH,
    Auth,
    Endpoint,
    FleetOptions,
    SourceProblem,
    endpoints,
    queries,
)
from gpuguard.console.fleet.view import (
    TREE_FAMILIES,
    AlertState,
    Answers,
    build_view,
    fleet_json,
)

EXP, REM = "gpuguard", "gpuguard-remediator"
A, B = "10.0.0.1:9877", "10.0.0.2:9877"


def s(value: float | None = 1.0, **labels: str) -> Sample:
    return Sample(dict(labels), value)


def tree_series(instance: str, pid: str, start: str, *, job: str = EXP, age: float = 400.0,
                memory: float = 2**31, idle: float | None = 90.0,
                procs: float = 3) -> dict[str, list[Sample]]:
    labels = {"job": job, "instance": instance, "root_pid": pid, "root_start_time": start,
              "comm": "python", "user": "alice", "reason": "launcher-killed"}
    out = {TREE_FAMILIES["age_seconds"]: [s(age, **labels)],
           TREE_FAMILIES["memory_bytes"]: [s(memory, **labels)],
           TREE_FAMILIES["processes"]: [s(procs, **labels)],
           TREE_FAMILIES["idle_seconds"]: [s(idle, **labels)] if idle is not None else []}
    return out


def merged(*parts: dict[str, list[Sample]]) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {f: [] for f in TREE_FAMILIES.values()}
    for part in parts:
        for family, samples in part.items():
            out[family] += samples
    return out


def host(instance: str, name: str, job: str = EXP) -> Sample:
    return s(job=job, instance=instance, hostname=name, version="0.3.0")


def alert(name: str, pid: str, start: str, state: str = "firing") -> Sample:
    return s(alertname="GPUOrphanTree", alertstate=state, hostname=name, root_pid=pid,
             root_start_time=start, job=EXP, instance="x", remediate="true")


def am(name: str, pid: str, start: str, *, silenced: tuple[str, ...] = (),
       inhibited: tuple[str, ...] = ()) -> AmAlert:
    return AmAlert({"alertname": "GPUOrphanTree", "hostname": name, "root_pid": pid,
                    "root_start_time": start},
                   "suppressed" if silenced or inhibited else "active", silenced, inhibited,
                   "2026-12-08T00:00:00Z")


def answers(**kw: Any) -> Answers:
    base: dict[str, Any] = dict(
        trees=merged(tree_series(A, "100", "5000"), tree_series(B, "200", "6000")),
        host_info=[host(A, "node-a"), host(B, "node-b")], host_info_hour=[],
        remediator_info=[s(job=REM, instance="10.0.0.1:9878", hostname="node-a",
                           mode="enforce")],
        remediator_info_hour=[],
        up=[s(1, job=EXP, instance=A), s(1, job=EXP, instance=B),
            s(1, job=REM, instance="10.0.0.1:9878")],
        alerts=[alert("node-a", "100", "5000"), alert("node-b", "200", "6000")],
        exporter_job=EXP, remediator_job=REM)
    base.update(kw)
    return Answers(**base)


SILENCE = Silence("s-1", "oncall@example.org", "looking at it", "2026-12-08T01:00:00Z",
                  "active")


def test_one_tree_silenced_by_whom_until_when_the_other_firing() -> None:
    view = build_view(answers(alertmanager=[am("node-a", "100", "5000", silenced=("s-1",)),
                                            am("node-b", "200", "6000")],
                              silences={"s-1": SILENCE}))
    a, b = view.trees
    assert (a.hostname, a.root_pid, a.root_start_time, a.user, a.reason) == (
        "node-a", 100, 5000, "alice", "launcher-killed")
    assert (a.age_seconds, a.memory_bytes, a.idle_seconds, a.processes) == (400.0, 2**31,
                                                                            90.0, 3)
    assert a.state == AlertState.SILENCED and a.alerts[0].silences == (SILENCE,)
    assert b.state == AlertState.FIRING and b.alerts[0].alertmanager == "active"
    doc = fleet_json(view, schema=FLEET_SCHEMA, taken_at=1.0, prometheus="p",
                     alertmanager="am", errors=[])
    silenced = doc["trees"][0]["alerts"][0]
    assert silenced["silences"] == [{"id": "s-1", "created_by": "oncall@example.org",
                                     "comment": "looking at it",
                                     "ends_at": "2026-12-08T01:00:00Z", "state": "active"}]
    assert doc["trees"][0]["alert_state"] == "silenced"
    assert doc["trees"][1]["alert_state"] == "firing"
    json.dumps(doc)  # plain JSON throughout


def test_hosts_say_exporter_remediator_and_mode() -> None:
    view = build_view(answers())
    node_a, node_b = view.hosts
    assert node_a.hostname == "node-a" and node_a.trees == 1
    assert [(d.instance, d.up) for d in node_a.exporters] == [(A, True)]
    assert [(d.instance, d.up, d.mode) for d in node_a.remediators] == [
        ("10.0.0.1:9878", True, "enforce")]
    assert node_b.remediators == () and node_b.exporters[0].up is True


def test_pending_comes_from_prometheus_and_a_young_tree_has_none() -> None:
    view = build_view(answers(alerts=[alert("node-a", "100", "5000", "pending")]))
    assert [t.state for t in view.trees] == [AlertState.PENDING, AlertState.NONE]


def test_inhibited_names_the_inhibiting_alert() -> None:
    view = build_view(answers(alertmanager=[am("node-a", "100", "5000", inhibited=("f00d",))]))
    assert view.trees[0].state == AlertState.INHIBITED
    assert view.trees[0].alerts[0].inhibited_by == ("f00d",)


def test_a_silence_missing_from_the_list_keeps_its_id() -> None:
    view = build_view(answers(alertmanager=[am("node-a", "100", "5000", silenced=("gone",))]))
    doc = fleet_json(view, schema=FLEET_SCHEMA, taken_at=1.0, prometheus="p",
                     alertmanager="am", errors=[])
    assert doc["trees"][0]["alerts"][0]["silences"] == [
        {"id": "gone", "created_by": None, "comment": None, "ends_at": None, "state": None}]


def test_silenced_wins_over_a_firing_sibling_alert() -> None:
    sibling = AmAlert({"alertname": "GPUOrphanTreeBig", "hostname": "node-a", "root_pid": "100",
                       "root_start_time": "5000"}, "active", (), (), "")
    view = build_view(answers(alertmanager=[am("node-a", "100", "5000", silenced=("s-1",)),
                                            sibling], silences={"s-1": SILENCE}))
    tree = view.trees[0]
    assert [a.alertname for a in tree.alerts] == ["GPUOrphanTree", "GPUOrphanTreeBig"]
    assert tree.state == AlertState.SILENCED


def test_alertmanager_unanswered_leaves_prometheus_word() -> None:
    view = build_view(answers(alertmanager_error="http://am: HTTP 503"))
    assert [t.state for t in view.trees] == [AlertState.FIRING, AlertState.FIRING]
    assert view.alertmanager_error == "http://am: HTTP 503"


def test_an_exporter_down_keeps_its_name_and_its_alert_is_stray() -> None:
    view = build_view(answers(
        trees=merged(tree_series(A, "100", "5000")), host_info=[host(A, "node-a")],
        host_info_hour=[host(A, "node-a"), host(B, "node-b")],
        up=[s(1, job=EXP, instance=A), s(0, job=EXP, instance=B)]))
    names = {h.hostname: h for h in view.hosts}
    assert names["node-b"].exporters[0].up is False and names["node-b"].trees == 0
    ((key, stray),) = view.stray_alerts
    assert key == {"hostname": "node-b", "root_pid": "200", "root_start_time": "6000"}
    assert stray.state == AlertState.FIRING


def test_a_remediator_without_its_info_joins_the_exporter_at_its_address() -> None:
    view = build_view(answers(remediator_info=[],
                              up=[s(1, job=EXP, instance=A), s(1, job=EXP, instance=B),
                                  s(0, job=REM, instance="10.0.0.2:9878"),
                                  s(1, job=REM, instance="10.9.9.9:9878")]))
    names = {h.hostname: h for h in view.hosts}
    assert [(d.instance, d.up, d.mode) for d in names["node-b"].remediators] == [
        ("10.0.0.2:9878", False, None)]
    # No exporter there: a host of its own, unnamed.
    assert [d.instance for d in names[None].remediators] == ["10.9.9.9:9878"]


def test_one_exporter_under_two_jobs_is_one_tree() -> None:
    view = build_view(answers(
        trees=merged(tree_series(A, "100", "5000"), tree_series(A, "100", "5000", job="dup")),
        host_info=[host(A, "node-a"), host(A, "node-a", job="dup")]))
    assert [(t.hostname, t.root_pid) for t in view.trees] == [("node-a", 100)]


def test_a_series_without_numbers_is_left_out_and_said() -> None:
    view = build_view(answers(trees=merged(tree_series(A, "x", "5000"),
                                           tree_series(B, "200", "6000"))))
    assert [t.root_pid for t in view.trees] == [200]
    assert len(view.malformed) == 4 and "root_pid 'x'" in view.malformed[0]


def test_a_tree_without_idle_series_has_none() -> None:
    view = build_view(answers(trees=merged(tree_series(A, "100", "5000", idle=None))))
    assert view.trees[0].idle_seconds is None


def test_the_document_has_the_documented_keys() -> None:
    doc = fleet_json(build_view(answers()), schema=FLEET_SCHEMA, taken_at=1.0,
                     prometheus="p", alertmanager=None, errors=[])
    for key in (*doc, *doc["trees"][0], *doc["hosts"][0], *doc["trees"][0]["alerts"][0]):
        assert f'"{key}"' in FLEET_EPILOG, key


# -- the queries: a fixed number, none per host --------------------------------------------


def test_the_queries_are_a_fixed_set_that_names_no_host() -> None:
    got = queries("gpuguard", "gpuguard-remediator")
    assert len(got) == 10
    assert got["up"] == 'up{job="gpuguard"} or up{job="gpuguard-remediator"}'
    assert all("hostname=" not in q and "instance=" not in q for q in got.values())
    assert queries('a"b\\', "r")["up"].startswith('up{job="a\\"b\\\\"}')
    assert "filter=root_pid%3D~%22.%2B%22" in AM_ALERTS_PATH


# -- the answers' shapes --------------------------------------------------------------------


def test_vector_reads_an_instant_vector() -> None:
    body = {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"job": "j"}, "value": [1.5, "42"]},
        {"metric": {"job": "k"}, "value": [1.5, "NaN"]}]}}
    assert vector(body, "q") == [Sample({"job": "j"}, 42.0), Sample({"job": "k"}, None)]


@pytest.mark.parametrize("body", [
    [], {"status": "error", "error": "bad"}, {"status": "success", "data": {"resultType":
                                                                          "matrix"}},
    {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {},
                                                                      "value": [1]}]}},
    {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {"a": 1},
                                                                      "value": [1, "1"]}]}},
    {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {},
                                                                      "value": [1, "x"]}]}},
])
def test_vector_refuses_another_shape_in_one_line(body: Any) -> None:
    with pytest.raises(ShapeError) as caught:
        vector(body, "q")
    assert "\n" not in str(caught.value)


def test_alertmanager_answers_are_read() -> None:
    (a,) = am_alerts([{"labels": {"alertname": "X"}, "startsAt": "t",
                       "status": {"state": "suppressed", "silencedBy": ["s"],
                                  "inhibitedBy": None}}])
    assert (a.state, a.silenced_by, a.inhibited_by) == ("suppressed", ("s",), ())
    got = silences([{"id": "s", "createdBy": "me", "comment": "c", "endsAt": "e",
                     "status": {"state": "active"}, "matchers": []}])
    assert got == {"s": Silence("s", "me", "c", "e", "active")}
    with pytest.raises(ShapeError):
        am_alerts([{"labels": {}, "status": {}}])


# -- the options ----------------------------------------------------------------------------


def config(**alertmanager: Any) -> Config:
    section = AlertmanagerConfig(**alertmanager) if alertmanager else None
    return Config(remediate=Remediate(alertmanager=section))


@pytest.mark.parametrize(("auth", "url", "insecure", "problem"), [
    (Auth(credentials_file="/t"), "http://p:9090", False, "in clear"),
    (Auth(username="u", password_file="/p"), "http://p:9090", False, "in clear"),
    (Auth(credentials_file="/t"), "http://p:9090", True, None),
    (Auth(credentials_file="/t"), "https://p:9090", False, None),
    (Auth(credentials_file="/t", username="u", password_file="/p"), "https://p", False,
     "exclusive"),
    (Auth(username="u"), "https://p", False, "go together"),
    (Auth(username="a:b", password_file="/p"), "https://p", False, "without ':'"),
    (Auth(), "ftp://p", False, "not an http"),
    (Auth(), "https://u:pw@p", False, "no credentials"),
    (Auth(), "https://p/?q=1", False, "no credentials"),
])
def test_endpoint_problems(auth: Auth, url: str, insecure: bool, problem: str | None) -> None:
    got = Endpoint("--prometheus", (url,), auth, insecure).problem()
    assert (got is None) if problem is None else (problem in (got or ""))


def test_alertmanager_defaults_to_the_remediators_own() -> None:
    prom, am_ = endpoints(FleetOptions("http://p:9090"),
                          config(url=("https://am-1:9093", "https://am-2:9093/"),
                                 credentials_file="/etc/gpuguard/am-token", ca_file="/ca"))
    assert prom.urls == ("http://p:9090",)
    assert am_ is not None and am_.urls == ("https://am-1:9093", "https://am-2:9093")
    assert (am_.auth.credentials_file, am_.auth.ca_file) == ("/etc/gpuguard/am-token", "/ca")
    flagged = endpoints(FleetOptions("http://p:9090", alertmanager=("http://am:9093",)),
                        config(url=("https://am-1:9093",)))[1]
    assert flagged is not None and flagged.urls == ("http://am:9093",)
    assert endpoints(FleetOptions("http://p:9090"), config())[1] is None
    with pytest.raises(SourceProblem, match="--prometheus URL is required"):
        endpoints(FleetOptions(None), config())
