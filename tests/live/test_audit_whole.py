"""Audit records are whole or absent (issue 43): on a real full filesystem, a write the
disk cuts short is undone; a line a crash left torn is ended before the next record;
readers (records(), crash recovery) skip a damaged line and count it.

The full disk is a real one: a 64 KiB tmpfs, filled, whose audit log ends part-way
into a page, so the next record's write really stops part-way with ENOSPC.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuguard.engine.reap.audit import LOCK_WAIT_SECONDS, AuditLog
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, stat_fields, wait_for
from tests.support.remediator_harness import Harness, account, payload, spawn_orphan

PAGE = 4096


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs of our own (a real ENOSPC when full)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=64,mode=0700",
                           "tmpfs", str(mnt)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot mount a tmpfs: {done.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path) -> Path:
    """Fill `disk` to the last page; returns the filler (unlink it for space again)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * PAGE)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def record(n: int, size: int = 0) -> dict[str, Any]:
    """A record shaped like the remediator's (a `key`), padded to about `size` bytes."""
    return {"key": {"hostname": "h", "root_pid": n, "root_start_time": 1}, "phase": "final",
            "reap_id": f"reap-{n}", "ts": float(n), "pad": "x" * size}


def nearly_a_page(log: AuditLog, room: int) -> None:
    """One record that leaves `room` bytes free in the log's last page."""
    first = json.dumps(record(1), sort_keys=True) + "\n"
    log.append(record(1, PAGE - room - len(first)))
    assert log.path.stat().st_size == PAGE - room


def test_a_write_the_disk_cuts_short_is_undone(small_disk: Path) -> None:
    log = AuditLog(small_disk / "audit.jsonl")
    nearly_a_page(log, room=200)
    filler = fill(small_disk)
    before = log.path.read_bytes()
    with pytest.raises(OSError) as raised:
        log.append(record(2, 3000))  # 200 bytes fit, then ENOSPC: a real part-way write
    assert raised.value.errno == errno.ENOSPC
    assert log.path.read_bytes() == before  # absent, not torn
    filler.unlink()
    log.append(record(3))
    assert [r["reap_id"] for r in log.records()] == ["reap-1", "reap-3"]
    assert log.damaged_lines == 0


def test_a_torn_line_is_skipped_counted_once_and_ended_before_the_next_record(
        tmp_path: Path) -> None:
    """What a crash (or an older version on a full disk) leaves: a line without its end,
    once with a record glued onto it, once as the file's last bytes."""
    path = tmp_path / "audit.jsonl"
    whole = [json.dumps(record(n), sort_keys=True) for n in (1, 3, 4)]
    torn = json.dumps(record(2), sort_keys=True)[:70]
    path.write_text(f"{whole[0]}\n{torn}{whole[1]}\n{whole[2]}\n{torn}")
    log = AuditLog(path)
    assert [r["reap_id"] for r in log.records()] == ["reap-1", "reap-3", "reap-4"]
    assert log.damaged_lines == 2
    assert log.has_final("reap-3")  # the glued record is read, not lost with its line
    assert log.records() and log.damaged_lines == 2  # re-reading counts nothing again
    log.append(record(5))
    assert path.read_text().endswith(f"{torn}\n" + json.dumps(record(5), sort_keys=True)
                                     + "\n")
    assert [r["reap_id"] for r in log.records()] == ["reap-1", "reap-3", "reap-4", "reap-5"]
    assert log.damaged_lines == 2  # the line it ended is the one the read counted


