"""The fleet view: the exporters' orphan-tree series, their alerts (Prometheus's ALERTS and
Alertmanager's word) and each host's daemons, joined into rows; and its JSON document.

Pure: `build_view` takes what the queries answered (`Answers`) and the time. The joins are
the shipped rules' own: a tree's series name their scrape target (job, instance), which
`gpuguard_host_info` names a host (`hostname`); an alert names its tree by `hostname`,
`root_pid` and `root_start_time` (the alert contract); a remediator names its host in
`gpuguard_remediator_info`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from gpuguard.base.compat import StrEnum
from gpuguard.console.fleet.series import AmAlert, Sample, Silence

#: The exporter's per-tree families (docs/metrics.md), by the field each fills.
TREE_FAMILIES = {
    "age_seconds": "gpuguard_orphan_tree_age_seconds",
    "memory_bytes": "gpuguard_orphan_tree_memory_bytes",
    "idle_seconds": "gpuguard_orphan_tree_idle_seconds",
    "processes": "gpuguard_orphan_tree_processes",
}
#: The labels that name one tree of one host in an alert (the alert contract).
ALERT_KEY = ("hostname", "root_pid", "root_start_time")


class AlertState(StrEnum):
    """Where a tree's alert stands, the summary a person reads first."""

    SILENCED = "silenced"  # Alertmanager holds it under a silence
    INHIBITED = "inhibited"  # Alertmanager holds it under another alert
    FIRING = "firing"  # firing, and neither
    PENDING = "pending"  # Prometheus waits out the rule's `for:`
    NONE = "none"  # no alert (yet): the tree is younger than the rule's threshold


#: A tree with several alerts is summed up by the one that says most about a reap: a
#: silenced alert stops the remediator, whatever a sibling does.
PRECEDENCE = (AlertState.SILENCED, AlertState.INHIBITED, AlertState.FIRING,
              AlertState.PENDING, AlertState.NONE)


@dataclass(frozen=True)
class Answers:
    """What each query answered. `alertmanager` None: not asked (none configured) or no
    answer (`alertmanager_error` says why); then silences and inhibitions are unknown."""

    trees: Mapping[str, list[Sample]]  # TREE_FAMILIES' values -> samples
    host_info: list[Sample]  # gpuguard_host_info now
    host_info_hour: list[Sample]  # last_over_time(gpuguard_host_info[1h])
    remediator_info: list[Sample]
    remediator_info_hour: list[Sample]
    up: list[Sample]  # up of the exporter's and the remediator's jobs
    alerts: list[Sample]  # ALERTS{root_pid!=""}
    exporter_job: str
    remediator_job: str
    alertmanager: list[AmAlert] | None = None
    silences: Mapping[str, Silence] = field(default_factory=dict)
    alertmanager_error: str | None = None


@dataclass(frozen=True)
class Daemon:
    """One scrape target of a host's exporter or remediator."""

    job: str
    instance: str
    up: bool | None  # None: Prometheus has no `up` for it under the job asked for
    mode: str | None = None  # a remediator's remediate.mode, while it answers


@dataclass(frozen=True)
class TreeAlert:
    """One alert about one tree (GPUOrphanTree, or any rule keyed by the tree's labels)."""

    alertname: str
    state: AlertState
    prometheus: str | None  # ALERTS' alertstate: pending, firing; None: no such series
    alertmanager: str | None  # active, suppressed, unprocessed; None: not there, or not asked
    silences: tuple[Silence | str, ...] = ()  # the silence, or only its id when not listed
    inhibited_by: tuple[str, ...] = ()
    starts_at: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TreeRow:
    hostname: str | None
    job: str
    instance: str
    root_pid: int
    root_start_time: int
    comm: str
    user: str
    reason: str
    age_seconds: float | None
    memory_bytes: int | None
    idle_seconds: float | None
    processes: int | None
    alerts: tuple[TreeAlert, ...]

    @property
    def state(self) -> AlertState:
        return summary(self.alerts)


