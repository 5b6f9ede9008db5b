"""The exporter's TLS front under hostile connections, before and after issue 48, side by side.

The real exporter (`python -m gpuguard.exporter`, fake NVML with one GPU) behind a web
config with TLS, once from this checkout and once from BASELINE (extracted with
`git archive` into the temp dir), one after the other on the same machine:

- RSS before, at its peak during, and settled after 2,000 TCP connections opened and
  closed before any byte (no credential needed), then 1,000 that send one byte of a
  ClientHello and close;
- while one address (127.0.0.1, Prometheus's own here) holds 512 silent TLS
  connections: how many of 10 scrapes, from the same address, are answered.

Every loop is bounded in count and in time; 127.0.0.1 only.

    .venv/bin/python benchmarks/hostile_fronts.py
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    PACKAGE_PATHS,
    REPO,
    FakeNvml,
    Result,
    Table,
    extract_commit,
    median,
    ms,
    rss_mib,
    run_benchmark,
)

#: main before issue 48's fronts.
BASELINE = "b573558"
CONNECT_CLOSE = 2000
ONE_BYTE = 1000
SILENT = 512
SCRAPES = 10
#: --short: this checkout only (no baseline), a quarter of the connections, 5 scrapes;
#: still SILENT silent connections (what a quarter of the slots is about).
SHORT_CONNECT_CLOSE, SHORT_ONE_BYTE, SHORT_SCRAPES = 500, 250, 5
#: Seconds any one phase may take, whatever the code does.
PHASE_LIMIT = 90.0
#: The DaemonSet's memory limit for the exporter.
LIMIT_MIB = 256.0


def extract_baseline(dest: Path) -> Path | None:
    """The package at BASELINE (harness.extract_commit)."""
    return extract_commit(BASELINE, dest, *PACKAGE_PATHS)


def settled(pid: int, *, limit: float = 10.0) -> float:
    """RSS once three readings over a second agree within 0.5 MiB (or after `limit` s)."""
    readings = [rss_mib(pid)]
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.5)
        readings.append(rss_mib(pid))
        if len(readings) >= 3 and max(readings[-3:]) - min(readings[-3:]) < 0.5:
            break
    return readings[-1]


def churn(port: int, pid: int, count: int, payload: bytes) -> tuple[int, float]:
    """`count` connections opened and closed (sending `payload` first): (made, peak RSS)."""
    peak = rss_mib(pid)
    deadline = time.monotonic() + PHASE_LIMIT
    made = 0
    for made in range(1, count + 1):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                if payload:
                    s.sendall(payload)
        except OSError:
            pass  # refused or reset: the server's business, still one connection
        if made % 50 == 0:
            peak = max(peak, rss_mib(pid))
        if time.monotonic() > deadline:
            break
    return made, max(peak, rss_mib(pid))


def scrapes_under_silence(port: int, ca: str, scrapes: int = SCRAPES) -> tuple[int, float, int]:
    """Hold SILENT silent connections, scrape `scrapes` times: (answered, median s, held)."""
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + PHASE_LIMIT / 3
        while len(held) < SILENT and time.monotonic() < deadline:
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        answered, took = 0, []
        for _ in range(scrapes):
            began = time.monotonic()
            try:
                ok = requests.get(f"https://127.0.0.1:{port}/metrics", verify=ca,
                                  timeout=3).status_code == 200
            except requests.RequestException:
                ok = False
            took.append(time.monotonic() - began)
            answered += ok
        return answered, median(took), len(held)
    finally:
        for s in held:
            s.close()


def measure(label: str, code: Path, fake: FakeNvml, web: Path, ca: str,
            counts: tuple[int, int, int] = (CONNECT_CLOSE, ONE_BYTE, SCRAPES)
            ) -> dict[str, float]:
    from tests.support.proctree import wait_for
    from tests.support.servers import ServerProcess

    exporter = ServerProcess("gpuguard.exporter", [
        "--scan-interval", "1", "--web-config-file", str(web)],
        env={**fake.env(), "PYTHONPATH": str(code)}, cwd=code)
    try:
        pid, port = exporter.proc.pid, exporter.port
        wait_for(lambda: requests.get(f"https://127.0.0.1:{port}/metrics", verify=ca,
                                      timeout=5).ok, timeout=20, what=f"{label}: a scrape")
        out = {"before": settled(pid)}
        made, out["peak"] = churn(port, pid, counts[0], b"")
        out["made"] = made
        out["after"] = settled(pid)
        made, out["peak1"] = churn(port, pid, counts[1], b"\x16")
        out["made1"] = made
        out["after1"] = settled(pid)
        out["answered"], out["scrape_s"], out["held"] = scrapes_under_silence(port, ca,
                                                                              counts[2])
        print(f"  {label}: RSS {out['before']:.1f} -> peak {out['peak']:.1f} -> "
              f"{out['after']:.1f} MiB; one byte: peak {out['peak1']:.1f} -> "
              f"{out['after1']:.1f}; scrapes {out['answered']:.0f}/{counts[2]}", flush=True)
        return out
    finally:
        exporter.stop()


def body(result: Result, tmp: Path) -> None:
    from tests.support.certs import make_certs

    fake = FakeNvml(tmp)
    fake.world.add_gpu(0)
    certs = make_certs(tmp / "certs")
    web = tmp / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {certs.path('server.crt')}\n"
                   f"  key_file: {certs.path('server.key')}\n")
    ca = certs.path("ca.crt")
    connect_close = result.pick(CONNECT_CLOSE, SHORT_CONNECT_CLOSE)
    one_byte = result.pick(ONE_BYTE, SHORT_ONE_BYTE)
    scrapes = result.pick(SCRAPES, SHORT_SCRAPES)
    counts = (connect_close, one_byte, scrapes)
    runs = {"after (this checkout)": measure("after", REPO, fake, web, ca, counts)}
    old = None if result.short else extract_baseline(tmp / "old")
    if old is not None:
        runs[f"before ({BASELINE})"] = measure("before", old, fake, web, ca, counts)

    table = Table("Exporter behind TLS under hostile connections",
                  ["code", "RSS before MiB", f"peak over {connect_close:,} connect-close",
                   "settled after", f"peak over {one_byte:,} one-byte", "settled after",
                   f"scrapes answered under {SILENT} silent", "median scrape ms"])
    for label, r in runs.items():
        table.add(label, r["before"], r["peak"], r["after"], r["peak1"], r["after1"],
                  f"{r['answered']:.0f}/{scrapes}", ms(r["scrape_s"]))
    table.notes.append("one exporter at a time, fake NVML with 1 GPU, --scan-interval 1; "
                       "connections and scrapes from 127.0.0.1; a scrape times out at 3 s")
    table.notes.append(f"the DaemonSet's memory limit is {LIMIT_MIB:.0f} MiB")
    result.tables.append(table)

    new = runs["after (this checkout)"]
    grew = new["after"] - new["before"]
    result.target(f"RSS growth after {connect_close:,} TLS connect-and-close", f"{grew:.1f} MiB",
                  "< 5 MiB", grew < 5)
    grew1 = new["after1"] - new["before"]
    result.target(f"RSS growth after {one_byte:,} one-byte connections too", f"{grew1:.1f} MiB",
                  "< 5 MiB", grew1 < 5)
    peak = max(new["peak"], new["peak1"])
    result.target("peak RSS during the connection bursts", f"{peak:.1f} MiB",
                  f"< {LIMIT_MIB / 2:.0f} MiB (half the DaemonSet's limit)",
                  peak < LIMIT_MIB / 2)
    result.target(f"scrapes answered while one address holds {SILENT} silent TLS connections",
                  f"{new['answered']:.0f}/{scrapes}", f"{scrapes}/{scrapes}",
                  new["answered"] == scrapes)


if __name__ == "__main__":
    sys.exit(run_benchmark("hostile_fronts", body))
