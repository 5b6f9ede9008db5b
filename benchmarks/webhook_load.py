"""A bounded burst of Alertmanager deliveries at the remediator (dry-run mode).

The real remediator (`python -m gpuguard.remediator --token-file F`) with a fake NVML
and 4 real orphan trees. 2,000 POST /alerts, 50 concurrent: the trees' alerts
repeated many times (as Alertmanager re-sends every group_interval), HA-peer
duplicates (same tree, other fingerprint and groupKey), other hosts' alerts,
and malformed requests (bad JSON, wrong shape, wrong Content-Type, no or wrong
token). Checks: no 5xx, each kind gets its expected status, the answer time,
exactly one decision per tree in the audit log, and the RSS before, at peak
and after the burst.

    .venv/bin/python benchmarks/webhook_load.py
"""

from __future__ import annotations

import http.client
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests  # noqa: E402
import yaml  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    FakeNvml,
    Result,
    Table,
    cpu_seconds,
    hwm_mib,
    ms,
    percentile,
    rss_mib,
    run_benchmark,
    spawn_gpu_trees,
)

HOST = "bench-gpu-1"
TOKEN = "bench-token-5f1e"
TREES = 4
CONCURRENCY = 50
P99_TARGET_MS = 100.0
RSS_TOLERANCE = 0.10
#: Requests sent one at a time before the burst: service time without queueing (--short).
SERIAL, SHORT_SERIAL = 200, 50
#: A --short run sends this share of each kind.
SHORT_SCALE = 0.2
#: kind -> (how many of the 2,000 of a burst, expected HTTP status)
MIX: dict[str, tuple[int, int]] = {
    "tree alert (repeated)": (1000, 200),
    "HA-peer duplicate": (300, 200),
    "other host": (100, 200),
    "bad JSON": (150, 400),  # the media type is right: 400 (remediator/app.py)
    "wrong shape": (150, 400),
    "wrong Content-Type": (100, 415),
    "no token": (100, 401),
    "wrong token": (100, 401),
}
ZERO_TIME = "0001-01-01T00:00:00Z"
TREE_KINDS = ("tree alert (repeated)", "HA-peer duplicate")


def alert(labels: dict[str, str], fingerprint: str, status: str = "firing") -> dict[str, Any]:
    return {"status": status, "labels": labels,
            "annotations": {"summary": f"orphaned GPU tree {labels.get('root_pid')}"},
            "startsAt": "2024-05-01T10:00:00.123456789Z", "endsAt": ZERO_TIME,
            "generatorURL": "http://127.0.0.1:9090/graph", "fingerprint": fingerprint}


def notification(alerts: list[dict[str, Any]], group_key: str) -> dict[str, Any]:
    common = alerts[0]["labels"] if alerts else {}
    return {"receiver": "gpuguard-remediator", "status": "firing", "alerts": alerts,
            "groupLabels": {k: common[k] for k in ("alertname", "hostname", "root_pid",
                                                   "root_start_time") if k in common},
            "commonLabels": common, "commonAnnotations": {},
            "externalURL": "http://127.0.0.1:9093", "version": "4", "groupKey": group_key,
            "truncatedAlerts": 0}


def tree_labels(root_pid: int, start: int, host: str = HOST) -> dict[str, str]:
    """GPUOrphanTree's labels as the shipped rule sets them: `remediate="true"` included,
    without which intake refuses the alert (not-remediate) and no tree is decided on."""
    return {"alertname": "GPUOrphanTree", "hostname": host, "root_pid": str(root_pid),
            "root_start_time": str(start), "comm": "sh", "user": "root",
            "reason": "session-ended", "severity": "critical", "remediate": "true"}


Request = tuple[str, bytes, dict[str, str]]  # kind, body, headers


