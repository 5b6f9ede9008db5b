"""`gpuguard run`'s one stderr line (gpuguard/launch/teardown.py, summarise and
teardown_line): each process is counted once, as what happened to it last.

The teardown tries a released member (its SIGSTOP refused) once more when signal 0
reaches it; the kernel may refuse that second SIGSTOP too (an LSM that allows signal 0,
or a setuid program that took root back between the probe and the stop). Both rounds'
results then name it in `released`."""

from __future__ import annotations

from gpuguard.launch.teardown import summarise, teardown_line
from gpuguard.remediator.decision.tree import Member
from gpuguard.remediator.reap.outcome import Outcome, ReapResult

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
