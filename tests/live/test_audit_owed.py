"""A record that could not be written is owed until it is (issue 47, part D).

The review's run: the audit log could not be written at the moment of a reap's final
record (outcome, signals, survivors): the record was swallowed, the ledger settled,
nothing retried it, and health cleared at the next good write, so the kill stood in the
log only as an intent. Now the final record stays owed in the state file, is retried
every loop with its original content and time, keeps /healthz at 503 and
gpuguard_remediator_audit_ok at 0 until it is written, and outlives a restart.

The log is made unwritable exactly at the final record: right before the reap's first
SIGTERM (the intent record is written by then), the log file is moved aside and a
directory put at its path. Every open of it then fails (EISDIR), root's too.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.reap.audit import as_written
from gpuguard.engine.state.audit_trail import MAX_OWED_RECORDS
from gpuguard.engine.state.ledger import Ledger
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, wait_for
from tests.support.remediator_harness import (
    HOST,
    TOKEN,
    Harness,
    Orphan,
    account,
    payload,
    spawn_orphan,
)

#: renameat2(2)'s flag: swap two paths in one step (Linux 3.15, glibc 2.28).
RENAME_EXCHANGE = 2
AT_FDCWD = -100


def exchange(a: Path, b: Path) -> None:
    """Swap what `a` and `b` name, atomically: no moment where either is missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b),
                      RENAME_EXCHANGE) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), str(a))


class BrokenLog:
    """The audit log replaced by a directory at its path, and put back. Both swaps are
    atomic: the remediator retries its owed records every loop, and a log path missing
    for a moment would take one into a file that the mend then replaced (a record the
    test itself lost, seen on a loaded CI run)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.aside = path.with_name(path.name + ".aside")

    def break_it(self) -> None:
        self.aside.mkdir()
        exchange(self.path, self.aside)  # the log aside, the directory at its path

    def mend(self) -> None:
        exchange(self.aside, self.path)  # the log back, the directory aside
        self.aside.rmdir()


def breaking_at_sigterm(log: BrokenLog) -> Callable[[int, int], None]:
    """pidfd_send_signal that breaks the log right before the reap's first SIGTERM."""

    def send(fd: int, sig: int) -> None:
        if sig == signal.SIGTERM and not log.path.is_dir():
            log.break_it()
        signal.pidfd_send_signal(fd, sig)

    return send


def health(h: Harness) -> tuple[int, str]:
    answer = h.client.get("/healthz")
    return answer.status_code, answer.get_data(as_text=True).strip()


def audit_ok(h: Harness) -> str:
    text = h.client.get("/metrics").get_data(as_text=True)
    (line,) = [x for x in text.splitlines() if x.startswith("gpuguard_remediator_audit_ok ")]
    return line.split()[1].removesuffix(".0")


def reap_records(h: Harness, orphan: Orphan) -> list[dict[str, Any]]:
    return [r for r in h.audit() if r["key"]["root_pid"] == orphan.root]


def owed_in_state(tmp_path: Path) -> list[dict[str, Any]]:
    state = json.loads((tmp_path / "state" / "remediator-state.json").read_text())
    return list(state.get("owed", []))


def reap_with_the_log_broken_at_the_final_record(
        tmp_path: Path, harness: Callable[..., Harness], trees: Trees,
        fake_gpu: FakeGpuWorld) -> tuple[Harness, Orphan, BrokenLog]:
    log = BrokenLog(tmp_path / "audit.jsonl")
    h = harness(reaper_kw={"pidfd_send": breaking_at_sigterm(log)})
    orphan = spawn_orphan(trees, fake_gpu)
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(orphan.none_alive, what="the reap")
    h.settle()
    assert log.path.is_dir(), "the log was not broken at the final record"
    return h, orphan, log


def check_the_final_record(records: list[dict[str, Any]], orphan: Orphan,
                           broken_before: float) -> None:
    """The intent, then the final record once, with the reap's outcome and signals, its
    own time (before the log was mended) and when it was written (`retried_at`)."""
    assert [r["phase"] for r in records] == ["intent", "final"], records
    intent, final = records
    assert final["reap_id"] == intent["reap_id"] is not None
    assert final["outcome"] == "reaped" and final["decision"]["action"] == "reap"
    assert {(s["pid"], s["signal"], s["result"]) for s in final["signals"]} >= {
        (p, "SIGTERM", "sent") for p in orphan.members}
    assert final["ts"] < broken_before and "retried_at" in final
    assert "retried_at" not in intent


