"""The fd tracer (tests/support/fdtrace.py) names the closer of an fd it does not own.

It is the tool for a failure seen only in whole runs, so it must be right when it is
finally needed: a wrong close is reported with the closer's line, a swallowed double
close with its EBADF, and the closes a correct program makes are never reported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.servers import child_env

SCENARIOS = '''
import gc, os, socket, time

from waitress import trigger


def test_correct_closes_are_not_reported(tmp_path):
    a, b = socket.socketpair()
    r, w = os.pipe()
    os.close(r); os.close(w)
    with open(tmp_path / "f", "w") as f:
        f.write("x")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    with os.fdopen(fd) as g:
        g.read()
    t = trigger.trigger({})
    t.close()
    a.close(); b.close(); a.close()
    time.sleep(0.1)  # the watcher's polls see the closed owners


def test_a_stale_close_of_a_live_socket(tmp_path):
    r, w = os.pipe()
    os.close(w)
    os.close(r)
    ours, theirs = socket.socketpair()  # takes the numbers just freed
    os.close(r)  # the double close: ours (or theirs) loses its fd
    time.sleep(0.1)


def test_a_swallowed_double_close():
    r, w = os.pipe()
    os.close(r)
    try:
        os.close(r)
    except OSError:
        pass
    os.close(w)


def test_a_socket_finalised_after_its_fd_was_reused():
    s = socket.socket()
    os.close(s.fileno())
    f = open(os.devnull)  # reuses the number
    del s
    gc.collect()  # the socket's finaliser closes the file's fd
    time.sleep(0.1)
    f = f


def test_a_closed_trigger_pulled():
    t = trigger.trigger({})
    t.close()
    try:
        t.pull_trigger()  # a task thread of a server already closed
    except OSError:
        pass
'''


def traced_run(tmp_path: Path, trace: bool) -> tuple[subprocess.CompletedProcess, Path]:
    tests = tmp_path / "test_scenarios.py"
    tests.write_text(textwrap.dedent(SCENARIOS))
    report = tmp_path / "fd.txt"
    env = child_env()
    env.pop("GPUGUARD_FD_TRACE", None)
    if trace:
        env["GPUGUARD_FD_TRACE"] = str(report)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "tests.support.fdtrace", "--rootdir", str(tmp_path), "-c", "/dev/null", str(tests)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    return done, report


def reports(report: Path) -> list[tuple[str, str]]:
    """(kind, test name) of each report."""
    found = []
    for block in report.read_text().split("=== ")[1:]:
        head = block.splitlines()[0]
        kind, _, rest = head.partition(": fd ")
        found.append((kind, rest.split(" in test ")[1].split("::")[-1].split(" ")[0]))
    return found


def test_the_tracer_names_wrong_closes_and_only_those(tmp_path: Path) -> None:
    done, report = traced_run(tmp_path, trace=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fdtrace:" in done.stdout
    got = reports(report)
    assert {test for _, test in got} == {
        "test_a_stale_close_of_a_live_socket", "test_a_swallowed_double_close",
        "test_a_socket_finalised_after_its_fd_was_reused", "test_a_closed_trigger_pulled"}, got
    kinds = {(kind, test) for kind, test in got}
    assert ("os.close of an fd a live socket owns",
            "test_a_stale_close_of_a_live_socket") in kinds
    assert ("os.close EBADF (closed already: a double close)",
            "test_a_swallowed_double_close") in kinds
    assert ("socket finaliser (GC) on an fd that is no longer its own (reused)",
            "test_a_socket_finalised_after_its_fd_was_reused") in kinds
    assert ("waitress trigger pulled after its close (a write to a stale fd)",
            "test_a_closed_trigger_pulled") in kinds
    # The closer's own line is in its report: that is what the tracer is for.
    line = next(n for n, text in enumerate(textwrap.dedent(SCENARIOS).splitlines(), 1)
                if "the double close" in text)
    assert (f"test_scenarios.py:{line} test_a_stale_close_of_a_live_socket: os.close(r)"
            in report.read_text())


def test_without_the_variable_the_plugin_does_nothing(tmp_path: Path) -> None:
    done, report = traced_run(tmp_path, trace=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not report.exists() and "fdtrace:" not in done.stdout
