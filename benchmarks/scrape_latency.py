"""GET /metrics latency while scans run back to back: normal NVML, slow NVML, TLS.

The real exporter (`python -m gpuguard.exporter --scan-interval 0.01`) on a fake NVML
with 2 GPUs and 6 holders in 3 trees (one orphaned). Phase 1: normal NVML.
Phase 2: every NVML call sleeps 50 ms, so one scan takes ~1 s. The scrape
renders the last snapshot, so its latency must not follow the scan duration.

    .venv/bin/python benchmarks/scrape_latency.py
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    FakeNvml,
    Result,
    Table,
    ms,
    percentile,
    run_benchmark,
    spawn_gpu_trees,
)

REQUESTS = 1000  # at least this many per phase ...
MIN_PHASE_S = 3.0  # ... and for at least this long, so several slow scans overlap the phase
SHORT_REQUESTS, SHORT_MIN_PHASE_S = 200, 2.0  # --short: still two slow scans a phase
GPUS = 2
SLOW_MS = 50
P99_TARGET_MS = 20.0

_GAUGE = re.compile(r"^(gpuguard_scan_duration_seconds|gpuguard_scans_total|gpuguard_orphan_trees)"
                    r" (\S+)$", re.MULTILINE)


def gauges(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in _GAUGE.findall(text)}


def phase(session: requests.Session, url: str, requests_: int = REQUESTS,
          min_phase_s: float = MIN_PHASE_S) -> tuple[list[float], list[float], float]:
    """Sequential scrapes: latencies, sampled scan durations, scans completed meanwhile."""
    latencies: list[float] = []
    durations: list[float] = []
    first: float | None = None
    began = time.monotonic()
    i = 0
    while i < requests_ or time.monotonic() - began < min_phase_s:
        i += 1
        start = time.perf_counter()
        resp = session.get(url, timeout=10)
        latencies.append(time.perf_counter() - start)
        if resp.status_code != 200:
            raise RuntimeError(f"GET /metrics answered {resp.status_code}")
        if i % 50 == 1:
            g = gauges(resp.text)
            durations.append(g["gpuguard_scan_duration_seconds"])
            first = g["gpuguard_scans_total"] if first is None else first
    g = gauges(session.get(url, timeout=10).text)
    durations.append(g["gpuguard_scan_duration_seconds"])
    return latencies, durations, g["gpuguard_scans_total"] - (first or 0)


def body(result: Result, tmp: Path) -> None:
    from tests.support.proctree import Trees, wait_for
    from tests.support.servers import Exporter

    fake = FakeNvml(tmp)
    for index in range(GPUS):
        fake.world.add_gpu(index)
    trees = Trees(tmp / "trees")
    exporter = None
    try:
        spawn_gpu_trees(trees, fake.world, count=3, per_tree=2, orphaned=1, gpus=GPUS)
        exporter = Exporter(env=fake.env(), scan_interval=0.01)
        url = f"{exporter.url}/metrics"
        session = requests.Session()
        wait_for(lambda: gauges(session.get(url, timeout=10).text).get("gpuguard_orphan_trees")
                 == 1, timeout=20, what="the exporter to see the orphan tree")
        for _ in range(50):
            session.get(url, timeout=10)  # warm the connection and the server threads

        sizes = (result.pick(REQUESTS, SHORT_REQUESTS), result.pick(MIN_PHASE_S,
                                                                    SHORT_MIN_PHASE_S))
        table = Table(
            f"GET /metrics latency, sequential requests (>= {sizes[0]:,} and >= "
            f"{sizes[1]:g} s per phase), scans back to back",
            ["phase", "requests", "p50 ms", "p99 ms", "max ms",
             "scan duration s (median of samples)", "scans during phase", "body bytes"])
        p99: dict[str, float] = {}
        for name, delay in (("normal NVML", 0), (f"slow NVML ({SLOW_MS} ms per call)", SLOW_MS)):
            fake.world.set_delay_ms(delay)
            if delay:
                wait_for(lambda: gauges(session.get(url, timeout=10).text)
                         ["gpuguard_scan_duration_seconds"] > 0.5,
                         timeout=30, interval=0.2, what="a slow scan to finish")
            latencies, durations, scans = phase(session, url, *sizes)
            size = len(session.get(url, timeout=10).content)
            p99[name] = percentile(latencies, 99)
            durations.sort()
            table.add(name, len(latencies), ms(percentile(latencies, 50)), ms(p99[name]),
                      ms(max(latencies)), durations[len(durations) // 2], int(scans), size)
            print(f"  {name}: p50 {ms(percentile(latencies, 50)):.2f} ms, p99 "
                  f"{ms(p99[name]):.2f} ms, scan {durations[len(durations) // 2]:.3f} s",
                  flush=True)
        fake.world.set_delay_ms(0)
        normal, slow = p99.values()
        exporter.stop()  # one exporter scanning back to back at a time, on 2 cores
        exporter = None
        tls_p99 = tls_phase(result, tmp, fake, table)
        table.notes.append(f"fake NVML: {GPUS} GPUs, 6 holders in 3 trees (1 orphaned); "
                           "exporter --scan-interval 0.01")
        result.tables.append(table)
        result.target("p99 normal NVML", f"{ms(normal):.2f} ms", f"< {P99_TARGET_MS:.0f} ms",
                      ms(normal) < P99_TARGET_MS, absolute=True)
        result.target("p99 slow NVML", f"{ms(slow):.2f} ms", f"< {P99_TARGET_MS:.0f} ms",
                      ms(slow) < P99_TARGET_MS, absolute=True)
        result.timed_ratio("p99 slow / p99 normal", slow / normal, at_most=2.0,
                           goal="~1 (not following scan duration; <= 2)")
        result.target("p99 TLS + basic auth", f"{ms(tls_p99):.2f} ms",
                      f"< {P99_TARGET_MS:.0f} ms", ms(tls_p99) < P99_TARGET_MS, absolute=True)
    finally:
        if exporter is not None:
            exporter.stop()
        trees.cleanup()


def tls_phase(result: Result, tmp: Path, fake: FakeNvml, table: Table) -> float:
    """The same scrapes (normal NVML) at a second exporter behind --web-config-file (TLS,
    basic auth with a bcrypt cost-10 hash; keep-alive, as Prometheus scrapes), started
    once the plain one has stopped. Returns its p99."""
    import bcrypt

    from tests.support.certs import make_certs
    from tests.support.proctree import wait_for
    from tests.support.servers import Exporter

    certs = make_certs(tmp / "certs")
    web = tmp / "web.yml"
    hashed = bcrypt.hashpw(b"bench", bcrypt.gensalt(rounds=10)).decode()
    web.write_text(f"tls_server_config:\n  cert_file: {certs.path('server.crt')}\n"
                   f"  key_file: {certs.path('server.key')}\n"
                   f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    exporter = Exporter(env=fake.env(), scan_interval=0.01, args=["--web-config-file", str(web)])
    try:
        url = f"https://127.0.0.1:{exporter.port}/metrics"
        session = requests.Session()
        session.trust_env = False  # REQUESTS_CA_BUNDLE would override `verify`
        session.verify = certs.path("ca.crt")
        session.auth = ("prometheus", "bench")
        wait_for(lambda: gauges(session.get(url, timeout=10).text).get("gpuguard_orphan_trees")
                 == 1, timeout=20, what="the TLS exporter to see the orphan tree")
        for _ in range(50):
            session.get(url, timeout=10)
        latencies, durations, scans = phase(
            session, url, result.pick(REQUESTS, SHORT_REQUESTS),
            result.pick(MIN_PHASE_S, SHORT_MIN_PHASE_S))
        durations.sort()
        p99 = percentile(latencies, 99)
        table.add("normal NVML, TLS + basic auth", len(latencies),
                  ms(percentile(latencies, 50)), ms(p99), ms(max(latencies)),
                  durations[len(durations) // 2], int(scans),
                  len(session.get(url, timeout=10).content))
        print(f"  TLS: p50 {ms(percentile(latencies, 50)):.2f} ms, p99 {ms(p99):.2f} ms",
              flush=True)
        table.notes.append("TLS row: a second exporter on the same fake NVML with "
                           "--web-config-file (TLS, bcrypt cost 10 basic auth), keep-alive")
        return p99
    finally:
        exporter.stop()


if __name__ == "__main__":
    sys.exit(run_benchmark("scrape_latency", body))
