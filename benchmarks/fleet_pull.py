"""A simulated fleet pulling its own alerts: Alertmanager 0.25 and Prometheus 2.x, side by side.

Issue 54: 10,000 nodes each polling every 30 s (333 polls/s) at 10,000 firing alerts,
without a lost poll. For 1,000 and 10,000 firing alerts, each server is loaded and then
swept with an open-loop schedule of polls (a ladder of rates, each held STEP seconds) by
many lightweight pollers, each poll one host asking for its own alerts with the exact
request a remediator makes:

- Alertmanager: `GET /api/v2/alerts?active=true&silenced=false&inhibited=false&
  filter=hostname="H"&filter=remediate="true"` with the remediator's headers (checked at
  start against what gpuguard's AlertmanagerClient.poll really sends: `exact_am_request`);
- Prometheus: the remediator's own query through `GET /api/v1/query` (its firing_query:
  `ALERTS_FOR_STATE{sel} and ignoring(alertstate) ALERTS{sel,alertstate="firing"}`, sel
  the alert names, `hostname="H"` and `remediate="true"`).

Alertmanager holds the alerts posted to `POST /api/v2/alerts`: GPUOrphanTree with
`remediate="true"` on a distinct host each, and OTHER_SHARE of other teams' alerts (other
names, no remediate label) on the same hosts, routed by the shipped alerts/alertmanager.yml
(its receivers without webhooks). Prometheus gets the same alerts from alerting rules over
a static exposition of one series per alert served by a tiny HTTP server in this process
(scraped and evaluated every EVAL_SECONDS, `for: 1s`, so ALERTS and ALERTS_FOR_STATE hold
one series per alert).

Each step counts the polls answered within P99_LIMIT (p99 from the poll's scheduled time,
so a poll the client could not start in time counts as late), the ones shed (503, 429)
or failed, the server's CPU (utime + stime from /proc/PID/stat, less its idle rate) and
RSS (/proc/PID/status), and the pollers' own CPU: the pollers share the machine's cores
with the servers, and a step where they used most of one core (the GIL) or started their
polls late is marked client-bound. A rate is carried when the step has p99 <= 1 s and no
shed or failed poll. A real remediator per server (dry-run, interval 1 s) polls among the
pollers, one on the Alertmanager pull and one on the Prometheus pull; each step counts the
lost polls of the one pulling from the server swept, from its own /metrics, and its
/healthz at the step's end.

    .venv/bin/python benchmarks/fleet_pull.py                # about 5-8 minutes
    .venv/bin/python benchmarks/fleet_pull.py --short        # under 2 minutes (CI)
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests  # noqa: E402
import yaml  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    FakeNvml,
    Result,
    Table,
    cpu_seconds,
    ms,
    percentile,
    rss_mib,
    run_benchmark,
)
from gpuguard.engine.alerting.prometheus import firing_query  # noqa: E402

FLEET_NODES = 10_000
ALERT_COUNTS = (1_000, 10_000)
#: Share of the firing alerts that are other teams' (other names, no remediate label).
OTHER_SHARE = 0.2
OTHER_ALERTS = ("NodeFilesystemAlmostFull", "KubePodCrashLooping", "HighRequestLatency",
                "TargetDown")
ALERTNAMES = ("GPUOrphanTree",)  # remediate.alerts' default
GOAL_RATE = FLEET_NODES / 30  # every node polling every 30 s
P99_LIMIT = 1.0
POLL_TIMEOUT = 3.0  # remediate.alertmanager.timeout_seconds' default
WORKERS = 400  # polls in flight at most (a poll later than its schedule counts late)
EVAL_SECONDS = 5
#: Rates (polls/s) each server is swept over, lowest first; a sweep ends at the first
#: rate not carried.
LADDERS = {"alertmanager": ((1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 200, 333),
                            (1, 2, 5, 10, 25, 50, 100)),
           "prometheus": ((50, 100, 200, 333, 500, 750, 1000, 1500),
                          (100, 333, 700))}
#: Whole evaluation cycles of Prometheus's rules (EVAL_SECONDS), so that its idle rate
#: subtracts evenly (a short run's steps do not: its Prometheus CPU per poll is noise).
STEP_SECONDS, SHORT_STEP_SECONDS = 10.0, 3.0
IDLE_SECONDS, SHORT_IDLE_SECONDS = 10.0, 5.0
#: No sweep takes a new step this long after the run began (a bound on a slow machine:
#: the full ladders take about 5 minutes, the short ones about 90 s).
BUDGET_SECONDS, SHORT_BUDGET_SECONDS = 540.0, 110.0
#: A step is client-bound when the pollers used this share of one core (the GIL) ...
CLIENT_BOUND_CORES = 0.8
#: ... or a free poller started its poll this late (p99): the machine did not run it.
CLIENT_LAG_S = 0.1
SERVERS = ("alertmanager", "prometheus")
REMEDIATOR_HOST_INDEX = 0  # the remediator is gpu-node-00000, which has an alert


def node(i: int) -> str:
    return f"gpu-node-{i:05d}"


# -- the fleet's alerts -------------------------------------------------------------------


def fleet_alerts(count: int) -> list[dict[str, str]]:
    """`count` firing alerts' labels: GPUOrphanTree on a distinct host each (spread over the
    fleet, node 0 first), then OTHER_SHARE of other teams' alerts on the same hosts."""
    others = round(count * OTHER_SHARE)
    trees = count - others
    out = [{"alertname": "GPUOrphanTree", "hostname": node(k * FLEET_NODES // trees),
            "root_pid": str(3_990_000 + k), "root_start_time": "1", "comm": "python",
            "user": f"user{k % 50}", "reason": "session-ended", "severity": "warning",
            "remediate": "true"} for k in range(trees)]
    out += [{"alertname": OTHER_ALERTS[k % len(OTHER_ALERTS)],
             "hostname": node((k * 7919) % FLEET_NODES), "team": f"team{k % 12}",
             "severity": "critical" if k % 5 == 0 else "warning"} for k in range(others)]
    return out


def exposition(alerts: list[dict[str, str]]) -> bytes:
    """One series per alert: `fleet_alert{<its labels but alertname>, name="<alertname>"} 1`;
    the rules (fleet_rules) turn each back into its alert."""
    lines = ["# TYPE fleet_alert gauge"]
    for labels in alerts:
        pairs = [f'name="{labels["alertname"]}"'] + [
            f'{k}="{v}"' for k, v in labels.items() if k != "alertname"]
        lines.append("fleet_alert{" + ",".join(pairs) + "} 1")
    return ("\n".join(lines) + "\n").encode()


def fleet_rules() -> str:
    rules = [{"alert": name, "expr": f'fleet_alert{{name="{name}"}} > 0', "for": "1s"}
             for name in (*ALERTNAMES, *OTHER_ALERTS)]
    return yaml.safe_dump({"groups": [{"name": "fleet", "interval": f"{EVAL_SECONDS}s",
                                       "rules": rules}]}, sort_keys=False)


class Exposition:
    """A static /metrics for Prometheus to scrape, served from a thread of this process."""

    def __init__(self, body: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def null_alertmanager_config() -> dict[str, Any]:
    """The shipped alerts/alertmanager.yml (its routing tree and inhibitions: what a GET
    walks), every receiver without webhooks: nothing is sent anywhere. Pull mode needs no
    remediator route, and the shipped one groups per tree and re-flushes every group each
    minute (8,000 groups at 10,000 alerts: bursts of work unrelated to polls), so it goes,
    as docs/alerting.md allows."""
    from tests.support.promstack import REPO

    config = yaml.safe_load((REPO / "alerts" / "alertmanager.yml").read_text())
    config["route"]["routes"] = [r for r in config["route"]["routes"]
                                 if r["receiver"] != "gpuguard-remediator"]
    for receiver in config["receivers"]:
        for key in [k for k in receiver if k.endswith("_configs")]:
            receiver.pop(key)
    return config


def post_alerts(url: str, alerts: list[dict[str, str]]) -> None:
    """Into Alertmanager as a Prometheus would send them, firing for the next hour."""
    from datetime import datetime, timedelta, timezone

    now = datetime.now(timezone.utc)
    starts, ends = now.isoformat(), (now + timedelta(hours=1)).isoformat()
    with requests.Session() as session:
        for i in range(0, len(alerts), 1000):
            body = [{"labels": labels, "startsAt": starts, "endsAt": ends,
                     "generatorURL": "http://prometheus.example/graph"}
                    for labels in alerts[i:i + 1000]]
            session.post(f"{url}/api/v2/alerts", json=body, timeout=60).raise_for_status()


# -- the exact requests -------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One server's poll for one host: path and headers; `ok` judges a 200's body."""

    server: str
    base: str
    path: Callable[[str], str]
    headers: dict[str, str]
    ok: Callable[[Any], bool]


def am_path(hostname: str) -> str:
    """AlertmanagerClient.poll's request path (gpuguard/engine/alerting/alertmanager.py)."""
    from gpuguard.engine.alerting.alertmanager import matcher
    from gpuguard.engine.alerting.alerts import REMEDIATE_LABEL, REMEDIATE_VALUE

    params = [("active", "true"), ("silenced", "false"), ("inhibited", "false"),
              ("filter", matcher("hostname", hostname)),
              ("filter", matcher(REMEDIATE_LABEL, REMEDIATE_VALUE))]
    return f"/api/v2/alerts?{urlencode(params, quote_via=quote)}"


def promql_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def prometheus_query(hostname: str, alertnames: Sequence[str] = ALERTNAMES) -> str:
    """The Prometheus pull's query, as the remediator builds it (its firing_query)."""
    return firing_query(alertnames, hostname)


def prom_path(hostname: str) -> str:
    return f"/api/v1/query?{urlencode({'query': prometheus_query(hostname)}, quote_via=quote)}"


def exact_am_request() -> tuple[str, dict[str, str]]:
    """What gpuguard's AlertmanagerClient.poll sends for node 0 (path, headers), caught by
    a one-shot server here: the pollers' request must be exactly that."""
    from gpuguard.config.remediate import AlertmanagerConfig
    from gpuguard.engine.alerting.alertmanager import AlertmanagerClient

    seen: list[tuple[str, dict[str, str]]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append((self.path, dict(self.headers.items())))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"[]")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = AlertmanagerClient(AlertmanagerConfig(
            url=(f"http://127.0.0.1:{server.server_address[1]}",), timeout_seconds=5))
        client.poll(hostname=node(REMEDIATOR_HOST_INDEX), alertnames=ALERTNAMES)
    finally:
        server.shutdown()
        server.server_close()
    path, headers = seen[0]
    if path != am_path(node(REMEDIATOR_HOST_INDEX)):
        raise RuntimeError(f"the pollers' Alertmanager request {am_path(node(0))!r} is not "
                           f"the remediator's {path!r}: update am_path")
    return path, {k: v for k, v in headers.items() if k.lower() not in ("host",
                                                                         "accept-encoding")}


def requests_for(am_url: str, prom_url: str, am_headers: dict[str, str]) -> dict[str, Request]:
    prom_headers = {"Accept": "application/json", "User-Agent": "gpuguard-remediator"}
    return {
        "alertmanager": Request("alertmanager", am_url, am_path, am_headers,
                                lambda body: isinstance(body, list)),
        "prometheus": Request("prometheus", prom_url, prom_path, prom_headers,
                              lambda body: isinstance(body, dict)
                              and body.get("status") == "success"),
    }


# -- the pollers -----------------------------------------------------------------------------

SHED, FAILED, TIMEOUT = "shed (503/429)", "failed", "timed out"


def poll(req: Request, hostname: str) -> str:
    """One poll as a remediator makes it: a new connection, GET, the whole body, JSON."""
    parts = urlsplit(req.base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=POLL_TIMEOUT)
    try:
        conn.request("GET", req.path(hostname), headers=req.headers)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status in (429, 503):
            return SHED
        if resp.status != 200:
            return f"{FAILED}: HTTP {resp.status}"
        return "ok" if req.ok(json.loads(body)) else f"{FAILED}: unexpected body"
    except TimeoutError:
        return TIMEOUT
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return f"{FAILED}: {type(exc).__name__}"
    finally:
        conn.close()


@dataclass(frozen=True)
class Done:
    scheduled: float
    claimed: float  # when a poller took it: after `scheduled` only while every one was busy
    started: float
    ended: float
    outcome: str

    @property
    def late_start(self) -> float:
        """How late a free poller started it: the machine did not run the poller in time."""
        return self.started - max(self.scheduled, self.claimed)


def open_loop(req: Request, rate: float, seconds: float, hosts: Sequence[str]) -> list[Done]:
    """rate * seconds polls, the k-th scheduled at start + k / rate whatever the answers
    before it (open loop: a slow server meets the same schedule), up to WORKERS at once."""
    total = max(1, round(rate * seconds))
    counter = itertools.count()
    out: list[Done] = []
    start = time.monotonic() + 0.05

    def worker() -> None:
        while (k := next(counter)) < total:
            when = start + k / rate
            claimed = time.monotonic()
            delay = when - claimed
            if delay > 0:
                time.sleep(delay)
            began = time.monotonic()
            outcome = poll(req, hosts[k % len(hosts)])
            out.append(Done(when, claimed, began, time.monotonic(), outcome))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(WORKERS, total))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# -- the real remediator ------------------------------------------------------------------


def remediator_policy(pull: str, tmp: Path, am_url: str, prom_url: str) -> dict[str, Any]:
    """The remediator's `remediate:` section, pulling from `pull` every second (dry-run: it
    signals nothing)."""
    policy: dict[str, Any] = {
        "mode": "dry-run", "state_dir": str(tmp / "state"), "audit_log": str(tmp / "audit"),
        "users": {"allow": ["*"], "deny": []}, "allow_root_owned": True,
        "alertmanager": {"url": am_url, "pull": pull == "alertmanager",
                         "pull_interval_seconds": 1},
    }
    if pull == "prometheus":
        policy["prometheus"] = {"url": prom_url, "pull_interval_seconds": 1}
    return policy


#: The pull's poll counter: one name for both sources, told apart by `source`.
POLLS_LINE = re.compile(r'^gpuguard_remediator_alertmanager_polls_total\{(.*)\} (\S+)$')
LABEL = re.compile(r'(\w+)="([^"]*)"')


class Remediator:
    """gpuguard-remediator in pull mode among the pollers; its own count of lost polls."""

    def __init__(self, pull: str, tmp: Path, am_url: str, prom_url: str) -> None:
        from tests.support.servers import ServerProcess

        self.pull = pull
        fake = FakeNvml(tmp)
        fake.world.add_gpu(0)
        token = tmp / "token"
        token.write_text("fleet-bench-token\n")
        token.chmod(0o600)
        config = tmp / "gpuguard.yml"
        config.write_text(yaml.safe_dump({"remediate": remediator_policy(pull, tmp, am_url,
                                                                         prom_url)}))
        self.server = ServerProcess("gpuguard.remediator", [
            "--config", str(config), "--token-file", str(token), "--hostname",
            node(REMEDIATOR_HOST_INDEX), "--log-level", "WARNING", "--allow-pid-namespace"],
            env=fake.env())

    def polls(self) -> Counter[str]:
        """Its polls of the server it pulls from so far, by result (ok, busy, timeout...)."""
        text = requests.get(f"{self.server.url}/metrics", timeout=10).text
        out: Counter[str] = Counter()
        for line in text.splitlines():
            m = POLLS_LINE.match(line)
            labels = dict(LABEL.findall(m.group(1))) if m else {}
            if m and labels.get("source", "alertmanager") == self.pull:
                out[labels["result"]] += int(float(m.group(2)))
        return out

    def healthz(self) -> str:
        resp = requests.get(f"{self.server.url}/healthz", timeout=10)
        return f"{resp.status_code} {resp.text.strip()}"

    def stop(self) -> None:
        self.server.stop()


# -- a sweep ---------------------------------------------------------------------------------


@dataclass
class Step:
    server: str
    alerts: int
    rate: float
    polls: list[Done]
    seconds: float
    server_cpu: float  # CPU seconds in the step, less the idle rate's
    rss: float
    client_cpu: float
    remediator_polls: int = 0
    remediator_lost: int = 0
    healthz: str = ""

    @property
    def outcomes(self) -> Counter[str]:
        return Counter(d.outcome for d in self.polls)

    @property
    def lost(self) -> int:
        return sum(n for outcome, n in self.outcomes.items() if outcome != "ok")

    def p(self, q: float) -> float:
        return percentile([d.ended - d.scheduled for d in self.polls], q)

    @property
    def lag_p99(self) -> float:
        return percentile([d.late_start for d in self.polls], 99)

    @property
    def queued(self) -> int:
        """Polls that waited for a poller (all WORKERS in flight: a server answering slowly)."""
        return sum(1 for d in self.polls if d.claimed > d.scheduled + 0.001)

    @property
    def achieved(self) -> float:
        return len(self.polls) / self.seconds

    @property
    def carried(self) -> bool:
        return self.lost == 0 and self.p(99) <= P99_LIMIT

    @property
    def client_bound(self) -> bool:
        return (self.client_cpu / self.seconds >= CLIENT_BOUND_CORES
                or self.lag_p99 > CLIENT_LAG_S)

    @property
    def cpu_ms_per_poll(self) -> float:
        return 1000 * self.server_cpu / max(1, len(self.polls))

    def why_not(self) -> str:
        parts = [f"{n} {o}" for o, n in sorted(self.outcomes.items()) if o != "ok"]
        if self.p(99) > P99_LIMIT:
            parts.append(f"p99 {self.p(99):.2f} s")
        return ", ".join(parts)


@dataclass
class Idle:
    cores: dict[str, float]  # CPU seconds per second with no poller (the remediator's polls in)
    rss: dict[str, float]


@dataclass
class Sweep:
    server: str
    alerts: int
    idle_cores: float
    idle_rss: float
    steps: list[Step] = field(default_factory=list)
    cut_short: bool = False  # the run's time budget ended the ladder

    @property
    def best(self) -> Step | None:
        """The highest rate carried before the first one that was not."""
        best = None
        for step in self.steps:
            if not step.carried:
                break
            best = step
        return best

    @property
    def failed(self) -> Step | None:
        return next((s for s in self.steps if not s.carried), None)

    @property
    def cpu_ms_per_answer(self) -> float:
        """Server CPU ms per poll over every step that lost none (a shed 503 costs little),
        answered late or not: the cost of one answer, on the most polls this sweep has."""
        whole = [s for s in self.steps if s.lost == 0]
        polls = sum(len(s.polls) for s in whole)
        return 1000 * sum(s.server_cpu for s in whole) / polls if polls else float("nan")


def measure_idle(pids: dict[str, int], seconds: float) -> Idle:
    before = {s: cpu_seconds(p) for s, p in pids.items()}
    time.sleep(seconds)  # a measurement window, not a synchronisation
    return Idle({s: (cpu_seconds(p) - before[s]) / seconds for s, p in pids.items()},
                {s: rss_mib(p) for s, p in pids.items()})


def sweep(req: Request, alerts: int, ladder: Sequence[float], *, pid: int, idle: Idle,
          step_seconds: float, hosts: Sequence[str], remediator: Remediator | None,
          deadline: float) -> Sweep:
    out = Sweep(req.server, alerts, idle.cores[req.server], idle.rss[req.server])
    me = os.getpid()
    for rate in ladder:
        if time.monotonic() > deadline:
            out.cut_short = True
            break
        rem_before = remediator.polls() if remediator is not None else Counter()
        cpu0, client0, t0 = cpu_seconds(pid), cpu_seconds(me), time.monotonic()
        polls = open_loop(req, rate, step_seconds, hosts)
        seconds = time.monotonic() - t0
        step = Step(req.server, alerts, rate, polls, seconds,
                    max(0.0, cpu_seconds(pid) - cpu0 - idle.cores[req.server] * seconds),
                    rss_mib(pid), cpu_seconds(me) - client0)
        if remediator is not None:
            rem = remediator.polls()
            rem.subtract(rem_before)
            step.remediator_polls = sum(rem.values())
            step.remediator_lost = step.remediator_polls - rem["ok"]
            step.healthz = remediator.healthz()
        out.steps.append(step)
        print(f"{req.server} {alerts:,} alerts {rate:g}/s: {step.achieved:.0f}/s p99 "
              f"{ms(step.p(99)):.0f} ms lost {step.lost} server {step.cpu_ms_per_poll:.2f} "
              f"ms/poll client {step.client_cpu / seconds:.2f} cores"
              + (f"; remediator lost {step.remediator_lost}/{step.remediator_polls}"
                 if remediator is not None else ""), flush=True)
        if not step.carried:
            break
    return out


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Stack:
    """One fleet's servers: the exposition, Prometheus, Alertmanager, the remediator."""

    started: list[Any] = field(default_factory=list)

    def stop(self) -> None:
        for thing in reversed(self.started):
            thing.stop()


def start_stack(tmp: Path, alerts: list[dict[str, str]]
                ) -> tuple[Stack, Any, Any, dict[str, Remediator]]:
    from tests.support.proctree import wait_for
    from tests.support.promstack import Alertmanager, Prometheus

    stack = Stack()
    try:
        expo = Exposition(exposition(alerts))
        stack.started.append(expo)
        prom = Prometheus(tmp / "prom", targets={"fleet": expo.target},
                          rules_text=fleet_rules(), alertmanager_url=None,
                          scrape={"scrape_interval": f"{EVAL_SECONDS}s",
                                  "scrape_timeout": f"{EVAL_SECONDS - 1}s"})
        stack.started.append(prom)
        am = Alertmanager(tmp / "am", null_alertmanager_config())
        stack.started.append(am)
        post_alerts(am.url, alerts)
        wait_for(lambda: len(requests.get(f"{am.url}/api/v2/alerts", timeout=30).json())
                 == len(alerts), timeout=60, interval=0.5, what="Alertmanager to hold them")
        expr = 'count(ALERTS{alertstate="firing"})'
        wait_for(lambda: [float(r["value"][1]) for r in prom.query(expr)] == [len(alerts)],
                 timeout=90, interval=0.5, what="Prometheus to fire them all")
        # One real remediator per server, each pulling from its own (1 poll/s each).
        remediators = {pull: Remediator(pull, tmp / f"remediator-{pull}", am.url, prom.url)
                       for pull in SERVERS}
        stack.started.extend(remediators.values())
        for remediator in remediators.values():
            wait_for(lambda r=remediator: sum(r.polls().values()) >= 1, timeout=30,
                     interval=0.2, what=f"the {remediator.pull} remediator's first poll")
    except BaseException:
        stack.stop()
        raise
    return stack, am, prom, remediators


def body(result: Result, tmp: Path) -> None:
    import random

    from tests.support.promstack import missing_binaries

    if (why := missing_binaries()) is not None:
        raise SystemExit(why)
    _, am_headers = exact_am_request()
    hosts = [node(i) for i in range(FLEET_NODES)]
    random.Random(54).shuffle(hosts)  # each poll one host asking for its own alerts
    step_seconds = result.pick(STEP_SECONDS, SHORT_STEP_SECONDS)
    deadline = time.monotonic() + result.pick(BUDGET_SECONDS, SHORT_BUDGET_SECONDS)
    load = [Path("/proc/loadavg").read_text().split()[:3]]
    sweeps: dict[tuple[str, int], Sweep] = {}
    for count in ALERT_COUNTS:
        stack, am, prom, remediators = start_stack(tmp / f"fleet-{count}", fleet_alerts(count))
        try:
            pids = {"alertmanager": am.proc.pid, "prometheus": prom.proc.pid}
            idle = measure_idle(pids, result.pick(IDLE_SECONDS, SHORT_IDLE_SECONDS))
            reqs = requests_for(am.url, prom.url, am_headers)
            for server in SERVERS:
                sweeps[server, count] = sweep(
                    reqs[server], count, LADDERS[server][result.short], pid=pids[server],
                    idle=idle, step_seconds=step_seconds, hosts=hosts,
                    remediator=remediators[server], deadline=deadline)
        finally:
            stack.stop()
        load.append(Path("/proc/loadavg").read_text().split()[:3])
    report(result, sweeps, step_seconds, load)


def per_core(ms_each: float) -> float:
    """Polls/s one core would answer at `ms_each` CPU ms a poll (NaN when unmeasured)."""
    return 1000 / ms_each if ms_each > 0 else float("nan")


def report(result: Result, sweeps: dict[tuple[str, int], Sweep], step_seconds: float,
           load: list[list[str]]) -> None:
    cores = len(os.sched_getaffinity(0))
    steps = Table(f"Every step: open-loop polls for {step_seconds:g} s at each rate, each "
                  "poll one host's own request",
                  ["server", "firing alerts", "rate polls/s", "answered polls/s", "p50 ms",
                   "p99 ms", "lost (shed, failed, timed out)", "server CPU (cores)",
                   "server CPU ms per poll",
                   "server RSS MiB", "pollers' CPU (cores)", "polls queued for a poller",
                   "free poller's late start p99 ms", "client-bound",
                   "real remediator: lost / polls", "its /healthz"])
    for sw in sweeps.values():
        for s in sw.steps:
            steps.add(s.server, s.alerts, s.rate, s.achieved, ms(s.p(50)), ms(s.p(99)),
                      s.why_not() if s.lost else 0,
                      f"{s.server_cpu / s.seconds + sw.idle_cores:.2f}", s.cpu_ms_per_poll, s.rss,
                      f"{s.client_cpu / s.seconds:.2f}", s.queued, ms(s.lag_p99),
                      "yes" if s.client_bound else "no",
                      f"{s.remediator_lost} / {s.remediator_polls}" if s.healthz else "-",
                      s.healthz or "-")
    steps.notes += [
        f"p50/p99 from each poll's scheduled time (a poll the pollers started late counts "
        f"late); lost: 503/429 (shed), other answers or errors, or no answer within "
        f"{POLL_TIMEOUT:g} s; a rate is carried with p99 <= {P99_LIMIT:g} s and nothing lost",
        "server CPU (cores): utime + stime of the server process over the step; per poll: "
        "less its idle rate (the scrape and rule evaluation every 5 s, the real remediator's "
        "polls), per poll answered. A server that used far less than the cores while its "
        "answers were late was waiting for this shared machine, not for work of its own",
        f"pollers: {WORKERS} threads of one Python process, a new connection per poll as the "
        "remediator's; queued: polls that found all of them waiting on the server (they "
        "count late from their schedule: a fleet's nodes would not wait for each other)",
        f"client-bound: the pollers used >= {CLIENT_BOUND_CORES:g} of one core (the GIL) or "
        f"a free poller started its poll > {ms(CLIENT_LAG_S):.0f} ms late (p99): the "
        f"machine did not run it in time, so the limit there is this machine's {cores} "
        "cores shared by pollers, servers and other work, not the server alone",
        "a real remediator per server (gpuguard-remediator, pull from that server: "
        "remediate.alertmanager.pull or remediate.prometheus, interval 1 s, timeout 3 s, "
        "dry-run) polls among them as gpu-node-00000; its lost polls are its own "
        "gpuguard_remediator_alertmanager_polls_total{result!=\"ok\",source=SERVER} over "
        "the step",
    ]
    summary = Table("What one server carries: polls/s before p99 passes 1 s or it sheds",
                    ["server", "firing alerts", "idle CPU (% of one core)", "polls/s carried",
                     "next rate: why not", "server CPU ms per answer",
                     "polls/s one core would answer", "% of one core per 100 polls/s",
                     "RSS MiB idle -> at carried", "RSS MiB per 100 polls/s",
                     "real remediator's lost polls (carried / next)", "goal 333 polls/s"])
    for sw in sweeps.values():
        best, failed = sw.best, sw.failed
        why = ("time budget" if sw.cut_short else "(top of the sweep)") if failed is None \
            else (f"{failed.rate:g}/s: {failed.why_not()}"
                  + (" (client-bound)" if failed.client_bound else ""))
        carried = best.achieved if best is not None else 0.0
        per100 = (100 * (best.server_cpu / best.seconds) / (carried / 100)
                  if best is not None and carried else float("nan"))
        rss100 = ((best.rss - sw.idle_rss) / (carried / 100) if best is not None and carried
                  else float("nan"))
        remote = (f"{best.remediator_lost if best and best.healthz else '-'} / "
                  f"{failed.remediator_lost if failed and failed.healthz else '-'}")
        summary.add(sw.server, sw.alerts, f"{100 * sw.idle_cores:.1f}%", carried, why,
                    sw.cpu_ms_per_answer, per_core(sw.cpu_ms_per_answer),
                    f"{per100:.2f}%", f"{sw.idle_rss:.0f} -> "
                    f"{best.rss if best is not None else sw.idle_rss:.0f}", rss100, remote,
                    "met" if carried >= GOAL_RATE * 0.95 else "not met")
    summary.notes += [
        f"machine: {cores} cores shared with other engineers' work; load average (1, 5, "
        f"15 min) before, between and after the fleets: {' / '.join(' '.join(x) for x in load)}",
        "idle CPU: the server with no poller but the real remediator (Prometheus: a scrape of "
        f"one series per alert and the rules' evaluation every {EVAL_SECONDS} s); % of one "
        "core per 100 polls/s: the server's CPU above idle at the carried rate, scaled to 100 "
        "polls/s; RSS follows the alerts held more than the rate (per 100 polls/s: the growth "
        "over idle at the carried rate, within the garbage collector's noise)",
        "CPU ms per answer: over every step that lost no poll; polls/s one core would "
        "answer: 1000 / that, what the server's own work allows with this machine's load "
        "aside",
        "goal: 10,000 nodes every 30 s = 333 polls/s at 10,000 alerts, with no lost poll",
    ]
    result.tables += [summary, steps]
    targets(result, sweeps)


def targets(result: Result, sweeps: dict[tuple[str, int], Sweep]) -> None:
    low, high = ALERT_COUNTS

    def carried(server: str, count: int) -> float:
        best = sweeps[server, count].best
        return best.achieved if best is not None else 0.0

    am_low, am_high = carried("alertmanager", low), carried("alertmanager", high)
    result.target(f"Alertmanager polls/s carried at {high:,} alerts < at {low:,}",
                  f"{am_high:.0f} < {am_low:.0f}", "lower (a poll walks every alert)",
                  am_high < am_low)
    cost = [sweeps["alertmanager", n].cpu_ms_per_answer for n in ALERT_COUNTS]
    result.timed_ratio(f"Alertmanager CPU per answer, {high:,} / {low:,} alerts",
                       cost[1] / cost[0] if cost[0] else float("inf"), at_least=3.0,
                       goal=">= 3x (the cost follows the alerts held)")
    prom = carried("prometheus", high)
    bound = sweeps["prometheus", high].failed
    result.target(f"Prometheus polls/s carried at {high:,} alerts, no lost poll",
                  f"{prom:.0f}" + (" (then client-bound)" if bound and bound.client_bound
                                   else ""),
                  f">= {GOAL_RATE:.0f} (10,000 nodes every 30 s)", prom >= GOAL_RATE * 0.95,
                  absolute=True)
    result.target(f"Alertmanager polls/s carried at {high:,} alerts", f"{am_high:.0f}",
                  f"informational: the goal {GOAL_RATE:.0f} is Prometheus's", am_high >= 333,
                  informational=True)
    for server in SERVERS:
        lost = sum(s.remediator_lost for (name, _), sw in sweeps.items() if name == server
                   for s in sw.steps if s.carried and s.healthz)
        result.target(f"the real remediator's lost polls ({server} pull) at the rates "
                      f"{server} carried", str(lost), "0", lost == 0)


if __name__ == "__main__":
    sys.exit(run_benchmark("fleet_pull", body))