def build_requests(roots: list[tuple[int, int]], rng: random.Random,
                   mix: dict[str, tuple[int, int]]) -> list[Request]:
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json",
            "User-Agent": "Alertmanager/0.25.0"}
    out: list[Request] = []

    def add(kind: str, body: object, headers: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        out.append((kind, data, dict(auth if headers is None else headers)))

    for kind, (count, _) in mix.items():
        for i in range(count):
            pid, start = roots[i % len(roots)]
            labels = tree_labels(pid, start)
            if kind == "tree alert (repeated)":
                add(kind, notification([alert(labels, f"fp{pid}")], f"{{}}:{{root_pid={pid}}}"))
            elif kind == "HA-peer duplicate":
                add(kind, notification([alert(labels, f"peer{i}")], f"peer{i}:{{{pid}}}"))
            elif kind == "other host":
                other = tree_labels(pid, start, host=f"other-{i % 7}")
                add(kind, notification([alert(other, f"o{i}")], f"other{i}"))
            elif kind == "bad JSON":
                add(kind, b'{"version": "4", "alerts": [' + b"x" * (i % 50))
            elif kind == "wrong shape":
                shapes: list[object] = [
                    {**notification([alert(labels, "w")], "w"), "version": "3"},
                    {**notification([], "w"), "alerts": {"not": "a list"}},
                    notification([{**alert(labels, "w"), "labels": {"root_pid": 12}}], "w"),
                    notification([{**alert(labels, "w"), "status": "burning"}], "w"),
                    [1, 2, 3],
                ]
                add(kind, shapes[i % len(shapes)])
            elif kind == "wrong Content-Type":
                add(kind, notification([alert(labels, f"fp{pid}")], "ct"),
                    {**auth, "Content-Type": "text/plain"})
            elif kind == "no token":
                add(kind, notification([alert(labels, f"fp{pid}")], "nt"),
                    {k: v for k, v in auth.items() if k != "Authorization"})
            elif kind == "wrong token":
                add(kind, notification([alert(labels, f"fp{pid}")], "wt"),
                    {**auth, "Authorization": "Bearer not-the-token"})
    rng.shuffle(out)
    return out


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0.0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            self._stop_event.wait(0.01)

    def stop(self) -> float:
        self._stop_event.set()
        self.join(5)
        return self.peak


@dataclass
class Burst:
    client: str
    answers: list[tuple[str, int, float]]  # kind, status (-1: connection error), seconds
    wall: float
    cpu_server: float
    cpu_client: float
    rss_peak: float

    def latencies(self, kind: str | None = None) -> list[float]:
        return [t for k, _, t in self.answers if kind is None or k == kind]


def _post_requests(url: str, local: threading.local, req: Request) -> int:
    session = getattr(local, "session", None)
    if session is None:
        session = local.session = requests.Session()
    _, data, headers = req
    try:
        return session.post(url, data=data, headers=headers, timeout=30).status_code
    except requests.RequestException:
        return -1


def _post_http_client(url: str, local: threading.local, req: Request) -> int:
    conn = getattr(local, "conn", None)
    if conn is None:
        parts = urlsplit(url)
        conn = local.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    _, data, headers = req
    try:
        conn.request("POST", "/alerts", body=data, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        conn.close()
        local.conn = None
        return -1


CLIENTS = {"requests": _post_requests, "http.client": _post_http_client}


def burst(url: str, reqs: list[Request], client: str, server_pid: int) -> Burst:
    """All of `reqs`, CONCURRENCY at a time, each thread on its own keep-alive connection."""
    local = threading.local()
    send = CLIENTS[client]

    def post(req: Request) -> tuple[str, int, float]:
        start = time.perf_counter()
        status = send(url, local, req)
        return req[0], status, time.perf_counter() - start

    sampler = RssSampler(server_pid)
    sampler.start()
    cpu_server, cpu_client = cpu_seconds(server_pid), cpu_seconds(os.getpid())
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        answers = list(pool.map(post, reqs))
    wall = time.perf_counter() - start
    return Burst(client, answers, wall, cpu_seconds(server_pid) - cpu_server,
                 cpu_seconds(os.getpid()) - cpu_client, max(sampler.stop(), rss_mib(server_pid)))


def body(result: Result, tmp: Path) -> None:
    from tests.support.proctree import Trees, stat_fields, wait_for
    from tests.support.servers import ServerProcess

    fake = FakeNvml(tmp)
    fake.world.add_gpu(0)
    trees = Trees(tmp / "trees")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    audit = tmp / "audit.jsonl"
    config = tmp / "gpuguard.yml"
    config.write_text(yaml.safe_dump({"remediate": {
        "mode": "dry-run", "state_dir": str(tmp / "state"), "audit_log": str(audit),
        "min_age_seconds": 0, "users": {"allow": ["*"], "deny": []},
        "allow_root_owned": True,  # dry-run: no signal is sent; we run as root here
        "rate_limit": {"max_reaps": 100, "per_seconds": 3600},
        # The trees' launchers die before the remediator starts: with its listener on
        # that reads launcher-unrecorded, not reaped by default; this measures intake.
        "reasons": ["launcher-killed", "session-ended", "launcher-unrecorded"],
    }}))
    server = None
    try:
        holders = spawn_gpu_trees(trees, fake.world, count=TREES, per_tree=2, orphaned=TREES,
                                  gpus=1)
        roots: list[tuple[int, int]] = []
        for pids in holders:
            ppid = int(stat_fields(pids[0])["ppid"])  # type: ignore[index,arg-type]
            roots.append((ppid, int(stat_fields(ppid)["start_time"])))  # type: ignore[index,arg-type]
        server = ServerProcess("gpuguard.remediator", ["--config", str(config), "--token-file",
                                              str(token_file), "--hostname", HOST,
                                              "--log-level", "WARNING",
                                              # the fake NVML reports this namespace's pids
                                              # (CI runs the suite in a PID namespace)
                                              "--allow-pid-namespace"], env=fake.env())
        url = f"{server.url}/alerts"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        mix = {kind: (round(count * result.pick(1.0, SHORT_SCALE)), want)
               for kind, (count, want) in MIX.items()}
        total = sum(count for count, _ in mix.values())
        reqs = build_requests(roots, random.Random(5), mix)

        # Warm-up: every kind of path once (not counted), then the baseline RSS.
        warm = requests.Session()
        for kind in MIX:
            sample = next(r for r in reqs if r[0] == kind and kind != "tree alert (repeated)"
                          ) if kind not in ("tree alert (repeated)", "HA-peer duplicate") else None
            if sample is not None:
                for _ in range(5):
                    warm.post(url, data=sample[1], headers=sample[2], timeout=10)
        # Service time without queueing, one request at a time; no tree alert yet, so that
        # each tree's first acceptance happens under the concurrent burst.
        serial: list[float] = []
        quiet = [r for r in reqs if r[0] not in TREE_KINDS]
        for _, data, headers in quiet[:result.pick(SERIAL, SHORT_SERIAL)]:
            start = time.perf_counter()
            warm.post(url, data=data, headers=headers, timeout=10)
            serial.append(time.perf_counter() - start)
        time.sleep(1.0)
        pid = server.proc.pid
        rss_before = rss_mib(pid)
        bursts = [burst(url, reqs, client, pid) for client in CLIENTS]

        def idle() -> bool:
            state = warm.get(f"{server.url}/state", headers=auth, timeout=10).json()
            return not state["pending"] and state["in_flight"] is None

        wait_for(idle, timeout=60, interval=0.1, what="the remediator's worker to go idle")
        time.sleep(2.0)
        rss_after = rss_mib(pid)
        rss_hwm = hwm_mib(pid)

        # -- tables ---------------------------------------------------------------------------
        codes = Table(f"POST /alerts: the same {total:,}-request mix sent as one burst per "
                      f"client, {CONCURRENCY} in flight",
                      ["kind", "sent per burst", *(f"answers ({b.client} burst)" for b in bursts),
                       "expected", "all as expected"])
        all_expected = True
        for kind, (count, want) in mix.items():
            cells = []
            ok = True
            for b in bursts:
                got = Counter(status for k, status, _ in b.answers if k == kind)
                ok &= got == Counter({want: count})
                cells.append(", ".join(f"{s}: {n}" for s, n in sorted(got.items())))
            all_expected &= ok
            codes.add(kind, count, *cells, want, "yes" if ok else "NO")
        five_xx = 0
        for b in bursts:
            totals = Counter(status for _, status, _ in b.answers)
            bad = sum(n for s, n in totals.items() if s >= 500 or s < 0)
            five_xx += bad
            codes.notes.append(f"{b.client} burst: {b.wall:.2f} s ({total / b.wall:,.0f} req/s); "
                               + ", ".join(f"{s}: {n}" for s, n in sorted(totals.items()))
                               + f"; 5xx or connection errors: {bad}")

        lat = Table("Answer time (client side)",
                    ["requests", "p50 ms", "p90 ms", "p99 ms", "max ms", "req/s",
                     "remediator CPU ms per request", "client CPU ms per request"])
        lat.add(f"one at a time ({len(serial)} non-tree requests via requests, before the "
                "bursts)",
                ms(percentile(serial, 50)), ms(percentile(serial, 90)),
                ms(percentile(serial, 99)), ms(max(serial)), "", "", "")
        for b in bursts:
            values = b.latencies()
            lat.add(f"burst via {b.client}, {CONCURRENCY} in flight: {len(values):,}",
                    ms(percentile(values, 50)), ms(percentile(values, 90)),
                    ms(percentile(values, 99)), ms(max(values)), total / b.wall,
                    1000 * b.cpu_server / total, 1000 * b.cpu_client / total)
        lat.notes.append(f"client and remediator share {os.cpu_count()} cores: under a burst the "
                         "answer time is mostly queueing (in flight / throughput), and the "
                         "requests client itself burns more CPU than the remediator; the "
                         "http.client burst is closer to Alertmanager's (Go) cost")

        records = [json.loads(line) for line in audit.read_text().splitlines() if line.strip()]
        per_tree = Table("Decisions per tree (audit log after both bursts)",
                         ["root_pid", "alerts naming it", "audit records", "decisions"])
        one_each = True
        for root_pid, start in roots:
            mine = [r for r in records if r["key"]["root_pid"] == root_pid
                    and r["key"]["root_start_time"] == start]
            needle = f'"root_pid": "{root_pid}"'.encode()
            sent = len(bursts) * sum(1 for k, data, _ in reqs
                                     if k in TREE_KINDS and needle in data)
            actions = Counter(f"{r['decision']['action']} ({r['decision']['reason']})"
                              for r in mine)
            one_each &= len(mine) == 1
            per_tree.add(root_pid, sent, len(mine),
                         ", ".join(f"{a} x{n}" for a, n in actions.items()) or "none")
        others = len(records) - sum(1 for r in records if (r["key"]["root_pid"],
                                                           r["key"]["root_start_time"]) in roots)
        per_tree.notes.append(f"audit records for anything else: {others}")

        mem = Table("Remediator RSS (MiB)", ["before the bursts", "peak during the bursts",
                                             "after (worker idle + 2 s)", "after / before",
                                             "VmHWM"])
        rss_peak = max(b.rss_peak for b in bursts)
        mem.add(rss_before, rss_peak, rss_after, f"{rss_after / rss_before:.3f}", rss_hwm)
        result.tables += [codes, lat, per_tree, mem]

        result.target("5xx answers or connection errors", str(five_xx), "0", five_xx == 0)
        result.target("every kind answered its expected status", "yes" if all_expected else "no",
                      "yes", all_expected)
        for b in bursts:
            p99 = ms(percentile(b.latencies(), 99))
            # The requests client spends ~2x the remediator's CPU per request on the same
            # 2 cores, so its tail measures the client as much as the server: reported only.
            light = b.client == "http.client"
            result.target(f"p99 answer time, {b.client} burst", f"{p99:.1f} ms",
                          f"< {P99_TARGET_MS:.0f} ms" + ("" if light else " (informational: "
                                                         "client-bound)"),
                          p99 < P99_TARGET_MS, informational=not light, absolute=True)
        result.target("decisions per tree", "exactly 1 each" if one_each else "NOT 1 each",
                      "exactly 1", one_each)
        growth = rss_after / rss_before - 1
        result.target("RSS after burst vs before", f"{100 * growth:+.1f}%",
                      f"within {100 * RSS_TOLERANCE:.0f}%", abs(growth) <= RSS_TOLERANCE)
    finally:
        if server is not None:
            server.stop()
        trees.cleanup()


if __name__ == "__main__":
    sys.exit(run_benchmark("webhook_load", body))
