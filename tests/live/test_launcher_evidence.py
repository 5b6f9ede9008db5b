"""How the launcher died, live: the kernel's exit events name the orphan's reason.

Real trees, the real listener (gpuguard/host/events/listener.py), the exporter's scan. The
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

from gpuguard.base.counters import Counters
from gpuguard.engine.scan.scanner import Scanner
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.host.launcher_memory import LauncherMemory
from gpuguard.host.procfs import ProcessView, boot_id, identity_alive
from gpuguard.orphans.rules_config import Rules
from tests.support.ci import RUN_INITIAL_PIDNS, require
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import SMALL_EXIT_STORE, Trees, exit_burst, wait_for

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


def scan_reason(events: ProcessEvents | None, root: int,
                memory: LauncherMemory | None = None) -> tuple[str, str]:
    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters), counters=counters,
                      view=ProcessView(counters=counters, events=events, memory=memory))
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


def test_a_launcher_gone_before_the_listener_started_is_unrecorded(
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
    assert reason == "launcher-unrecorded" and "no exit event seen" in detail


def test_a_launcher_gone_where_no_listener_runs_is_session_ended(
        trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    tree = trees.spawn(WAITS)
    fake_gpu.add_process(0, tree.pid("holder"), GIB)
    root = tree.pid("root")
    tree.kill_launcher()
    reason, detail = scan_reason(None, root)
    assert reason == "session-ended" and "no process-event listener" in detail


def test_the_exporter_keeps_the_first_reason_past_eviction_and_a_restart(
        trees: Trees, fake_gpu: FakeGpuWorld, tmp_path: Path) -> None:
    """launcher-exited (not reaped by default) stays so once the record is evicted (a
    small store and a burst of exits, forced) and after a restart that reads the memory
    back from its file."""
    listener = ProcessEvents(max_records=SMALL_EXIT_STORE)
    listener.start()
    require(listener.available, f"no connector ({listener.unavailable_reason})")
    path = str(tmp_path / "launchers.json")
    try:
        tree = trees.spawn(LEAVES)
        fake_gpu.add_process(0, tree.pid("holder"), GIB)
        root = tree.pid("root")
        tree.launcher.wait(timeout=10)
        leader = tree.launcher.pid
        wait_for(lambda: listener.exit_of(leader, after=0), what="the exit event")
        memory = LauncherMemory(path, boot=boot_id(), alive=identity_alive)
        assert scan_reason(listener, root, memory)[0] == "launcher-exited"
        exit_burst(trees)
        wait_for(lambda: listener.exit_of(leader, after=0) is None, what="the eviction")
        assert listener.evictions()["count"] >= 1
        assert scan_reason(listener, root)[0] == "launcher-unrecorded"  # no memory
        reason, detail = scan_reason(listener, root, memory)
        assert reason == "launcher-exited" and "exited with status 0" in detail
    finally:
        listener.stop()
    restarted = LauncherMemory(path, boot=boot_id(), alive=identity_alive)
    assert len(restarted) == 1
    assert scan_reason(None, root, restarted)[0] == "launcher-exited"
    assert scan_reason(None, root)[0] == "session-ended"  # what it read before the memory