@dataclass(frozen=True)
class HostRow:
    hostname: str | None  # None: no gpuguard_host_info for its exporter in the last hour
    exporters: tuple[Daemon, ...]
    remediators: tuple[Daemon, ...]
    trees: int


@dataclass(frozen=True)
class FleetView:
    hosts: tuple[HostRow, ...]
    trees: tuple[TreeRow, ...]
    #: Alerts keyed by a tree that no exporter series shows now (its exporter is down, or
    #: the tree is gone and the rule's keep_firing_for holds the alert).
    stray_alerts: tuple[tuple[dict[str, str], TreeAlert], ...]
    malformed: tuple[str, ...]  # series left out, each saying why
    alertmanager_error: str | None


def summary(alerts: Iterable[TreeAlert]) -> AlertState:
    states = {a.state for a in alerts}
    return next((s for s in PRECEDENCE if s in states), AlertState.NONE)


def _digits(text: str | None) -> int | None:
    if text is None or not (0 < len(text) <= 20 and text.isascii() and text.isdigit()):
        return None
    return int(text)


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


def _hostnames(now: list[Sample], hour: list[Sample],
               label: str = "hostname") -> dict[tuple[str, str], str]:
    """Each target's host name: its current info series, else the last hour's (an exporter
    that went down keeps its name); of several, the smallest, so the answer is stable."""
    names: dict[tuple[str, str], str] = {}
    for samples in (hour, now):  # the current one wins
        found: dict[tuple[str, str], set[str]] = {}
        for s in samples:
            if s.labels.get(label):
                found.setdefault(s.target(), set()).add(s.labels[label])
        names.update({t: min(v) for t, v in found.items()})
    return names


def _address(instance: str) -> str:
    """The host part of a target's `instance` (`node-07:9877` -> `node-07`)."""
    try:
        return urlsplit(f"//{instance}").hostname or instance
    except ValueError:
        return instance


def _tree_alerts(answers: Answers) -> dict[tuple[str, str, str], list[TreeAlert]]:
    """Every alert that names a tree, by (hostname, root_pid, root_start_time)."""
    by_key: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}

    def entry(labels: Mapping[str, str]) -> dict[str, Any] | None:
        if not all(labels.get(k) for k in (*ALERT_KEY, "alertname")):
            return None
        key = (labels["hostname"], labels["root_pid"], labels["root_start_time"])
        return by_key.setdefault(key, {}).setdefault(labels["alertname"], {"labels": labels})

    for s in answers.alerts:
        got = entry(s.labels)
        if got is not None and s.labels.get("alertstate") in ("firing", "pending"):
            # Several ALERTS series for one tree and name (two exporter jobs): firing wins.
            if got.get("prometheus") != "firing":
                got["prometheus"] = s.labels["alertstate"]
    for a in answers.alertmanager or ():
        got = entry(a.labels)
        if got is not None:
            got.update(alertmanager=a.state, starts_at=a.starts_at or None,
                       silenced_by=got.get("silenced_by", ()) + a.silenced_by,
                       inhibited_by=got.get("inhibited_by", ()) + a.inhibited_by)
    out: dict[tuple[str, str, str], list[TreeAlert]] = {}
    for key, names in by_key.items():
        out[key] = [_alert(name, got, answers) for name, got in sorted(names.items())]
    return out


def _alert(name: str, got: Mapping[str, Any], answers: Answers) -> TreeAlert:
    silenced_by = tuple(dict.fromkeys(got.get("silenced_by", ())))
    inhibited_by = tuple(dict.fromkeys(got.get("inhibited_by", ())))
    if silenced_by:
        state = AlertState.SILENCED
    elif inhibited_by:
        state = AlertState.INHIBITED
    elif got.get("alertmanager") is not None or got.get("prometheus") == "firing":
        state = AlertState.FIRING
    elif got.get("prometheus") == "pending":
        state = AlertState.PENDING
    else:
        state = AlertState.NONE
    return TreeAlert(
        alertname=name, state=state, prometheus=got.get("prometheus"),
        alertmanager=got.get("alertmanager"),
        silences=tuple(answers.silences.get(i, i) for i in silenced_by),
        inhibited_by=inhibited_by, starts_at=got.get("starts_at"), labels=got["labels"])


