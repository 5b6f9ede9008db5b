"""`gpuguard run` on Windows (issue 30): what each event leads to, and its one line.

The launcher's Job Object and waits need a Windows kernel (the Wine tier runs them); its
decisions are pure and checked here against the Linux launcher's (gpuguard/launch/events.py).
"""

from __future__ import annotations

import signal

import pytest

from gpuguard.engine.windows import launcher as windows
from gpuguard.engine.windows.launcher import (
    CmdExited,
    CtrlC,
    Finish,
    GraceOver,
    ParentDied,
    Stopped,
    decide,
    teardown_line,
)
from gpuguard.launch import events, options
from gpuguard.launch.options import EXIT_PARENT_DIED, EXIT_SIGINT, Options

OPTS = Options(grace=2.5)


def test_both_launchers_share_their_words() -> None:
    assert (EXIT_PARENT_DIED, EXIT_SIGINT) == (128 + signal.SIGHUP, 128 + signal.SIGINT)
    assert events.Options is options.Options and events.Exit is options.Exit
    assert events.DEFAULT_GRACE_SECONDS == options.DEFAULT_GRACE_SECONDS


def test_cmd_exiting_ends_the_run_with_its_status_and_the_job() -> None:
    assert decide(CmdExited(3), interrupted=False, options=OPTS) == Finish(
        3, True, "CMD exited with status 3")
    kept = decide(CmdExited(0), interrupted=False, options=Options(keep_leftovers=True))
    assert kept == Finish(0, False, "CMD exited with status 0")


def test_ctrl_c_waits_for_grace_then_ends_as_130() -> None:
    assert decide(CtrlC(), interrupted=False, options=OPTS) is None
    assert decide(CtrlC(), interrupted=True, options=OPTS) == Finish(
        EXIT_SIGINT, True, "a second Ctrl-C")
    assert decide(GraceOver(), interrupted=True, options=OPTS) == Finish(
        EXIT_SIGINT, True, "CMD still ran 2.5 s after Ctrl-C")
    # Even --keep-leftovers: a Ctrl-C run ends its tree, as on Linux.
    assert decide(CmdExited(0), interrupted=True,
                  options=Options(keep_leftovers=True)) == Finish(
        EXIT_SIGINT, True, "CMD exited after Ctrl-C")


@pytest.mark.parametrize("keep", [False, True])
def test_the_parent_dying_ends_the_tree(keep: bool) -> None:
    assert decide(ParentDied(), interrupted=False,
                  options=Options(keep_leftovers=keep)) == Finish(
        EXIT_PARENT_DIED, True, "the parent process died")


def test_a_stop_signal_ends_the_run_as_128_plus_it() -> None:
    assert decide(Stopped(int(signal.SIGTERM)), interrupted=False, options=OPTS) == Finish(
        128 + signal.SIGTERM, True, "SIGTERM")
    assert decide(Stopped(21), interrupted=False, options=OPTS).code == 149  # SIGBREAK


def test_the_line_names_what_was_ended_and_what_was_left() -> None:
    assert teardown_line("CMD exited with status 0", [], []) is None
    assert teardown_line("a second Ctrl-C", [(10, "python.exe"), (14, "worker.exe")], []) == (
        "gpuguard run: a second Ctrl-C: reaped 2 process(es): 10 (python.exe), "
        "14 (worker.exe)")
    line = teardown_line("x", [(10, "a.exe")], [22])
    assert line is not None and line.endswith(
        f"; 1 still in the job after {windows.TEARDOWN_CONFIRM_SECONDS:g} s: 22")