def test_a_final_record_the_log_cannot_take_is_owed_until_written(
        tmp_path: Path, harness: Callable[..., Harness], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    h, orphan, log = reap_with_the_log_broken_at_the_final_record(tmp_path, harness, trees,
                                                                  fake_gpu)
    assert health(h) == (503, "audit-log-unwritable")
    assert audit_ok(h) == "0"
    state = h.client.get("/state", headers={"Authorization": f"Bearer {TOKEN}"}).get_json()
    assert "1 record(s) owed" in state["health"]["detail"], state["health"]
    (owed,) = owed_in_state(tmp_path)  # durable: a restart still owes it
    assert owed["phase"] == "final" and owed["outcome"] == "reaped"
    mended_at = time.time()
    log.mend()
    # Nothing new arrives: only the worker's own retry can write it and clear health.
    wait_for(lambda: health(h)[0] == 200, what="the owed record written, health clear")
    assert audit_ok(h) == "1"
    check_the_final_record(reap_records(h, orphan), orphan, mended_at)
    assert owed_in_state(tmp_path) == []
    h.service.stop()
    assert len(reap_records(h, orphan)) == 2  # written once, not again at stop


def test_a_restart_while_a_record_is_owed_still_writes_it(
        tmp_path: Path, harness: Callable[..., Harness], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    h, orphan, log = reap_with_the_log_broken_at_the_final_record(tmp_path, harness, trees,
                                                                  fake_gpu)
    assert health(h)[0] == 503
    h.service.stop()
    mended_at = time.time()
    log.mend()
    again = harness()  # the restart, the log writable again
    wait_for(lambda: health(again)[0] == 200, what="health after the restart")
    check_the_final_record(reap_records(again, orphan), orphan, mended_at)
    assert owed_in_state(tmp_path) == []
    # The key stays closed: the reap happened, whatever the log could take at the time.
    assert account(again.post(payload(orphan.alert())))["status"] == "duplicate"


def test_at_the_bound_of_what_may_be_owed_no_reap_begins_and_nothing_is_dropped(
        tmp_path: Path, harness: Callable[..., Harness], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    """Owed records are kept in the state file, which is rewritten whole at every change:
    at MAX_OWED_RECORDS no reap begins (it could owe one more), refused `audit-failed`
    with the reason; none owed is dropped; once they are written, reaps go on."""
    h = harness()
    log = BrokenLog(h.audit_path)
    h.audit_path.touch()
    log.break_it()
    earlier = [as_written({"phase": "final", "reap_id": f"earlier-{n}", "ts": 1000.0 + n,
                           "key": {"hostname": HOST, "root_pid": 1, "root_start_time": n}})
               for n in range(MAX_OWED_RECORDS)]
    h.service.ledger.settle_interrupted(TreeKey(HOST, 1, 1), owed=earlier)
    orphan = spawn_orphan(trees, fake_gpu)
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    decision = h.decisions(orphan.root)[0]  # the newest
    assert decision["reason"] == "audit-failed" and "owed" in decision["detail"], decision
    assert orphan.all_alive() and h.service.ledger.owed() == earlier

    log.mend()
    wait_for(lambda: health(h)[0] == 200, what="the owed records written")
    written = [{k: v for k, v in r.items() if k != "retried_at"} for r in h.audit()]
    assert written == earlier
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(orphan.none_alive, what="the reap once nothing is owed")


def test_a_refusal_the_log_could_not_take_is_audited_again_at_the_next_delivery(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """A refusal signals nothing, so its record is not owed; but the next delivery for
    the tree must not be counted as a repeat of a record that was never written."""
    h = harness(reasons=["launcher-killed"])  # this tree's session-ended is not allowed
    log = BrokenLog(h.audit_path)
    h.audit_path.touch()
    log.break_it()
    orphan = spawn_orphan(trees, fake_gpu)
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    assert h.service.ledger.owed() == []
    log.mend()
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    (refusal,) = reap_records(h, orphan)
    assert refusal["decision"]["reason"] == "reason-not-allowed" and orphan.all_alive()


def test_a_record_written_before_its_state_file_said_so_is_not_written_twice(
        tmp_path: Path, harness: Callable[..., Harness]) -> None:
    """A crash between an owed record's write and the state file's note that it was paid:
    the restart finds it in the log and only clears it."""
    record = as_written({"phase": "final", "reap_id": "r1", "ts": 1234.5,
                         "key": {"hostname": HOST, "root_pid": 1, "root_start_time": 1}})
    Ledger(tmp_path / "state").settle_interrupted(TreeKey(HOST, 1, 1), owed=[record])
    (tmp_path / "audit.jsonl").write_text(
        json.dumps({**record, "retried_at": "then"}, sort_keys=True) + "\n")
    h = harness()
    wait_for(lambda: health(h)[0] == 200, what="health")
    assert h.audit() == [{**record, "retried_at": "then"}]
    assert owed_in_state(tmp_path) == []