def _trees(answers: Answers, hosts: Mapping[tuple[str, str], str],
           alerts: dict[tuple[str, str, str], list[TreeAlert]],
           malformed: list[str]) -> list[TreeRow]:
    series: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for fieldname, family in TREE_FAMILIES.items():
        for s in answers.trees.get(family, ()):
            pid, start = s.labels.get("root_pid"), s.labels.get("root_start_time")
            if _digits(pid) is None or _digits(start) is None:
                malformed.append(f"{family} of {s.labels.get('instance', '?')}: root_pid "
                                 f"{pid!r}, root_start_time {start!r} are not numbers"[:200])
                continue
            job, instance = s.target()
            row = series.setdefault((job, instance, str(pid), str(start)), {"labels": s.labels})
            row[fieldname] = s.value
    rows: dict[tuple[str, str, str], TreeRow] = {}
    for (job, instance, pid, start), got in sorted(series.items()):
        hostname = hosts.get((job, instance))
        key = (hostname or f"instance {instance}", pid, start)
        if key in rows:  # the same exporter under a second job: one tree
            continue
        labels = got["labels"]
        rows[key] = TreeRow(
            hostname=hostname, job=job, instance=instance,
            root_pid=int(pid), root_start_time=int(start), comm=labels.get("comm", ""),
            user=labels.get("user", ""), reason=labels.get("reason", ""),
            age_seconds=got.get("age_seconds"), memory_bytes=_whole(got.get("memory_bytes")),
            idle_seconds=got.get("idle_seconds"), processes=_whole(got.get("processes")),
            alerts=tuple(alerts.pop((hostname, pid, start), ())) if hostname else ())
    return sorted(rows.values(), key=lambda r: (r.hostname or "", r.instance, r.root_pid))


def _daemons(answers: Answers, job: str, now: list[Sample],
             hour: list[Sample]) -> dict[tuple[str, str], Daemon]:
    """The targets of one daemon: those `up` names under its job, and any that exported
    its info series in the last hour under another job."""
    ups = {s.target(): s.value == 1 for s in answers.up if s.labels.get("job") == job}
    current = {s.target(): s for s in now}
    targets = set(ups) | set(current) | {s.target() for s in hour}
    out = {}
    for t in targets:
        info = current.get(t)
        up = ups.get(t, True if info is not None else None)
        mode = info.labels.get("mode") if info is not None and up else None
        out[t] = Daemon(t[0], t[1], up, mode)
    return out


def _hosts(answers: Answers, exporter_hosts: Mapping[tuple[str, str], str],
           trees: list[TreeRow]) -> list[HostRow]:
    exporters = _daemons(answers, answers.exporter_job, answers.host_info,
                         answers.host_info_hour)
    remediators = _daemons(answers, answers.remediator_job, answers.remediator_info,
                           answers.remediator_info_hour)
    remediator_hosts = _hostnames(answers.remediator_info, answers.remediator_info_hour)
    # A remediator without its info series (one older than it) is the host's whose
    # exporter shares its address: the units and the DaemonSet run them side by side.
    by_address: dict[str, set[str]] = {}

    def key_of(target: tuple[str, str], names: Mapping[tuple[str, str], str]) -> str:
        if target in names:
            return names[target]
        if not by_address:  # built on the first target that needs it
            for known, name in exporter_hosts.items():
                by_address.setdefault(_address(known[1]), set()).add(name)
        same = by_address.get(_address(target[1]), set())
        return next(iter(same)) if len(same) == 1 else f"\0{target[1]}"

    grouped: dict[str, tuple[list[Daemon], list[Daemon]]] = {}
    for target, daemon in exporters.items():
        grouped.setdefault(key_of(target, exporter_hosts), ([], []))[0].append(daemon)
    for target, daemon in remediators.items():
        grouped.setdefault(key_of(target, remediator_hosts), ([], []))[1].append(daemon)
    counts: dict[str, int] = {}
    for tree in trees:
        name = tree.hostname if tree.hostname is not None else f"\0{tree.instance}"
        counts[name] = counts.get(name, 0) + 1
        grouped.setdefault(name, ([], []))

    def order(d: Daemon) -> tuple[str, str]:
        return d.job, d.instance

    return [HostRow(None if key.startswith("\0") else key, tuple(sorted(exp, key=order)),
                    tuple(sorted(rem, key=order)), counts.get(key, 0))
            for key, (exp, rem) in sorted(grouped.items(), key=lambda kv: kv[0].lstrip("\0"))]


