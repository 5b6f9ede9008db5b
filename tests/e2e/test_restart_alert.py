"""An exporter restart under a firing GPUOrphanTree (issue 50), with a real Prometheus
evaluating the shipped rule (test-sized threshold and `for:`, the shipped
`keep_firing_for`): the age Prometheus sees continues (--state-dir), and the alert never
leaves `firing` nor starts again (its activeAt, which Alertmanager's startsAt follows,
stays). A scrape that fails while the exporter is down makes Prometheus mark the series
stale, the expression empties, and without `keep_firing_for` the alert resolved and
re-pended for its `for:` (measured: 4 s here, a minute with the shipped `for: 1m`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import CHAIN, Trees, wait_for
from tests.support.promstack import RULES, Prometheus, require_binaries, rules_with_durations
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


def scrape_failed(prom: Prometheus) -> bool:
    return any(row["value"][1] == "0" for row in prom.query('up{job="gpuguard"}'))


def shipped_keep_firing_for() -> str:
    (rule,) = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
               if r.get("alert") == "GPUOrphanTree"]
    return str(rule["keep_firing_for"])


def test_the_alert_stays_firing_across_a_restart(
        trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path, tmp_path: Path) -> None:
    require_binaries()
    rules = rules_with_durations(for_seconds=3, orphan_age_seconds=5, keep_firing_seconds=None)
    assert f"keep_firing_for: {shipped_keep_firing_for()}" in rules  # the shipped value
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
                          rules_text=rules, alertmanager_url=None)
        (firing,) = wait_for(lambda: prom.firing("GPUOrphanTree", root_pid=str(root)),
                             timeout=60, what="GPUOrphanTree firing")
        before = age_seen(prom, root)
        assert before is not None
        states: list[tuple[float, str]] = []
        stopped = time.monotonic()

        def sample() -> None:
            """What Prometheus says of the alert now (sampled, not synchronising)."""
            now = prom.firing("GPUOrphanTree", root_pid=str(root))
            states.append((round(time.monotonic() - stopped, 1),
                           now[0]["activeAt"] if now else "not firing"))

        exp.stop()
        # A scrape fails while it is down: Prometheus marks the tree's series stale.
        wait_for(lambda: sample() or scrape_failed(prom), timeout=20, what="a failed scrape")
        wait_for(lambda: sample() or age_seen(prom, root) is None, timeout=20,
                 what="the series stale")
        exp = same_port(env, port, state)
        after = wait_for(lambda: sample() or age_seen(prom, root), timeout=20,
                         what="the age again")
        deadline = time.monotonic() + 10  # past the test rule's `for:` and a few evaluations
        while time.monotonic() < deadline:
            sample()
            time.sleep(0.5)
        print("restart:", states)
        assert after >= before, (before, after)
        # Never resolved, never re-armed: the same alert, active since the same time.
        assert {activeAt for _, activeAt in states} == {firing["activeAt"]}, states
    finally:
        exp.stop()
        if prom is not None:
            prom.stop()
