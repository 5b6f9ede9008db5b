"""How the launcher died, live: the kernel's exit events name the orphan's reason.

Real trees, the real listener (exporter/procevents.py), the exporter's scan. The
kernel reports host pids, which a child PID namespace cannot name, so these tests are
marked `initial_pidns`: .ci/run runs them outside the namespace it gives the rest of the
suite (elsewhere they skip, saying how to run them; under CI=true they fail). They do not
depend on the runner's ancestry: each tree's root is found in the holder's own session
(the launcher's), and each test checks that root by pid.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.exporter.classify import Rules
from gpuguard.exporter.counters import Counters
from gpuguard.exporter.nvml import Nvml
from gpuguard.exporter.procevents import ProcessEvents
from gpuguard.exporter.procfs import ProcessView
from gpuguard.exporter.scanner import Scanner
from tests.ci import RUN_INITIAL_PIDNS, require
from tests.fakenvml import FakeGpuWorld
from tests.proctree import Trees, wait_for

pytestmark = pytest.mark.initial_pidns

GIB = 2**30
#: The launcher (a session leader) starts sh -> holder and waits, or leaves at once.
WAITS = 'sh -c "{holder} --pidfile {dir}/holder" & echo $! > {dir}/root; wait'
LEAVES = 'sh -c "{holder} --pidfile {dir}/holder" & echo $! > {dir}/root; exit 0'


@pytest.fixture
def events() -> Iterator[ProcessEvents]:
    listener = ProcessEvents()
    listener.start()
    require(listener.available, f"no process-events connector here "
            f"({listener.unavailable_reason}); {RUN_INITIAL_PIDNS}")
    try:
        yield listener
    finally:
        listener.stop()


def scan_reason(events: ProcessEvents, root: int) -> tuple[str, str]:
    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters), counters=counters,
                      view=ProcessView(counters=counters, events=events))
    (tree,) = [t for t in scanner.scan_once().trees if t.root_pid == root]
    return tree.reason, tree.evidence.detail


@pytest.mark.parametrize(("sig", "name"), [(signal.SIGKILL, "SIGKILL"),
                                          (signal.SIGTERM, "SIGTERM")])
def test_a_launcher_killed_by_a_signal_is_launcher_killed(
        trees: Trees, fake_gpu: FakeGpuWorld, events: ProcessEvents, sig: int,
        name: str) -> None:
    tree = trees.spawn(WAITS)
    fake_gpu.add_process(0, tree.pid("holder"), GIB)
    root = tree.pid("root")
    tree.launcher.send_signal(sig)
    tree.launcher.wait(timeout=10)
    wait_for(lambda: events.exit_of(tree.launcher.pid, after=0), what="the exit event")
    reason, detail = scan_reason(events, root)
    assert reason == "launcher-killed" and f"killed by {name}" in detail


def test_a_launcher_that_exits_by_itself_is_launcher_exited(
        trees: Trees, fake_gpu: FakeGpuWorld, events: ProcessEvents) -> None:
    tree = trees.spawn(LEAVES)
    fake_gpu.add_process(0, tree.pid("holder"), GIB)
    root = tree.pid("root")
    tree.launcher.wait(timeout=10)
    wait_for(lambda: events.exit_of(tree.launcher.pid, after=0), what="the exit event")
    reason, detail = scan_reason(events, root)
    assert reason == "launcher-exited" and "exited with status 0" in detail


def test_a_launcher_gone_before_the_listener_started_is_session_ended(
        trees: Trees, fake_gpu: FakeGpuWorld, tmp_path: Path) -> None:
    tree = trees.spawn(WAITS)
    fake_gpu.add_process(0, tree.pid("holder"), GIB)
    root = tree.pid("root")
    tree.kill_launcher()
    late = ProcessEvents()
    late.start()  # the exporter started after the launcher died
    try:
        reason, detail = scan_reason(late, root)
    finally:
        late.stop()
    assert reason == "session-ended" and "no exit event seen" in detail