def build_view(answers: Answers) -> FleetView:
    """Every orphan tree with its alerts, and every host with its daemons."""
    malformed: list[str] = []
    exporter_hosts = _hostnames(answers.host_info, answers.host_info_hour)
    alerts = _tree_alerts(answers)
    trees = _trees(answers, exporter_hosts, alerts, malformed)
    stray = tuple((dict(zip(ALERT_KEY, key, strict=True)), a)
                  for key, found in sorted(alerts.items()) for a in found)
    return FleetView(tuple(_hosts(answers, exporter_hosts, trees)), tuple(trees), stray,
                     tuple(malformed), answers.alertmanager_error)


# -- the JSON document --------------------------------------------------------------------


def _silence_json(s: Silence | str) -> dict[str, Any]:
    if isinstance(s, str):  # silencedBy names it; the silences list did not have it
        return {"id": s, "created_by": None, "comment": None, "ends_at": None, "state": None}
    return {"id": s.id, "created_by": s.created_by, "comment": s.comment,
            "ends_at": s.ends_at or None, "state": s.state}


def alert_json(a: TreeAlert) -> dict[str, Any]:
    return {"alertname": a.alertname, "state": a.state, "prometheus": a.prometheus,
            "alertmanager": a.alertmanager, "starts_at": a.starts_at,
            "silences": [_silence_json(s) for s in a.silences],
            "inhibited_by": list(a.inhibited_by)}


def _daemon_json(d: Daemon, *, remediator: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"job": d.job, "instance": d.instance, "up": d.up}
    if remediator:
        out["mode"] = d.mode
    return out


def fleet_json(view: FleetView, *, schema: str, taken_at: float, prometheus: str,
               alertmanager: str | None, errors: list[str]) -> dict[str, Any]:
    """The `fleet --json` document (contract.FLEET_EPILOG describes it)."""
    return {
        "schema": schema,
        "taken_at": taken_at,
        "sources": {"prometheus": prometheus, "alertmanager": alertmanager,
                    "alertmanager_error": view.alertmanager_error},
        "errors": errors + list(view.malformed),
        "hosts": [{"hostname": h.hostname, "orphan_trees": h.trees,
                   "exporters": [_daemon_json(d, remediator=False) for d in h.exporters],
                   "remediators": [_daemon_json(d, remediator=True) for d in h.remediators]}
                  for h in view.hosts],
        "trees": [{"hostname": t.hostname, "job": t.job, "instance": t.instance,
                   "root_pid": t.root_pid, "root_start_time": t.root_start_time,
                   "comm": t.comm, "user": t.user, "reason": t.reason,
                   "age_seconds": t.age_seconds, "memory_bytes": t.memory_bytes,
                   "idle_seconds": t.idle_seconds, "processes": t.processes,
                   "alert_state": t.state, "alerts": [alert_json(a) for a in t.alerts]}
                  for t in view.trees],
        "stray_alerts": [{"hostname": key["hostname"], "root_pid": _digits(key["root_pid"]),
                          "root_start_time": _digits(key["root_start_time"]), **alert_json(a)}
                         for key, a in view.stray_alerts],
    }
