"""A tree the policy refuses again and again is audited once in full, then counted (issue 25).

Alertmanager re-delivers a firing alert every group_interval, and pull mode asks every
15 s: a refused 40-process tree used to add its whole member list to the audit log on
each (20 deliveries: 11 KB -> 219 KB). The in-process remediator, a real tree, the
fake NVML.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, children_of, wait_for
from tests.support.remediator_harness import FakeClock, Harness, account, payload, spawn_orphan

#: bash (killed) -> sh (root) -> holder with 38 sleeping children: 40 processes.
WIDE = ('sh -c "{holder} --children 38 --pidfile {dir}/holder" & echo $! > {dir}/root; '
        'wait')
DELIVERIES = 20


def finals(h: Harness, root: int) -> list[dict]:
    return [r for r in h.audit() if r["key"]["root_pid"] == root and r["phase"] == "final"]


def test_a_repeated_refusal_is_audited_once_and_then_counted(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    orphan = spawn_orphan(trees, fake_gpu, WIDE)
    wait_for(lambda: len(children_of(orphan.holder)) == 38, what="38 children")
    clock = FakeClock()
    h = harness(clock=clock, reasons=["launcher-killed"])  # session-ended: refused
    size = h.audit_path.stat().st_size if h.audit_path.exists() else 0
    for _ in range(DELIVERIES):
        assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
        h.settle()
        clock.now += 15  # pull mode's interval: every one within the re-check window
    (record,) = finals(h, orphan.root)
    assert record["decision"]["reason"] == "reason-not-allowed"
    assert len(record["tree"]["members"]) == 40
    grown = h.audit_path.stat().st_size - size
    assert grown < 2 * len(h.audit_path.read_text().splitlines()[-1]) + 1024, grown
    assert h.service.counts()["refusals_repeated"] == DELIVERIES - 1
    decided = [d for d in h.decisions(orphan.root) if d["source"] == "worker"]
    assert len(decided) == DELIVERIES  # every one decided, and shown in /state
    assert orphan.all_alive()

    # Something changes (a member exits): the next inspection audits in full again and
    # says how many identical refusals came before it.
    child = children_of(orphan.holder)[0]
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: not alive(child), what="the child to exit")
    clock.now += 61
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    first, second = finals(h, orphan.root)
    assert second["repeats_before"] == DELIVERIES - 1
    assert len(second["tree"]["members"]) == 39
