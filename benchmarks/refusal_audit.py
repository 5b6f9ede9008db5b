"""Audit bytes per hour for one tree the policy keeps refusing, at pull mode's 15 s poll.

A real orphan tree of 40 processes (sh -> holder with 38 children) that the policy
refuses (its reason is not in remediate.reasons), delivered to the in-process
remediator 240 times, one simulated hour at 15 s apart (its boot clock moved by hand).
Side by side in one run: the bytes one full refusal record takes, times the deliveries
(what every delivery used to add), against what the audit log really grew by.

    .venv/bin/python benchmarks/refusal_audit.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import FakeNvml, Result, Table, run_benchmark  # noqa: E402

DELIVERIES = 240  # an hour at 15 s
SHORT_DELIVERIES = 80  # --short: 20 minutes
POLL_S = 15.0
CHILDREN = 38
TARGET_RATIO = 20.0  # at least this many times fewer bytes than a record per delivery


def body(result: Result, tmp: Path) -> None:
    from gpuguard.base.counters import Counters
    from gpuguard.config import load_config
    from gpuguard.gpu.nvml import Nvml
    from gpuguard.remediator.app import create_app
    from gpuguard.remediator.service import build_remediator
    from tests.support.proctree import Trees, children_of, wait_for
    from tests.support.remediator_harness import (
        TOKEN,
        FakeClock,
        payload,
        spawn_orphan,
        write_config,
    )

    fake = FakeNvml(tmp)
    fake.load_here()
    fake.world.add_gpu(0)
    trees = Trees(tmp / "trees")
    service = None
    try:
        orphan = spawn_orphan(trees, fake.world, 'sh -c "{holder} --children '
                              f'{CHILDREN} --pidfile {{dir}}/holder" & echo $! > {{dir}}/root;'
                              ' wait')
        wait_for(lambda: len(children_of(orphan.holder)) == CHILDREN, what="the children")
        clock = FakeClock()
        config = load_config(write_config(tmp, reasons=["launcher-killed"]))
        counters = Counters()
        service = build_remediator(config, hostname="gpu-test-1", clock=clock,
                                   boot_clock=clock.boot, nvml=Nvml(counters=counters),
                                   counters=counters)
        client = create_app(service, token=lambda: TOKEN.encode()).test_client()
        service.start()
        audit = Path(config.remediate.audit_log)
        before = audit.stat().st_size if audit.exists() else 0
        started = time.perf_counter()
        deliveries = result.pick(DELIVERIES, SHORT_DELIVERIES)
        for _ in range(deliveries):
            resp = client.post("/alerts", json=payload(orphan.alert()),
                               headers={"Authorization": f"Bearer {TOKEN}"})
            assert resp.status_code == 200, resp.get_data(as_text=True)
            assert service.wait_idle(10)
            clock.now += POLL_S
        took = time.perf_counter() - started
        grown = audit.stat().st_size - before
        finals = [line for line in audit.read_text().splitlines() if '"final"' in line]
        one = len(finals[-1]) + 1
        naive = one * deliveries
        table = Table(f"Audit log growth: one refused tree of {CHILDREN + 2} processes, "
                      f"{deliveries} deliveries {POLL_S:g} s apart (a simulated "
                      f"{deliveries * POLL_S / 60:.0f} minutes)",
                      ["measure", "bytes"])
        table.add("one full refusal record", one)
        table.add(f"a full record per delivery ({deliveries}, as before)", naive)
        table.add("what the audit log grew by (audited once, then counted)", grown)
        table.notes.append(f"{len(finals)} final record(s) written; repeats counted in "
                           f"gpuguard_remediator_refusals_repeated_total "
                           f"({service.counts()['refusals_repeated']}); {took:.1f} s wall")
        result.tables.append(table)
        ratio = naive / max(grown, 1)
        result.target("audit bytes per hour for a refused tree", f"{grown:,} B "
                      f"({ratio:.0f}x fewer than a record per delivery)",
                      f">= {TARGET_RATIO:g}x fewer", ratio >= TARGET_RATIO)
    finally:
        if service is not None:
            service.stop()
        trees.cleanup()


if __name__ == "__main__":
    sys.exit(run_benchmark("refusal_audit", body))
