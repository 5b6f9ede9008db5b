"""`gpuguard run`'s teardown lines (gpuguard/launch/teardown/report.py: summarise, audit_line and
teardown_line): each process is counted once, as what happened to it last.

The teardown tries a released member (its SIGSTOP refused) once more when signal 0
reaches it; the kernel may refuse that second SIGSTOP too (an LSM that allows signal 0,
or a setuid program that took root back between the probe and the stop). Both rounds'
results then name it in `released`."""

from __future__ import annotations

import json

from gpuguard.engine.decision.tree import Member
from gpuguard.engine.reap.outcome import Kept, Outcome, ReapResult, SignalRecord
from gpuguard.launch.teardown.keeping import honoured, inherits_keep
from gpuguard.launch.teardown.report import audit_line, summarise, teardown_line
from gpuguard.orphans.protections import KEEP, KEEP_REGISTRATION

CMD = Member(pid=100, ppid=1, start_time=5, uid=1000, user="u", comm="python")
ROOTLY = Member(pid=200, ppid=100, start_time=7, uid=0, user="root", comm="setuid-root")
AGAIN = Member(pid=200, ppid=1, start_time=7, uid=0, user="root", comm="setuid-root")
REUSED = Member(pid=200, ppid=1, start_time=99, uid=0, user="root", comm="other")


def test_a_member_released_by_two_rounds_is_reported_once() -> None:
    first = ReapResult(Outcome.REAPED, members=(CMD,), released=(ROOTLY,))
    retried = ReapResult(Outcome.REAPED, members=(), released=(AGAIN,))  # its retry
    teardown = summarise([first, retried], [], rounds=2)
    assert [(m.pid, m.start_time) for m in teardown.refused] == [(200, 7)]
    line = teardown_line("CMD exited with status 0", teardown)
    assert line is not None
    assert line.endswith("needs root or CAP_KILL): 200 (setuid-root)"), line
    assert "1 survived, not signalled" in line, line


def test_a_reused_pid_is_another_process_and_counted_apart() -> None:
    first = ReapResult(Outcome.REAPED, members=(CMD,), released=(ROOTLY,))
    later = ReapResult(Outcome.REAPED, members=(), released=(REUSED,))
    teardown = summarise([first, later], [], rounds=2)
    assert [(m.pid, m.start_time) for m in teardown.refused] == [(200, 7), (200, 99)]


def test_a_member_released_then_reaped_is_reported_reaped_only() -> None:
    first = ReapResult(Outcome.REAPED, members=(CMD,), released=(ROOTLY,))
    reaped = ReapResult(Outcome.REAPED, members=(AGAIN,))
    teardown = summarise([first, reaped], [], rounds=2)
    assert [m.pid for m in teardown.killed] == [100, 200] and not teardown.refused
    line = teardown_line("CMD exited with status 0", teardown)
    assert line == ("gpuguard run: CMD exited with status 0: reaped 2 process(es): "
                    "100 (python), 200 (setuid-root)")


def test_a_released_member_that_exited_by_the_end_is_not_called_a_survivor() -> None:
    """A member let go of (its SIGSTOP refused) that exited while the teardown watched
    it was reported "survived, not signalled", as if it still ran."""
    first = ReapResult(Outcome.REAPED, members=(CMD,), released=(ROOTLY,))
    teardown = summarise([first], [], rounds=1, ended=frozenset({(200, 7)}))
    assert not teardown.refused and [m.pid for m in teardown.exited] == [200]
    line = teardown_line("CMD exited with status 0", teardown)
    assert line == ("gpuguard run: CMD exited with status 0: reaped 1 process(es): "
                    "100 (python); 1 not signalled (the kernel refused the launcher's "
                    "SIGSTOP), gone by the end: 200 (setuid-root)")
    # Another process at that pid (a later start time) is not the one that exited.
    later = ReapResult(Outcome.REAPED, members=(), released=(REUSED,))
    teardown = summarise([first, later], [], rounds=2, ended=frozenset({(200, 7)}))
    assert [(m.pid, m.start_time) for m in teardown.refused] == [(200, 99)]


