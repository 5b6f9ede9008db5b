"""An exporter restart under a firing GPUOrphanTree (issue 50), with a real Prometheus
evaluating the shipped rule (test-sized threshold and `for:`): what Prometheus sees
across the restart. Measures; asserts only what --state-dir promises (the age it
evaluates after the restart is never below the age before)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import CHAIN, Trees, wait_for
from tests.support.promstack import Prometheus, require_binaries, rules_with_durations
from tests.support.servers import Exporter, ServerProcess, child_env

pytestmark = pytest.mark.slow

GIB = 2**30


#: The exporter started on a given port (a restart keeps its `instance`, which the rule
#: joins on): ServerProcess always asks for port 0, so its address is replaced here.
SAME_PORT = ("import sys; from gpuguard.exporter.cli import main; a = sys.argv[1:]; "
             "a[a.index('--listen') + 1] = '127.0.0.1:' + a.pop(); sys.exit(main(a))")


def same_port(env: dict[str, str], port: str, state: Path) -> Exporter:
    exp = Exporter.__new__(Exporter)
    ServerProcess.__init__(exp, "gpuguard.exporter",
                           ["--scan-interval", "0.2", "--state-dir", str(state), port],
                           env=env, command=(sys.executable, "-c", SAME_PORT))
    return exp


def age_seen(prom: Prometheus, root: int) -> float | None:
    rows = prom.query(f'gpuguard_orphan_tree_age_seconds{{root_pid="{root}"}}')
    return float(rows[0]["value"][1]) if rows else None


def test_the_age_prometheus_sees_continues_across_a_restart(
        trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path, tmp_path: Path) -> None:
    require_binaries()
    tree = trees.spawn(CHAIN)
    worker, root = tree.pid("worker"), tree.pid("sh")
    fake_gpu.add_process(0, worker, GIB)
    tree.kill_launcher()
    state = tmp_path / "state"
    state.mkdir()
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    exp = Exporter(env=env, args=["--state-dir", str(state)])
    port = exp.url.rsplit(":", 1)[1]
    prom = None
    try:
        prom = Prometheus(tmp_path / "prom", targets={"gpuguard": exp.url.split("//", 1)[1]},
                          rules_text=rules_with_durations(for_seconds=3, orphan_age_seconds=5),
                          alertmanager_url=None)
        wait_for(lambda: prom.firing("GPUOrphanTree", root_pid=str(root)), timeout=60,
                 what="GPUOrphanTree firing")
        before = age_seen(prom, root)
        assert before is not None
        exp.stop()
        stopped = time.monotonic()
        exp = same_port(env, port, state)
        states: list[tuple[float, str]] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            firing = prom.firing("GPUOrphanTree", root_pid=str(root))
            states.append((round(time.monotonic() - stopped, 1),
                           "firing" if firing else "not firing"))
            time.sleep(0.5)  # sampling what Prometheus says, not synchronising
        after = wait_for(lambda: age_seen(prom, root), timeout=20, what="the age again")
        print("restart:", states)
        assert after >= before, (before, after)
    finally:
        exp.stop()
        if prom is not None:
            prom.stop()