def stopped(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields["state"] in ("T", "t")


def test_a_full_disk_under_a_real_remediator_leaves_no_record_to_glue_onto(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        small_disk: Path) -> None:
    """The review's run: the next reap's intent record, which names what is killed,
    was glued onto a torn one and no longer parsed. Here the torn write is undone, the
    reap refused (audit-failed, nothing signalled); with space again the next delivery
    reaps, and every record parses."""
    log = AuditLog(small_disk / "audit.jsonl")
    nearly_a_page(log, room=100)  # less than any intent record
    filler = fill(small_disk)
    h = harness(audit_log=str(log.path))
    orphan = spawn_orphan(trees, fake_gpu)
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    assert orphan.all_alive() and not any(stopped(p) for p in orphan.members)
    assert log.path.stat().st_size == PAGE - 100  # the torn intent record was undone
    assert [d["reason"] for d in h.decisions(orphan.root)][0] == "audit-failed"

    filler.unlink()
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    wait_for(orphan.none_alive, what="the reap once the disk has room")
    h.settle()
    phases = [(r["reap_id"] is not None, r["phase"]) for r in h.audit()[1:]]
    # The refused reap's final record (owed while the disk was full), then this reap's.
    assert phases == [(True, "final"), (True, "intent"), (True, "final")]
    assert h.audit()[1]["decision"]["reason"] == "audit-failed"
    intent = h.audit()[2]
    assert sorted(m["pid"] for m in intent["tree"]["members"]) == sorted(orphan.members)
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert "gpuguard_remediator_audit_damaged_lines_total 0.0" in metrics


def test_recovery_reads_past_a_torn_line_and_its_records_parse(
        tmp_path: Path, harness: Callable[..., Harness], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    """A crash mid-write (the torn tail) and mid-reap (a frozen tree): the restart
    continues the tree, its records start their own lines, the damage is counted."""
    from tests.live.test_kill_safety import freeze_and_crash

    orphan = spawn_orphan(trees, fake_gpu)
    freeze_and_crash(tmp_path, orphan)
    audit = tmp_path / "audit.jsonl"
    audit.write_text(json.dumps(record(1), sort_keys=True) + "\n"
                     + json.dumps(record(2), sort_keys=True)[:50])
    h = harness()
    wait_for(lambda: not any(stopped(p) for p in orphan.members), what="the thaw")
    records = h.audit()
    assert [r["phase"] for r in records] == ["final", "intent", "final"]
    assert {(s["pid"], s["signal"], s["result"]) for s in records[2]["signals"]} == {
        (p, "SIGCONT", "sent") for p in orphan.members}
    metrics = h.client.get("/metrics").get_data(as_text=True)
    assert "gpuguard_remediator_audit_damaged_lines_total 1.0" in metrics


@pytest.fixture
def lock_holder(tmp_path: Path) -> Iterator[Callable[[Path, str], None]]:
    """Another process holding an flock on a file (`flock -s FILE sleep`), until the end."""
    held: list[subprocess.Popen[bytes]] = []

    def hold(path: Path, mode: str) -> None:
        ready = tmp_path / f"locked-{len(held)}"
        held.append(subprocess.Popen(["flock", mode, str(path), "sh", "-c",
                                      f"touch {ready}; exec sleep 300"]))
        wait_for(ready.exists, what="the other process to hold the lock")

    yield hold
    for proc in held:
        proc.kill()
        proc.wait(timeout=10)


def test_a_lock_another_process_holds_is_waited_for_no_longer_than_its_bound(
        tmp_path: Path, lock_holder: Callable[[Path, str], None],
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """Anyone who can open the log can flock it (a reader stopped half-way holds a shared
    lock too): an append waits at most LOCK_WAIT_SECONDS, then fails, so a reap signals
    nothing (audit-failed) instead of waiting, its tree perhaps frozen, for as long as the
    holder likes. Reads go on without the lock."""
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append(record(1))
    lock_holder(log.path, "-s")
    began = time.monotonic()
    with pytest.raises(OSError, match="locked by another process"):
        log.append(record(2))
    assert time.monotonic() - began < LOCK_WAIT_SECONDS + 2.0
    assert [r["reap_id"] for r in log.records()] == ["reap-1"]

    h = harness(audit_log=str(log.path))
    orphan = spawn_orphan(trees, fake_gpu)
    assert account(h.post(payload(orphan.alert())))["status"] == "accepted"
    h.settle()
    assert [d["reason"] for d in h.decisions(orphan.root)][0] == "audit-failed"
    assert orphan.all_alive() and not any(stopped(p) for p in orphan.members)