KEPT = Member(pid=300, ppid=100, start_time=9, uid=1000, user="u", comm="server")


def test_a_kept_member_is_named_with_why_and_is_no_kill() -> None:
    """The reaper reports what `spare` kept; the line for people ends with it, and the
    audit line gives every process its identity, owner, outcome and the signals sent."""
    sent = (SignalRecord(100, "SIGSTOP", "sent", 1.0), SignalRecord(300, "SIGSTOP", "sent", 1.1),
            SignalRecord(300, "SIGCONT", "sent", 2.0), SignalRecord(100, "SIGTERM", "sent", 3.0),
            SignalRecord(100, "SIGCONT", "sent", 3.1))
    first = ReapResult(Outcome.REAPED, members=(CMD,), signals=sent,
                       kept=(Kept(KEPT, "is marked to keep (GPUGUARD_KEEP=1)"),))
    again = ReapResult(Outcome.REAPED, kept=(Kept(KEPT, "is marked to keep (GPUGUARD_KEEP=1)"),))
    teardown = summarise([first, again], [], rounds=2)
    assert [k.member.pid for k in teardown.kept] == [300] and not teardown.empty
    line = teardown_line("SIGTERM", teardown)
    assert line == ("gpuguard run: SIGTERM: reaped 1 process(es): 100 (python); kept 1 with "
                    "what it started: 300 (server) is marked to keep (GPUGUARD_KEEP=1)")
    audit = audit_line("SIGTERM", teardown, (42, 7))
    assert audit is not None and audit.startswith("gpuguard run: audit {")
    record = json.loads(audit.removeprefix("gpuguard run: audit "))
    assert record == {
        "event": "teardown", "why": "SIGTERM", "launcher": {"pid": 42, "start_time": 7},
        "processes": [
            {"pid": 100, "start_time": 5, "comm": "python", "user": "u", "uid": 1000,
             "outcome": "killed", "signals": ["SIGSTOP", "SIGTERM", "SIGCONT"]},
            {"pid": 300, "start_time": 9, "comm": "server", "user": "u", "uid": 1000,
             "outcome": "kept", "signals": ["SIGSTOP", "SIGCONT"],
             "why": "is marked to keep (GPUGUARD_KEEP=1)"}],
        "problems": []}


def test_every_outcome_has_its_word_in_the_audit_line() -> None:
    survivor = Member(pid=400, ppid=100, start_time=11, uid=1000, user="u", comm="stuck")
    first = ReapResult(Outcome.FAILED, reason="survivors", members=(CMD, survivor),
                       survivors=(400,), released=(ROOTLY, REUSED))
    teardown = summarise([first], [], rounds=1, ended=frozenset({(200, 99)}))
    audit = audit_line("the parent process died", teardown, (42, 7))
    assert audit is not None
    record = json.loads(audit.removeprefix("gpuguard run: audit "))
    assert [(p["pid"], p["outcome"]) for p in record["processes"]] == [
        (100, "killed"), (400, "survived-sigkill"), (200, "not-signalled"), (200, "gone")]
    assert record["processes"][2]["why"] == "the kernel refused the launcher's SIGSTOP"


def test_a_teardown_that_found_nothing_says_nothing() -> None:
    teardown = summarise([], [], rounds=0)
    assert teardown.empty
    assert teardown_line("CMD exited with status 0", teardown) is None
    assert audit_line("CMD exited with status 0", teardown, (42, 7)) is None


def test_a_keep_mark_in_the_launchers_environment_keeps_nobody() -> None:
    """`GPUGUARD_KEEP=1 gpuguard run ...`: every member inherits it, so only a `gpuguard
    keep` registration keeps; read with the classifier's own parser (exact entry)."""
    assert inherits_keep({b"PATH": b"/bin", b"GPUGUARD_KEEP": b"1"})
    assert not inherits_keep({b"PATH": b"/bin", b"GPUGUARD_KEEP": b"yes"})
    assert not inherits_keep({})
    assert honoured(True) == (KEEP_REGISTRATION,)
    assert honoured(False) == KEEP
